package compile

import (
	"flag"
	"net"
	"net/netip"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/google/nftables/expr"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

var update = flag.Bool("update", false, "rewrite the golden files under testdata/")

type goldenCase struct {
	name  string
	rules Rules
}

func withOverflow(r Rules, port uint16) Rules {
	r.Cap = SetBasedCap{OverflowPort: port}
	return r
}

var (
	g1 = Guest{Name: "g1", Tap: "tap-g1", MAC: net.HardwareAddr{0x52, 0x54, 0, 0, 0, 1}, Addr: netip.MustParseAddr("10.213.0.11")}
	g2 = Guest{Name: "g2", Tap: "tap-g2", MAC: net.HardwareAddr{0x52, 0x54, 0, 0, 0, 2}, Addr: netip.MustParseAddr("10.213.0.12")}
	// Not leased yet: only DHCP and ARP probes from its MAC pass.
	g3 = Guest{Name: "g3", Tap: "tap-g3", MAC: net.HardwareAddr{0x52, 0x54, 0, 0, 0, 3}}
)

// baseRules numbers the exposures' marks in order (their counter slots,
// as the plane hands them over).
func baseRules(exps ...Exposure) Rules {
	for i := range exps {
		exps[i].MarkID = uint32(i + 1)
	}
	return Rules{Bridge: "brk0", Subnet: netip.MustParsePrefix("10.213.0.1/24"),
		Masquerade: true, DHCP: true, DNS: true, Guests: []Guest{g1, g2}, Exposures: exps, Cap: SetBasedCap{}}
}

func tcpTo(name string, hostPort uint16, guest Guest, guestPort uint16) Exposure {
	return Exposure{Name: name, Protocol: "tcp", HostPort: hostPort, GuestAddr: guest.Addr, GuestPort: guestPort}
}

// goldenCases: one configuration per feature of the tables, each small
// enough to read in its golden file.
func goldenCases() []goldenCase {
	capped := tcpTo("web", 8080, g1, 80)
	capped.MaxConns = 3
	bound := tcpTo("admin", 2222, g2, 22)
	bound.HostAddr = netip.MustParseAddr("192.0.2.1")
	udp := Exposure{Name: "dns", Protocol: "udp", HostPort: 5353, GuestAddr: g2.Addr, GuestPort: 53}
	udpCapped := udp
	udpCapped.Name, udpCapped.HostPort, udpCapped.MaxConns = "dns-capped", 5354, 8
	target := Exposure{Name: "db", Protocol: "tcp", HostPort: 15432, GuestAddr: netip.MustParseAddr("198.51.100.7"), GuestPort: 5432}
	loop := tcpTo("local", 9000, g1, 9000)
	loop.HostAddr = netip.MustParseAddr("127.0.0.1")

	kernel := baseRules(capped, bound, udp)
	kernel.Cap = MarksOnly{}
	noMasq := baseRules(tcpTo("web", 8080, g1, 80))
	noMasq.Masquerade, noMasq.DHCP, noMasq.DNS = false, false, false
	isolated := baseRules(tcpTo("web", 8080, g1, 80))
	isolated.IsolateGuests = true
	antiSpoof := baseRules()
	antiSpoof.Guests = []Guest{g1, g3}
	// IPv6 on the bridge: g1 with its SLAAC address, g3 not leased (its
	// link-local address only), masquerade of the unique-local /64.
	dual := baseRules(tcpTo("web", 8080, g1, 80))
	dual.Subnet6 = netip.MustParsePrefix("fd00:6272:6b72::1/64")
	g1v6 := g1
	g1v6.Addr6 = netip.MustParseAddr("fd00:6272:6b72:0:5054:ff:fe00:1")
	dual.Guests = []Guest{g1v6, g3}
	// Both families on the nat path: "" publishes each family the
	// exposure has a guest address of, :: and an IPv6 address IPv6 only,
	// 0.0.0.0 IPv4 only; one mark (slot) per exposure either way.
	web6 := tcpTo("web", 8080, g1, 80)
	web6.GuestAddr6, web6.MaxConns = g1v6.Addr6, 3
	only6 := tcpTo("v6only", 8443, g1, 443)
	only6.HostAddr, only6.GuestAddr6 = netip.IPv6Unspecified(), g1v6.Addr6
	only4 := tcpTo("v4only", 8444, g1, 443)
	only4.HostAddr, only4.GuestAddr6 = netip.IPv4Unspecified(), g1v6.Addr6
	bound6 := Exposure{Name: "admin6", Protocol: "udp", HostAddr: netip.MustParseAddr("2001:db8::1"), HostPort: 5353,
		GuestAddr6: g1v6.Addr6, GuestPort: 53}
	target6 := Exposure{Name: "db6", Protocol: "tcp", HostPort: 15432, GuestAddr6: netip.MustParseAddr("fd00:6272:6b72::c8"), GuestPort: 5432}
	dualNat := baseRules(web6, only6, only4, bound6, target6)
	dualNat.Cap, dualNat.Subnet6, dualNat.Guests = MarksOnly{}, dual.Subnet6, []Guest{g1v6}
	// The set-based cap publishes IPv4 only.
	dualSet := baseRules(web6)
	dualSet.Subnet6, dualSet.Guests = dual.Subnet6, []Guest{g1v6}
	// Port ranges (nat path only): one interval element and one mark each,
	// the port kept (exp-target-addr) or one guest port for all of it.
	kept := Exposure{Name: "games", Protocol: "tcp", HostPort: 30000, HostPortLast: 30099, GuestAddr: g1.Addr, GuestAddr6: g1v6.Addr6,
		GuestPort: 30000, GuestPortLast: 30099, MaxConns: 64}
	fan := Exposure{Name: "voice", Protocol: "udp", HostAddr: netip.MustParseAddr("192.0.2.1"), HostPort: 40000, HostPortLast: 40009,
		GuestAddr: g1.Addr, GuestPort: 27015}
	kept6 := Exposure{Name: "games6", Protocol: "tcp", HostAddr: netip.MustParseAddr("2001:db8::1"), HostPort: 50000, HostPortLast: 50004,
		GuestAddr6: g1v6.Addr6, GuestPort: 50000, GuestPortLast: 50004}
	// Shifted: each host port to its own guest port, one element each.
	shifted := Exposure{Name: "shifted", Protocol: "udp", HostPort: 41000, HostPortLast: 41002, GuestAddr: g1.Addr, GuestAddr6: g1v6.Addr6,
		GuestPort: 51000, GuestPortLast: 51002}
	ranges := baseRules(tcpTo("web", 8080, g1, 80), kept, fan, kept6, shifted)
	ranges.Cap, ranges.Subnet6, ranges.Guests = MarksOnly{}, dual.Subnet6, []Guest{g1v6}
	// Under the set-based cap: IPv4 ranges, their accepted in the target
	// elements' counters; a capped one's chain admits by the port dialled
	// too and DNATs as its kind does (the port kept, shifted, one port).
	keptUncapped := kept
	keptUncapped.GuestAddr6, keptUncapped.MaxConns = netip.Addr{}, 0
	shifted4 := shifted
	shifted4.GuestAddr6 = netip.Addr{}
	keptCapped := keptUncapped
	keptCapped.Name, keptCapped.HostPort, keptCapped.HostPortLast, keptCapped.GuestPort, keptCapped.GuestPortLast, keptCapped.MaxConns =
		"lobby", 31000, 31009, 31000, 31009, 8
	shiftedCapped := shifted4
	shiftedCapped.Name, shiftedCapped.Protocol, shiftedCapped.HostPort, shiftedCapped.HostPortLast, shiftedCapped.MaxConns = "relay", "tcp", 42000, 42002, 4
	fanCapped := Exposure{Name: "admin", Protocol: "tcp", HostPort: 43000, HostPortLast: 43004, GuestAddr: g1.Addr, GuestPort: 22, MaxConns: 2}
	rangesSet := baseRules(keptUncapped, fan, shifted4, keptCapped, shiftedCapped, fanCapped)
	global6 := baseRules()
	global6.Subnet6 = netip.MustParsePrefix("2001:db8:7::1/64")
	return []goldenCase{
		{name: "empty", rules: Rules{Bridge: "brk0", Subnet: netip.MustParsePrefix("10.213.0.1/24"), Cap: SetBasedCap{}}},
		{name: "wildcard", rules: baseRules(tcpTo("web", 8080, g1, 80))},
		{name: "specific-address", rules: baseRules(bound)},
		{name: "wildcard-and-specific-same-port", rules: baseRules(tcpTo("web", 2222, g1, 80), bound)},
		{name: "cap-tcp-set", rules: withOverflow(baseRules(capped), 40001)},
		{name: "cap-tcp-set-no-listener", rules: baseRules(capped)},
		{name: "cap-kernel", rules: kernel},
		{name: "udp", rules: baseRules(udp, udpCapped)},
		{name: "hairpin-two-guests", rules: baseRules(tcpTo("web1", 8081, g1, 80), tcpTo("web2", 8082, g2, 80))},
		{name: "isolate-guests", rules: isolated},
		{name: "no-masquerade-no-dhcp-dns", rules: noMasq},
		{name: "anti-spoof-leased-and-not", rules: antiSpoof},
		{name: "several-exposures-one-guest", rules: baseRules(tcpTo("http", 80, g1, 8080), tcpTo("https", 443, g1, 8443),
			tcpTo("ssh", 2201, g1, 22), Exposure{Name: "syslog", Protocol: "udp", HostPort: 5514, GuestAddr: g1.Addr, GuestPort: 514})},
		{name: "target-address", rules: baseRules(target)},
		{name: "loopback-only", rules: baseRules(loop)},
		{name: "ipv6-ula", rules: dual},
		{name: "ipv6-global-no-nat66", rules: global6},
		{name: "dual-stack-nat", rules: dualNat},
		{name: "dual-stack-set-cap", rules: dualSet},
		{name: "port-ranges", rules: ranges},
		{name: "port-ranges-set-cap", rules: rangesSet},
	}
}

// renderCase is the case's two tables in `nft -f` syntax.
func renderCase(t *testing.T, c goldenCase) string {
	t.Helper()
	inet, bridge, err := Whole(c.rules)
	require.NoError(t, err, c.name)
	var out []string
	for _, tab := range []*TableSpec{inet, bridge} {
		s, err := Render(tab)
		require.NoError(t, err, c.name)
		out = append(out, s)
	}
	return strings.Join(out, "\n")
}

func goldenPath(name string) string { return filepath.Join("testdata", name+".nft") }

// The compiled tables, rendered, match the golden files (go test -update
// rewrites them).
func TestGolden(t *testing.T) {
	want := map[string]bool{}
	for _, c := range goldenCases() {
		want[goldenPath(c.name)] = true
		got := renderCase(t, c)
		if *update {
			require.NoError(t, os.MkdirAll("testdata", 0o755))
			require.NoError(t, os.WriteFile(goldenPath(c.name), []byte(got), 0o644))
		}
		b, err := os.ReadFile(goldenPath(c.name))
		require.NoError(t, err, "run with -update to create it")
		assert.Equal(t, string(b), got, c.name)
	}
	files, err := filepath.Glob("testdata/*.nft")
	require.NoError(t, err)
	for _, f := range files {
		assert.True(t, want[f], "%s belongs to no case: delete it", f)
	}
}

// An expression the renderer does not know fails the render, naming it.
func TestRenderRefusesUnknownExpression(t *testing.T) {
	inet, _, err := Whole(baseRules())
	require.NoError(t, err)
	inet.addChain(&ChainSpec{Name: "x", Rules: []RuleSpec{rule(inet.Family, "log", &expr.Log{})}})
	_, err = Render(inet)
	require.Error(t, err)
	assert.Contains(t, err.Error(), "*expr.Log")
	assert.Contains(t, err.Error(), "chain x")
}

// Input Validate refuses but that reaches the compiler anyway is an error
// naming the field, never a panic, and nothing is planned.
func TestPlanRefusesImpossibleInput(t *testing.T) {
	for field, mutate := range map[string]func(*Rules){
		"exposures[web].guestAddr": func(r *Rules) { r.Exposures[0].GuestAddr = netip.Addr{} },
		"exposures[web].hostAddr":  func(r *Rules) { r.Exposures[0].HostAddr = netip.MustParseAddr("2001:db8::1") },
		"exposures[web].protocol":  func(r *Rules) { r.Exposures[0].Protocol = "sctp" },
		"exposures[web].markID":    func(r *Rules) { r.Exposures[0].MarkID = 0 },
		"exposures[web2].markID": func(r *Rules) {
			r.Exposures = append(r.Exposures, tcpTo("web2", 8081, g1, 80))
			r.Exposures[1].MarkID = 1
		},
		"exposures[web2].hostPort": func(r *Rules) {
			r.Exposures = append(r.Exposures, tcpTo("web2", 8080, g1, 81))
			r.Exposures[1].MarkID = 2
		},
		"exposures[web].name":          func(r *Rules) { r.Exposures = append(r.Exposures, r.Exposures[0]) },
		"exposures[web].hostPortLast":  func(r *Rules) { r.Exposures[0].HostPortLast = 8079; r.Cap = MarksOnly{} },
		"exposures[web].guestPortLast": func(r *Rules) { r.Exposures[0].GuestPortLast = 81; r.Cap = MarksOnly{} },
		"subnet":                       func(r *Rules) { r.Subnet = netip.Prefix{} },
		"bridge":                       func(r *Rules) { r.Bridge = "a-name-longer-than-ifnamsiz" },
		"guests[0].mac":                func(r *Rules) { r.Guests[0].MAC = nil },
		"guests[0].addr":               func(r *Rules) { r.Guests[0].Addr = netip.MustParseAddr("2001:db8::2") },
	} {
		r := baseRules(tcpTo("web", 8080, g1, 80))
		r.Guests = []Guest{g1}
		mutate(&r)
		p, err := NewState().Plan(r, &Observation{Inet: EmptyObserved(), Bridge: EmptyObserved()})
		require.Error(t, err, field)
		assert.Nil(t, p, field)
		assert.Contains(t, err.Error(), field+":")
	}
}
