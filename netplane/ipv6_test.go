package netplane

import (
	"context"
	"net/netip"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/brokkr/brokkr/internal/nstest"
	"github.com/brokkr/brokkr/netplane/ipam"
)

var ula = netip.MustParsePrefix("fd00:6272:6b72::1/64")

func network6() Network {
	n := network()
	n.CIDR6 = ula
	return n
}

// attachGuest puts a guest namespace on the bridge by veth, with the MAC
// brokkr gave the guest: a stand-in for the VM on its tap (the veth is not
// one of the taps anti-spoof guards).
func attachGuest(t *testing.T, host *nstest.NS, g GuestStatus) *nstest.NS {
	ns := nstest.New(t, "guest")
	host.MustRun(t, "ip", "link", "add", "vh-"+g.Name, "type", "veth", "peer", "name", "eth0", "address", g.MAC.String(), "netns", ns.Name)
	host.MustRun(t, "ip", "link", "set", "vh-"+g.Name, "master", "brokkr0", "up")
	ns.MustRun(t, "ip", "link", "set", "eth0", "up")
	return ns
}

func addrs6(t *testing.T, g *nstest.NS) string {
	return g.MustRun(t, "ip", "-6", "-o", "addr", "show", "dev", "eth0", "scope", "global")
}

// converge runs passes (as the daemon's loop does, every second) until ok.
func convergeUntil(t *testing.T, p *Plane, d Desired, what string, ok func(Report) bool) Report {
	t.Helper()
	deadline := time.Now().Add(20 * time.Second)
	for {
		rep := p.Converge(context.Background(), d)
		require.NoError(t, rep.Err)
		if ok(rep) {
			return rep
		}
		require.True(t, time.Now().Before(deadline), "timed out waiting for %s", what)
		time.Sleep(200 * time.Millisecond)
	}
}

// A guest on the bridge that does nothing but its kernel's SLAAC takes the
// address brokkr reports for it (from its MAC, in network.cidr6), from
// brokkr's router advertisements; the bridge holds the /64's address; and
// once the guest answers neighbour discovery there it is reported seen.
func TestAGuestTakesItsIPv6AddressBySLAACFromTheBridge(t *testing.T) {
	host := nstest.New(t, "host")
	p, _ := newPlane(t, host, t.TempDir())
	d := Desired{Network: network6(), Guests: guestsOf("web")}
	rep := p.Converge(context.Background(), d)
	require.NoError(t, rep.Err)
	web := rep.Guests[0]
	require.Equal(t, ipam.SLAAC(ula, web.MAC), web.Address6, "known before the guest boots")
	assert.False(t, web.Seen6)
	assert.Contains(t, host.MustRun(t, "ip", "-6", "addr", "show", "dev", "brokkr0"), "fd00:6272:6b72::1/64 scope global")

	g := attachGuest(t, host, web)
	convergeUntil(t, p, d, "the guest's SLAAC address", func(Report) bool {
		out := addrs6(t, g)
		return strings.Contains(out, web.Address6.String()+"/64") && !strings.Contains(out, "tentative")
	})
	assert.Equal(t, 1, strings.Count(addrs6(t, g), "inet6"), "the EUI-64 address, no other")

	// The table's input chain takes neighbour advertisements from guests:
	// the guest's answer reaches brokkr.
	rep = convergeUntil(t, p, d, "the guest seen at its IPv6 address", func(r Report) bool { return r.Guests[0].Seen6 })
	assert.Equal(t, web.Address6, rep.Guests[0].Address6)
}

// network.cidr6 changed: the old prefix is withdrawn (the guest deprecates
// it), the new one advertised and taken; cidr6 "" withdraws it and leaves
// the bridge and the guests with IPv4 only.
func TestAChangedOrRemovedPrefixIsWithdrawn(t *testing.T) {
	host := nstest.New(t, "host")
	p, _ := newPlane(t, host, t.TempDir())
	d := Desired{Network: network6(), Guests: guestsOf("web")}
	web := p.Converge(context.Background(), d).Guests[0]
	g := attachGuest(t, host, web)
	convergeUntil(t, p, d, "the first address", func(Report) bool { return strings.Contains(addrs6(t, g), web.Address6.String()) })

	d.Network.CIDR6 = netip.MustParsePrefix("fd00:77::1/64")
	rep := convergeUntil(t, p, d, "the new address and the old one deprecated", func(Report) bool {
		out := addrs6(t, g)
		return strings.Contains(out, ipam.SLAAC(d.Network.CIDR6, web.MAC).String()) &&
			strings.Contains(out, web.Address6.String()+"/64 scope global deprecated")
	})
	assert.Equal(t, ipam.SLAAC(d.Network.CIDR6, web.MAC), rep.Guests[0].Address6)
	bridge := host.MustRun(t, "ip", "-6", "addr", "show", "dev", "brokkr0")
	assert.Contains(t, bridge, "fd00:77::1/64")
	assert.NotContains(t, bridge, "fd00:6272:6b72::1")

	d.Network.CIDR6 = netip.Prefix{}
	rep = convergeUntil(t, p, d, "the prefix withdrawn", func(Report) bool {
		return strings.Contains(addrs6(t, g), ipam.SLAAC(netip.MustParsePrefix("fd00:77::1/64"), web.MAC).String()+"/64 scope global deprecated")
	})
	assert.False(t, rep.Guests[0].Address6.IsValid())
	assert.NotContains(t, host.MustRun(t, "ip", "-6", "addr", "show", "dev", "brokkr0"), "scope global")
}

// Where the bridge can carry no IPv6 (disabled for new links here), the
// pass goes on with IPv4 and says why; a /64 overlapping a foreign link's
// prefix is refused by name.
func TestWithoutIPv6OnTheBridgeGuestsGetIPv4OnlyAndAClashIsRefused(t *testing.T) {
	host := nstest.New(t, "host")
	host.MustRun(t, "sh", "-c", "echo 1 > /proc/sys/net/ipv6/conf/default/disable_ipv6")
	p, _ := newPlane(t, host, t.TempDir())
	d := Desired{Network: network6(), Guests: guestsOf("web")}
	rep := p.Converge(context.Background(), d)
	require.NoError(t, rep.Err)
	assert.Contains(t, rep.Warnings, "network.cidr6: bridge brokkr0 has no IPv6 (disabled on this host, or an MTU below 1280): guests get IPv4 only")
	assert.False(t, rep.Guests[0].Address6.IsValid())
	assert.True(t, rep.Guests[0].Address.IsValid())

	other := nstest.New(t, "other")
	other.MustRun(t, "ip", "link", "add", "up0", "type", "bridge")
	other.MustRun(t, "ip", "addr", "add", "fd00:6272:6b72:0:1::1/80", "dev", "up0", "nodad")
	q, _ := newPlane(t, other, t.TempDir())
	errs := q.Validate(d)
	require.Len(t, errs, 1)
	assert.EqualError(t, errs[0], "network.cidr6: fd00:6272:6b72::/64 overlaps fd00:6272:6b72:0:1::1/80 on up0")
}
