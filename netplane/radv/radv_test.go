package radv

import (
	"errors"
	"io"
	"net"
	"net/netip"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	"go.uber.org/goleak"

	"github.com/brokkr/brokkr/internal/nstest"
	"github.com/brokkr/brokkr/netplane/ipam"
)

func TestMain(m *testing.M) { goleak.VerifyTestMain(m) }

var prefix = netip.MustParsePrefix("fd00:6272:6b72::1/64")

// fast is the timing of the tests: the same schedule, in less time.
var fast = timing{
	tick:     50 * time.Millisecond,
	initial:  []time.Duration{0},
	interval: time.Hour, // a guest that comes later is configured by its solicitation
	probe:    200 * time.Millisecond,
	booting:  time.Hour,
	reprobe:  time.Hour,
	seenFor:  time.Hour,
	minRS:    10 * time.Millisecond,
}

// topo: a host namespace with bridge br0 holding the /64's first address,
// and guests attached to it by veth, with their kernels' defaults (they
// take router advertisements and form EUI-64 addresses).
type topo struct {
	host *nstest.NS
}

func newTopo(t *testing.T) *topo {
	nstest.RequireRoot(t)
	tp := &topo{host: nstest.New(t, "host")}
	tp.host.MustRun(t, "ip", "link", "add", "br0", "type", "bridge")
	tp.host.MustRun(t, "sh", "-c", "echo 0 > /proc/sys/net/ipv6/conf/br0/accept_ra")
	tp.host.MustRun(t, "ip", "addr", "add", prefix.String(), "dev", "br0", "nodad")
	tp.host.MustRun(t, "ip", "link", "set", "br0", "up")
	return tp
}

// guest attaches a guest namespace with eth0 at mac to the bridge.
func (tp *topo) guest(t *testing.T, role string, mac string) *nstest.NS {
	return tp.guestWith(t, role, mac, nil)
}

// guestWith is guest with set run in the guest namespace before its eth0
// exists (to change the defaults eth0 is made with).
func (tp *topo) guestWith(t *testing.T, role string, mac string, set []string) *nstest.NS {
	g := nstest.New(t, role)
	if set != nil {
		g.MustRun(t, set[0], set[1:]...)
	}
	port := role + "p"
	nstest.Link(t, tp.host, port, "", g, "eth0", "")
	g.MustRun(t, "ip", "link", "set", "eth0", "down")
	g.MustRun(t, "ip", "link", "set", "eth0", "address", mac)
	g.MustRun(t, "ip", "link", "set", "eth0", "up")
	tp.host.MustRun(t, "ip", "link", "set", port, "master", "br0")
	return g
}

// start starts a server, waiting for the bridge's link-local address (it
// has one only once a port has carrier, after its DAD).
func (tp *topo) start(t *testing.T, cfg Config, onSeen func(net.HardwareAddr, netip.Addr)) *Server {
	t.Helper()
	deadline := time.Now().Add(10 * time.Second)
	for {
		s, err := start(tp.host.Path, cfg, nil, onSeen, fast)
		if err == nil {
			return s
		}
		require.ErrorIs(t, err, ErrNotReady)
		require.True(t, time.Now().Before(deadline), "the bridge never got a usable link-local address")
		time.Sleep(50 * time.Millisecond)
	}
}

// globalAddrs is the guest's eth0 IPv6 addresses of global scope, as `ip`
// prints them (address/len and flags).
func globalAddrs(t *testing.T, g *nstest.NS) string {
	return g.MustRun(t, "ip", "-6", "-o", "addr", "show", "dev", "eth0", "scope", "global")
}

func waitFor(t *testing.T, what string, d time.Duration, ok func() bool) {
	t.Helper()
	deadline := time.Now().Add(d)
	for !ok() {
		if time.Now().After(deadline) {
			t.Fatalf("timed out waiting for %s", what)
		}
		time.Sleep(50 * time.Millisecond)
	}
}

// A guest doing nothing but its kernel's SLAAC takes exactly the address
// ipam.SLAAC derives from its MAC, on-link, with the advertised MTU and no
// default route; it answers the server's solicitation from its own MAC, so
// the server reports it seen (and says so once).
func TestAGuestFormsItsEUI64AddressAndIsSeenAtIt(t *testing.T) {
	tp := newTopo(t)
	mac, _ := net.ParseMAC("52:54:00:8c:7d:82")
	g := tp.guest(t, "g1", mac.String())
	want := ipam.SLAAC(prefix, mac)
	var mu sync.Mutex
	var seen []netip.Addr
	s := tp.start(t, Config{Interface: "br0", Prefix: prefix, MTU: 1400}, func(m net.HardwareAddr, a netip.Addr) {
		mu.Lock()
		defer mu.Unlock()
		assert.Equal(t, mac, m)
		seen = append(seen, a)
	})
	defer s.Close()
	s.SetBindings([]Binding{{MAC: mac, Addr: want}})

	waitFor(t, "the guest's SLAAC address", 10*time.Second, func() bool {
		out := globalAddrs(t, g)
		return strings.Contains(out, want.String()+"/64") && !strings.Contains(out, "tentative")
	})
	assert.Equal(t, 1, strings.Count(globalAddrs(t, g), "inet6"), "one address, the EUI-64 one")
	assert.Contains(t, g.MustRun(t, "ip", "-6", "route", "show", "dev", "eth0"), "fd00:6272:6b72::/64 proto kernel")
	assert.Empty(t, strings.TrimSpace(g.MustRun(t, "ip", "-6", "route", "show", "default")), "router lifetime 0: no default route")
	assert.Equal(t, "1400", strings.TrimSpace(g.MustRun(t, "cat", "/proc/sys/net/ipv6/conf/eth0/mtu")))

	waitFor(t, "the guest seen", 5*time.Second, func() bool { return s.Seen()[mac.String()] == want })
	mu.Lock()
	assert.Equal(t, []netip.Addr{want}, seen)
	mu.Unlock()
	// The host reaches it there: the address is really the guest's.
	var ln net.Listener
	require.NoError(t, g.Do(func() (err error) { ln, err = net.Listen("tcp6", "["+want.String()+"]:7000"); return err }))
	defer ln.Close()
	go func() {
		if c, err := ln.Accept(); err == nil {
			_, _ = c.Write([]byte("g1"))
			c.Close()
		}
	}()
	var got []byte
	require.NoError(t, tp.host.Do(func() error {
		c, err := net.DialTimeout("tcp6", "["+want.String()+"]:7000", 2*time.Second)
		if err != nil {
			return err
		}
		defer c.Close()
		got, err = io.ReadAll(c)
		return err
	}))
	assert.Equal(t, "g1", string(got))
}

// A binding no guest answers for (nobody holds the address, or a guest
// holds it under another MAC than the binding's) is never seen.
func TestOnlyTheBindingsMACAtItsAddressCounts(t *testing.T) {
	tp := newTopo(t)
	mac, _ := net.ParseMAC("52:54:00:00:00:11")
	tp.guest(t, "g1", mac.String())
	s := tp.start(t, Config{Interface: "br0", Prefix: prefix}, nil)
	defer s.Close()
	other, _ := net.ParseMAC("52:54:00:00:00:99")
	real := ipam.SLAAC(prefix, mac)
	nobody := ipam.SLAAC(prefix, other)
	// The guest really holds real (a binding with its MAC is seen), but
	// a binding claiming real for another MAC is not.
	s.SetBindings([]Binding{{MAC: other, Addr: real}, {MAC: other, Addr: nobody}})
	time.Sleep(3 * time.Second) // SLAAC, DAD, and several probes
	assert.Empty(t, s.Seen())
	s.SetBindings([]Binding{{MAC: mac, Addr: real}})
	waitFor(t, "the guest seen", 5*time.Second, func() bool { return s.Seen()[mac.String()] == real })
}

// A guest that comes up after the initial advertisement (the next
// unsolicited one is an hour away in this test) is configured through its
// router solicitation, at once.
func TestALateGuestIsAnsweredOnItsSolicitation(t *testing.T) {
	tp := newTopo(t)
	early := tp.guest(t, "g1", "52:54:00:00:00:21")
	s := tp.start(t, Config{Interface: "br0", Prefix: prefix}, nil)
	defer s.Close()
	waitFor(t, "the first guest's address", 10*time.Second, func() bool { return strings.Contains(globalAddrs(t, early), "fd00:6272:6b72:") })
	late := tp.guest(t, "g2", "52:54:00:00:00:22")
	mac, _ := net.ParseMAC("52:54:00:00:00:22")
	waitFor(t, "the late guest's address", 10*time.Second, func() bool {
		return strings.Contains(globalAddrs(t, late), ipam.SLAAC(prefix, mac).String())
	})
}

// Withdraw takes the prefix back (the on-link route goes, the address is
// deprecated); Close leaves the guests as they are, since VMs outlive the
// daemon.
func TestWithdrawDeprecatesThePrefixAndCloseLeavesIt(t *testing.T) {
	tp := newTopo(t)
	g := tp.guest(t, "g1", "52:54:00:00:00:31")
	s := tp.start(t, Config{Interface: "br0", Prefix: prefix}, nil)
	waitFor(t, "the guest's address", 10*time.Second, func() bool { return strings.Contains(globalAddrs(t, g), "fd00:6272:6b72:") })
	require.NoError(t, s.Close())
	time.Sleep(500 * time.Millisecond)
	out := globalAddrs(t, g)
	assert.Contains(t, out, "fd00:6272:6b72:")
	assert.NotContains(t, out, "deprecated", "Close withdraws nothing")

	s = tp.start(t, Config{Interface: "br0", Prefix: prefix}, nil)
	require.NoError(t, s.Withdraw())
	waitFor(t, "the prefix withdrawn", 5*time.Second, func() bool {
		return strings.Contains(globalAddrs(t, g), "deprecated") &&
			!strings.Contains(g.MustRun(t, "ip", "-6", "route", "show", "dev", "eth0"), "fd00:6272:6b72::/64")
	})
}

// The server speaks on the bridge alone: a namespace on another link of
// the host gets no advertisement and no address; and before the bridge has
// a usable link-local address (no port with carrier) Start says so.
func TestOnlyTheBridgeHearsIt(t *testing.T) {
	tp := newTopo(t)
	_, err := start(tp.host.Path, Config{Interface: "br0", Prefix: prefix}, nil, nil, fast)
	require.True(t, errors.Is(err, ErrNotReady), "no port, no carrier, no link-local address: %v", err)

	outside := nstest.New(t, "out")
	nstest.Link(t, tp.host, "up0", "", outside, "eth0", "")
	g := tp.guest(t, "g1", "52:54:00:00:00:41")
	s := tp.start(t, Config{Interface: "br0", Prefix: prefix}, nil)
	defer s.Close()
	waitFor(t, "the guest's address", 10*time.Second, func() bool { return strings.Contains(globalAddrs(t, g), "fd00:6272:6b72:") })
	// The outside link solicits a router too (its kernel does at link up).
	time.Sleep(2 * time.Second)
	assert.Empty(t, strings.TrimSpace(globalAddrs(t, outside)), "no advertisement leaves the bridge")
}

// A guest that never solicits a router (its solicitations disabled here,
// as they are dropped on the way in elsewhere) is still configured: a new
// guest brings the initial advertisements back.
func TestANewGuestGetsTheInitialAdvertisementsAgain(t *testing.T) {
	tp := newTopo(t)
	tp.guest(t, "g0", "52:54:00:00:00:50") // for carrier: the server can start
	s := tp.start(t, Config{Interface: "br0", Prefix: prefix}, nil)
	defer s.Close()
	mac, _ := net.ParseMAC("52:54:00:00:00:51")
	g := tp.guestWith(t, "g1", mac.String(), []string{"sh", "-c", "echo 0 > /proc/sys/net/ipv6/conf/default/router_solicitations"})
	time.Sleep(2 * time.Second)
	require.NotContains(t, globalAddrs(t, g), "fd00:6272:6b72:", "the next unsolicited advertisement is an hour away")
	s.SetBindings([]Binding{{MAC: mac, Addr: ipam.SLAAC(prefix, mac)}})
	waitFor(t, "the new guest's address", 10*time.Second, func() bool {
		return strings.Contains(globalAddrs(t, g), ipam.SLAAC(prefix, mac).String())
	})
}
