package nft

import (
	"errors"
	"fmt"
	"os"
	"sync"
	"sync/atomic"

	"github.com/brokkr/brokkr/netplane/conntrack"
	"github.com/brokkr/brokkr/netplane/nft/compile"
	"github.com/google/nftables"
	"github.com/mdlayher/netlink"
	"golang.org/x/sys/unix"
)

// kernel is what a Table needs of the kernel: it observes brokkr's tables,
// applies one batch of operations, reads counters, verifies, and flushes
// conntrack by host side. It decides nothing: what to observe, apply and
// flush is the compiler's and Converge's. nlKernel is the real one (tested
// against the kernel, in namespaces); the tests of Converge's decisions use
// an in-process fake (fake_test.go).
type kernel interface {
	// generation is the ruleset generation as far as others changed it:
	// the kernel's, less the commits this kernel made outside apply (the
	// set-based cap's members), so an unchanged value proves nobody else
	// touched the tables since the last apply.
	generation() (uint32, error)
	// foreign drains what nftables' change notifications said other
	// programs changed in brokkr's tables since the last call.
	foreign() (foreignChanges, error)
	// observe reads one table: chains and rule fingerprints, set shapes
	// and digests, counter names. A set trusted names is not read (its
	// elements are what brokkr applied); another set's elements are
	// decoded too when read says so, given its digest.
	observe(fam nftables.TableFamily, trusted func(set string) bool, read func(set string, d compile.Digest) bool) (*compile.Observed, error)
	// apply sends ops as one batch: all or nothing.
	apply(ops []compile.Op) error
	// lookup reads the elements of set at keys (the verify after a large
	// batch): an error when one is missing.
	lookup(fam nftables.TableFamily, set string, keys [][]byte) (map[string]compile.ElemSpec, error)
	// counts reads the named counters and the counters of the elements of
	// sets (a replace carries them).
	counts(sets []string) (compile.Counts, error)
	// flush deletes the conntrack entries of each host side and returns
	// how many per side.
	flush(sides []compile.HostSide) ([]int, error)
	close() error
}

// sockBuf is the send and receive buffer of the nftables socket: a batch of
// 100,000 exposures is tens of MiB, and a dump of their maps as much.
const sockBuf = 64 << 20

// nlKernel is the kernel over netlink in one network namespace.
type nlKernel struct {
	nsPath string
	nsFile *os.File // keeps the namespace fd for the netlink sockets
	ct     *conntrack.Conn

	// nlMu: the netlink sockets, one request or batch at a time.
	nlMu   sync.Mutex
	conn   *nftables.Conn // lasting: the set-based cap's small requests
	raw    *netlink.Conn  // batches and dumps
	closed bool

	// membersMu: the members of the cap sets. A read of a set's members
	// and the deletes or add decided from it happen under it, and so do a
	// batch that seeds a cap set and its commit: no slow-path decision
	// lands between them.
	membersMu sync.Mutex

	// sideCommits counts the batches committed outside apply (member
	// adds and deletes): generation discounts them.
	sideCommits atomic.Uint32

	// mon: the ruleset's change notifications, less brokkr's own (nil when
	// they could not be listened to). Drained by the Table (Table.mu).
	mon *monitor
}

func openKernel(netnsPath string) (*nlKernel, error) {
	k := &nlKernel{nsPath: netnsPath}
	ncfg := &netlink.Config{}
	var lastingPID uint32
	nopts := []nftables.ConnOption{nftables.AsLasting(), nftables.WithSockOptions(forceBuffers, func(c *netlink.Conn) (err error) {
		lastingPID, err = portID(c)
		return err
	})}
	if netnsPath != "" {
		f, err := os.Open(netnsPath)
		if err != nil {
			return nil, fmt.Errorf("nft: open netns: %w", err)
		}
		k.nsFile = f
		ncfg.NetNS = int(f.Fd())
		nopts = append(nopts, nftables.WithNetNSFd(int(f.Fd())))
	}
	var err error
	if k.conn, err = nftables.New(nopts...); err != nil {
		k.closeFiles()
		return nil, fmt.Errorf("nft: %w", err)
	}
	if k.raw, err = netlink.Dial(unix.NETLINK_NETFILTER, ncfg); err != nil {
		k.closeFiles()
		return nil, fmt.Errorf("nft: netfilter socket: %w", err)
	}
	if err := forceBuffers(k.raw); err != nil {
		k.closeFiles()
		return nil, err
	}
	if k.ct, err = conntrack.Dial(netnsPath); err != nil {
		k.closeFiles()
		return nil, err
	}
	rawPID, err := portID(k.raw)
	if err != nil {
		k.closeFiles()
		return nil, err
	}
	// Without notifications a pass falls back to the generation and full
	// reads: slower at scale, still right.
	k.mon, _ = openMonitor(netnsPath, rawPID, lastingPID)
	return k, nil
}

// portID is a netlink socket's port id (what the kernel puts in the
// notifications of what it commits).
func portID(c *netlink.Conn) (uint32, error) {
	rc, err := c.SyscallConn()
	if err != nil {
		return 0, err
	}
	var pid uint32
	var serr error
	if err := rc.Control(func(fd uintptr) {
		var sa unix.Sockaddr
		if sa, serr = unix.Getsockname(int(fd)); serr == nil {
			if nl, ok := sa.(*unix.SockaddrNetlink); ok {
				pid = nl.Pid
			} else {
				serr = errors.New("not a netlink socket")
			}
		}
	}); err != nil {
		return 0, err
	}
	if serr != nil {
		return 0, fmt.Errorf("nft: socket port id: %w", serr)
	}
	return pid, nil
}

func (k *nlKernel) foreign() (foreignChanges, error) {
	if k.mon == nil {
		return foreignChanges{lost: true}, nil
	}
	return k.mon.drain()
}

func forceBuffers(c *netlink.Conn) error {
	rc, err := c.SyscallConn()
	if err != nil {
		return err
	}
	var serr error
	if err := rc.Control(func(fd uintptr) {
		// The *FORCE variants pass net.core.[rw]mem_max (we are root).
		if serr = unix.SetsockoptInt(int(fd), unix.SOL_SOCKET, unix.SO_SNDBUFFORCE, sockBuf); serr != nil {
			return
		}
		serr = unix.SetsockoptInt(int(fd), unix.SOL_SOCKET, unix.SO_RCVBUFFORCE, sockBuf)
	}); err != nil {
		return err
	}
	if serr != nil {
		return fmt.Errorf("nft: socket buffers: %w", serr)
	}
	return nil
}

func (k *nlKernel) closeFiles() {
	if k.conn != nil {
		_ = k.conn.CloseLasting()
	}
	if k.raw != nil {
		_ = k.raw.Close()
	}
	if k.ct != nil {
		_ = k.ct.Close()
	}
	if k.nsFile != nil {
		_ = k.nsFile.Close()
	}
	if k.mon != nil {
		_ = k.mon.close()
	}
}

func (k *nlKernel) close() error {
	k.nlMu.Lock()
	defer k.nlMu.Unlock()
	if !k.closed {
		k.closed = true
		k.closeFiles()
	}
	return nil
}

// errClosed: the Table was closed.
var errClosed = errors.New("nft: table closed")

// nl runs fn with the netlink sockets to itself.
func (k *nlKernel) nl(fn func() error) error {
	k.nlMu.Lock()
	defer k.nlMu.Unlock()
	if k.closed {
		return errClosed
	}
	return fn()
}

func (k *nlKernel) generation() (uint32, error) {
	var g uint32
	err := k.nl(func() (err error) {
		g, err = genID(k.raw)
		g -= k.sideCommits.Load() // counted under nlMu, like the commits
		return err
	})
	return g, err
}

func (k *nlKernel) observe(fam nftables.TableFamily, trusted func(string) bool, read func(string, compile.Digest) bool) (o *compile.Observed, err error) {
	err = k.nl(func() error { o, err = observeTable(k.conn, k.raw, fam, trusted, read); return err })
	return o, err
}

func (k *nlKernel) lookup(fam nftables.TableFamily, set string, keys [][]byte) (m map[string]compile.ElemSpec, err error) {
	err = k.nl(func() error { m, err = lookupElems(k.raw, fam, set, keys); return err })
	return m, err
}

// digest reads one set's digest (a full dump: tests only check with it).
func (k *nlKernel) digest(fam nftables.TableFamily, set string) (d compile.Digest, err error) {
	err = k.nl(func() error {
		d, _, err = dumpElems(k.raw, fam, set, false)
		return err
	})
	return d, err
}

func (k *nlKernel) counts(sets []string) (compile.Counts, error) {
	c := compile.Counts{Elems: map[string]map[string]compile.CounterValue{}}
	err := k.nl(func() (err error) {
		if c.Named, err = readCounters(k.conn); err != nil {
			return err
		}
		for _, s := range sets {
			if c.Elems[s], err = elemCounters(k.raw, s); err != nil {
				return err
			}
		}
		return nil
	})
	return c, err
}

// counters reads the named counters alone.
func (k *nlKernel) counters() (m map[string]compile.CounterValue, err error) {
	err = k.nl(func() error { m, err = readCounters(k.conn); return err })
	return m, err
}

// elemCounters reads the counters of one set's elements, by string(key).
func (k *nlKernel) elemCounters(set string) (m map[string]compile.CounterValue, err error) {
	err = k.nl(func() error { m, err = elemCounters(k.raw, set); return err })
	return m, err
}

func (k *nlKernel) flush(sides []compile.HostSide) ([]int, error) {
	list := make([]conntrack.HostSide, len(sides))
	for i, s := range sides {
		list[i] = conntrack.HostSide{Proto: s.Proto, Addr: s.Addr, Port: s.Port, PortLast: s.PortLast}
	}
	return k.ct.DeleteHostSides(list)
}

// sideCommit runs fn (which commits a small batch on the lasting socket)
// and counts it when it committed, so generation does not move for it.
func (k *nlKernel) sideCommit(fn func() error) error {
	return k.nl(func() error {
		err := fn()
		if err == nil {
			k.sideCommits.Add(1)
		}
		return err
	})
}
