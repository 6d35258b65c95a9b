package config

import (
	"fmt"
	"math/rand/v2"
	"reflect"
	"testing"

	"github.com/brokkr/brokkr/internal/spec"
)

// randomExposure draws from a small space, so that names, host sides and
// targets meet often, and every check has values on both sides of it.
func randomExposure(r *rand.Rand) Exposure {
	// Each field is mostly one of a few valid values (which meet each
	// other), now and then an invalid one.
	pick := func(valid []string, invalid ...string) string {
		if len(invalid) > 0 && r.IntN(12) == 0 {
			return invalid[r.IntN(len(invalid))]
		}
		return valid[r.IntN(len(valid))]
	}
	pickInt := func(valid []int, invalid ...int) int {
		if len(invalid) > 0 && r.IntN(12) == 0 {
			return invalid[r.IntN(len(invalid))]
		}
		return valid[r.IntN(len(valid))]
	}
	s := func(xs ...string) []string { return xs }
	n := func(xs ...int) []int { return xs }
	mc := pickInt(n(0, 0, 5), -1, spec.MaxConnsLimit+1)
	e := Exposure{
		Name:        pick(s("a", "b", "c", "d", "e", "f", "g", "h", "i", "j", "k", "l"), "", "-bad"),
		Protocol:    pick(s("tcp", "tcp", "udp"), "sctp"),
		GuestPort:   P(pickInt(n(80, 22), 0, 65536)),
		HostPort:    P(pickInt(n(8080, 8081, 8082, 8083, 53, 54), 0, 70000)),
		HostAddress: pick(s("0.0.0.0", "127.0.0.1", "192.0.2.7", "192.0.2.8", "::1", "::", "2001:db8::1"), "224.0.0.1", "nope", "fe80::1%eth0"),
		Mode:        pick(s("auto", "auto", "nat", "proxy"), "bogus"),
		MaxConns:    &mc,
	}
	switch r.IntN(6) {
	case 0:
		e.Target = pick(s("10.213.0.9", "10.213.0.10"), "10.213.0.1", "10.213.0.255", "10.9.0.1", "x")
	case 1:
		if r.IntN(4) == 0 {
			e.VM, e.Target = "web", "10.213.0.9"
		} else {
			e.VM = "ghost"
		}
	default:
		e.VM = pick(s("web", "db"))
	}
	// Ranges that meet the single ports and each other (and now and then
	// one that is not valid), with a guest port for all or the same range.
	if r.IntN(4) == 0 {
		ranges := []Port{Range(8080, 8082), Range(8082, 8083), Range(50, 60), Range(8083, 8083), Range(7000, 7000+spec.MaxPortRange-1)}
		e.HostPort = ranges[r.IntN(len(ranges))]
		switch r.IntN(12) {
		case 0:
			e.HostPort = Range(8083, 8080)
		case 1:
			e.HostPort = Range(1, spec.MaxPortRange+1)
		}
		switch r.IntN(4) {
		case 0:
			e.GuestPort = e.HostPort
		case 1:
			e.GuestPort = Range(e.HostPort.First+1, e.HostPort.Last+1) // shifted (or past 65535: refused)
		}
	}
	if r.IntN(6) == 0 {
		e.ProxyProtocol = pick(s("v1", "v2"), "v3")
	}
	return e
}

// The shortcut never drifts from Compile: on many random changes (puts of
// random exposures, removals) of a desired state that compiles, Check
// accepts exactly what Compile of the whole changed state accepts, with the
// same model of the exposure, and a removal always compiles. Each accepted
// change is made on both, so the index is compared as it is kept up to
// date, not only as built.
func TestLiveExposuresAgreeWithCompile(t *testing.T) {
	accepted, refused := 0, 0
	for seed := uint64(0); seed < 40; seed++ {
		r := rand.New(rand.NewPCG(seed, 22))
		c, err := Parse([]byte("vms: [{name: web, kernel: /k}, {name: db, kernel: /k}]\n"))
		if err != nil {
			t.Fatal(err)
		}
		model, errs := Compile(c)
		if len(errs) > 0 {
			t.Fatal(errs)
		}
		live := NewLiveExposures(c, model)
		for step := 0; step < 300; step++ {
			if len(c.Exposures) > 0 && r.IntN(4) == 0 {
				name := c.Exposures[r.IntN(len(c.Exposures))].Name
				next, _ := c.WithoutExposure(name)
				m, errs := Compile(next)
				if len(errs) > 0 {
					t.Fatalf("seed %d step %d: removing %q from a valid state does not compile: %v", seed, step, name, errs)
				}
				live.Remove(name)
				c, model = next, m
				continue
			}
			e := randomExposure(r)
			next, pos, _ := c.WithExposure(e)
			m, errs := Compile(next)
			me, ok := live.Check(e)
			if ok != (len(errs) == 0) {
				t.Fatalf("seed %d step %d: put %+v: Check says %v, Compile says %v\nstate: %+v", seed, step, e, ok, errs, c.Exposures)
			}
			if !ok {
				refused++
				continue
			}
			accepted++
			if !reflect.DeepEqual(me, m.Exposures[pos]) {
				t.Fatalf("seed %d step %d: Check's model %+v, Compile's %+v", seed, step, me, m.Exposures[pos])
			}
			live.Put(e, me)
			c, model = next, m
		}
		// The index as kept equals the index built from the state now.
		fresh := NewLiveExposures(c, model)
		if live.Len() != fresh.Len() || fmt.Sprint(live.ix.binds) != fmt.Sprint(sortedBinds(fresh, live)) {
			t.Fatalf("seed %d: the kept index differs from a fresh one:\n%v\n%v", seed, live.ix.binds, fresh.ix.binds)
		}
	}
	t.Logf("%d changes accepted, %d refused", accepted, refused)
	if accepted < 500 || refused < 500 {
		t.Fatalf("the random changes are one-sided: %d accepted, %d refused", accepted, refused)
	}
}

// sortedBinds is fresh's binds in the order live keeps them (a replaced
// exposure's binds move to the end of their list), positions aside.
func sortedBinds(fresh, live *LiveExposures) map[portKey][]hostBind {
	out := map[portKey][]hostBind{}
	for k, bs := range live.ix.binds {
		for _, b := range bs {
			for _, f := range fresh.ix.binds[k] {
				if f.name == b.name && f.addr == b.addr {
					f.pos = b.pos
					out[k] = append(out[k], f)
				}
			}
		}
	}
	return out
}

// At the host's limit a new exposure is refused, by both, and a replaced
// one is not.
func TestLiveExposuresCapacity(t *testing.T) {
	if testing.Short() {
		t.Skip("compiles a state of spec.MaxExposures exposures")
	}
	c, err := Parse([]byte("vms: [{name: web, kernel: /k}]\n"))
	if err != nil {
		t.Fatal(err)
	}
	zero := 0
	for i := 0; i < spec.MaxExposures; i++ {
		c.Exposures = append(c.Exposures, Exposure{Name: fmt.Sprint("e", i), VM: "web", Protocol: "tcp", GuestPort: P(80),
			HostPort: P(1 + i%60000), HostAddress: fmt.Sprintf("192.0.2.%d", 1+i/60000), Mode: "nat", MaxConns: &zero})
	}
	model, errs := Compile(c)
	if len(errs) > 0 {
		t.Fatal(errs[:1])
	}
	live := NewLiveExposures(c, model)
	more := Exposure{Name: "more", VM: "web", Protocol: "tcp", GuestPort: P(80), HostPort: P(7), HostAddress: "192.0.2.9", Mode: "nat", MaxConns: &zero}
	next, _, _ := c.WithExposure(more)
	_, errs = Compile(next)
	if _, ok := live.Check(more); ok || len(errs) == 0 {
		t.Fatalf("one more than the limit: Check %v, Compile %v", ok, errs)
	}
	again := c.Exposures[5]
	again.GuestPort = P(81)
	next, _, _ = c.WithExposure(again)
	_, errs = Compile(next)
	if _, ok := live.Check(again); !ok || len(errs) > 0 {
		t.Fatalf("a replacement at the limit: Check %v, Compile %v", ok, errs)
	}
}

// The allowFrom total counts each desired exposure's prefixes once: checks
// that are not put count nothing, a replacement counts its new list, not
// both, and a removal gives its prefixes back; the existing state's
// prefixes are counted from the start.
func TestLiveExposuresCountAllowFromOnce(t *testing.T) {
	c, model, err := Load([]byte("exposures: [{name: a, target: 10.213.0.9, guestPort: 1, hostPort: 1, allowFrom: [192.0.2.0/24, 198.51.100.0/24]}]"))
	if err != nil {
		t.Fatal(err)
	}
	live := NewLiveExposures(c, model)
	if live.ix.allowTotal != 2 {
		t.Fatalf("the existing state's prefixes: %d, want 2", live.ix.allowTotal)
	}
	b := c.Exposures[0]
	b.Name, b.HostPort = "b", P(2)
	for range 1000 {
		if _, ok := live.Check(b); !ok {
			t.Fatal("refused")
		}
	}
	if live.ix.allowTotal != 2 {
		t.Fatalf("after 1,000 checks: %d, want 2", live.ix.allowTotal)
	}
	me, _ := live.Check(b)
	live.Put(b, me)
	a := c.Exposures[0]
	a.AllowFrom = []string{"203.0.113.0/24"}
	me, _ = live.Check(a)
	live.Put(a, me)
	if live.ix.allowTotal != 3 {
		t.Fatalf("b's 2 and a's new 1: %d, want 3", live.ix.allowTotal)
	}
	live.Remove("b")
	if live.ix.allowTotal != 1 {
		t.Fatalf("after b's removal: %d, want 1", live.ix.allowTotal)
	}
}
