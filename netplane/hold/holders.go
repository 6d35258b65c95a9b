package hold

import (
	"bufio"
	"encoding/hex"
	"fmt"
	"net/netip"
	"os"
	"strconv"
	"strings"

	"github.com/brokkr/brokkr/internal/procfs"
)

// named is how a reason names a holder: "pid 812 (nginx)".
func named(h procfs.Owner) string { return fmt.Sprintf("pid %d (%s)", h.PID, h.Comm) }

// The states of /proc/net/tcp that matter here (include/net/tcp_states.h).
const tcpTimeWait = 0x06

// entry is one socket of /proc/net/{tcp,udp}[6].
type entry struct {
	addr  netip.Addr
	port  uint16
	state int
	inode uint64
}

// findHolders finds the processes whose sockets hold sd's port in the
// calling thread's namespace and reports whether everything on the port is
// in TIME_WAIT (no process holds those).
func findHolders(sd Side) ([]procfs.Owner, bool) {
	inodes, only := socketsOn(sd)
	return procfs.SocketOwners(inodes), only
}

// socketsOn lists the inodes of the sockets on sd's port in the calling
// thread's namespace (/proc/thread-self/net is per namespace), and reports
// whether everything found there is in TIME_WAIT.
func socketsOn(sd Side) (map[uint64]bool, bool) {
	var es []entry
	for _, f := range []string{sd.Proto, sd.Proto + "6"} {
		es = append(es, readTable("/proc/thread-self/net/"+f)...)
	}
	inodes := map[uint64]bool{}
	tw, other := 0, 0
	for _, e := range es {
		if e.port != sd.Port || !overlaps(sd.Addr, e.addr) {
			continue
		}
		if sd.Proto == "tcp" && e.state == tcpTimeWait {
			tw++
			continue
		}
		other++
		if e.inode != 0 {
			inodes[e.inode] = true
		}
	}
	return inodes, tw > 0 && other == 0
}

// overlaps reports whether a bind of a conflicts with a socket bound to b:
// the same family and either is the wildcard or they are equal; an IPv6
// wildcard socket may be dual-stack (/proc does not say), so it overlaps
// every IPv4 address.
func overlaps(a, b netip.Addr) bool {
	b = b.Unmap()
	switch {
	case a.Is4() == b.Is4():
		return a.IsUnspecified() || b.IsUnspecified() || a == b
	case a.Is4():
		return b == netip.IPv6Unspecified()
	}
	return false
}

// readTable parses one /proc/net socket table; a table that cannot be read
// (the family is off) is empty.
func readTable(path string) []entry {
	f, err := os.Open(path)
	if err != nil {
		return nil
	}
	defer f.Close()
	var out []entry
	sc := bufio.NewScanner(f)
	sc.Scan() // header
	for sc.Scan() {
		if e, ok := parseLine(sc.Text()); ok {
			out = append(out, e)
		}
	}
	return out
}

// parseLine reads "sl local rem st tx:rx tr:when retr uid timeout inode ...".
func parseLine(line string) (entry, bool) {
	fs := strings.Fields(line)
	if len(fs) < 10 {
		return entry{}, false
	}
	ap, ok := parseHexAddrPort(fs[1])
	if !ok {
		return entry{}, false
	}
	st, err := strconv.ParseUint(fs[3], 16, 8)
	if err != nil {
		return entry{}, false
	}
	ino, err := strconv.ParseUint(fs[9], 10, 64)
	if err != nil {
		return entry{}, false
	}
	return entry{addr: ap.Addr(), port: ap.Port(), state: int(st), inode: ino}, true
}

// parseHexAddrPort reads the kernel's "0100007F:2328": the address as
// 32-bit words in host byte order (little-endian here), the port in hex.
func parseHexAddrPort(s string) (netip.AddrPort, bool) {
	a, p, ok := strings.Cut(s, ":")
	if !ok {
		return netip.AddrPort{}, false
	}
	port, err := strconv.ParseUint(p, 16, 16)
	if err != nil {
		return netip.AddrPort{}, false
	}
	b, err := hex.DecodeString(a)
	if err != nil || (len(b) != 4 && len(b) != 16) {
		return netip.AddrPort{}, false
	}
	for i := 0; i < len(b); i += 4 {
		b[i], b[i+1], b[i+2], b[i+3] = b[i+3], b[i+2], b[i+1], b[i]
	}
	addr, _ := netip.AddrFromSlice(b)
	return netip.AddrPortFrom(addr, uint16(port)), true
}
