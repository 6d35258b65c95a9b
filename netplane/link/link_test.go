package link

import (
	"net"
	"net/netip"
	"os"
	"strings"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	"github.com/vishvananda/netlink"
	"go.uber.org/goleak"

	"github.com/brokkr/brokkr/internal/nstest"
)

func TestMain(m *testing.M) { goleak.VerifyTestMain(m) }

var testBridge = BridgeSpec{Name: "brokkr0", Addr: netip.MustParsePrefix("10.213.0.1/24"), MTU: 1450}

func newManager(t *testing.T) (*Manager, *nstest.NS) {
	ns := nstest.New(t, "host")
	m, err := New(ns.Path)
	require.NoError(t, err)
	t.Cleanup(m.Close)
	return m, ns
}

func TestTapNamesFitAndDoNotCollide(t *testing.T) {
	assert.Equal(t, "brk-web", TapName("web"))
	assert.Equal(t, "brk-abcdefghijk", TapName("abcdefghijk"))
	a, b := TapName("runner-aaaaaaaaaaaa-1"), TapName("runner-aaaaaaaaaaaa-2")
	assert.NotEqual(t, a, b, "long names sharing a prefix must get different taps")
	for _, n := range []string{a, b, TapName(strings.Repeat("x", 32))} {
		assert.LessOrEqual(t, len(n), MaxNameLen)
		assert.NoError(t, ValidName(n))
	}
	assert.Equal(t, a, TapName("runner-aaaaaaaaaaaa-1"), "stable")
}

func TestGuestMACIsStableAndLocallyAdministered(t *testing.T) {
	m := GuestMAC("web", 0)
	assert.Equal(t, m, GuestMAC("web", 0))
	assert.NotEqual(t, m, GuestMAC("web", 1))
	assert.NotEqual(t, m, GuestMAC("db", 0))
	assert.Equal(t, byte(0x02), m[0]&0x02, "locally administered bit")
	assert.Equal(t, byte(0), m[0]&0x01, "unicast")
	assert.NotEqual(t, m, hostMAC(m), "the tap's own MAC must differ from the guest's")
}

func TestValidName(t *testing.T) {
	assert.NoError(t, ValidName("brokkr0"))
	for _, bad := range []string{"", "a-name-too-long-x", "a/b", "a b", ".", "a:b"} {
		assert.Error(t, ValidName(bad), bad)
	}
}

func TestBridgeCreatedThenRepaired(t *testing.T) {
	m, ns := newManager(t)
	created, rep, err := m.EnsureBridge(testBridge)
	require.NoError(t, err)
	assert.True(t, created)
	assert.Empty(t, rep)
	out := ns.MustRun(t, "ip", "-d", "addr", "show", "brokkr0")
	assert.Contains(t, out, "10.213.0.1/24")
	assert.Contains(t, out, "mtu 1450")
	assert.Contains(t, out, ",UP>")
	assert.Contains(t, out, "alias brokkr:bridge")

	created, rep, err = m.EnsureBridge(testBridge)
	require.NoError(t, err)
	assert.False(t, created)
	assert.Empty(t, rep, "a second pass changes nothing")

	ns.MustRun(t, "ip", "link", "set", "brokkr0", "down")
	ns.MustRun(t, "ip", "link", "set", "brokkr0", "mtu", "1400")
	ns.MustRun(t, "ip", "addr", "del", "10.213.0.1/24", "dev", "brokkr0")
	ns.MustRun(t, "ip", "addr", "add", "10.9.9.1/24", "dev", "brokkr0")
	_, rep, err = m.EnsureBridge(testBridge)
	require.NoError(t, err)
	assert.Len(t, rep, 4, "%q", rep)
	joined := strings.Join(rep, "; ")
	for _, want := range []string{"was down", "MTU 1400", "lost its address 10.213.0.1/24", "stray address 10.9.9.1/24"} {
		assert.Contains(t, joined, want)
	}
	out = ns.MustRun(t, "ip", "addr", "show", "brokkr0")
	assert.Contains(t, out, "10.213.0.1/24")
	assert.NotContains(t, out, "10.9.9.1")
	assert.Contains(t, out, "mtu 1450")
	assert.Contains(t, out, ",UP")

	require.NoError(t, m.DeleteBridge("brokkr0"))
	_, err = ns.Run("ip", "link", "show", "brokkr0")
	assert.Error(t, err, "bridge deleted")
}

func TestForeignLinksAreNeverTouched(t *testing.T) {
	m, ns := newManager(t)
	ns.MustRun(t, "ip", "link", "add", "brokkr0", "mtu", "1300", "type", "bridge")
	ns.MustRun(t, "ip", "link", "add", "brk-web", "type", "veth", "peer", "name", "brk-peer")
	before := ns.MustRun(t, "ip", "-d", "addr", "show")

	_, _, err := m.EnsureBridge(testBridge)
	assert.ErrorIs(t, err, ErrForeign)
	assert.ErrorIs(t, m.DeleteBridge("brokkr0"), ErrForeign)

	ns.MustRun(t, "ip", "link", "add", "brokkr1", "type", "bridge")
	ns.MustRun(t, "ip", "link", "set", "brokkr1", "alias", "brokkr:bridge")
	_, _, err = m.EnsureTap(TapSpec{VM: "web", Name: "brk-web", GuestMAC: GuestMAC("web", 0), Bridge: "brokkr1"})
	assert.ErrorIs(t, err, ErrForeign)
	assert.ErrorIs(t, m.DeleteTap("brk-web"), ErrForeign)
	ns.MustRun(t, "ip", "link", "del", "brokkr1")

	assert.Equal(t, before, ns.MustRun(t, "ip", "-d", "addr", "show"), "foreign links unchanged")
	taps, err := m.OwnedTaps()
	require.NoError(t, err)
	assert.Empty(t, taps)
}

func TestTapCreatedAttachedHairpinAndRemoved(t *testing.T) {
	m, ns := newManager(t)
	_, _, err := m.EnsureBridge(testBridge)
	require.NoError(t, err)
	for _, mq := range []bool{false, true} {
		vm := map[bool]string{false: "web", true: "a-very-long-vm-name"}[mq]
		spec := TapSpec{VM: vm, Name: TapName(vm), GuestMAC: GuestMAC(vm, 0), MultiQueue: mq, Bridge: "brokkr0", MTU: 1450}
		created, rep, err := m.EnsureTap(spec)
		require.NoError(t, err)
		assert.True(t, created)
		assert.Empty(t, rep)

		out := ns.MustRun(t, "ip", "-d", "link", "show", spec.Name)
		assert.Contains(t, out, "master brokkr0")
		assert.Contains(t, out, "hairpin on")
		assert.Contains(t, out, "tun type tap")
		assert.Contains(t, out, "persist on")
		assert.Contains(t, out, "mtu 1450")
		assert.Contains(t, out, "alias brokkr:tap:"+vm)
		assert.Contains(t, out, hostMAC(spec.GuestMAC).String())
		assert.Equal(t, mq, strings.Contains(out, "multi_queue"), "IFF_MULTI_QUEUE only when asked")

		_, rep, err = m.EnsureTap(spec)
		require.NoError(t, err)
		assert.Empty(t, rep, "idempotent")

		wrong := spec
		wrong.MultiQueue = !mq
		_, _, err = m.EnsureTap(wrong)
		assert.ErrorContains(t, err, "multiQueue")
	}
	taps, err := m.OwnedTaps()
	require.NoError(t, err)
	assert.Equal(t, map[string]string{"brk-web": "web", TapName("a-very-long-vm-name"): "a-very-long-vm-name"}, taps)

	require.NoError(t, m.DeleteTap("brk-web"))
	require.NoError(t, m.DeleteTap("brk-web"), "deleting a missing tap is fine")
	_, err = ns.Run("ip", "link", "show", "brk-web")
	assert.Error(t, err)
}

func TestTapDriftRepaired(t *testing.T) {
	m, ns := newManager(t)
	_, _, err := m.EnsureBridge(testBridge)
	require.NoError(t, err)
	spec := TapSpec{VM: "web", Name: "brk-web", GuestMAC: GuestMAC("web", 0), Bridge: "brokkr0"}
	_, _, err = m.EnsureTap(spec)
	require.NoError(t, err)

	ns.MustRun(t, "ip", "link", "set", "brk-web", "nomaster")
	ns.MustRun(t, "ip", "link", "set", "brk-web", "down")
	_, rep, err := m.EnsureTap(spec)
	require.NoError(t, err)
	assert.Contains(t, strings.Join(rep, ";"), "was not attached")
	assert.Contains(t, strings.Join(rep, ";"), "was down")

	ns.MustRun(t, "bridge", "link", "set", "dev", "brk-web", "hairpin", "off")
	_, rep, err = m.EnsureTap(spec)
	require.NoError(t, err)
	assert.Equal(t, []string{"tap brk-web had hairpin off"}, rep)
	assert.Contains(t, ns.MustRun(t, "ip", "-d", "link", "show", "brk-web"), "hairpin on")

	ns.MustRun(t, "ip", "link", "del", "brk-web")
	created, _, err := m.EnsureTap(spec)
	require.NoError(t, err)
	assert.True(t, created, "a deleted tap is made again")
	l, err := m.Handle().LinkByName("brk-web")
	require.NoError(t, err)
	assert.Equal(t, net.FlagUp, l.Attrs().Flags&net.FlagUp)
	_, isTap := l.(*netlink.Tuntap)
	assert.True(t, isTap)
}

func TestForwardingOnlyInTheManagedNamespace(t *testing.T) {
	rootBefore, err := os.ReadFile("/proc/sys/net/ipv4/ip_forward")
	require.NoError(t, err)
	m, ns := newManager(t)
	changed, err := m.EnableForwarding()
	require.NoError(t, err)
	assert.True(t, changed, "a new namespace starts with forwarding off")
	assert.Equal(t, "1", strings.TrimSpace(ns.MustRun(t, "cat", "/proc/sys/net/ipv4/ip_forward")))
	changed, err = m.EnableForwarding()
	require.NoError(t, err)
	assert.False(t, changed)
	rootAfter, err := os.ReadFile("/proc/sys/net/ipv4/ip_forward")
	require.NoError(t, err)
	assert.Equal(t, rootBefore, rootAfter, "the root namespace is never touched")
}

func TestForeignPrefixes(t *testing.T) {
	m, ns := newManager(t)
	_, _, err := m.EnsureBridge(testBridge)
	require.NoError(t, err)
	ns.MustRun(t, "ip", "link", "add", "up0", "type", "bridge")
	ns.MustRun(t, "ip", "addr", "add", "192.168.7.2/16", "dev", "up0")
	ns.MustRun(t, "ip", "addr", "add", "2001:db8:5::2/56", "dev", "up0", "nodad")
	ns.MustRun(t, "ip", "addr", "add", "fe80::2/64", "dev", "up0", "nodad")
	ps, err := m.ForeignPrefixes()
	require.NoError(t, err)
	assert.ElementsMatch(t, []InterfacePrefix{
		{Link: "up0", Prefix: netip.MustParsePrefix("192.168.7.2/16")},
		{Link: "up0", Prefix: netip.MustParsePrefix("2001:db8:5::2/56")},
	}, ps, "brokkr's own bridge, loopback and link-local addresses are not foreign")
}

// The bridge's IPv6 address is kept like its IPv4 one: added (usable at
// once, no duplicate address detection), put back when lost, strays
// removed, all of it gone with cidr6 off; its link-local address stays; it
// never takes router advertisements. Without IPv6 on the bridge nothing of
// this is tried.
func TestBridgeIPv6AddressKeptLikeTheIPv4One(t *testing.T) {
	m, ns := newManager(t)
	spec := testBridge
	spec.Addr6 = netip.MustParsePrefix("fd00:6272:6b72::1/64")
	_, rep, err := m.EnsureBridge(spec)
	require.NoError(t, err)
	assert.Empty(t, rep)
	addr6 := func() string { return ns.MustRun(t, "ip", "-6", "addr", "show", "dev", "brokkr0") }
	out := addr6()
	assert.Contains(t, out, "inet6 fd00:6272:6b72::1/64 scope global nodad")
	assert.NotContains(t, out, "tentative")
	assert.Equal(t, "0", strings.TrimSpace(ns.MustRun(t, "cat", "/proc/sys/net/ipv6/conf/brokkr0/accept_ra")))
	_, rep, err = m.EnsureBridge(spec)
	require.NoError(t, err)
	assert.Empty(t, rep, "a second pass changes nothing")

	ns.MustRun(t, "ip", "addr", "del", "fd00:6272:6b72::1/64", "dev", "brokkr0")
	ns.MustRun(t, "ip", "addr", "add", "fd00:9::1/64", "dev", "brokkr0", "nodad")
	ns.MustRun(t, "ip", "addr", "add", "fe80::77/64", "dev", "brokkr0", "nodad")
	ns.MustRun(t, "sh", "-c", "echo 1 > /proc/sys/net/ipv6/conf/brokkr0/accept_ra")
	_, rep, err = m.EnsureBridge(spec)
	require.NoError(t, err)
	assert.ElementsMatch(t, []string{
		"bridge brokkr0 accepted router advertisements",
		"bridge brokkr0 had stray address fd00:9::1/64",
		"bridge brokkr0 lost its address fd00:6272:6b72::1/64",
	}, rep)
	out = addr6()
	assert.Contains(t, out, "fd00:6272:6b72::1/64")
	assert.NotContains(t, out, "fd00:9::1")
	assert.Contains(t, out, "fe80::77/64", "link-local addresses are the kernel's")
	assert.Equal(t, "0", strings.TrimSpace(ns.MustRun(t, "cat", "/proc/sys/net/ipv6/conf/brokkr0/accept_ra")))

	// Down and up again: the kernel drops IPv6 addresses with the link.
	ns.MustRun(t, "ip", "link", "set", "brokkr0", "down")
	_, rep, err = m.EnsureBridge(spec)
	require.NoError(t, err)
	assert.Contains(t, rep, "bridge brokkr0 lost its address fd00:6272:6b72::1/64")
	assert.Contains(t, addr6(), "fd00:6272:6b72::1/64")

	// cidr6 off: the address goes, the link-local stays.
	_, rep, err = m.EnsureBridge(testBridge)
	require.NoError(t, err)
	assert.Equal(t, []string{"bridge brokkr0 had stray address fd00:6272:6b72::1/64"}, rep)
	assert.NotContains(t, addr6(), "scope global")

	// IPv6 disabled on the bridge: nothing is tried, nothing fails.
	ns.MustRun(t, "sh", "-c", "echo 1 > /proc/sys/net/ipv6/conf/brokkr0/disable_ipv6")
	on, err := m.IPv6Enabled("brokkr0")
	require.NoError(t, err)
	assert.False(t, on)
	_, rep, err = m.EnsureBridge(spec)
	require.NoError(t, err)
	assert.Empty(t, rep)
	on, err = m.IPv6Enabled("no-such-link")
	require.NoError(t, err)
	assert.False(t, on)
}
