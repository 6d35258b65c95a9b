package nft

import (
	"fmt"
	"maps"
	"sync"

	"github.com/brokkr/brokkr/netplane/nft/compile"
	"github.com/google/nftables"
	"github.com/google/nftables/expr"
	"golang.org/x/sys/unix"
)

// fakeKernel is an in-process kernel for the tests of Converge's
// decisions: it holds both tables as objects, applies a batch all or
// nothing with the checks the kernel makes that a wrong order of
// operations would trip (a chain or set still referenced, an object that
// is missing or already there with other data), counts commits in a
// generation, and records what it was asked to observe, apply and flush.
// It is for tests only: the netlink kernel is tested against the kernel.
type fakeKernel struct {
	mu      sync.Mutex
	tabs    map[nftables.TableFamily]*fakeTable
	gen     uint32
	batches [][]compile.Op
	flushes [][]compile.HostSide
	// flushGate, when set, makes each flush wait for it to close; events
	// lists the kernel calls that change something, in order.
	flushGate chan struct{}
	events    []string
	decoded   []string // sets whose elements observe decoded
	reads     int      // observe calls
	// failApply, when set, is asked about each batch: an error fails it
	// (nothing applied).
	failApply func(ops []compile.Op) error
	// truncate keeps only the first elements of a large AddElems, as the
	// kernel did with google/nftables' oversized lists.
	truncate bool
	// news is what the change notifications hold for the next drain; deaf:
	// they are not listened to (or were lost).
	news foreignChanges
	deaf bool
}

type fakeTable struct {
	chains   map[string]*fakeChain
	sets     map[string]*fakeSet
	counters map[string]compile.CounterValue
}

type fakeChain struct {
	hook  *compile.HookSpec
	rules []compile.RuleSpec
}

type fakeSet struct {
	spec  compile.SetSpec
	elems map[string]compile.ElemSpec
}

func newFakeKernel() *fakeKernel {
	return &fakeKernel{tabs: map[nftables.TableFamily]*fakeTable{}, news: foreignChanges{sets: map[string]bool{}}}
}

func (t *fakeTable) clone() *fakeTable {
	c := &fakeTable{chains: map[string]*fakeChain{}, sets: map[string]*fakeSet{}, counters: maps.Clone(t.counters)}
	for n, ch := range t.chains {
		cc := *ch
		cc.rules = append([]compile.RuleSpec(nil), ch.rules...)
		c.chains[n] = &cc
	}
	for n, s := range t.sets {
		c.sets[n] = &fakeSet{spec: s.spec, elems: maps.Clone(s.elems)}
	}
	return c
}

func (k *fakeKernel) generation() (uint32, error) {
	k.mu.Lock()
	defer k.mu.Unlock()
	return k.gen, nil
}

// edit changes brokkr's tables as another program would, in a commit of its
// own; the notifications say so (elems: only those sets' elements changed).
func (k *fakeKernel) edit(fam nftables.TableFamily, fn func(t *fakeTable), elems ...string) {
	k.mu.Lock()
	defer k.mu.Unlock()
	if t := k.tabs[fam]; t != nil {
		fn(t)
	}
	k.gen++
	if len(elems) == 0 {
		k.news.other = true
	}
	for _, s := range elems {
		k.news.sets[s] = true
	}
}

// elsewhere is another program's commit to a table of its own.
func (k *fakeKernel) elsewhere() {
	k.mu.Lock()
	defer k.mu.Unlock()
	k.gen++
}

func (k *fakeKernel) foreign() (foreignChanges, error) {
	k.mu.Lock()
	defer k.mu.Unlock()
	f := k.news
	f.lost = f.lost || k.deaf
	k.news = foreignChanges{sets: map[string]bool{}}
	return f, nil
}

func (k *fakeKernel) observe(fam nftables.TableFamily, trusted func(string) bool, read func(string, compile.Digest) bool) (*compile.Observed, error) {
	k.mu.Lock()
	defer k.mu.Unlock()
	k.reads++
	o := compile.EmptyObserved()
	t := k.tabs[fam]
	if t == nil {
		return o, nil
	}
	o.Exists = true
	for n, c := range t.chains {
		oc := &compile.ObsChain{Hook: c.hook}
		for _, r := range c.rules {
			oc.Rules = append(oc.Rules, r.Fp)
		}
		o.Chains[n] = oc
	}
	for n, s := range t.sets {
		os := &compile.ObsSet{Shape: s.spec.Shape()}
		if trusted(n) {
			os.Trusted = true
		} else if !s.spec.Dynamic {
			os.Digest = compile.DigestOf(s.elems)
			if read(n, os.Digest) {
				k.decoded = append(k.decoded, n)
				os.Elems = map[string]compile.ElemSpec{}
				for key, e := range s.elems {
					e.Owner, e.Counter = "", compile.CounterValue{} // the kernel knows no owners; counts are read apart
					os.Elems[key] = e
				}
			}
		}
		o.Sets[n] = os
	}
	for n := range t.counters {
		o.Counters[n] = true
	}
	return o, nil
}

func (k *fakeKernel) digest(fam nftables.TableFamily, set string) (compile.Digest, error) {
	k.mu.Lock()
	defer k.mu.Unlock()
	t := k.tabs[fam]
	if t == nil || t.sets[set] == nil {
		return compile.Digest{}, unix.ENOENT
	}
	return compile.DigestOf(t.sets[set].elems), nil
}

func (k *fakeKernel) lookup(fam nftables.TableFamily, set string, keys [][]byte) (map[string]compile.ElemSpec, error) {
	k.mu.Lock()
	defer k.mu.Unlock()
	t := k.tabs[fam]
	if t == nil || t.sets[set] == nil {
		return nil, unix.ENOENT
	}
	out := map[string]compile.ElemSpec{}
	for _, key := range keys {
		e, ok := t.sets[set].elems[string(key)]
		if !ok {
			return nil, unix.ENOENT
		}
		out[string(key)] = e
	}
	return out, nil
}

func (k *fakeKernel) counts(sets []string) (compile.Counts, error) {
	k.mu.Lock()
	defer k.mu.Unlock()
	c := compile.Counts{Named: map[string]compile.CounterValue{}, Elems: map[string]map[string]compile.CounterValue{}}
	if t := k.tabs[famInet]; t != nil {
		c.Named = maps.Clone(t.counters)
		for _, n := range sets {
			if s := t.sets[n]; s != nil {
				c.Elems[n] = map[string]compile.CounterValue{}
				for key, e := range s.elems {
					c.Elems[n][key] = e.Counter
				}
			}
		}
	}
	return c, nil
}

func (k *fakeKernel) flush(sides []compile.HostSide) ([]int, error) {
	k.mu.Lock()
	gate := k.flushGate
	k.mu.Unlock()
	if gate != nil {
		<-gate
	}
	k.mu.Lock()
	defer k.mu.Unlock()
	k.events = append(k.events, "flush")
	k.flushes = append(k.flushes, append([]compile.HostSide(nil), sides...))
	return make([]int, len(sides)), nil
}

func (k *fakeKernel) close() error { return nil }

func (k *fakeKernel) apply(ops []compile.Op) error {
	k.mu.Lock()
	defer k.mu.Unlock()
	k.batches = append(k.batches, ops)
	k.events = append(k.events, "apply")
	if k.failApply != nil {
		if err := k.failApply(ops); err != nil {
			return err
		}
	}
	tabs := map[nftables.TableFamily]*fakeTable{}
	for f, t := range k.tabs {
		tabs[f] = t.clone()
	}
	for i, o := range ops {
		if err := fakeApply(tabs, o, k.truncate); err != nil {
			return fmt.Errorf("op %d %T: %w", i, o, err)
		}
	}
	k.tabs = tabs
	k.gen++
	return nil
}

func fakeApply(tabs map[nftables.TableFamily]*fakeTable, o compile.Op, truncate bool) error {
	f := o.Family()
	if _, ok := o.(compile.AddTable); ok {
		if tabs[f] == nil {
			tabs[f] = &fakeTable{chains: map[string]*fakeChain{}, sets: map[string]*fakeSet{}, counters: map[string]compile.CounterValue{}}
		}
		return nil
	}
	t := tabs[f]
	if t == nil {
		return unix.ENOENT
	}
	switch x := o.(type) {
	case compile.DelTable:
		delete(tabs, f)
	case compile.DelElems:
		s := t.sets[x.Set]
		if s == nil {
			return unix.ENOENT
		}
		for _, e := range x.Elems {
			if _, ok := s.elems[string(e.Key)]; !ok {
				return unix.ENOENT
			}
			delete(s.elems, string(e.Key))
		}
	case compile.FlushChain:
		c := t.chains[x.Chain]
		if c == nil {
			return unix.ENOENT
		}
		c.rules = nil
	case compile.DelChain:
		if t.chains[x.Chain] == nil {
			return unix.ENOENT
		}
		if t.refersToChain(x.Chain) {
			return unix.EBUSY
		}
		delete(t.chains, x.Chain)
	case compile.DelSet:
		if t.sets[x.Set] == nil {
			return unix.ENOENT
		}
		if t.refersToSet(x.Set) {
			return unix.EBUSY
		}
		delete(t.sets, x.Set)
	case compile.DelCounter:
		if _, ok := t.counters[x.Name]; !ok {
			return unix.ENOENT
		}
		delete(t.counters, x.Name)
	case compile.AddCounter:
		if _, ok := t.counters[x.Name]; !ok {
			t.counters[x.Name] = x.Value
		}
	case compile.AddSet:
		if s, ok := t.sets[x.Set.Name]; ok {
			if s.spec.Shape() != x.Set.Shape() {
				return unix.EEXIST
			}
			return nil
		}
		t.sets[x.Set.Name] = &fakeSet{spec: *x.Set, elems: map[string]compile.ElemSpec{}}
	case compile.AddChain:
		if _, ok := t.chains[x.Chain.Name]; !ok {
			t.chains[x.Chain.Name] = &fakeChain{hook: x.Chain.Hook}
		}
	case compile.AddRules:
		c := t.chains[x.Chain.Name]
		if c == nil {
			return unix.ENOENT
		}
		for _, r := range x.Chain.Rules {
			for _, e := range r.Exprs {
				if err := t.resolves(e); err != nil {
					return err
				}
			}
			c.rules = append(c.rules, r)
		}
	case compile.AddElems:
		s := t.sets[x.Set.Name]
		if s == nil {
			return unix.ENOENT
		}
		es := x.Elems
		if truncate && len(es) >= verifyMin {
			es = es[:len(es)/3]
		}
		for _, e := range es {
			if e.Verdict != "" && t.chains[e.Verdict] == nil {
				return unix.ENOENT
			}
			if have, ok := s.elems[string(e.Key)]; ok && !have.Same(e) {
				return unix.EEXIST
			}
			s.elems[string(e.Key)] = e
		}
	default:
		return fmt.Errorf("operation %T", o)
	}
	return nil
}

// resolves checks that what a rule's expression names exists.
func (t *fakeTable) resolves(e expr.Any) error {
	switch x := e.(type) {
	case *expr.Lookup:
		if t.sets[x.SetName] == nil {
			return unix.ENOENT
		}
	case *expr.Dynset:
		if t.sets[x.SetName] == nil {
			return unix.ENOENT
		}
	case *expr.Objref:
		if _, ok := t.counters[x.Name]; !ok {
			return unix.ENOENT
		}
	case *expr.Verdict:
		if x.Chain != "" && t.chains[x.Chain] == nil {
			return unix.ENOENT
		}
	}
	return nil
}

func (t *fakeTable) refersToChain(name string) bool {
	for _, c := range t.chains {
		for _, r := range c.rules {
			for _, e := range r.Exprs {
				if v, ok := e.(*expr.Verdict); ok && v.Chain == name {
					return true
				}
			}
		}
	}
	for _, s := range t.sets {
		for _, e := range s.elems {
			if e.Verdict == name {
				return true
			}
		}
	}
	return false
}

func (t *fakeTable) refersToSet(name string) bool {
	for _, c := range t.chains {
		for _, r := range c.rules {
			for _, e := range r.Exprs {
				switch x := e.(type) {
				case *expr.Lookup:
					if x.SetName == name {
						return true
					}
				case *expr.Dynset:
					if x.SetName == name {
						return true
					}
				}
			}
		}
	}
	return false
}

// spec is what the fake holds, as whole tables (for comparing with what
// the compiler builds).
func (k *fakeKernel) spec(fam nftables.TableFamily) *compile.Observed {
	o, _ := k.observe(fam, func(string) bool { return false }, func(string, compile.Digest) bool { return true })
	k.mu.Lock()
	defer k.mu.Unlock()
	k.reads--
	return o
}
