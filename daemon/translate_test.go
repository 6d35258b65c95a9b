package daemon

import (
	"context"
	"net/netip"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/brokkr/brokkr/internal/spec"
)

// Where the nat path's fallback runs, a capped auto exposure the kernel
// would carry is carried by the proxy (one cap for every caller); uncapped
// ones, loopback ones and other modes are left as they are, and the model
// the daemon holds is not changed.
func TestByProxyMovesOnlyCappedAutoExposuresTheKernelCarries(t *testing.T) {
	any4 := netip.IPv4Unspecified()
	lo := netip.MustParseAddr("127.0.0.1")
	m := &spec.Desired{Exposures: []spec.Exposure{
		{Name: "capped-auto", Mode: spec.ModeAuto, HostAddr: any4, HostPort: 7002, MaxConns: 2},
		{Name: "open-auto", Mode: spec.ModeAuto, HostAddr: any4, HostPort: 7003},
		{Name: "capped-loopback", Mode: spec.ModeAuto, HostAddr: lo, HostPort: 7004, MaxConns: 2},
		{Name: "capped-nat", Mode: spec.ModeNAT, HostAddr: any4, HostPort: 7000, MaxConns: 2},
	}}
	got, moved := byProxy(m)
	assert.Equal(t, []string{"capped-auto"}, moved)
	require.Len(t, got.Exposures, 4)
	modes := map[string]spec.Mode{}
	for _, e := range got.Exposures {
		modes[e.Name] = e.Mode
		assert.Equal(t, e.Name == "capped-auto", e.AllByProxy, e.Name)
	}
	assert.Equal(t, map[string]spec.Mode{"capped-auto": spec.ModeAuto, "open-auto": spec.ModeAuto,
		"capped-loopback": spec.ModeAuto, "capped-nat": spec.ModeNAT}, modes, "still auto: the status and the proxy's listeners are auto's")
	assert.False(t, m.Exposures[0].AllByProxy, "the daemon's model is not changed")
	assert.False(t, got.Exposures[0].UsesSocketPath(), "the proxy carries its host-local callers too")
	kernel := got.KernelExposures()
	for _, e := range kernel {
		assert.NotEqual(t, "capped-auto", e.Name, "nftables no longer carries it")
	}
	for _, sock := range []bool{false, true} {
		assert.Equal(t, []netip.Addr{any4, netip.IPv6Loopback()}, got.Exposures[0].ProxyBinds(true, sock),
			"the proxy binds its host side and ::1 (as auto's loopback proxies), socket path %v", sock)
		assert.Equal(t, []netip.Addr{any4}, got.Exposures[0].ProxyBinds(false, sock), "no IPv6 loopback: the host side alone")
	}

	same, none := byProxy(&spec.Desired{Exposures: m.Exposures[1:]})
	assert.Empty(t, none)
	assert.Equal(t, m.Exposures[1:], same.Exposures)
}

// An auto exposure with a PROXY header reaches the proxy alone: nftables
// does not carry it, the socket path does not serve it, and the proxy
// listens on its host side and on ::1 with the header, socket path or not,
// in both kinds of host (with the nat path's fallback or without).
func TestAnAutoExposureWithAProxyHeaderGoesToTheProxyAlone(t *testing.T) {
	any4 := netip.IPv4Unspecified()
	m := &spec.Desired{Exposures: []spec.Exposure{
		{Name: "pp", Mode: spec.ModeAuto, Proto: spec.TCP, HostAddr: any4, HostPort: 7010, MaxConns: 2, ProxyProtocol: spec.ProxyV2},
		{Name: "plain", Mode: spec.ModeAuto, Proto: spec.TCP, HostAddr: any4, HostPort: 7011},
	}}
	moved, names := byProxy(m)
	assert.Empty(t, names, "not moved: it is the proxy's already, and no warning is due")
	for _, d := range []*spec.Desired{m, moved} {
		var kernel []string
		for _, e := range netDesired(d).Exposures {
			kernel = append(kernel, e.Name)
		}
		assert.Equal(t, []string{"plain"}, kernel)
		assert.False(t, d.Exposures[0].UsesSocketPath())
		for _, sock := range []bool{false, true} {
			ps := proxySpecs(d, true, sock)
			var pp []netip.Addr
			for _, s := range ps {
				if s.Name == "pp" {
					pp = append(pp, s.Listen)
					assert.Equal(t, spec.ProxyV2, s.ProxyProtocol)
				}
			}
			assert.Equal(t, []netip.Addr{any4, netip.IPv6Loopback()}, pp, "socket path %v", sock)
		}
	}
}

// On the nat path's fallback the kernel cannot enforce allowFrom: the
// exposures that have one go to the proxy, which checks it at accept.
func TestRestrictedByProxyMovesOnlyKernelExposuresWithAllowFrom(t *testing.T) {
	any4 := netip.IPv4Unspecified()
	allow := []netip.Prefix{netip.MustParsePrefix("192.0.2.0/24")}
	m := &spec.Desired{Exposures: []spec.Exposure{
		{Name: "nat-allow", Mode: spec.ModeNAT, HostAddr: any4, HostPort: 7000, AllowFrom: allow},
		{Name: "auto-allow", Mode: spec.ModeAuto, HostAddr: any4, HostPort: 7001, AllowFrom: allow},
		{Name: "nat-open", Mode: spec.ModeNAT, HostAddr: any4, HostPort: 7002},
		{Name: "proxy-allow", Mode: spec.ModeProxy, HostAddr: any4, HostPort: 7003, AllowFrom: allow},
	}}
	got, moved := restrictedByProxy(m)
	assert.Equal(t, []string{"nat-allow", "auto-allow"}, moved)
	assert.Equal(t, spec.ModeProxy, got.Exposures[0].Mode)
	assert.Equal(t, spec.ModeAuto, got.Exposures[1].Mode, "auto stays auto, carried wholly by the proxy")
	assert.True(t, got.Exposures[1].AllByProxy)
	assert.Equal(t, []netip.Addr{any4, netip.IPv6Loopback()}, got.Exposures[1].ProxyBinds(true, true), "with auto's ::1 listener")
	assert.Equal(t, spec.ModeNAT, got.Exposures[2].Mode)
	assert.Equal(t, allow, got.Exposures[0].AllowFrom, "the proxy enforces the same list")
	assert.Equal(t, spec.ModeNAT, m.Exposures[0].Mode, "the daemon's model is not changed")
	assert.Len(t, got.KernelExposures(), 1)
}

// On the nat path's fallback, which publishes IPv4 only, the IPv6 callers
// of an auto exposure with a guest address of that family go to the
// proxy: one of both families keeps IPv4 in the kernel and has the proxy
// on ::, one of IPv6 alone is the proxy's wholly; nat, IPv4-only and
// guests without IPv6 are left as they are.
func TestIPv6ByProxyGivesTheProxyTheIPv6CallersTheFallbackCannotCarry(t *testing.T) {
	any4, any6 := netip.IPv4Unspecified(), netip.IPv6Unspecified()
	vm := spec.Target{VM: "web"}
	m := &spec.Desired{Network: spec.Network{CIDR6: netip.MustParsePrefix("fd00:6272:6b72::1/64")}, Exposures: []spec.Exposure{
		{Name: "both", Target: vm, Mode: spec.ModeAuto, Proto: spec.TCP, HostPort: 7000},
		{Name: "v6-only", Target: vm, Mode: spec.ModeAuto, Proto: spec.TCP, HostAddr: any6, HostPort: 7001},
		{Name: "v4-only", Target: vm, Mode: spec.ModeAuto, Proto: spec.TCP, HostAddr: any4, HostPort: 7002},
		{Name: "nat-both", Target: vm, Mode: spec.ModeNAT, Proto: spec.TCP, HostPort: 7003},
		{Name: "target-v4", Target: spec.Target{Addr: netip.MustParseAddr("10.213.0.200")}, Mode: spec.ModeAuto, Proto: spec.TCP, HostPort: 7004},
		{Name: "target-both", Target: spec.Target{Addr: netip.MustParseAddr("10.213.0.200"), Addr6: netip.MustParseAddr("fd00:6272:6b72::c8")},
			Mode: spec.ModeAuto, Proto: spec.TCP, HostPort: 7005},
	}}
	got, moved := ipv6ByProxy(m)
	assert.Equal(t, []string{"both", "v6-only", "target-both"}, moved)
	by := map[string]spec.Exposure{}
	for _, e := range got.Exposures {
		by[e.Name] = e
	}
	assert.True(t, by["both"].IPv6ByProxy)
	assert.True(t, by["both"].UsesKernel(), "its IPv4 callers stay the kernel's")
	assert.True(t, by["both"].UsesSocketPath(), "and its host-local ones the socket path's")
	assert.Equal(t, []netip.Addr{any6}, by["both"].ProxyBinds(true, true), "the proxy on ::")
	assert.Equal(t, []netip.Addr{netip.MustParseAddr("127.0.0.1"), any6}, by["both"].ProxyBinds(true, false),
		"without the socket path, auto's IPv4 loopback listener beside it (:: takes ::1)")
	assert.True(t, by["v6-only"].AllByProxy)
	assert.False(t, by["v6-only"].UsesKernel())
	assert.True(t, by["target-both"].IPv6ByProxy)
	for _, n := range []string{"v4-only", "nat-both", "target-v4"} {
		assert.Equal(t, m.Exposures[slices.IndexFunc(m.Exposures, func(e spec.Exposure) bool { return e.Name == n })], by[n], n)
	}
	assert.False(t, m.Exposures[0].IPv6ByProxy, "the daemon's model is not changed")

	off := *m
	off.Network.CIDR6 = netip.Prefix{}
	got, moved = ipv6ByProxy(&off)
	assert.Equal(t, []string{"target-both"}, moved, "the VMs have no IPv6: none of theirs is moved")
	assert.False(t, got.Exposures[0].IPv6ByProxy)

	capped := *m
	capped.Exposures = slices.Clone(m.Exposures)
	capped.Exposures[0].MaxConns = 2
	_, mv := onFallback(&capped)
	assert.Equal(t, []string{"both"}, mv.capped, "a capped one is the proxy's wholly, for one cap")
	assert.Equal(t, []string{"v6-only", "target-both"}, mv.ipv6)
}

// natNet is a network plane that says its BPF nat path did not load.
type natNet struct {
	*recNet
	reason string
}

func (n natNet) NatPathFallback() string { return n.reason }

// A plane whose nat path's programs did not load (on a kernel whose
// features predicted they would: no CappedAutoByProxy) is believed: its
// capped auto exposures go to the proxy, with the plane's reason in the
// status; while it says nothing, they stay the kernel's.
func TestThePlanesOwnNatPathReasonMovesCappedAutoToTheProxy(t *testing.T) {
	r := newRig(t, `
exposures:
  - {name: capped, target: 10.213.0.200, guestPort: 80, hostPort: 8080, maxConns: 2}
`)
	nn := natNet{recNet: r.net}
	d, err := New(Options{Host: r.host, Store: r.store, Supervisor: r.sup, Network: &nn, Proxy: r.px,
		Logger: r.d.log, Timeout: 200 * time.Millisecond})
	require.NoError(t, err)
	d.Pass(context.Background())
	require.Len(t, r.net.desired().Exposures, 1, "no reason: the kernel carries it")

	nn.reason = "nat path: fallback (the programs did not load)"
	d.Pass(context.Background())
	assert.Empty(t, r.net.desired().Exposures, "the proxy carries it now")
	assert.Contains(t, strings.Join(d.Status().Warnings, "\n"), "capped auto exposures [capped] are carried by the proxy for every caller, so that they keep one cap: nat path: fallback (the programs did not load)")
}

// Through a pass on the fallback: an uncapped auto exposure of both
// families stays the kernel's for IPv4, the proxy listens on :: for its
// IPv6 callers, and the status says so. (The kernel-matrix test checks
// the same on a 5.10 VM; CI's kernels run the nat path, so this is where
// CI sees it.)
func TestAPassOnTheFallbackGivesTheProxyAnAutoExposuresIPv6Callers(t *testing.T) {
	r := newRig(t, `
exposures:
  - {name: both, target: 10.213.0.200, target6: "fd00:6272:6b72::c8", guestPort: 80, hostPort: 8080, maxConns: 0}
`)
	nn := natNet{recNet: r.net, reason: "nat path: fallback (the programs did not load)"}
	d, err := New(Options{Host: r.host, Store: r.store, Supervisor: r.sup, Network: &nn, Proxy: r.px,
		Logger: r.d.log, Timeout: 200 * time.Millisecond, IPv6Loopback: true})
	require.NoError(t, err)
	d.Pass(context.Background())
	require.Len(t, r.net.desired().Exposures, 1, "its IPv4 callers stay the kernel's")
	specs, _ := r.px.specs()
	var listens []netip.Addr
	for _, s := range specs {
		listens = append(listens, s.Listen)
	}
	assert.Contains(t, listens, netip.IPv6Unspecified(), "the proxy listens on :: for its IPv6 callers")
	assert.NotContains(t, listens, netip.IPv4Unspecified(), "and not on 0.0.0.0")
	assert.Contains(t, strings.Join(d.Status().Warnings, "\n"), "the IPv6 callers of auto exposures [both] are carried by the proxy (the kernel path publishes IPv4 only here): nat path: fallback (the programs did not load)")
}
