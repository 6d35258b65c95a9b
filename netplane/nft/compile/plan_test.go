package compile

import (
	"net/netip"
	"regexp"
	"strconv"
	"strings"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

// Pure planning: no kernel.

func refRules() Rules {
	return Rules{Bridge: "br0", Subnet: netip.MustParsePrefix("10.213.0.1/24"),
		Masquerade: true, DHCP: true, Exposures: []Exposure{
			{Name: "web", Protocol: "tcp", HostPort: 8080, GuestAddr: netip.MustParseAddr("10.213.0.11"), GuestPort: 80, MaxConns: 3},
			{Name: "dns", Protocol: "udp", HostPort: 5353, GuestAddr: netip.MustParseAddr("10.213.0.12"), GuestPort: 53},
		}}
}

func mustDesired(t *testing.T, r Rules, ids map[string]uint32) (inet, bridge *TableSpec) {
	t.Helper()
	inet, bridge, err := Desired(r, ids, 0)
	require.NoError(t, err)
	return inet, bridge
}

func TestPlanNothingWhenEqual(t *testing.T) {
	r := refRules()
	ids := AssignIDs(r.Exposures, nil)
	d, _ := mustDesired(t, r, ids)
	assert.True(t, MakePlan(d, ObservedFrom(d)).Empty())
}

func TestPlanOneExposureAdded(t *testing.T) {
	r := refRules()
	ids := AssignIDs(r.Exposures, nil)
	d0, _ := mustDesired(t, r, ids)
	r.Exposures = append(r.Exposures, Exposure{Name: "ssh", Protocol: "tcp", HostPort: 2222, GuestAddr: netip.MustParseAddr("10.213.0.11"), GuestPort: 22})
	ids = AssignIDs(r.Exposures, ids)
	d1, _ := mustDesired(t, r, ids)
	p := MakePlan(d1, ObservedFrom(d0))
	assert.Len(t, p.AddChains, 1)
	assert.Equal(t, "exp-ssh", p.AddChains[0].Name)
	assert.Len(t, p.AddElems[MapExpAny], 1)
	assert.Empty(t, p.FlushChains, "no other chain is rewritten")
	assert.Empty(t, p.DelChains)
	assert.ElementsMatch(t, []string{"ssh-accepted"}, p.AddCounters, "uncapped: no refused counter")
}

func TestPlanRemovedAndDrift(t *testing.T) {
	r := refRules()
	ids := AssignIDs(r.Exposures, nil)
	d0, _ := mustDesired(t, r, ids)
	obs := ObservedFrom(d0)
	delete(obs.Chains, "dispatch")       // drift: a chain deleted
	obs.Chains["prerouting"].Rules = nil // drift: a flushed chain
	r.Exposures = r.Exposures[:1]        // change: dns removed
	d1, _ := mustDesired(t, r, AssignIDs(r.Exposures, ids))
	p := MakePlan(d1, obs)
	assert.Contains(t, p.DelChains, "exp-dns")
	assert.Contains(t, p.DelCounters, "dns-accepted")
	assert.Len(t, p.DelElems[MapExpAny], 1)
	repaired, changed := Split(p, Fingerprints(d0), Fingerprints(d1))
	assert.Contains(t, repaired, "chain dispatch missing")
	assert.Contains(t, repaired, "rules of chain prerouting differ")
	assert.Contains(t, changed, "chain exp-dns unexpected")
}

func TestPlanCapChangeRecreatesSetAndRewritesChain(t *testing.T) {
	r := refRules()
	ids := AssignIDs(r.Exposures, nil)
	d0, _ := mustDesired(t, r, ids)
	r.Exposures[0].MaxConns = 5
	d1, _ := mustDesired(t, r, ids)
	p := MakePlan(d1, ObservedFrom(d0))
	assert.Contains(t, p.DelSets, "conns-web")
	require.Len(t, p.Seed, 1, "a recreated cap set is seeded from conntrack")
	assert.Contains(t, p.FlushChains, "exp-web")
}

func TestIDsStableAndDistinct(t *testing.T) {
	var exps []Exposure
	for i := 0; i < 5000; i++ {
		exps = append(exps, Exposure{Name: "e" + strings.Repeat("x", i%7) + string(rune('a'+i%26)) + itoa(i)})
	}
	ids := AssignIDs(exps, nil)
	seen := map[uint32]bool{}
	for _, id := range ids {
		assert.NotZero(t, id)
		assert.Zero(t, id&^MarkIDMask)
		assert.False(t, seen[id])
		seen[id] = true
	}
	again := AssignIDs(append(exps, Exposure{Name: "new"}), ids)
	for n, id := range ids {
		assert.Equal(t, id, again[n])
	}
}

func itoa(i int) string { return strings.TrimSpace(strings.Repeat(" ", 0) + string([]byte(fmtInt(i)))) }

func fmtInt(i int) string {
	if i == 0 {
		return "0"
	}
	var b []byte
	for ; i > 0; i /= 10 {
		b = append([]byte{byte('0' + i%10)}, b...)
	}
	return string(b)
}

func TestLoopbackExposureGetsNoRules(t *testing.T) {
	r := refRules()
	r.Exposures = append(r.Exposures, Exposure{Name: "lo", Protocol: "tcp", HostAddr: netip.MustParseAddr("127.0.0.1"), HostPort: 1,
		GuestAddr: netip.MustParseAddr("10.213.0.11"), GuestPort: 1})
	d, _ := mustDesired(t, r, AssignIDs(r.Exposures, nil))
	assert.NotContains(t, d.Chains, "exp-lo")
	u, err := UnitOf(&UnitKey{Exp: r.Exposures[2], ID: 1})
	require.NoError(t, err)
	assert.Nil(t, u.Chains["exp-lo"])
}

// Any input either builds or is refused with an error: the compiler never
// panics, whatever reaches it.
func FuzzDesired(f *testing.F) {
	f.Add("web", "tcp", uint16(8080), uint16(80), 3, "10.213.0.11")
	f.Add("", "udp", uint16(0), uint16(0), -1, "::1")
	f.Fuzz(func(t *testing.T, name, proto string, hp, gp uint16, max int, guest string) {
		r := refRules()
		ga, _ := netip.ParseAddr(guest)
		r.Exposures = append(r.Exposures, Exposure{Name: name, Protocol: proto, HostPort: hp, GuestPort: gp, MaxConns: max, GuestAddr: ga})
		_, _, _ = Desired(r, AssignIDs(r.Exposures, nil), 0)
	})
}

// nameRE is what validName accepts, as a regexp.
var nameRE = regexp.MustCompile(`^[a-zA-Z0-9][a-zA-Z0-9_.-]{0,63}$`)

// validName accepts exactly what nameRE accepts.
func FuzzValidNameMatchesNameRE(f *testing.F) {
	for _, s := range []string{"", "a", "web", "x00001", "-a", "a-", "_a", "a_b.c-d", "a b", "ä", strings.Repeat("a", 64), strings.Repeat("a", 65), "a\n"} {
		f.Add(s)
	}
	f.Fuzz(func(t *testing.T, s string) {
		if validName(s) != nameRE.MatchString(s) {
			t.Fatalf("validName(%q) = %v, nameRE says %v", s, validName(s), nameRE.MatchString(s))
		}
	})
}

// The Go side of a first 10,000-exposure Converge: units built and merged
// into the whole table, then planned against an empty kernel.
func BenchmarkWholeTable10000(b *testing.B) {
	r := refRules()
	r.Exposures = nil
	for i := 0; i < 10000; i++ {
		r.Exposures = append(r.Exposures, Exposure{Name: "x" + strconv.Itoa(i), Protocol: "tcp", HostPort: uint16(20000 + i),
			GuestAddr: netip.MustParseAddr("10.213.0.11"), GuestPort: 7000})
	}
	ids := AssignIDs(r.Exposures, nil)
	var keys []UnitKey
	for _, e := range r.Exposures {
		keys = append(keys, UnitKey{Exp: e, ID: ids[e.Name]})
	}
	g, _, err := Desired(Rules{Bridge: r.Bridge, Subnet: r.Subnet, Masquerade: true, DHCP: true}, nil, 0)
	require.NoError(b, err)
	b.ReportAllocs()
	for b.Loop() {
		units, err := BuildUnits(keys)
		require.NoError(b, err)
		MakePlan(Assemble(g, units), EmptyObserved())
	}
}
