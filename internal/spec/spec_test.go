package spec

import (
	"net/netip"
	"testing"

	"github.com/stretchr/testify/assert"
)

func TestWhichPathsCarryAnExposure(t *testing.T) {
	a := netip.MustParseAddr
	lo4, lo6 := a("127.0.0.1"), a("::1")
	cases := []struct {
		mode   Mode
		host   string
		kernel bool
		binds  []netip.Addr // ipv6 loopback present, no socket path
		binds4 []netip.Addr // no ipv6 loopback
	}{
		{ModeAuto, "0.0.0.0", true, []netip.Addr{lo4, lo6}, []netip.Addr{lo4}},
		{ModeAuto, "192.0.2.1", true, nil, nil},
		{ModeAuto, "127.0.0.1", false, []netip.Addr{lo4}, []netip.Addr{lo4}},
		{ModeAuto, "::1", false, []netip.Addr{lo6}, []netip.Addr{lo6}},
		{ModeNAT, "0.0.0.0", true, nil, nil},
		{ModeNAT, "192.0.2.1", true, nil, nil},
		{ModeProxy, "0.0.0.0", false, []netip.Addr{a("0.0.0.0")}, []netip.Addr{a("0.0.0.0")}},
		{ModeProxy, "::", false, []netip.Addr{a("::")}, []netip.Addr{a("::")}},
		{ModeProxy, "127.0.0.2", false, []netip.Addr{a("127.0.0.2")}, []netip.Addr{a("127.0.0.2")}},
	}
	for _, c := range cases {
		e := Exposure{Name: "e", Mode: c.mode, HostAddr: a(c.host)}
		what := string(c.mode) + " on " + c.host
		assert.Equal(t, c.kernel, e.UsesKernel(), what)
		assert.Equal(t, c.binds, e.ProxyBinds(true, false), what)
		assert.Equal(t, c.binds4, e.ProxyBinds(false, false), what)
		assert.Equal(t, c.mode == ModeAuto, e.UsesSocketPath(), what)
		if c.mode == ModeAuto {
			assert.Empty(t, e.ProxyBinds(true, true), "%s: the socket path serves local callers", what)
		} else {
			assert.Equal(t, c.binds, e.ProxyBinds(true, true), "%s: the socket path is auto's only", what)
		}
	}
}

func TestKernelExposuresKeepOrder(t *testing.T) {
	a := netip.MustParseAddr
	d := Desired{Exposures: []Exposure{
		{Name: "n", Mode: ModeNAT, HostAddr: a("0.0.0.0")},
		{Name: "p", Mode: ModeProxy, HostAddr: a("0.0.0.0")},
		{Name: "lo", Mode: ModeAuto, HostAddr: a("127.0.0.1")},
		{Name: "auto", Mode: ModeAuto, HostAddr: a("0.0.0.0")},
	}}
	var names []string
	for _, e := range d.KernelExposures() {
		names = append(names, e.Name)
	}
	assert.Equal(t, []string{"n", "auto"}, names)
}

func TestTargetIsAVMOrAnAddress(t *testing.T) {
	vm := Target{VM: "web"}
	addr := Target{Addr: netip.MustParseAddr("10.213.0.9")}
	assert.True(t, vm.IsVM())
	assert.False(t, addr.IsVM())
	assert.Equal(t, "web", vm.String())
	assert.Equal(t, "10.213.0.9", addr.String())
}

func TestStatesMergeWorstFirst(t *testing.T) {
	assert.Less(t, StateActive.Rank(), StatePending.Rank())
	assert.Less(t, StatePending.Rank(), StateFailed.Rank())
	assert.Equal(t, StateFailed.Rank(), ExposureState("unknown").Rank(), "an unknown state is no better than failed")
}

func TestVMByName(t *testing.T) {
	d := Desired{VMs: []VM{{Name: "a"}, {Name: "b", CPUs: 2}}}
	v, ok := d.VM("b")
	assert.True(t, ok)
	assert.Equal(t, 2, v.CPUs)
	_, ok = d.VM("c")
	assert.False(t, ok)
}

// An auto exposure with a PROXY header is carried wholly by the proxy: the
// nat path and the socket path cannot write the header, and a guest that
// expects one must get it from every caller. The proxy binds what auto
// claims (hostAddress, and ::1 beside 0.0.0.0), socket path or not. proxy
// mode is unchanged by the header.
func TestAnAutoExposureWithAProxyHeaderIsCarriedByTheProxyAlone(t *testing.T) {
	a := netip.MustParseAddr
	lo6 := a("::1")
	cases := []struct {
		host          string
		binds, binds4 []netip.Addr // with and without IPv6 loopback
	}{
		{"0.0.0.0", []netip.Addr{a("0.0.0.0"), lo6}, []netip.Addr{a("0.0.0.0")}},
		{"192.0.2.1", []netip.Addr{a("192.0.2.1")}, []netip.Addr{a("192.0.2.1")}},
		{"127.0.0.1", []netip.Addr{a("127.0.0.1")}, []netip.Addr{a("127.0.0.1")}},
		{"::1", []netip.Addr{lo6}, []netip.Addr{lo6}},
	}
	for _, v := range []ProxyProtocol{ProxyV1, ProxyV2} {
		for _, c := range cases {
			e := Exposure{Name: "e", Mode: ModeAuto, HostAddr: a(c.host), ProxyProtocol: v}
			what := string(v) + " auto on " + c.host
			assert.False(t, e.UsesKernel(), what)
			assert.False(t, e.UsesSocketPath(), what)
			for _, sock := range []bool{false, true} {
				assert.Equal(t, c.binds, e.ProxyBinds(true, sock), what)
				assert.Equal(t, c.binds4, e.ProxyBinds(false, sock), what)
			}
			d := Desired{Exposures: []Exposure{e}}
			assert.Empty(t, d.KernelExposures(), what)
		}
		p := Exposure{Name: "p", Mode: ModeProxy, HostAddr: a("0.0.0.0"), ProxyProtocol: v}
		assert.Equal(t, []netip.Addr{a("0.0.0.0")}, p.ProxyBinds(true, true), "proxy mode binds hostAddress alone")
		assert.False(t, p.UsesKernel())
	}
}
