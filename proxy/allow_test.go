package proxy

import (
	"errors"
	"io"
	"net"
	"net/netip"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/brokkr/brokkr/internal/nstest"
	"github.com/brokkr/brokkr/internal/spec"
)

func TestAllowListMatchesByPrefixOfBothFamilies(t *testing.T) {
	a := newAllowList([]netip.Prefix{netip.MustParsePrefix("10.0.0.0/8"), netip.MustParsePrefix("192.0.2.7/32"),
		netip.MustParsePrefix("2001:db8::/32"), netip.MustParsePrefix("fd00::5/128")})
	for s, want := range map[string]bool{
		"10.1.2.3": true, "11.0.0.1": false, "192.0.2.7": true, "192.0.2.8": false,
		"::ffff:10.9.9.9": true, "2001:db8:ffff::1": true, "2001:db9::1": false,
		"fd00::5": true, "fd00::6": false, "::ffff:192.0.2.8": false,
	} {
		assert.Equal(t, want, a.allows(netip.MustParseAddr(s)), s)
	}
	var none *allowList
	assert.True(t, none.allows(netip.MustParseAddr("203.0.113.1")), "no list: everyone")
	assert.True(t, newAllowList(nil) == nil)
	assert.True(t, a.same(a.src))
	assert.False(t, a.same(a.src[:1]))
	assert.True(t, hostLocal(netip.MustParseAddr("127.0.0.1"), netip.MustParseAddr("10.99.0.1")))
	assert.True(t, hostLocal(netip.MustParseAddr("::ffff:10.99.0.1"), netip.MustParseAddr("10.99.0.1")))
	assert.False(t, hostLocal(netip.MustParseAddr("10.99.0.2"), netip.MustParseAddr("10.99.0.1")))
}

// allowNS is a host namespace (10.99.0.1 and fd00:99::1 towards an allowed
// client, 10.98.0.1 and fd00:98::1 towards a denied one) where the proxy
// listens; the guest stays on the root namespace's loopback, which the
// Manager's goroutines dial from there.
func allowNS(t *testing.T) (host, allowed, denied *nstest.NS) {
	host, allowed, denied = nstest.New(t, "host"), nstest.New(t, "ok"), nstest.New(t, "no")
	nstest.Link(t, allowed, "eth0", "10.99.0.2/24", host, "v-ok", "10.99.0.1/24")
	nstest.Link(t, denied, "eth0", "10.98.0.2/24", host, "v-no", "10.98.0.1/24")
	allowed.MustRun(t, "ip", "route", "add", "default", "via", "10.99.0.1")
	denied.MustRun(t, "ip", "route", "add", "default", "via", "10.98.0.1")
	for _, c := range []struct {
		ns       *nstest.NS
		dev, adr string
	}{{host, "v-ok", "fd00:99::1/64"}, {host, "v-no", "fd00:98::1/64"}, {allowed, "eth0", "fd00:99::2/64"}, {denied, "eth0", "fd00:98::2/64"}} {
		c.ns.MustRun(t, "ip", "addr", "add", c.adr, "dev", c.dev, "nodad")
	}
	allowed.MustRun(t, "ip", "-6", "route", "add", "default", "via", "fd00:99::1")
	denied.MustRun(t, "ip", "-6", "route", "add", "default", "via", "fd00:98::1")
	return host, allowed, denied
}

func dialIn(t *testing.T, ns *nstest.NS, network, addr string) net.Conn {
	t.Helper()
	var c net.Conn
	require.NoError(t, ns.Do(func() (err error) { c, err = net.DialTimeout(network, addr, 3*time.Second); return err }))
	t.Cleanup(func() { c.Close() })
	return c
}

// closedAtAccept: the handshake is the kernel's, then the proxy closes the
// connection without a byte.
func closedAtAccept(t *testing.T, c net.Conn) {
	t.Helper()
	require.NoError(t, c.SetDeadline(time.Now().Add(3*time.Second)))
	_, _ = c.Write([]byte("hi"))
	b, err := io.ReadAll(c)
	assert.Empty(t, b, "nothing reaches the guest or comes back")
	if err != nil {
		var ne net.Error
		assert.False(t, errors.As(err, &ne) && ne.Timeout(), "closed at accept, not left hanging: %v", err)
	}
}

func TestAllowFromOnTheProxyPath(t *testing.T) {
	host, allowed, denied := allowNS(t)
	m, _ := newManager(t)
	guest := echoServer(t, "g:")
	allow := []netip.Prefix{netip.MustParsePrefix("10.99.0.0/24"), netip.MustParsePrefix("fd00:99::2/128")}
	specs := []Spec{
		{Exposure: spec.Exposure{Name: "web", Target: spec.Target{VM: "vm1"}, Proto: "tcp", HostPort: 8080, GuestPort: uint16(guest),
			MaxConns: 1, AllowFrom: allow}, Listen: netip.MustParseAddr("0.0.0.0")},
		{Exposure: spec.Exposure{Name: "web6", Target: spec.Target{VM: "vm1"}, Proto: "tcp", HostPort: 8080, GuestPort: uint16(guest),
			MaxConns: 1, AllowFrom: allow}, Listen: netip.MustParseAddr("::")},
		{Exposure: spec.Exposure{Name: "dns", Target: spec.Target{VM: "vm1"}, Proto: "udp", HostPort: 5353, GuestPort: uint16(udpEcho(t)),
			AllowFrom: allow}, Listen: netip.MustParseAddr("0.0.0.0")},
	}
	var st []Status
	require.NoError(t, host.Do(func() error { st = m.Converge(specs); return nil }))
	for _, s := range st {
		require.Equal(t, StateActive, s.State, "%s: %s", s.ID, s.Reason)
	}
	count := func(name string) (denied, accepted, refused uint64) {
		c, ok := m.stats.Lookup(name)
		require.True(t, ok)
		return c.Denied, c.Accepted, c.Refused
	}

	// A denied caller first: closed at accept, counted, no place taken.
	closedAtAccept(t, dialIn(t, denied, "tcp4", "10.98.0.1:8080"))
	require.Eventually(t, func() bool { d, _, _ := count("web"); return d == 1 }, 3*time.Second, 10*time.Millisecond)
	// The allowed caller gets the cap's one place and is carried.
	a := dialIn(t, allowed, "tcp4", "10.99.0.1:8080")
	require.NoError(t, a.SetDeadline(time.Now().Add(3*time.Second)))
	_, err := a.Write([]byte("x"))
	require.NoError(t, err)
	buf := make([]byte, 3)
	_, err = io.ReadFull(a, buf)
	require.NoError(t, err, "the cap of 1 was not consumed by the denied caller")
	assert.Equal(t, "g:x", string(buf))
	// While it holds the place, a denied caller is denied, not refused.
	closedAtAccept(t, dialIn(t, denied, "tcp4", "10.98.0.1:8080"))
	require.Eventually(t, func() bool { d, _, _ := count("web"); return d == 2 }, 3*time.Second, 10*time.Millisecond)
	d, acc, ref := count("web")
	assert.EqualValues(t, 2, d)
	assert.EqualValues(t, 1, acc)
	assert.Zero(t, ref, "allowFrom comes before the cap")

	// IPv6: a /128 of the list is allowed, another address is not.
	closedAtAccept(t, dialIn(t, denied, "tcp6", "[fd00:98::1]:8080"))
	b := dialIn(t, allowed, "tcp6", "[fd00:99::1]:8080")
	require.NoError(t, b.SetDeadline(time.Now().Add(3*time.Second)))
	_, err = b.Write([]byte("y"))
	require.NoError(t, err)
	_, err = io.ReadFull(b, buf)
	require.NoError(t, err)
	assert.Equal(t, "g:y", string(buf))
	require.Eventually(t, func() bool { d, _, _ := count("web6"); return d == 1 }, 3*time.Second, 10*time.Millisecond)

	// A host-local caller (the host's own process, from the address it
	// dials) is not restricted.
	a.Close()
	require.Eventually(t, func() bool { c, _ := m.stats.Lookup("web"); return c.Active == 0 }, 3*time.Second, 10*time.Millisecond)
	h := dialIn(t, host, "tcp4", "10.98.0.1:8080")
	require.NoError(t, h.SetDeadline(time.Now().Add(3*time.Second)))
	_, err = h.Write([]byte("z"))
	require.NoError(t, err)
	_, err = io.ReadFull(h, buf)
	require.NoError(t, err, "a host-local caller is carried")
	h.Close()
	require.Eventually(t, func() bool { c, _ := m.stats.Lookup("web"); return c.Active == 0 }, 3*time.Second, 10*time.Millisecond)

	// UDP: a datagram from a denied source is dropped and counted; an
	// allowed one gets its answer.
	var ok, no *net.UDPConn
	require.NoError(t, allowed.Do(func() error { ok = udpClient(t, "udp4", "10.99.0.2:0"); return nil }))
	require.NoError(t, denied.Do(func() error { no = udpClient(t, "udp4", "10.98.0.2:0"); return nil }))
	_, err = no.WriteToUDPAddrPort([]byte("q"), netip.MustParseAddrPort("10.98.0.1:5353"))
	require.NoError(t, err)
	require.Eventually(t, func() bool { d, _, _ := count("dns"); return d == 1 }, 3*time.Second, 10*time.Millisecond)
	reply, _ := ask(t, ok, "10.99.0.1:5353", "r", 3*time.Second)
	assert.Contains(t, reply, ":r")
	d, acc, _ = count("dns")
	assert.EqualValues(t, 1, d)
	assert.EqualValues(t, 1, acc)

	// The list is changed in place: the listener stays, the other caller
	// is allowed now.
	specs[0].AllowFrom = []netip.Prefix{netip.MustParsePrefix("10.98.0.0/24")}
	require.NoError(t, host.Do(func() error { st = m.Converge(specs); return nil }))
	require.Equal(t, StateActive, st[0].State, st[0].Reason)
	c := dialIn(t, denied, "tcp4", "10.98.0.1:8080")
	require.NoError(t, c.SetDeadline(time.Now().Add(3*time.Second)))
	_, err = c.Write([]byte("w"))
	require.NoError(t, err)
	_, err = io.ReadFull(c, buf)
	require.NoError(t, err, "allowed after the change")
}
