package compile

import (
	"fmt"
	"net/netip"
	"regexp"
	"sort"
	"strings"
	"testing"

	"github.com/google/nftables"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

// Pure planning: no kernel.

func refRules() Rules {
	return Rules{Bridge: "br0", Subnet: netip.MustParsePrefix("10.213.0.1/24"),
		Masquerade: true, DHCP: true, Cap: SetBasedCap{}, Exposures: []Exposure{
			{Name: "web", Protocol: "tcp", HostPort: 8080, GuestAddr: netip.MustParseAddr("10.213.0.11"), GuestPort: 80, MaxConns: 3, MarkID: 1},
			{Name: "dns", Protocol: "udp", HostPort: 5353, GuestAddr: netip.MustParseAddr("10.213.0.12"), GuestPort: 53, MarkID: 2},
		}}
}

func ssh() Exposure {
	return Exposure{Name: "ssh", Protocol: "tcp", HostPort: 2222, GuestAddr: netip.MustParseAddr("10.213.0.11"), GuestPort: 22, MarkID: 3}
}

// empty is what a kernel without brokkr's tables holds.
func empty() *Observation { return &Observation{Inet: EmptyObserved(), Bridge: EmptyObserved()} }

// held is what a kernel holds once r is applied exactly.
func held(t *testing.T, r Rules) *Observation {
	t.Helper()
	inet, bridge, err := Whole(r)
	require.NoError(t, err)
	return &Observation{Inet: ObservedFrom(inet), Bridge: ObservedFrom(bridge)}
}

// applied is a state that has applied r.
func applied(t *testing.T, r Rules) *State {
	t.Helper()
	s := NewState()
	p, err := s.Plan(r, empty())
	require.NoError(t, err)
	s.Commit(p)
	return s
}

func opsOf[T Op](p *Plan) []T {
	var out []T
	for _, o := range p.Ops {
		if x, ok := o.(T); ok {
			out = append(out, x)
		}
	}
	return out
}

func elemCount[T interface{ AddElems | DelElems }](ops []T, set string) int {
	n := 0
	for _, o := range ops {
		switch x := any(o).(type) {
		case AddElems:
			if x.Set.Name == set {
				n += len(x.Elems)
			}
		case DelElems:
			if x.Set == set {
				n += len(x.Elems)
			}
		}
	}
	return n
}

func changesOf(p *Plan) []string {
	var out []string
	for _, c := range p.Changes {
		s := c.Exposure.Name + " " + c.Kind.String()
		if c.Flush {
			s += " flush " + c.HostSide.String()
		}
		out = append(out, s)
	}
	sort.Strings(out) // the plan lists them in the desired state's order
	return out
}

func TestPlanFirstApplyCreatesEverythingAndFlushesEachUDPHostSide(t *testing.T) {
	p, err := NewState().Plan(refRules(), empty())
	require.NoError(t, err)
	assert.Equal(t, []string{"dns created flush udp *:5353", "web created"}, changesOf(p), "a new TCP host side has no flow to move: only UDP flushes on creation")
	assert.Empty(t, p.Repairs, "a first build is not drift")
	assert.Len(t, opsOf[AddTable](p), 2)
	assert.Equal(t, 2, elemCount(opsOf[AddElems](p), MapExpAny))
}

func TestPlanNothingWhenEqual(t *testing.T) {
	r := refRules()
	s := applied(t, r)
	for name, obs := range map[string]*Observation{"generation unchanged": nil, "read back": held(t, r)} {
		p, err := s.Plan(r, obs)
		require.NoError(t, err, name)
		assert.True(t, p.Empty(), name)
		assert.Empty(t, p.Changes, name)
		assert.Empty(t, p.Repairs, name)
	}
}

// A new process finds the tables as the last one left them: nothing to
// send, every exposure is new to the state, and none is flushed.
func TestPlanAfterRestartFlushesNothing(t *testing.T) {
	r := refRules()
	p, err := NewState().Plan(r, held(t, r))
	require.NoError(t, err)
	assert.True(t, p.Empty())
	assert.Equal(t, []string{"dns created", "web created"}, changesOf(p))
}

func TestPlanOneExposureAdded(t *testing.T) {
	r := refRules()
	s := applied(t, r)
	r.Exposures = append(r.Exposures, ssh())
	for name, obs := range map[string]*Observation{"generation unchanged": nil, "read back": held(t, refRules())} {
		p, err := s.Plan(r, obs)
		require.NoError(t, err)
		assert.Equal(t, []string{"ssh created"}, changesOf(p), name)
		assert.Equal(t, 1, elemCount(opsOf[AddElems](p), MapExpAny), name)
		assert.Equal(t, 1, elemCount(opsOf[AddElems](p), MapExpTarget), name)
		assert.Equal(t, 1, elemCount(opsOf[AddElems](p), MapExpBytesOrig), name)
		assert.Equal(t, 1, elemCount(opsOf[AddElems](p), MapExpBytesReply), name)
		assert.Len(t, p.Ops, 4, name+": four elements (the set-based cap's byte counters two) and nothing else")
		assert.Empty(t, opsOf[AddChain](p), name+": an exposure is data, not a chain")
		assert.Empty(t, opsOf[DelElems](p), name)
		assert.Empty(t, p.Repairs, name)
	}
}

// PlanUpdate plans the exposures it is given and nothing else: at 2,000
// exposures one more is the same few operations as at 2.
func TestPlanUpdateTouchesOnlyItsExposures(t *testing.T) {
	r := refRules()
	for i := 0; i < 2000; i++ {
		r.Exposures = append(r.Exposures, Exposure{Name: fmt.Sprintf("x%04d", i), Protocol: "tcp", HostPort: uint16(20000 + i),
			GuestAddr: netip.MustParseAddr("10.213.0.11"), GuestPort: 7000, MarkID: uint32(100 + i)})
	}
	s := applied(t, r)
	p, err := s.PlanUpdate(nil, []Exposure{ssh()}, []string{"x0007"}, nil)
	require.NoError(t, err)
	assert.Equal(t, []string{"ssh created", "x0007 removed flush tcp *:20007"}, changesOf(p))
	assert.Equal(t, 1, elemCount(opsOf[AddElems](p), MapExpAny))
	assert.Equal(t, 1, elemCount(opsOf[DelElems](p), MapExpAny))
	s.Commit(p)
	_, ok := s.Exposure("x0007")
	assert.False(t, ok)
	got, ok := s.Exposure("ssh")
	assert.True(t, ok)
	assert.Equal(t, ssh(), got)

	// The same update again changes nothing.
	p, err = s.PlanUpdate(nil, []Exposure{ssh()}, []string{"x0007"}, nil)
	require.NoError(t, err)
	assert.True(t, p.Empty())
	assert.Empty(t, p.Changes)
	// And the whole desired state, planned afresh, agrees with it.
	r.Exposures = append(r.Exposures, ssh())
	r.Exposures = append(r.Exposures[:9], r.Exposures[10:]...) // x0007
	p, err = s.Plan(r, nil)
	require.NoError(t, err)
	assert.True(t, p.Empty(), "%v", p.Ops)
}

func TestPlanUpdateNeedsAWholeStateFirst(t *testing.T) {
	_, err := NewState().PlanUpdate(nil, []Exposure{ssh()}, nil, empty())
	assert.ErrorContains(t, err, "no whole desired state")
}

func TestPlanRemovedAndDrift(t *testing.T) {
	r := refRules()
	s := applied(t, r)
	obs := held(t, r)
	delete(obs.Inet.Chains, "dispatch")       // drift: a chain deleted
	obs.Inet.Chains["prerouting"].Rules = nil // drift: a flushed chain
	r.Exposures = r.Exposures[:1]             // change: dns removed
	p, err := s.Plan(r, obs)
	require.NoError(t, err)
	assert.Equal(t, 1, elemCount(opsOf[DelElems](p), MapExpAny))
	assert.Equal(t, 1, elemCount(opsOf[DelElems](p), MapExpTarget))
	var repairs []string
	for _, r := range p.Repairs {
		repairs = append(repairs, r.String())
	}
	assert.ElementsMatch(t, []string{"chain dispatch missing", "rules of chain prerouting differ"}, repairs)
	assert.Equal(t, []string{"dns removed flush udp *:5353"}, changesOf(p))
}

// A repaired element restores where the flows already go: nothing is
// flushed for it.
func TestPlanRepairedElementIsNotFlushed(t *testing.T) {
	r := refRules()
	s := applied(t, r)
	obs := held(t, r)
	for k, e := range obs.Inet.Sets[MapExpAny].Elems {
		if e.Comment == "web" {
			delete(obs.Inet.Sets[MapExpAny].Elems, k)
		}
	}
	p, err := s.Plan(r, obs)
	require.NoError(t, err)
	require.Len(t, p.Repairs, 1)
	assert.Equal(t, "element exp-any[web] missing", p.Repairs[0].String())
	assert.Empty(t, p.Changes)
	assert.Equal(t, 1, elemCount(opsOf[AddElems](p), MapExpAny))
	assert.Len(t, p.Ops, 1)
}

// A dispatch element that no exposure owns (its exposure was deleted while
// no daemon ran) is deleted on the first pass and its host side flushed.
func TestPlanOrphanElementIsDeletedAndFlushed(t *testing.T) {
	old := refRules()
	obs := held(t, old)
	r := refRules()
	r.Exposures = r.Exposures[:1] // dns went while the daemon was down
	p, err := NewState().Plan(r, obs)
	require.NoError(t, err)
	assert.Equal(t, []string{"dns removed flush udp 0.0.0.0:5353", "web created"}, changesOf(p), "an orphan of exp-any is an IPv4 wildcard")
}

func TestPlanCapChangeRecreatesSetAndRewritesChainButKeepsFlows(t *testing.T) {
	r := refRules()
	s := applied(t, r)
	r.Exposures[0].MaxConns = 5
	p, err := s.Plan(r, nil)
	require.NoError(t, err)
	assert.Contains(t, opsOf[DelSet](p), DelSet{nftables.TableFamilyINet, "conns-web"})
	adds := opsOf[AddSet](p)
	require.Len(t, adds, 1)
	assert.True(t, adds[0].Set.Stateful, "a recreated cap set is seeded from conntrack")
	assert.Equal(t, uint32(1), adds[0].Set.SeedID)
	assert.Contains(t, opsOf[FlushChain](p), FlushChain{nftables.TableFamilyINet, "cap-web"})
	assert.Equal(t, []string{"web changed"}, changesOf(p), "a new cap keeps where the flows go")
}

func TestPlanRetargetFlushesAndAMoveFlushesBothSides(t *testing.T) {
	r := refRules()
	s := applied(t, r)
	r.Exposures[0].GuestPort = 81
	r.Exposures[1].HostPort = 5354
	p, err := s.Plan(r, nil)
	require.NoError(t, err)
	assert.Equal(t, []string{"dns created flush udp *:5354", "dns removed flush udp *:5353", "web changed flush tcp *:8080"}, changesOf(p))
}

// With the cap outside the table (MarksOnly), a new cap is the slot's business: the table does not
// change and nothing is flushed.
func TestPlanMarksOnlyChangeOfCapAloneSendsNothing(t *testing.T) {
	r := refRules()
	r.Cap = MarksOnly{}
	s := applied(t, r)
	r.Exposures[0].MaxConns = 9
	p, err := s.Plan(r, nil)
	require.NoError(t, err)
	assert.True(t, p.Empty())
	assert.Equal(t, []string{"web changed"}, changesOf(p))
}

// A shared map whose digest is what the state applied is not read: the
// plan then covers the changed exposures' elements there. A map whose
// digest differs must be read before anything is planned.
func TestPlanTrustsAnUnreadMapOnlyWhenItsDigestMatches(t *testing.T) {
	r := refRules()
	s := applied(t, r)
	obs := held(t, r)
	unread := obs.Inet.Sets[MapExpAny]
	unread.Elems = nil
	r.Exposures = append(r.Exposures, ssh())
	p, err := s.Plan(r, obs)
	require.NoError(t, err)
	assert.Equal(t, 1, elemCount(opsOf[AddElems](p), MapExpAny))
	assert.Equal(t, []string{"ssh created"}, changesOf(p))

	unread.Digest = unread.Digest.Plus(Digest{1, 42})
	_, err = s.Plan(r, obs)
	assert.ErrorContains(t, err, "set "+MapExpAny)
}

func TestDigestFollowsCommits(t *testing.T) {
	r := refRules()
	s := applied(t, r)
	assert.Equal(t, held(t, r).Inet.Sets[MapExpAny].Digest, s.Digest(MapExpAny))
	p, err := s.PlanUpdate(nil, []Exposure{ssh()}, []string{"dns"}, nil)
	require.NoError(t, err)
	s.Commit(p)
	r.Exposures = append(r.Exposures[:1], ssh())
	assert.Equal(t, held(t, r).Inet.Sets[MapExpAny].Digest, s.Digest(MapExpAny))
	assert.Equal(t, 2, s.Digest(MapExpAny).Count)
}

// A first apply's Commit keeps the same whether its part was prepared
// ahead (while the kernel took the batch) or not; a later plan has nothing
// to prepare.
func TestPreparedCommitKeepsWhatCommitKeeps(t *testing.T) {
	r := refRules()
	r.Exposures = append(r.Exposures, ssh())
	plain := applied(t, r)
	prep := NewState()
	p, err := prep.Plan(r, empty())
	require.NoError(t, err)
	p.PrepareCommit()
	require.NotNil(t, p.next.kept)
	prep.Commit(p)
	whole := held(t, r).Inet
	for _, set := range []string{MapExpAny, MapExpTarget, MapExpBytesOrig} {
		assert.Equal(t, whole.Sets[set].Digest, prep.Digest(set), set)
		assert.Equal(t, plain.Digest(set), prep.Digest(set), set)
		assert.Positive(t, prep.Digest(set).Count, set)
	}
	for _, e := range r.Exposures {
		got, ok := prep.Exposure(e.Name)
		assert.True(t, ok, e.Name)
		assert.Equal(t, e, got)
	}
	p, err = prep.PlanUpdate(nil, []Exposure{{Name: "dns2", Protocol: "udp", HostPort: 5354, GuestAddr: netip.MustParseAddr("10.213.0.12"), GuestPort: 53, MarkID: 9}}, nil, nil)
	require.NoError(t, err)
	p.PrepareCommit()
	assert.Nil(t, p.next.kept, "not a first apply")
	prep.Commit(p)
	_, ok := prep.Exposure("dns2")
	assert.True(t, ok)
	_, ok = prep.Exposure("web")
	assert.True(t, ok, "the first apply's exposures stay")
}

// The replacement creates the target whole, after deleting both tables,
// and carries counter values.
func TestReplacementDeletesAndCreatesWhole(t *testing.T) {
	r := refRules()
	s := applied(t, r)
	r.Exposures = append(r.Exposures, ssh())
	p, err := s.Plan(r, nil)
	require.NoError(t, err)
	ops := p.Replacement(Counts{Named: map[string]CounterValue{"web-refused": {Packets: 7, Bytes: 700}}})
	require.GreaterOrEqual(t, len(ops), 4)
	assert.Equal(t, []Op{AddTable{nftables.TableFamilyINet}, AddTable{nftables.TableFamilyBridge},
		DelTable{nftables.TableFamilyINet}, DelTable{nftables.TableFamilyBridge}}, ops[:4])
	var web CounterValue
	for _, o := range ops {
		if c, ok := o.(AddCounter); ok && c.Name == "web-refused" {
			web = c.Value
		}
	}
	assert.Equal(t, CounterValue{7, 700}, web)
	assert.Equal(t, 3, elemCount(opsOfList[AddElems](ops), MapExpAny))
}

func opsOfList[T Op](ops []Op) []T { return opsOf[T](&Plan{Ops: ops}) }

func TestLoopbackExposureGetsNoRules(t *testing.T) {
	r := refRules()
	r.Exposures = append(r.Exposures, Exposure{Name: "lo", Protocol: "tcp", HostAddr: netip.MustParseAddr("127.0.0.1"), HostPort: 1,
		GuestAddr: netip.MustParseAddr("10.213.0.11"), GuestPort: 1})
	inet, _, err := Whole(r)
	require.NoError(t, err)
	for _, s := range inet.Sets {
		for _, e := range s.Elems {
			assert.NotEqual(t, "lo", e.Owner)
		}
	}
	p, err := NewState().Plan(r, empty())
	require.NoError(t, err)
	assert.Contains(t, changesOf(p), "lo created", "known to the state, not published, not flushed")
}

// Any input either plans or is refused with an error: the compiler never
// panics, whatever reaches it.
func FuzzPlan(f *testing.F) {
	f.Add("web", "tcp", uint16(8080), uint16(0), uint16(80), false, false, 3, "10.213.0.11", uint32(5))
	f.Add("", "udp", uint16(0), uint16(0), uint16(0), false, false, -1, "::1", uint32(0))
	f.Add("games", "tcp", uint16(30000), uint16(30099), uint16(30000), true, false, 3, "10.213.0.11", uint32(5))
	f.Add("games", "udp", uint16(30000), uint16(29999), uint16(30000), true, true, 3, "10.213.0.11", uint32(5))
	f.Fuzz(func(t *testing.T, name, proto string, hp, last, gp uint16, keep, marksOnly bool, max int, guest string, mark uint32) {
		r := refRules()
		if marksOnly {
			r.Cap = MarksOnly{}
		}
		ga, _ := netip.ParseAddr(guest)
		r.Exposures = append(r.Exposures, Exposure{Name: name, Protocol: proto, HostPort: hp, HostPortLast: last, GuestPort: gp, GuestPortLast: map[bool]uint16{true: gp + (last - hp)}[keep],
			MaxConns: max, GuestAddr: ga, MarkID: mark})
		s := applied(t, refRules())
		if p, err := s.Plan(r, nil); err == nil && marksOnly {
			// What plans renders (the golden files' printer takes every
			// element the builder makes).
			inet, _, err := Whole(r)
			require.NoError(t, err)
			_, err = Render(inet)
			require.NoError(t, err)
			_ = p
		}
		_, _ = s.PlanUpdate(nil, r.Exposures[2:], nil, nil)
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

// The Go side of a first 10,000-exposure Converge: the whole table planned
// against an empty kernel.
func BenchmarkPlanWhole10000(b *testing.B) {
	r := refRules()
	r.Exposures = nil
	for i := 0; i < 10000; i++ {
		r.Exposures = append(r.Exposures, Exposure{Name: fmt.Sprintf("x%d", i), Protocol: "tcp", HostPort: uint16(20000 + i),
			GuestAddr: netip.MustParseAddr("10.213.0.11"), GuestPort: 7000, MarkID: uint32(i + 1)})
	}
	b.ReportAllocs()
	for b.Loop() {
		if _, err := NewState().Plan(r, empty()); err != nil {
			b.Fatal(err)
		}
	}
}

// An exposure published for IPv6 callers alone flushes its host side when
// it is retargeted or removed, as an IPv4 one does (its elements are in
// the IPv6 maps).
func TestPlanIPv6OnlyExposureRetargetAndRemovalFlush(t *testing.T) {
	r := refRules()
	r.Cap = MarksOnly{}
	r.Subnet6 = netip.MustParsePrefix("fd00:6272:6b72::1/64")
	v6 := Exposure{Name: "v6", Protocol: "udp", HostAddr: netip.IPv6Unspecified(), HostPort: 5300,
		GuestAddr6: netip.MustParseAddr("fd00:6272:6b72::c8"), GuestPort: 53, MarkID: 77}
	r.Exposures = append(r.Exposures, v6)
	s := applied(t, r)
	r.Exposures[len(r.Exposures)-1].GuestAddr6 = netip.MustParseAddr("fd00:6272:6b72::c9")
	p, err := s.Plan(r, nil)
	require.NoError(t, err)
	assert.Equal(t, []string{"v6 changed flush udp [::]:5300"}, changesOf(p), "retargeted")
	s = applied(t, r)
	r.Exposures = r.Exposures[:len(r.Exposures)-1]
	p, err = s.Plan(r, nil)
	require.NoError(t, err)
	assert.Equal(t, []string{"v6 removed flush udp [::]:5300"}, changesOf(p), "removed")
}

// A shared map created with many elements is declared at its full size (its
// hash table allocated once), one created with a few is not (4 MiB of kernel
// memory each); the interval maps never are. Either size is the same map to
// a later plan: a new process that finds the big map sized repairs nothing.
func TestPlanSizesTheSharedMapsCreatedBig(t *testing.T) {
	sizes := func(p *Plan) map[string]uint32 {
		m := map[string]uint32{}
		for _, a := range opsOf[AddSet](p) {
			if a.Set.PerExposure {
				m[a.Set.Name] = a.Set.Size
			}
		}
		return m
	}
	small := refRules()
	small.Cap = MarksOnly{}
	p, err := NewState().Plan(small, empty())
	require.NoError(t, err)
	for name, size := range sizes(p) {
		assert.Zero(t, size, "%s created with a few elements", name)
	}

	big := small
	big.Exposures = nil
	for i := range bigMapElems {
		big.Exposures = append(big.Exposures, Exposure{Name: fmt.Sprintf("x%d", i), Protocol: "tcp", HostPort: uint16(10000 + i),
			GuestAddr: netip.MustParseAddr("10.213.0.11"), GuestPort: 80, MarkID: uint32(i + 1)})
	}
	p, err = NewState().Plan(big, empty())
	require.NoError(t, err)
	got := sizes(p)
	assert.Equal(t, uint32(bigMapSize), got[MapExpAny], "exp-any: one element per exposure")
	assert.Equal(t, uint32(bigMapSize), got[MapExpTarget])
	for _, name := range []string{MapExpAddr, MapExpAnyRange, MapExpAddrRange, MapExpTargetPort} {
		assert.Zero(t, got[name], "%s: empty, an interval map or one per port", name)
	}

	obs := held(t, big)
	for name, size := range got {
		obs.Inet.Sets[name].Shape.Size = size // as the kernel lists it
	}
	p, err = NewState().Plan(big, obs)
	require.NoError(t, err)
	assert.True(t, p.Empty(), "a declared size is no drift")
	assert.Empty(t, p.Repairs)
	obs.Inet.Sets[MapExpAny].Shape.Size = 1000 // someone else's size
	p, err = NewState().Plan(big, obs)
	require.NoError(t, err)
	assert.Equal(t, []DelSet{{nftables.TableFamilyINet, MapExpAny}}, opsOf[DelSet](p), "another size is: the map is made again")
}

// A capped exposure new to a state the kernel holds exactly gets its cap set
// created fresh (nothing to seed from conntrack); a cap set made again for
// an exposure the kernel has (its cap changed), or any planned against what
// a new process read from the kernel, is seeded.
func TestCapSetOfANewExposureIsFresh(t *testing.T) {
	fresh := func(p *Plan) map[string]bool {
		m := map[string]bool{}
		for _, a := range opsOf[AddSet](p) {
			if a.Set.Stateful {
				m[a.Set.Name] = a.Fresh
			}
		}
		return m
	}
	r := refRules()
	s := applied(t, r)
	capped := ssh()
	capped.MaxConns = 4
	p, err := s.PlanUpdate(nil, []Exposure{capped}, nil, nil)
	require.NoError(t, err)
	assert.Equal(t, map[string]bool{ConnsSet("ssh"): true}, fresh(p), "new to the state: nothing can be in it")
	s.Commit(p)

	capped.MaxConns = 5
	p, err = s.PlanUpdate(nil, []Exposure{capped}, nil, nil)
	require.NoError(t, err)
	assert.Equal(t, map[string]bool{ConnsSet("ssh"): false}, fresh(p), "made again: seeded with what is open")

	p, err = NewState().Plan(r, empty())
	require.NoError(t, err)
	assert.Equal(t, map[string]bool{ConnsSet("web"): false}, fresh(p), "a new process seeds what it creates")
}

// A UDP exposure added to a running table flushes its host side (a flow
// made before its element would keep off the guest), a TCP one does not,
// on the incremental path as on a first apply.
func TestPlanUpdateOfANewUDPExposureFlushesItsHostSide(t *testing.T) {
	s := applied(t, refRules())
	dns2 := Exposure{Name: "dns2", Protocol: "udp", HostPort: 5354, GuestAddr: netip.MustParseAddr("10.213.0.12"), GuestPort: 53, MarkID: 7}
	p, err := s.PlanUpdate(nil, []Exposure{dns2, ssh()}, nil, nil)
	require.NoError(t, err)
	assert.Equal(t, []string{"dns2 created flush udp *:5354", "ssh created"}, changesOf(p))
}
