package netplane

import (
	"bufio"
	"context"
	"net"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/brokkr/brokkr/internal/kernelfeat"
	"github.com/brokkr/brokkr/internal/nstest"
	"github.com/brokkr/brokkr/internal/spec"
)

// serveRemote answers each connection on addr (network tcp4 or tcp6)
// inside ns with the caller's address as the guest sees it, one line, and
// keeps it open until the caller closes.
func serveRemote(t *testing.T, ns *nstest.NS, network, addr string) {
	ns.ServeTCP(t, network, addr, func(c net.Conn) {
		_, _ = c.Write([]byte(c.RemoteAddr().(*net.TCPAddr).IP.String() + "\n"))
		_, _ = c.Read(make([]byte, 1))
	})
}

// callFrom connects from inside ns and returns the connection and the
// caller's address the guest saw.
func callFrom(ns *nstest.NS, addr string) (net.Conn, string, error) {
	var c net.Conn
	if err := ns.Do(func() (err error) { c, err = net.DialTimeout("tcp", addr, 2*time.Second); return err }); err != nil {
		return nil, "", err
	}
	_ = c.SetDeadline(time.Now().Add(3 * time.Second))
	line, err := bufio.NewReader(c).ReadString('\n')
	if err != nil {
		c.Close()
		return nil, "", err
	}
	_ = c.SetDeadline(time.Time{})
	return c, strings.TrimSpace(line), nil
}

// An exposure of every address (hostAddress "") on the BPF nat path takes
// callers of both families to the guest's address of their family, with
// the caller's address kept; 0.0.0.0 is IPv4 only and :: IPv6 only; one cap
// of 2 is held by one IPv4 and one IPv6 caller and refuses a third of
// either family; the slot counts both.
func TestDualStackExposuresOnTheNatPath(t *testing.T) {
	nstest.RequireRoot(t)
	kernelfeat.Require(t, kernelfeat.NatPath...)
	host, client := hostAndClient(t)
	client.MustRun(t, "ip", "-6", "addr", "add", "fd00:99::2/64", "dev", "eth0", "nodad")
	host.MustRun(t, "ip", "-6", "addr", "add", "fd00:99::1/64", "dev", "up0", "nodad")
	p, store := newPinnedPlane(t, host, t.TempDir())
	web := spec.Target{VM: "web"}
	d := Desired{Network: network6(), Guests: guestsOf("web"), Exposures: []Exposure{
		{Name: "both", Target: web, Proto: spec.TCP, HostPort: 8080, GuestPort: 80, MaxConns: 2},
		{Name: "v4", Target: web, Proto: spec.TCP, HostAddr: mustAddr("0.0.0.0"), HostPort: 8081, GuestPort: 80},
		{Name: "v6", Target: web, Proto: spec.TCP, HostAddr: mustAddr("::"), HostPort: 8082, GuestPort: 80},
		{Name: "one6", Target: web, Proto: spec.TCP, HostAddr: mustAddr("fd00:99::1"), HostPort: 8083, GuestPort: 80},
	}}
	rep := p.Converge(context.Background(), d)
	require.NoError(t, rep.Err)
	require.Empty(t, rep.Warnings, "the nat path carries both families")
	g := rep.Guests[0]
	guest := attachGuest(t, host, g)
	guest.MustRun(t, "ip", "addr", "add", g.Address.String()+"/24", "dev", "eth0")
	guest.MustRun(t, "ip", "route", "add", "default", "via", "10.213.0.1")
	// The host forwards IPv6 for the published ports, so the
	// advertisements name it the default router: the guest answers IPv6
	// callers from beyond its /64 through it.
	convergeUntil(t, p, d, "the guest's SLAAC address and its default route", func(Report) bool {
		out := addrs6(t, guest)
		return strings.Contains(out, g.Address6.String()+"/64") && !strings.Contains(out, "tentative") &&
			strings.Contains(guest.MustRun(t, "ip", "-6", "route", "show", "default"), "via fe80::")
	})
	serveRemote(t, guest, "tcp4", "0.0.0.0:80")
	serveRemote(t, guest, "tcp6", "[::]:80")
	rep = p.Converge(context.Background(), d)
	require.NoError(t, rep.Err)
	for _, x := range rep.Exposures {
		// pending: the guest took its address by hand, not by DHCP; the
		// elements are in the table either way.
		require.NotEqual(t, spec.StateFailed, x.State, "%s: %s", x.Name, x.Reason)
	}

	reaches := func(addr, wantCaller string) {
		t.Helper()
		c, seen, err := callFrom(client, addr)
		require.NoError(t, err, addr)
		c.Close()
		assert.Equal(t, wantCaller, seen, "%s: the guest sees the caller's own address", addr)
	}
	refused := func(addr string) {
		t.Helper()
		c, _, err := callFrom(client, addr)
		if err == nil {
			c.Close()
		}
		assert.Error(t, err, "%s is not published", addr)
	}
	reaches("10.99.0.1:8080", "10.99.0.2")
	reaches("[fd00:99::1]:8080", "fd00:99::2")
	reaches("10.99.0.1:8081", "10.99.0.2")
	refused("[fd00:99::1]:8081")
	reaches("[fd00:99::1]:8082", "fd00:99::2")
	refused("10.99.0.1:8082")
	reaches("[fd00:99::1]:8083", "fd00:99::2")

	// One cap of 2 across both families.
	a, _, err := callFrom(client, "10.99.0.1:8080")
	require.NoError(t, err)
	defer a.Close()
	b, _, err := callFrom(client, "[fd00:99::1]:8080")
	require.NoError(t, err)
	defer b.Close()
	refused("10.99.0.1:8080")
	refused("[fd00:99::1]:8080")
	c, ok := store.Lookup("both")
	require.True(t, ok)
	assert.EqualValues(t, 2, c.Active, "one IPv4 and one IPv6 caller hold the cap")
	assert.EqualValues(t, 4, c.Accepted, "every caller of both families counts in the one slot")
	assert.EqualValues(t, 2, c.Refused, "a third caller of either family is refused")
	a.Close()
	require.Eventually(t, func() bool {
		c, _ := store.Lookup("both")
		return c.Active == 1
	}, 5*time.Second, 50*time.Millisecond, "a closed caller gives its place back")
	b.Close()
	require.Eventually(t, func() bool {
		c, _ := store.Lookup("both")
		return c.Active == 0
	}, 5*time.Second, 50*time.Millisecond, "a closed IPv6 caller gives its place back (FIN both ways)")
	reaches("[fd00:99::1]:8080", "fd00:99::2")
	require.Eventually(t, func() bool {
		c, _ := store.Lookup("both")
		return c.Active == 0
	}, 5*time.Second, 50*time.Millisecond, "and so does a short IPv6 call")
}
