package config

import (
	"net/netip"
	"strconv"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/brokkr/brokkr/internal/spec"
)

// The rules the network plane used to check on its own copy of the state
// are checked here, once, with the messages it gave.
func TestRulesOnceCheckedByTheEnginesNameTheirField(t *testing.T) {
	cases := []struct{ in, want string }{
		{"network: {cidr: 10.213.0.255/24}", "network.cidr: 10.213.0.255/24 is the broadcast address"},
		{"network: {cidr: 127.0.0.1/8}", "network.cidr: 127.0.0.1/8 is not a unicast address"},
		{"network: {cidr: 224.0.0.1/24}", "network.cidr: 224.0.0.1/24 is not a unicast address"},
		{"exposures: [{name: e, target: 10.213.0.9, guestPort: 1, hostPort: 2, maxConns: 1048577}]",
			"exposures[0].maxConns: 1048577 is outside 0 (unlimited)..1048576"},
		{"exposures: [{name: e, target: 10.213.0.9, guestPort: 1, hostPort: 2, hostAddress: '::'}]",
			"exposures[0].hostAddress: :: is IPv6 and the exposure has no target6; give target6, or mode proxy"},
		{"exposures: [{name: e, target: 10.213.0.9, guestPort: 1, hostPort: 2, hostAddress: '2001:db8::1', mode: nat}]",
			"exposures[0].hostAddress: 2001:db8::1 is IPv6 and the exposure has no target6; give target6, or mode proxy"},
		{"exposures: [{name: e, target: 10.213.0.9, guestPort: 1, hostPort: 2, hostAddress: '::ffff:192.0.2.1'}]",
			`exposures[0].hostAddress: "::ffff:192.0.2.1" is an IPv4-mapped IPv6 address; write it as IPv4`},
		{"network: {cidr6: ''}\nvms: [{name: a, kernel: /k}]\nexposures: [{name: e, vm: a, guestPort: 1, hostPort: 2, hostAddress: '::'}]",
			`exposures[0].hostAddress: :: is IPv6 and network.cidr6 is "" (the guests have no IPv6); use "" or an IPv4 address, or mode proxy`},
		{"exposures: [{name: e, target6: 'fd00:6272:6b72::c8', guestPort: 1, hostPort: 2, hostAddress: 0.0.0.0}]",
			`exposures[0].hostAddress: 0.0.0.0 is IPv4 and the exposure has only target6; give target, or use "" or an IPv6 address`},
		{"exposures: [{name: e, target6: '2001:db8::c8', guestPort: 1, hostPort: 2}]",
			`exposures[0].target6: "2001:db8::c8" is not inside network.cidr6 fd00:6272:6b72::1/64`},
		{"exposures: [{name: e, target6: 10.213.0.9, guestPort: 1, hostPort: 2}]",
			`exposures[0].target6: "10.213.0.9" is not an IPv6 address`},
		{"exposures: [{name: e, target6: 'fd00:6272:6b72::1', guestPort: 1, hostPort: 2}]",
			`exposures[0].target6: "fd00:6272:6b72::1" is the bridge's or the subnet-router anycast address of network.cidr6`},
		{"network: {cidr6: ''}\nexposures: [{name: e, target6: 'fd00:6272:6b72::c8', guestPort: 1, hostPort: 2}]",
			`exposures[0].target6: "fd00:6272:6b72::c8": network.cidr6 is "" (no IPv6 on the bridge)`},
		{"vms: [{name: a, kernel: /k}]\nexposures: [{name: e, vm: a, target6: 'fd00:6272:6b72::c8', guestPort: 1, hostPort: 2}]",
			`exposures[0]: vm "a" and target "fd00:6272:6b72::c8" are both set; give exactly one`},
	}
	for _, c := range cases {
		assert.Equal(t, []string{c.want}, errorsOf(t, c.in), c.in)
	}
	// The proxy alone may publish on IPv6, and auto on ::1 is the proxy's.
	for _, ok := range []string{
		"exposures: [{name: e, target: 10.213.0.9, guestPort: 1, hostPort: 2, hostAddress: '::', mode: proxy}]",
		"exposures: [{name: e, target: 10.213.0.9, guestPort: 1, hostPort: 2, hostAddress: '::1'}]",
		"exposures: [{name: e, target: 10.213.0.9, guestPort: 1, hostPort: 2, maxConns: 1048576}]",
		// Both families: each is published where the exposure has a guest
		// address of it.
		"exposures: [{name: e, target: 10.213.0.9, target6: 'fd00:6272:6b72::c8', guestPort: 1, hostPort: 2, hostAddress: '::', mode: nat}]",
		"exposures: [{name: e, target6: 'fd00:6272:6b72::c8', guestPort: 1, hostPort: 2}]",
		"vms: [{name: a, kernel: /k}]\nexposures: [{name: e, vm: a, guestPort: 1, hostPort: 2, hostAddress: '::'}]",
	} {
		_, err := Parse([]byte(ok))
		assert.NoError(t, err, ok)
	}
}

func TestCompileBuildsTheTypedModel(t *testing.T) {
	c, m, err := Load([]byte(`
network: {cidr: 10.9.0.1/16, mtu: 9000, dhcp: false, isolateGuests: true}
vms:
  - {name: web, cpus: 2, memory: 1G, kernel: /k, initramfs: /i, disk: {source: /d, size: 2G}, power: stopped, restart: never}
exposures:
  - {name: a, vm: web, guestPort: 80, hostPort: 8080}
  - {name: b, target: 10.9.3.4, protocol: udp, guestPort: 53, hostPort: 5353, hostAddress: 127.0.0.1, mode: proxy, maxConns: 0}
`))
	require.NoError(t, err)
	require.NotNil(t, c)
	assert.Equal(t, spec.Network{Bridge: "brokkr0", CIDR: netip.MustParsePrefix("10.9.0.1/16"),
		CIDR6: netip.MustParsePrefix("fd00:6272:6b72::1/64"), MTU: 9000, Masquerade: true, IsolateGuests: true}, m.Network)
	assert.Equal(t, []spec.VM{{Name: "web", CPUs: 2, MemoryMiB: 1024, Kernel: spec.Source{Location: "/k"},
		Initramfs: &spec.Source{Location: "/i"}, Cmdline: DefaultCmdline,
		Disk:  &spec.Disk{Source: spec.Source{Location: "/d"}, Size: 2 << 30},
		Power: spec.PowerStopped, Restart: spec.RestartNever}}, m.VMs)
	assert.Equal(t, []spec.Exposure{
		{Name: "a", Target: spec.Target{VM: "web"}, Proto: spec.TCP,
			HostPort: 8080, GuestPort: 80, Mode: spec.ModeAuto, MaxConns: DefaultMaxConns},
		{Name: "b", Target: spec.Target{Addr: netip.MustParseAddr("10.9.3.4")}, Proto: spec.UDP,
			HostAddr: netip.MustParseAddr("127.0.0.1"), HostPort: 5353, GuestPort: 53, Mode: spec.ModeProxy},
	}, m.Exposures)
}

// Whatever Compile accepts is something every engine can take without a
// check of its own: the rules netplane, the nft table and the proxy used to
// apply to their copies hold for every accepted model.
func FuzzCompile(f *testing.F) {
	f.Add([]byte(designExample))
	f.Add([]byte("network: {cidr6: 'fd00:1::1/64'}"))
	f.Add([]byte("network: {cidr6: ''}"))
	f.Add([]byte("network: {cidr: 10.0.0.1/8}\nvms: [{name: a, kernel: /k}]\nexposures: [{name: e, vm: a, guestPort: 1, hostPort: 2}]"))
	f.Add([]byte("exposures: [{name: e, target: 10.213.0.9, guestPort: 1, hostPort: 2, hostAddress: '::', mode: proxy}]"))
	f.Add([]byte("network: {cidr: 10.213.0.254/29}\nexposures: [{name: e, target: 10.213.0.253, guestPort: 65535, hostPort: 1, mode: nat}]"))
	f.Add([]byte("exposures: [{name: e, target: 10.213.0.9, guestPort: 1, hostPort: 2}, {name: f, target: 10.213.0.9, guestPort: 1, hostPort: 2, protocol: udp}]"))
	f.Add([]byte("exposures: [{name: e, target: 10.213.0.9, guestPort: 1, hostPort: '30000-30099', mode: proxy}, {name: f, target: 10.213.0.9, guestPort: '40-50', hostPort: '40-50', mode: proxy}]"))
	f.Add([]byte("exposures: [{name: e, target: 10.213.0.9, guestPort: 1, hostPort: '3-1', mode: proxy}, {name: f, target: 10.213.0.9, guestPort: 1, hostPort: 2, mode: proxy}]"))
	f.Fuzz(func(t *testing.T, data []byte) {
		_, m, err := Load(data)
		if err != nil {
			return
		}
		if p6 := m.Network.CIDR6; p6.IsValid() {
			a := p6.Addr().As16()
			if !p6.Addr().Is6() || p6.Addr().Is4In6() || p6.Bits() != 64 || p6.Addr().IsLinkLocalUnicast() ||
				p6.Addr().IsMulticast() || p6.Addr() == p6.Masked().Addr() || (a[11] == 0xff && a[12] == 0xfe) {
				t.Fatalf("accepted network.cidr6 %s", p6)
			}
		}
		p := m.Network.CIDR
		if !p.Addr().Is4() || p.Bits() < 8 || p.Bits() > 29 || p.Addr() == p.Masked().Addr() || p.Addr() == broadcast(p) ||
			p.Addr().IsLoopback() || p.Addr().IsMulticast() {
			t.Fatalf("accepted network.cidr %s", p)
		}
		if l := len(m.Network.Bridge); l < 1 || l > 15 || m.Network.MTU < 68 {
			t.Fatalf("accepted network %+v", m.Network)
		}
		vms := map[string]bool{}
		for _, v := range m.VMs {
			if vms[v.Name] || v.MemoryMiB < 16 || v.CPUs < 1 {
				t.Fatalf("accepted VM %+v", v)
			}
			vms[v.Name] = true
		}
		names := map[string]bool{}
		type bind struct {
			proto spec.Proto
			addr  netip.Addr
			port  uint16
		}
		binds := map[bind]string{}
		for _, e := range m.Exposures {
			if names[e.Name] || len(e.Name) == 0 || len(e.Name) > MaxExposureNameLen {
				t.Fatalf("accepted exposure name %q", e.Name)
			}
			names[e.Name] = true
			if (e.Proto != spec.TCP && e.Proto != spec.UDP) || e.HostPort == 0 || e.GuestPort == 0 ||
				e.MaxConns < 0 || e.MaxConns > spec.MaxConnsLimit || (e.HostAddr.IsValid() && e.HostAddr.Zone() != "") {
				t.Fatalf("accepted exposure %+v", e)
			}
			if e.HostPortLast != 0 && (e.HostPortLast <= e.HostPort || e.PortCount() > spec.MaxPortRange) ||
				e.GuestPortLast != 0 && (!e.IsRange() || int(e.GuestPortLast)-int(e.GuestPort) != int(e.HostPortLast)-int(e.HostPort)) {
				t.Fatalf("accepted ports %+v", e)
			}
			switch {
			case e.Target.IsVM() == (e.Target.Addr.IsValid() || e.Target.Addr6.IsValid()):
				t.Fatalf("target is not exactly one of a VM and addresses: %+v", e.Target)
			case e.Target.IsVM() && !vms[e.Target.VM]:
				t.Fatalf("accepted target VM %q that is not in vms", e.Target.VM)
			case e.Target.Addr.IsValid() && (!p.Masked().Contains(e.Target.Addr) || e.Target.Addr == p.Addr()):
				t.Fatalf("accepted target %s for %s", e.Target.Addr, p)
			}
			v4, v6 := e.HostFamilies()
			switch {
			case e.UsesKernel() && e.HostAddr.IsLoopback():
				t.Fatalf("the kernel path was given host address %s", e.HostAddr)
			case e.UsesKernel() && !e.Target.IsVM() && ((v4 && !v6 && !e.Target.Addr.IsValid()) || (v6 && !v4 && !e.Target.Addr6.IsValid())):
				t.Fatalf("the kernel path was given host address %s with no guest address of its family: %+v", e.HostAddr, e.Target)
			}
			// One bind per (protocol, address, port) across every path.
			claims := e.ProxyBinds(true, false)
			if e.UsesKernel() && e.HostAddr.IsValid() {
				claims = append(claims, e.HostAddr)
			} else if e.UsesKernel() {
				claims = append(claims, netip.IPv4Unspecified(), netip.IPv6Unspecified())
			}
			for _, a := range claims {
				for _, port := range e.HostPorts() {
					k := bind{e.Proto, a.Unmap(), port}
					if other, ok := binds[k]; ok && other != e.Name {
						t.Fatalf("exposures %s and %s both bind %v", other, e.Name, k)
					}
					binds[k] = e.Name
				}
			}
		}
	})
}

// A state with more exposures than the host has counter slots is refused
// whole, naming the limit: before, the apply succeeded and the exposures
// past the last slot never served ("nat: no counter slot").
func TestMoreExposuresThanSlotsAreRefusedWhole(t *testing.T) {
	build := func(n int) *Config {
		c := Defaults()
		for i := range n {
			// nat: the socket path's own bound (65,536 ports of auto
			// exposures) is not what this checks.
			c.Exposures = append(c.Exposures, Exposure{Name: "e" + strconv.Itoa(i), Target: "10.213.0.9", Mode: "nat",
				GuestPort: P(80), HostPort: P(1 + i%65535), HostAddress: "10.0." + strconv.Itoa(i/65535) + ".1"})
		}
		c.applyDefaults()
		return c
	}
	_, errs := Compile(build(spec.MaxExposures))
	require.Empty(t, errs)
	m, errs := Compile(build(spec.MaxExposures + 1))
	assert.Nil(t, m)
	require.Len(t, errs, 1)
	assert.Equal(t, "exposures", errs[0].Path)
	assert.Contains(t, errs[0].Msg, strconv.Itoa(spec.MaxExposures+1)+" exposures, more than the "+strconv.Itoa(spec.MaxExposures))
}

// network.cidr6: the bridge's IPv6 address on the guests' /64, the ULA by
// default, "" for IPv4 only; anything that is not a unicast /64 a guest
// could form its address in is refused, naming the field.
func TestNetworkCIDR6(t *testing.T) {
	_, m, err := Load(nil)
	require.NoError(t, err)
	assert.Equal(t, netip.MustParsePrefix(DefaultCIDR6), m.Network.CIDR6, "on by default")
	_, m, err = Load([]byte("network: {cidr6: ''}"))
	require.NoError(t, err)
	assert.False(t, m.Network.CIDR6.IsValid(), `"" is IPv4 only`)
	_, m, err = Load([]byte("network: {cidr6: '2001:db8:7::a/64'}"))
	require.NoError(t, err)
	assert.Equal(t, netip.MustParsePrefix("2001:db8:7::a/64"), m.Network.CIDR6, "a global prefix, the address as given")

	for in, want := range map[string]string{
		"fd00::1":                   `network.cidr6: "fd00::1" is not an IPv6 address with a prefix (like fd00:6272:6b72::1/64), or "" for IPv4 only`,
		"fd00::1/48":                `network.cidr6: "fd00::1/48": the prefix must be /64 (guests form their addresses from it)`,
		"10.1.0.1/24":               `network.cidr6: "10.1.0.1/24" is not an IPv6 address`,
		"::ffff:10.1.0.1/64":        `network.cidr6: "::ffff:10.1.0.1/64" is not an IPv6 address`,
		"fe80::1/64":                `network.cidr6: fe80::1/64 is link-local; give a unique-local or global address (like fd00:6272:6b72::1/64)`,
		"ff02::1/64":                `network.cidr6: ff02::1/64 is not a unicast address`,
		"::1/64":                    `network.cidr6: ::1/64 is not a unicast address`,
		"fd00:1::/64":               `network.cidr6: "fd00:1::/64" is the subnet-router anycast address; give the bridge's own address (like fd00:6272:6b72::1/64)`,
		"fd00:1::5054:ff:fe00:1/64": `network.cidr6: fd00:1::5054:ff:fe00:1/64 has the form of a guest's address (ff:fe in the middle of its host part); pick another, like ::1`,
	} {
		assert.Equal(t, []string{want}, errorsOf(t, "network: {cidr6: '"+in+"'}"), in)
	}
}
