package bpf

import (
	"fmt"
	"io"
	"net"
	"net/netip"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/brokkr/brokkr/internal/nstest"
)

// newSockTopo6 is newSockTopo with IPv6 on the bridge: br0 also holds
// fd00:1::1/64, g1 fd00:1::11 and g2 fd00:1::12, each serving on its IPv6
// address the same echo on 7000 and, on 7001, its name with "v6" after it
// (so a caller can tell which of the guest's addresses it reached).
func newSockTopo6(t *testing.T, proto uint32, cap uint32) *sockTopo {
	t.Helper()
	tp := newSockTopo(t, proto, cap)
	tp.host.MustRun(t, "ip", "addr", "add", "fd00:1::1/64", "dev", "br0", "nodad")
	for i, g := range []*nstest.NS{tp.g1, tp.g2} {
		addr := fmt.Sprintf("fd00:1::%d", 11+i)
		g.MustRun(t, "ip", "addr", "add", addr+"/64", "dev", "eth0", "nodad")
		serveEcho6(t, g, "["+addr+"]:7000")
		serveName6(t, g, "["+addr+"]:7001", fmt.Sprintf("g%dv6", i+1))
	}
	return tp
}

func serveName6(t *testing.T, ns *nstest.NS, addr, name string) {
	t.Helper()
	var ln net.Listener
	require.NoError(t, ns.Do(func() (err error) { ln, err = net.Listen("tcp6", addr); return err }))
	var wg sync.WaitGroup
	t.Cleanup(func() { ln.Close(); wg.Wait() })
	wg.Add(1)
	go func() {
		defer wg.Done()
		for {
			c, err := ln.Accept()
			if err != nil {
				return
			}
			_, _ = c.Write([]byte(name))
			c.Close()
		}
	}()
}

// serveEcho6 is nstest's ServeEcho on an IPv6 address.
func serveEcho6(t *testing.T, ns *nstest.NS, addr string) {
	t.Helper()
	var ln net.Listener
	var pc net.PacketConn
	require.NoError(t, ns.Do(func() (err error) {
		if ln, err = net.Listen("tcp6", addr); err != nil {
			return err
		}
		pc, err = net.ListenPacket("udp6", addr)
		return err
	}))
	var wg sync.WaitGroup
	t.Cleanup(func() { ln.Close(); pc.Close(); wg.Wait() })
	wg.Add(2)
	go func() {
		defer wg.Done()
		for {
			c, err := ln.Accept()
			if err != nil {
				return
			}
			wg.Add(1)
			go func() { defer wg.Done(); _, _ = io.Copy(c, c); c.Close() }()
		}
	}()
	go func() {
		defer wg.Done()
		buf := make([]byte, 65536)
		for {
			n, from, err := pc.ReadFrom(buf)
			if err != nil {
				return
			}
			_, _ = pc.WriteTo(buf[:n], from)
		}
	}()
}

var g1v6 = netip.MustParseAddr("fd00:1::11")

// IPv6 callers (::1, a host IPv6 address; dual-stack and IPV6_V6ONLY
// sockets alike) reach the guest's IPv6 address; getpeername shows what
// they dialled; IPv4 callers still reach its IPv4 address; every caller
// counts in the one slot. Without the IPv6 address, IPv6 callers go to the
// IPv4 one through a v4-mapped address again.
func TestSockLBSendsIPv6CallersToTheGuestsIPv6Address(t *testing.T) {
	tp := newSockTopo6(t, ProtoTCP, 0)
	lb := tp.load(t)
	defer lb.Close()
	require.NoError(t, lb.SetLocalAddrs([]netip.Addr{netip.MustParseAddr("10.213.0.1"), netip.MustParseAddr("fd00:1::1")}))
	require.NoError(t, lb.SetTarget(anyHost, ProtoTCP, 8081, SockTarget{Guest: guest("10.213.0.11:7001"), Guest6: g1v6, Slot: tp.slot.Index()}))

	for _, c := range []struct{ network, dst, want string }{
		{"tcp", "[::1]:8081", "g1v6"},
		{"tcp6", "[::1]:8081", "g1v6"}, // IPV6_V6ONLY: no v4-mapped address needed
		{"tcp", "[fd00:1::1]:8081", "g1v6"},
		{"tcp4", "127.0.0.1:8081", "g1"},
		{"tcp4", "10.213.0.1:8081", "g1"},
	} {
		conn, err := dial(t, tp.host, c.network, c.dst)
		require.NoError(t, err, c.dst)
		assert.Equal(t, netip.MustParseAddrPort(c.dst), peerOf(t, conn), "getpeername shows the address dialled (%s)", c.dst)
		assert.Equal(t, c.want, readAll(t, conn), "%s %s", c.network, c.dst)
		conn.Close()
	}
	// TCP bytes reach the slot when the connection is closed both ways.
	eventually(t, "every caller counted and released", func() bool {
		c := tp.slot.Read()
		return c.Accepted == 5 && c.Active == 0 && c.BytesOut == uint64(len("g1v6")*3+len("g1")*2)
	})

	// Echo over IPv6: bytes both ways, exact.
	require.NoError(t, lb.SetTarget(anyHost, ProtoTCP, 8080, SockTarget{Guest: guest("10.213.0.11:7000"), Guest6: g1v6, Slot: tp.slot.Index()}))
	e, err := dial(t, tp.host, "tcp6", "[::1]:8080")
	require.NoError(t, err)
	roundTrip(t, e, make([]byte, 3000))
	require.NoError(t, e.Close())
	eventually(t, "echo counted", func() bool { c := tp.slot.Read(); return c.Active == 0 && c.BytesIn == 3000 && c.BytesOut == 3000+16 })

	// No IPv6 address for the guest any more: dual-stack sockets go to
	// its IPv4 address as before, IPV6_V6ONLY ones cannot.
	require.NoError(t, lb.SetTarget(anyHost, ProtoTCP, 8081, SockTarget{Guest: guest("10.213.0.11:7001"), Slot: tp.slot.Index()}))
	conn, err := dial(t, tp.host, "tcp", "[::1]:8081")
	require.NoError(t, err)
	assert.Equal(t, "g1", readAll(t, conn))
	conn.Close()
	_, err = dial(t, tp.host, "tcp6", "[::1]:8081")
	require.ErrorIs(t, err, syscall.ECONNREFUSED, "left alone: nothing listens on the host's port")
	eventually(t, "active 0", func() bool { return tp.slot.Read().Active == 0 })
	assert.EqualValues(t, 7, tp.slot.Read().Accepted)
	assert.Zero(t, tp.slot.Read().Dropped)
}

// IPv6 UDP, unconnected (sendmsg6, translated per datagram now) and
// connected: the guest's IPv6 address answers, the replies appear to come
// from the address sent to, and the payload is counted both ways.
func TestSockLBTranslatesIPv6UDPConnectedAndNot(t *testing.T) {
	tp := newSockTopo6(t, ProtoUDP, 0)
	lb := tp.load(t)
	defer lb.Close()
	require.NoError(t, lb.SetTarget(anyHost, ProtoUDP, 8080, SockTarget{Guest: guest("10.213.0.11:7000"), Guest6: g1v6, Slot: tp.slot.Index()}))

	var u6 *net.UDPConn
	require.NoError(t, tp.host.Do(func() (err error) { u6, err = net.ListenUDP("udp6", nil); return err }))
	defer u6.Close()
	dst := net.UDPAddrFromAddrPort(netip.MustParseAddrPort("[::1]:8080"))
	sent := 0
	for _, msg := range []string{"hello", "again!"} {
		_, err := u6.WriteTo([]byte(msg), dst)
		require.NoError(t, err)
		buf := make([]byte, 100)
		require.NoError(t, u6.SetReadDeadline(time.Now().Add(5*time.Second)))
		n, from, err := u6.ReadFromUDPAddrPort(buf)
		require.NoError(t, err, "an unconnected IPv6 datagram is translated")
		assert.Equal(t, msg, string(buf[:n]))
		assert.Equal(t, "[::1]:8080", from.String(), "the reply comes from the address sent to")
		sent += len(msg)
	}

	c6, err := dial(t, tp.host, "udp6", "[::1]:8080")
	require.NoError(t, err)
	defer c6.Close()
	roundTrip(t, c6, []byte("six"))
	sent += 3
	assert.Equal(t, netip.MustParseAddrPort("[::1]:8080"), peerOf(t, c6))
	buf := make([]byte, 10)
	_, err = c6.Write([]byte("whose"))
	require.NoError(t, err)
	n, from, err := c6.(*net.UDPConn).ReadFromUDPAddrPort(buf)
	require.NoError(t, err)
	assert.Equal(t, "whose", string(buf[:n]))
	assert.Equal(t, "[::1]:8080", from.String())
	sent += 5

	c := tp.slot.Read()
	assert.EqualValues(t, 2, c.Active, "one place per socket")
	assert.EqualValues(t, 2, c.Accepted)
	assert.EqualValues(t, sent, c.BytesIn)
	assert.EqualValues(t, sent, c.BytesOut)
	require.NoError(t, u6.Close())
	require.NoError(t, c6.Close())
	eventually(t, "active 0", func() bool { return tp.slot.Read().Active == 0 })
}

// One cap of 2 across both families: an IPv4 and an IPv6 caller hold it, a
// third of either family is refused; a place given back by either lets a
// caller of the other in.
func TestSockLBOneCapAcrossBothFamilies(t *testing.T) {
	tp := newSockTopo6(t, ProtoTCP, 2)
	lb := tp.load(t)
	defer lb.Close()
	require.NoError(t, lb.SetTarget(anyHost, ProtoTCP, 8080, SockTarget{Guest: guest("10.213.0.11:7000"), Guest6: g1v6, Slot: tp.slot.Index()}))
	a, err := dial(t, tp.host, "tcp4", "127.0.0.1:8080")
	require.NoError(t, err)
	b, err := dial(t, tp.host, "tcp6", "[::1]:8080")
	require.NoError(t, err)
	roundTrip(t, b, []byte("v6"))
	for _, c := range []struct{ network, dst string }{{"tcp4", "127.0.0.1:8080"}, {"tcp6", "[::1]:8080"}, {"tcp", "[::1]:8080"}} {
		_, err := dial(t, tp.host, c.network, c.dst)
		require.ErrorIs(t, err, syscall.ECONNREFUSED, "%s %s", c.network, c.dst)
	}
	assert.EqualValues(t, 3, tp.slot.Read().Refused)
	require.NoError(t, a.Close())
	eventually(t, "active 1", func() bool { return tp.slot.Read().Active == 1 })
	d, err := dial(t, tp.host, "tcp6", "[::1]:8080")
	require.NoError(t, err)
	roundTrip(t, d, []byte("in"))
	d.Close()
	b.Close()
	eventually(t, "active 0, bytes at close", func() bool { c := tp.slot.Read(); return c.Active == 0 && c.BytesIn == 4 && c.BytesOut == 4 })
	c := tp.slot.Read()
	assert.EqualValues(t, 3, c.Accepted)
	assert.EqualValues(t, 3, c.Refused)
}

// A guest reached over IPv6 alone (no IPv4 address): IPv6 callers go
// there; IPv4 callers are refused at once, counted as dropped, as for a
// guest that cannot be reached.
func TestSockLBAGuestWithIPv6OnlyRefusesIPv4Callers(t *testing.T) {
	tp := newSockTopo6(t, ProtoTCP, 0)
	lb := tp.load(t)
	defer lb.Close()
	require.NoError(t, lb.SetTarget(anyHost, ProtoTCP, 8081, SockTarget{Guest: guest("0.0.0.0:7001"), Guest6: g1v6, Slot: tp.slot.Index()}))
	c, err := dial(t, tp.host, "tcp", "[::1]:8081")
	require.NoError(t, err)
	assert.Equal(t, "g1v6", readAll(t, c))
	c.Close()
	start := time.Now()
	_, err = dial(t, tp.host, "tcp4", "127.0.0.1:8081")
	require.ErrorIs(t, err, syscall.ECONNREFUSED)
	assert.Less(t, time.Since(start), 100*time.Millisecond)
	eventually(t, "active 0", func() bool { return tp.slot.Read().Active == 0 })
	r := tp.slot.Read()
	assert.EqualValues(t, 1, r.Accepted)
	assert.EqualValues(t, 1, r.Dropped)

	assert.Error(t, lb.SetTarget(anyHost, ProtoTCP, 8081, SockTarget{Guest: guest("10.213.0.11:7001"), Guest6: netip.MustParseAddr("10.213.0.11"), Slot: tp.slot.Index()}),
		"Guest6 must be IPv6")
}
