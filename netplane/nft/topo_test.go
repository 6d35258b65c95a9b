package nft

import (
	"bufio"
	"errors"
	"fmt"
	"io"
	"net"
	"net/netip"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/brokkr/brokkr/internal/nstest"
	"github.com/stretchr/testify/require"
	"golang.org/x/sys/unix"
)

// topo: client ns (10.99.0.2) -- veth -- host ns (10.99.0.1, bridge br0
// 10.213.0.1/24, a second host address 10.98.0.1 on a second veth) -- veth
// ports on br0 -- guest namespaces g1 (10.213.0.11), g2 (10.213.0.12).
type topo struct {
	client, host *nstest.NS
	guests       []*nstest.NS
	macs         []net.HardwareAddr
	table        *Table
	cap          *SetCap
	marks        map[string]uint32 // each exposure's mark id, by name, given on first sight
}

func guestAddr(i int) netip.Addr { return netip.AddrFrom4([4]byte{10, 213, 0, byte(11 + i)}) }
func guestPort(i int) string     { return fmt.Sprintf("g%dp", i+1) }

func newTopo(t *testing.T, nGuests int) *topo {
	t.Helper()
	nstest.RequireRoot(t)
	tp := &topo{client: nstest.New(t, "cli"), host: nstest.New(t, "host"), marks: map[string]uint32{}}
	nstest.Link(t, tp.client, "eth0", "10.99.0.2/24", tp.host, "vh-cli", "10.99.0.1/24")
	tp.client.MustRun(t, "ip", "route", "add", "default", "via", "10.99.0.1")
	tp.host.MustRun(t, "ip", "link", "add", "br0", "type", "bridge")
	tp.host.MustRun(t, "ip", "addr", "add", "10.213.0.1/24", "dev", "br0")
	tp.host.MustRun(t, "ip", "link", "set", "br0", "up")
	// A second host address, on a second link to the client.
	nstest.Link(t, tp.client, "eth1", "10.98.0.2/24", tp.host, "vh-cli2", "10.98.0.1/24")
	tp.host.MustRun(t, "sysctl", "-qw", "net.ipv4.ip_forward=1")
	for i := 0; i < nGuests; i++ {
		g := nstest.New(t, fmt.Sprintf("g%d", i+1))
		nstest.Link(t, tp.host, guestPort(i), "", g, "eth0", guestAddr(i).String()+"/24")
		tp.host.MustRun(t, "ip", "link", "set", guestPort(i), "master", "br0")
		// Hairpin: a frame may leave the port it came in on (the link
		// helper's job for taps; done by hand here).
		tp.host.MustRun(t, "ip", "link", "set", "dev", guestPort(i), "type", "bridge_slave", "hairpin", "on")
		g.MustRun(t, "ip", "route", "add", "default", "via", "10.213.0.1")
		// Not /sys: nsenter keeps the root mount namespace and its sysfs.
		f := strings.Fields(g.MustRun(t, "ip", "-o", "link", "show", "eth0"))
		var mac net.HardwareAddr
		var err error
		for j := range f {
			if f[j] == "link/ether" && j+1 < len(f) {
				mac, err = net.ParseMAC(f[j+1])
			}
		}
		require.NoError(t, err)
		tp.guests = append(tp.guests, g)
		tp.macs = append(tp.macs, mac)
	}
	tp.open(t)
	return tp
}

// open opens the host's table with the set-based cap beside it (the cap
// these tests exercise; the nat path's is bpf's), closed when the test ends.
func (tp *topo) open(t *testing.T, opts ...SetCapOption) {
	t.Helper()
	tb, err := Open(tp.host.Path)
	require.NoError(t, err)
	t.Cleanup(func() { tb.Close() })
	c, err := StartSetCap(tb, opts...)
	require.NoError(t, err)
	tp.table, tp.cap = tb, c
}

// rules is the topology's rules with exps; each exposure without a mark id
// gets its name's (as the plane hands over each exposure's counter slot).
func (tp *topo) rules(exps ...Exposure) Rules {
	for i := range exps {
		if exps[i].MarkID == 0 {
			exps[i].MarkID = tp.mark(exps[i].Name)
		}
	}
	r := Rules{Bridge: "br0", Subnet: netip.MustParsePrefix("10.213.0.1/24"),
		Masquerade: true, DHCP: true, Exposures: exps, Cap: SetBasedCap{}}
	for i := range tp.guests {
		r.Guests = append(r.Guests, Guest{Name: fmt.Sprintf("g%d", i+1), Tap: guestPort(i), MAC: tp.macs[i], Addr: guestAddr(i)})
	}
	return r
}

func (tp *topo) mark(name string) uint32 {
	id, ok := tp.marks[name]
	if !ok {
		id = uint32(len(tp.marks) + 1)
		tp.marks[name] = id
	}
	return id
}

// repaired is a result's repairs as the report prints them.
func repaired(res Result) []string {
	var out []string
	for _, r := range res.Repaired {
		out = append(out, r.String())
	}
	return out
}

func (tp *topo) converge(t *testing.T, r Rules) Result {
	t.Helper()
	res, err := tp.table.Converge(r)
	require.NoError(t, err)
	return res
}

// serveTCP runs a server in ns on addr: it writes tag+"\n", then echoes
// until EOF, then closes. Its cleanup closes the connections still open, so
// a test that fails while holding some ends instead of waiting for them.
func serveTCP(t *testing.T, ns *nstest.NS, addr, tag string) {
	t.Helper()
	var ln net.Listener
	require.NoError(t, ns.Do(func() (err error) { ln, err = net.Listen("tcp4", addr); return }))
	var (
		wg    sync.WaitGroup
		mu    sync.Mutex
		open  = map[net.Conn]struct{}{}
		ended bool
	)
	t.Cleanup(func() {
		ln.Close()
		mu.Lock()
		ended = true
		for c := range open {
			c.Close()
		}
		mu.Unlock()
		wg.Wait()
	})
	wg.Add(1)
	go func() {
		defer wg.Done()
		for {
			c, err := ln.Accept()
			if err != nil {
				return
			}
			mu.Lock()
			if ended {
				mu.Unlock()
				c.Close()
				return
			}
			open[c] = struct{}{}
			wg.Add(1) // under mu: a cleanup that saw c also waits for it
			mu.Unlock()
			go func() {
				defer wg.Done()
				defer func() { mu.Lock(); delete(open, c); mu.Unlock(); c.Close() }()
				_, _ = io.WriteString(c, tag+"\n")
				_, _ = io.Copy(c, c)
			}()
		}
	}()
}

// serveUDP answers every datagram with tag.
func serveUDP(t *testing.T, ns *nstest.NS, addr, tag string) {
	t.Helper()
	var pc net.PacketConn
	require.NoError(t, ns.Do(func() (err error) { pc, err = net.ListenPacket("udp4", addr); return }))
	done := make(chan struct{})
	t.Cleanup(func() { pc.Close(); <-done })
	go func() {
		defer close(done)
		buf := make([]byte, 1500)
		for {
			_, from, err := pc.ReadFrom(buf)
			if err != nil {
				return
			}
			_, _ = pc.WriteTo([]byte(tag), from)
		}
	}()
}

// dialTag connects from ns and returns the server's tag line.
func dialTag(ns *nstest.NS, addr string) (string, error) {
	var tag string
	err := ns.Do(func() error {
		c, err := net.DialTimeout("tcp4", addr, 2*time.Second)
		if err != nil {
			return err
		}
		defer c.Close()
		_ = c.SetDeadline(time.Now().Add(2 * time.Second))
		tag, err = bufio.NewReader(c).ReadString('\n')
		tag = strings.TrimSpace(tag)
		return err
	})
	return tag, err
}

// udpAsk sends one datagram from a fixed local port (so the conntrack entry
// is the same flow each time) and returns the reply.
func udpAsk(ns *nstest.NS, laddr, raddr string) (string, error) {
	var reply string
	err := ns.Do(func() error {
		la, _ := net.ResolveUDPAddr("udp4", laddr)
		ra, _ := net.ResolveUDPAddr("udp4", raddr)
		c, err := net.DialUDP("udp4", la, ra)
		if err != nil {
			return err
		}
		defer c.Close()
		_ = c.SetDeadline(time.Now().Add(time.Second))
		if _, err := c.Write([]byte("ping")); err != nil {
			return err
		}
		buf := make([]byte, 64)
		n, err := c.Read(buf)
		reply = string(buf[:n])
		return err
	})
	return reply, err
}

// openConns opens n TCP connections from ns at once (non-blocking connects
// issued back to back) and reports how many reached the guest (its server's
// first byte arrived) and how many were refused (connection refused, or
// reset after the handshake: the cap's slow path completes the handshake
// before it decides); the sockets stay open until the returned func is
// called.
func openConns(t *testing.T, ns *nstest.NS, addr netip.AddrPort, n int) (ok int, refused int, closeAll func()) {
	t.Helper()
	fds := make([]int, 0, n)
	require.NoError(t, ns.Do(func() error {
		sa := &unix.SockaddrInet4{Port: int(addr.Port()), Addr: addr.Addr().As4()}
		for i := 0; i < n; i++ {
			fd, err := unix.Socket(unix.AF_INET, unix.SOCK_STREAM|unix.SOCK_NONBLOCK|unix.SOCK_CLOEXEC, 0)
			if err != nil {
				return err
			}
			fds = append(fds, fd)
			if err := unix.Connect(fd, sa); err != nil && !errors.Is(err, unix.EINPROGRESS) {
				return err
			}
		}
		return nil
	}))
	// Every caller is decided within milliseconds unless one of its SYNs is
	// lost (a loaded machine), and then TCP retries after 1 s and 3 s: the
	// deadline leaves room for both, and slow decisions are logged.
	start := time.Now()
	deadline := start.Add(10 * time.Second)
	defer func() {
		if d := time.Since(start); d > time.Second {
			t.Logf("openConns: %d callers decided in %s (%d admitted, %d refused)", n, d.Round(time.Millisecond), ok, refused)
		}
	}()
	for _, fd := range fds {
		for {
			pfd := []unix.PollFd{{Fd: int32(fd), Events: unix.POLLOUT}}
			_, _ = unix.Poll(pfd, 100)
			if pfd[0].Revents != 0 || time.Now().After(deadline) {
				break
			}
		}
		soerr, _ := unix.GetsockoptInt(fd, unix.SOL_SOCKET, unix.SO_ERROR)
		switch soerr {
		case 0:
			if _, err := unix.Getpeername(fd); err != nil {
				// Connected (to the slow path) and reset between the two
				// calls: a refusal, whose error SO_ERROR now holds.
				again, _ := unix.GetsockoptInt(fd, unix.SOL_SOCKET, unix.SO_ERROR)
				if again == int(unix.ECONNRESET) || again == int(unix.ECONNREFUSED) || errors.Is(err, unix.ENOTCONN) {
					refused++
				} else {
					t.Logf("openConns: a caller neither admitted nor refused: getpeername %v, SO_ERROR %d", err, again)
				}
				continue
			}
			for {
				pfd := []unix.PollFd{{Fd: int32(fd), Events: unix.POLLIN}}
				_, _ = unix.Poll(pfd, 100)
				if pfd[0].Revents != 0 || time.Now().After(deadline) {
					break
				}
			}
			var b [1]byte
			n, _, err := unix.Recvfrom(fd, b[:], unix.MSG_PEEK|unix.MSG_DONTWAIT)
			switch {
			case n > 0:
				ok++
			case errors.Is(err, unix.ECONNRESET) || n == 0 && err == nil:
				refused++
			default:
				t.Logf("openConns: a connected caller neither admitted nor refused: recv %d %v", n, err)
			}
		case int(unix.ECONNREFUSED), int(unix.ECONNRESET):
			refused++
		default:
			t.Logf("openConns: a caller neither admitted nor refused: SO_ERROR %d", soerr)
		}
	}
	return ok, refused, func() {
		for _, fd := range fds {
			unix.Close(fd)
		}
	}
}

func dialTCP(addr string) (net.Conn, error) {
	c, err := net.DialTimeout("tcp4", addr, 2*time.Second)
	if err != nil {
		return nil, err
	}
	_ = c.SetDeadline(time.Now().Add(2 * time.Second))
	return c, nil
}
