// Package conntrack deletes and reads connection-tracking entries in one
// network namespace, and watches their end, over netlink
// (github.com/ti-mo/conntrack: maintained, netns-aware, events included).
//
// Entries are deleted by the host side of an exposure (protocol, host
// address, host port: the original-direction destination), never by the
// guest port, so a flow that would keep going to a previous guest is cut
// however the ports map (moby#53384 used the container port and missed).
package conntrack

import (
	"errors"
	"fmt"
	"net/netip"
	"os"
	"sync"

	"github.com/mdlayher/netlink"
	ct "github.com/ti-mo/conntrack"
	"github.com/ti-mo/netfilter"
	"golang.org/x/sys/unix"
)

// TCP conntrack states (enum tcp_conntrack) a connection no longer counts
// as open in.
const (
	TCPTimeWait = 7
	TCPClose    = 8
)

// Entry is the part of a conntrack entry brokkr uses.
type Entry struct {
	ID        uint32
	Mark      uint32
	Proto     uint8
	Orig      netip.AddrPort // original source
	OrigDst   netip.AddrPort // original destination (the host side of an exposure)
	TCPState  uint8          // 0 for other protocols
	Destroyed bool           // from a destroy event (the entry is gone)
}

// Open reports whether a TCP entry still counts as an open connection.
func (e Entry) Open() bool {
	return e.Proto != unix.IPPROTO_TCP || (e.TCPState != TCPTimeWait && e.TCPState != TCPClose)
}

// Conn is a conntrack netlink socket bound to one network namespace.
type Conn struct {
	mu sync.Mutex
	c  *ct.Conn
	// nf is a second socket for the dumps DeleteHostSides reads itself
	// (kernel-filtered, or parsed only as far as the original tuple).
	nf *netfilter.Conn
}

// Dial opens a conntrack socket in the namespace at nsPath ("" = the
// caller's namespace).
func Dial(nsPath string) (*Conn, error) {
	c, err := dial(nsPath)
	if err != nil {
		return nil, err
	}
	nf, err := dialNetfilter(nsPath)
	if err != nil {
		c.Close()
		return nil, err
	}
	return &Conn{c: c, nf: nf}, nil
}

func dial(nsPath string) (*ct.Conn, error) {
	var c *ct.Conn
	err := inNamespace(nsPath, func(cfg *netlink.Config) (err error) {
		c, err = ct.Dial(cfg)
		return err
	})
	return c, err
}

func dialNetfilter(nsPath string) (*netfilter.Conn, error) {
	var c *netfilter.Conn
	err := inNamespace(nsPath, func(cfg *netlink.Config) (err error) {
		c, err = netfilter.Dial(cfg)
		return err
	})
	return c, err
}

// inNamespace calls open with a netlink config bound to the namespace at
// nsPath ("" = the caller's).
func inNamespace(nsPath string, open func(*netlink.Config) error) error {
	cfg := &netlink.Config{}
	if nsPath != "" {
		f, err := os.Open(nsPath)
		if err != nil {
			return fmt.Errorf("conntrack: open netns: %w", err)
		}
		defer f.Close()
		cfg.NetNS = int(f.Fd())
	}
	if err := open(cfg); err != nil {
		return fmt.Errorf("conntrack: dial: %w", err)
	}
	return nil
}

// Close closes the sockets.
func (c *Conn) Close() error { return errors.Join(c.c.Close(), c.nf.Close()) }

// Get looks one IPv4 entry up by its original tuple; ok is false when
// there is none. One round trip, unlike a dump.
func (c *Conn) Get(proto uint8, src, dst netip.AddrPort) (e Entry, ok bool, err error) {
	c.mu.Lock()
	defer c.mu.Unlock()
	var f ct.Flow
	f.TupleOrig.IP.SourceAddress = src.Addr()
	f.TupleOrig.IP.DestinationAddress = dst.Addr()
	f.TupleOrig.Proto.Protocol = proto
	f.TupleOrig.Proto.SourcePort = src.Port()
	f.TupleOrig.Proto.DestinationPort = dst.Port()
	got, err := c.c.Get(f)
	if err != nil {
		if errors.Is(err, unix.ENOENT) {
			return Entry{}, false, nil
		}
		return Entry{}, false, fmt.Errorf("conntrack: get: %w", err)
	}
	return entry(&got), true, nil
}

// ByMark lists the entries whose mark & mask == mark.
func (c *Conn) ByMark(mark, mask uint32) ([]Entry, error) {
	c.mu.Lock()
	defer c.mu.Unlock()
	if n, err := c.entries(); n == 0 || err != nil {
		return nil, err
	}
	flows, err := c.c.DumpFilter(ct.NewFilter().Mark(mark).MarkMask(mask), nil)
	if err != nil {
		return nil, fmt.Errorf("conntrack: dump: %w", err)
	}
	out := make([]Entry, 0, len(flows))
	for i := range flows {
		// The kernel filters; check again in case it is too old to.
		if flows[i].Mark&mask != mark {
			continue
		}
		out = append(out, entry(&flows[i]))
	}
	return out, nil
}

// entries is how many entries the namespace tracks (one small request). At
// 0 a dump, which walks the whole host-wide hash (13–17 ms here), is skipped.
func (c *Conn) entries() (int, error) {
	st, err := c.c.StatsGlobal()
	if err != nil {
		return 0, fmt.Errorf("conntrack: stats: %w", err)
	}
	return int(st.Entries), nil
}

func entry(f *ct.Flow) Entry {
	e := Entry{
		ID:      f.ID,
		Mark:    f.Mark,
		Proto:   f.TupleOrig.Proto.Protocol,
		Orig:    netip.AddrPortFrom(f.TupleOrig.IP.SourceAddress, f.TupleOrig.Proto.SourcePort),
		OrigDst: netip.AddrPortFrom(f.TupleOrig.IP.DestinationAddress, f.TupleOrig.Proto.DestinationPort),
	}
	if f.ProtoInfo.TCP != nil {
		e.TCPState = f.ProtoInfo.TCP.State
	}
	return e
}
