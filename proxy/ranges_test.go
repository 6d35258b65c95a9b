package proxy

import (
	"errors"
	"fmt"
	"net"
	"net/netip"
	"syscall"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/brokkr/brokkr/bpf"
	"github.com/brokkr/brokkr/internal/nstest"
	"github.com/brokkr/brokkr/internal/spec"
)

// A port range in proxy mode is one listener per port, all of one
// exposure: each port of it carries to the guest, no port beside it is
// listened on, and the one cap and the one slot hold across every port.
// The listeners are bound in a namespace of the test's own (fixed ports);
// the guest is on the root namespace's loopback, dialled from there.
func TestPortRangeOnTheProxy(t *testing.T) {
	nstest.RequireRoot(t)
	host := nstest.New(t, "host")
	host.MustRun(t, "ip", "link", "set", "lo", "up")
	m, _ := newManager(t)
	guest := echoServer(t, "g:")
	e := spec.Exposure{Name: "range", Target: spec.Target{VM: "vm1"}, Proto: "tcp", HostPort: 30000, HostPortLast: 30009,
		GuestPort: uint16(guest), MaxConns: 2}
	specs := Specs(e, netip.MustParseAddr("127.0.0.1"))
	require.Len(t, specs, 10)
	var st []Status
	require.NoError(t, host.Do(func() error { st = m.Converge(specs); return nil }))
	for i, s := range st {
		require.Equal(t, StateActive, s.State, "port %d: %s", 30000+i, s.Reason)
		assert.Equal(t, fmt.Sprintf("127.0.0.1:%d", 30000+i), s.BoundAddr)
	}
	in := func(port int) net.Conn { return dialIn(t, host, "tcp4", fmt.Sprintf("127.0.0.1:%d", port)) }
	carried := func(port int) net.Conn {
		c := in(port)
		require.NoError(t, c.SetDeadline(time.Now().Add(5*time.Second)))
		require.Equal(t, "g:ping", roundTrip(t, c, "g:", "ping"), "port %d", port)
		return c
	}

	// The first and the last port, each holding one of the cap's two places.
	first, last := carried(30000), carried(30009)
	// A third caller, on a middle port, is past the one cap of the range.
	// (On loopback the RST can beat the dialer's return.)
	err := host.Do(func() error {
		c, err := net.DialTimeout("tcp4", "127.0.0.1:30004", 2*time.Second)
		if err != nil {
			return err
		}
		defer c.Close()
		_ = c.SetDeadline(time.Now().Add(5 * time.Second))
		n, err := c.Read(make([]byte, 16))
		assert.Zero(t, n)
		return err
	})
	assert.True(t, errors.Is(err, syscall.ECONNRESET), "want a reset at the cap, got %v", err)
	// With a place free the middle port carries.
	require.NoError(t, first.Close())
	eventually(t, "the place is given back", func() bool { c, _ := m.stats.Lookup("range"); return c.Active == 1 })
	carried(30004)
	_ = last

	// Beside the range nothing listens.
	for _, port := range []int{29999, 30010} {
		err := host.Do(func() error {
			c, err := net.DialTimeout("tcp4", fmt.Sprintf("127.0.0.1:%d", port), 2*time.Second)
			if err == nil {
				c.Close()
			}
			return err
		})
		assert.True(t, errors.Is(err, syscall.ECONNREFUSED), "port %d: %v", port, err)
	}

	// One slot: every port's callers are counted in it.
	cs, ok := m.stats.Lookup("range")
	require.True(t, ok)
	assert.EqualValues(t, 3, cs.Accepted)
	assert.EqualValues(t, 1, cs.Refused)
	assert.EqualValues(t, 2, cs.Active)

	// Shrinking the range closes the listeners of the ports it left.
	e.HostPortLast = 30004
	require.NoError(t, host.Do(func() error { st = m.Converge(Specs(e, netip.MustParseAddr("127.0.0.1"))); return nil }))
	require.Len(t, st, 5)
	err = host.Do(func() error {
		c, err := net.DialTimeout("tcp4", "127.0.0.1:30009", 2*time.Second)
		if err == nil {
			c.Close()
		}
		return err
	})
	assert.True(t, errors.Is(err, syscall.ECONNREFUSED), "a port the range left: %v", err)
}

// A guest range keeps each port: host port 30001 goes to the guest's
// 30001 (the guest's listeners on root loopback 127.0.0.3, ports few
// programs use).
func TestPortRangeKeepsThePortOnTheProxy(t *testing.T) {
	nstest.RequireRoot(t)
	host := nstest.New(t, "host")
	host.MustRun(t, "ip", "link", "set", "lo", "up")
	g := &guests{addrs: map[string]string{"vm1": "127.0.0.3"}}
	m := NewManager(g.resolve, nil)
	t.Cleanup(m.StopAll)
	const base = 47311
	for i := range 3 {
		ln, err := net.Listen("tcp4", fmt.Sprintf("127.0.0.3:%d", base+i))
		require.NoError(t, err)
		t.Cleanup(func() { ln.Close() })
		go func() {
			for {
				c, err := ln.Accept()
				if err != nil {
					return
				}
				fmt.Fprintf(c, "%d", base+i)
				c.Close()
			}
		}()
	}
	e := spec.Exposure{Name: "same", Target: spec.Target{VM: "vm1"}, Proto: "tcp", HostPort: base, HostPortLast: base + 2,
		GuestPort: base, GuestPortLast: base + 2}
	var st []Status
	require.NoError(t, host.Do(func() error { st = m.Converge(Specs(e, netip.MustParseAddr("127.0.0.1"))); return nil }))
	for _, s := range st {
		require.Equal(t, StateActive, s.State, s.Reason)
	}
	for i := range 3 {
		c := dialIn(t, host, "tcp4", fmt.Sprintf("127.0.0.1:%d", base+i))
		require.NoError(t, c.SetDeadline(time.Now().Add(5*time.Second)))
		b := make([]byte, 5)
		_, err := c.Read(b)
		require.NoError(t, err)
		assert.Equal(t, fmt.Sprint(base+i), string(b))
	}
}

// A range's listeners, one per port, are handed over each to its own port
// (listener names differ by port) and serve in the next Manager. The
// listeners are bound in a namespace of the test's own (fixed ports).
func TestFreezeHandsOverARangesListeners(t *testing.T) {
	nstest.RequireRoot(t)
	host := nstest.New(t, "host")
	host.MustRun(t, "ip", "link", "set", "lo", "up")
	store := bpf.NewInMemory("test")
	defer store.Close()
	g := &guests{addrs: map[string]string{"vm1": "127.0.0.1"}}
	e := spec.Exposure{Name: "range", Target: spec.Target{VM: "vm1"}, Proto: "tcp", HostPort: 30000, HostPortLast: 30004,
		GuestPort: uint16(echoServer(t, "g:"))}
	specs := Specs(e, netip.MustParseAddr("127.0.0.1"))
	m1 := NewManager(g.resolve, store)
	var before []Status
	require.NoError(t, host.Do(func() error { before = m1.Converge(specs); return nil }))
	for _, s := range before {
		require.Equal(t, StateActive, s.State, s.Reason)
	}
	snap := m1.Freeze()
	m1.StopAll()
	require.Len(t, snap.Listeners, 5, "one listener per port")

	m2 := NewManager(g.resolve, store)
	defer m2.StopAll()
	m2.Inherit(snap.Listeners)
	var after []Status
	require.NoError(t, host.Do(func() error { after = m2.Converge(specs); return nil }))
	assert.Empty(t, m2.DropUnclaimed(), "each inherited listener was claimed by its own port")
	for i, s := range after {
		require.Equal(t, StateActive, s.State, s.Reason)
		assert.Equal(t, before[i].BoundAddr, s.BoundAddr)
		c := dialIn(t, host, "tcp4", s.BoundAddr)
		require.NoError(t, c.SetDeadline(time.Now().Add(5*time.Second)))
		assert.Equal(t, "g:hi", roundTrip(t, c, "g:", "hi"))
	}
}

// The slot is labelled with the range's first port whichever port a
// connection handed over came in on (bpftool and brokkr stats show the
// exposure's shape, not its last adopted caller's port).
func TestARangesSlotKeepsItsFirstPort(t *testing.T) {
	nstest.RequireRoot(t)
	host := nstest.New(t, "host")
	host.MustRun(t, "ip", "link", "set", "lo", "up")
	store := bpf.NewInMemory("test")
	defer store.Close()
	g := &guests{addrs: map[string]string{"vm1": "127.0.0.1"}}
	e := spec.Exposure{Name: "range", Target: spec.Target{VM: "vm1"}, Proto: "tcp", HostPort: 30000, HostPortLast: 30004,
		GuestPort: uint16(echoServer(t, "g:"))}
	specs := Specs(e, netip.MustParseAddr("127.0.0.1"))
	m1 := NewManager(g.resolve, store)
	require.NoError(t, host.Do(func() error { m1.Converge(specs); return nil }))
	c := dialIn(t, host, "tcp4", "127.0.0.1:30003")
	require.NoError(t, c.SetDeadline(time.Now().Add(5*time.Second)))
	assert.Equal(t, "g:hi", roundTrip(t, c, "g:", "hi"))
	snap := m1.Freeze()
	m1.StopAll()
	require.Len(t, snap.Pairs, 1)

	m2 := NewManager(g.resolve, store)
	defer m2.StopAll()
	m2.Inherit(snap.Listeners)
	require.NoError(t, host.Do(func() error { m2.Converge(specs); return nil }))
	m2.Adopt(snap.Pairs)
	m2.Resume()
	assert.Equal(t, "g:again", roundTrip(t, c, "g:", "again"), "the adopted connection carries on")
	var port uint32
	for _, en := range store.Entries() {
		if en.Name == "range" {
			port = en.HostPort
		}
	}
	assert.EqualValues(t, 30000, port)
}
