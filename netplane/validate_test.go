package netplane

import (
	"net/netip"
	"strings"
	"testing"

	"github.com/stretchr/testify/assert"

	"github.com/brokkr/brokkr/netplane/link"
)

func errText(errs []error) string {
	var b strings.Builder
	for _, e := range errs {
		b.WriteString(e.Error() + "\n")
	}
	return b.String()
}

func TestValidateSpecFieldErrors(t *testing.T) {
	n := Network{Bridge: "brokkr0", CIDR: netip.MustParsePrefix("10.213.0.1/24")}
	exp := func(e Exposure) Desired {
		if e.Protocol == "" {
			e.Protocol = "tcp"
		}
		if e.HostPort == 0 {
			e.HostPort = 8080
		}
		if e.GuestPort == 0 {
			e.GuestPort = 80
		}
		return Desired{Network: n, Guests: guestsOf("web"), Exposures: []Exposure{e}}
	}
	addr := netip.MustParseAddr
	cases := []struct {
		d    Desired
		want string
	}{
		{Desired{Network: Network{Bridge: "brokkr0", CIDR: netip.MustParsePrefix("10.213.0.0/24")}}, "network.cidr: 10.213.0.0/24 is the network address"},
		{Desired{Network: Network{Bridge: "brokkr0", CIDR: netip.MustParsePrefix("10.213.0.255/24")}}, "network.cidr: 10.213.0.255/24 is the broadcast address"},
		{Desired{Network: Network{Bridge: "brokkr0", CIDR: netip.MustParsePrefix("10.213.0.1/31")}}, "network.cidr: 10.213.0.1/31 leaves no address"},
		{Desired{Network: Network{Bridge: "brokkr0", CIDR: netip.MustParsePrefix("fd00::1/64")}}, "network.cidr: fd00::1/64 is not IPv4"},
		{Desired{Network: Network{Bridge: "brokkr0", CIDR: n.CIDR, MTU: 20}}, "network.mtu"},
		{Desired{Network: Network{Bridge: "", CIDR: n.CIDR}}, "network.bridge: is empty"},
		{Desired{Network: n, Guests: guestsOf("web", "web")}, `guests[1].name: "web" appears twice`},
		{exp(Exposure{Name: "x", VM: "nope"}), `exposures[0].vm: "nope" is not a guest`},
		{exp(Exposure{Name: "x"}), "exposures[0].vm: give the vm"},
		{exp(Exposure{Name: "x", VM: "web", Target: addr("10.213.0.9")}), "exposures[0].target: give either"},
		{exp(Exposure{Name: "x", Target: addr("10.9.0.9")}), "exposures[0].target: 10.9.0.9 is outside"},
		{exp(Exposure{Name: "x", Target: addr("10.213.0.1")}), "exposures[0].target: 10.213.0.1 is the bridge's own address"},
		{exp(Exposure{Name: "x", Target: addr("10.213.0.7")}), `exposures[0].target: 10.213.0.7 is assigned to guest "web"`},
		{exp(Exposure{Name: "x", VM: "web", Protocol: "sctp"}), "exposures[0].protocol"},
		{exp(Exposure{Name: "x", VM: "web", HostAddress: addr("127.0.0.1")}), "exposures[0].hostAddress: 127.0.0.1 is loopback"},
		{exp(Exposure{Name: "x", VM: "web", HostAddress: addr("::1")}), "exposures[0].hostAddress"},
		{exp(Exposure{Name: "x", VM: "web", MaxConns: -1}), "exposures[0].maxConns"},
		{exp(Exposure{Name: "", VM: "web"}), "exposures[0].name"},
		{exp(Exposure{Name: "a b", VM: "web"}), "exposures[0].name"},
		{Desired{Network: n, Guests: guestsOf("we/b")}, "guests[0].name"},
	}
	assigned := map[string]netip.Addr{"web": addr("10.213.0.7")}
	for _, c := range cases {
		assert.Contains(t, errText(validateSpec(withDefaults(c.d), assigned)), c.want)
	}

	dup := Desired{Network: n, Guests: guestsOf("web"), Exposures: []Exposure{
		{Name: "a", VM: "web", Protocol: "udp", HostAddress: addr("192.0.2.1"), HostPort: 53, GuestPort: 53},
		{Name: "b", VM: "web", Protocol: "udp", HostPort: 53, GuestPort: 5353},
		{Name: "c", VM: "web", Protocol: "tcp", HostPort: 53, GuestPort: 53},
		{Name: "d", VM: "web", Protocol: "udp", HostAddress: addr("192.0.2.2"), HostPort: 53, GuestPort: 53},
	}}
	dup.Exposures = append(dup.Exposures,
		Exposure{Name: "e", VM: "web", Protocol: "udp", HostPort: 53, GuestPort: 53},
		Exposure{Name: "f", VM: "web", Protocol: "udp", HostAddress: addr("192.0.2.1"), HostPort: 53, GuestPort: 53})
	got := errText(validateSpec(withDefaults(dup), nil))
	assert.Contains(t, got, `exposures[4].hostPort: udp 0.0.0.0:53 is already published by exposure "b"`)
	assert.Contains(t, got, `exposures[5].hostPort: udp 192.0.2.1:53 is already published by exposure "a"`)
	assert.NotContains(t, got, "exposures[1]", "0.0.0.0 and a specific address may share a port (the specific one wins)")
	assert.NotContains(t, got, "exposures[2]", "tcp and udp do not clash")
	assert.NotContains(t, got, "exposures[3]")

	ok := Desired{Network: n, Guests: guestsOf("web", "db"), Exposures: []Exposure{
		{Name: "a", VM: "web", Protocol: "tcp", HostPort: 80, GuestPort: 80},
		{Name: "b", Target: addr("10.213.0.200"), Protocol: "tcp", HostPort: 81, GuestPort: 80, MaxConns: 4},
	}}
	assert.Empty(t, validateSpec(withDefaults(ok), assigned))
}

// Validation never panics, and whatever it accepts is something the
// kernel side can take: a valid IPv4 bridge address with room for guests,
// a bridge name that fits, unique tap names.
func FuzzValidateSpec(f *testing.F) {
	f.Add("brokkr0", "10.213.0.1/24", "web", "db", "web-http", "10.213.0.9", uint16(8080), 1500)
	f.Add("x", "10.0.0.0/8", "a", "a", "", "", uint16(0), 0)
	f.Add("brk-web", "fd00::1/64", "web", "abcdefghijk", "e", "10.0.0.1", uint16(1), 70000)
	f.Fuzz(func(t *testing.T, bridge, cidr, g1, g2, exp, target string, port uint16, mtu int) {
		prefix, _ := netip.ParsePrefix(cidr)
		tgt, _ := netip.ParseAddr(target)
		d := withDefaults(Desired{
			Network: Network{Bridge: bridge, CIDR: prefix, MTU: mtu},
			Guests:  guestsOf(g1, g2),
			Exposures: []Exposure{{Name: exp, VM: g1, Protocol: "tcp", HostPort: port, GuestPort: port},
				{Name: exp + "2", Target: tgt, Protocol: "udp", HostPort: port, GuestPort: port}},
		})
		if len(validateSpec(d, nil)) > 0 {
			return
		}
		p := d.Network.CIDR
		if !p.Addr().Is4() || p.Bits() > 30 || p.Addr() == p.Masked().Addr() || p.Addr() == broadcast(p) {
			t.Fatalf("accepted cidr %s", p)
		}
		if len(bridge) == 0 || len(bridge) > 15 {
			t.Fatalf("accepted bridge %q", bridge)
		}
		if link.TapName(g1) == link.TapName(g2) || link.TapName(g1) == bridge || link.TapName(g2) == bridge {
			t.Fatalf("accepted clashing taps for %q %q on %q", g1, g2, bridge)
		}
		if !p.Masked().Contains(tgt) || tgt == p.Addr() {
			t.Fatalf("accepted target %s for %s", tgt, p)
		}
		if errs := nftPreflight(d); len(errs) > 0 {
			t.Fatalf("netplane accepts what the nft table refuses: %v", errs)
		}
	})
}
