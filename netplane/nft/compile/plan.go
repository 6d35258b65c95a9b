package compile

import (
	"fmt"
	"maps"
	"slices"

	"github.com/google/nftables"
	"github.com/google/nftables/expr"

	"github.com/brokkr/brokkr/internal/spec"
)

// Observed is what the kernel has in one of brokkr's tables.
type Observed struct {
	Exists   bool
	Chains   map[string]*ObsChain
	Sets     map[string]*ObsSet
	Counters map[string]bool
}

type ObsChain struct {
	Hook  *HookSpec
	Rules []string // rule fingerprints in order ("" for a rule brokkr did not write)
}

type ObsSet struct {
	Shape SetShape
	// Trusted: not read, because the kernel's change notifications show
	// that nobody but brokkr touched its elements since the last batch.
	Trusted bool
	// Digest of the elements, when read (stateful sets: zero, never read).
	Digest Digest
	// Elems, by string(key): nil unless read (a set whose digest differs
	// from what brokkr applied, or one of the fixed part's small sets).
	Elems map[string]ElemSpec
}

// SetShape is what a set is, apart from its elements.
type SetShape struct {
	KeyType, KeyLen, DataType uint32
	IsMap, Dynamic, Counter   bool
	Interval                  bool
	Size                      uint32
}

const verdictDataType = 0xffffff00 // NFT_DATA_VERDICT, how the kernel stores a vmap's data type

// A shared map created holding at least bigMapElems elements is declared
// with size bigMapSize (spec.MaxExposures: at most one element per
// exposure). Declared, its hash table is allocated once at that size
// instead of being grown and rehashed while a first apply inserts 100,000
// elements (about 0.1 s of the kernel's share of that insert, BENCHMARKS.md
// "Converge of 100,000 exposures"); but it then takes 4 MiB of kernel
// memory per map whatever it holds, which a host with a few exposures
// should not pay (eight maps). Created small, a map grows as it fills. Both
// are the same map to brokkr: a declared size is no drift.
const (
	bigMapElems = 1 << 14
	bigMapSize  = spec.MaxExposures
)

// sizable: a shared map that may be declared with bigMapSize. Interval
// maps take no size hint, and the per-port maps of shifted ranges hold an
// element per port, not per exposure.
func (s *SetSpec) sizable() bool {
	return s.PerExposure && !s.Interval && s.Size == 0 && s.Name != MapExpTargetPort && s.Name != MapExpTargetPort6
}

// sized is s as created with n elements.
func (s *SetSpec) sized(n int) *SetSpec {
	if n < bigMapElems || !s.sizable() {
		return s
	}
	c := *s
	c.Size = bigMapSize
	return &c
}

// sameShape reports whether a set of shape sh is s (apart from the size a
// sizable map may have been created with).
func (s *SetSpec) sameShape(sh SetShape) bool {
	if sh.Size == bigMapSize && s.sizable() {
		sh.Size = 0
	}
	return sh == s.Shape()
}

func (s *SetSpec) Shape() SetShape {
	sh := SetShape{KeyType: s.Key.GetNFTMagic(), KeyLen: s.Key.Bytes, IsMap: s.IsMap, Dynamic: s.Dynamic, Counter: s.Counter,
		Interval: s.Interval, Size: s.Size}
	if s.IsMap {
		sh.DataType = s.Data.GetNFTMagic()
		if s.Data.Name == nftables.TypeVerdict.Name {
			sh.DataType = verdictDataType
		}
	}
	return sh
}

// EmptyObserved is a table that does not exist.
func EmptyObserved() *Observed {
	return &Observed{Chains: map[string]*ObsChain{}, Sets: map[string]*ObsSet{}, Counters: map[string]bool{}}
}

// ObservedFrom is what the kernel would hold after t was applied exactly.
func ObservedFrom(t *TableSpec) *Observed {
	o := EmptyObserved()
	o.Exists = true
	for n, c := range t.Chains {
		oc := &ObsChain{Hook: c.Hook}
		for _, r := range c.Rules {
			oc.Rules = append(oc.Rules, r.Fp)
		}
		o.Chains[n] = oc
	}
	for n, s := range t.Sets {
		os := &ObsSet{Shape: s.Shape()}
		if !s.Stateful {
			os.Elems = make(map[string]ElemSpec, len(s.Elems))
			for k, e := range s.Elems {
				e.Owner = "" // the kernel keeps no owners
				os.Elems[k] = e
			}
			os.Digest = DigestOf(s.Elems)
		}
		o.Sets[n] = os
	}
	for n := range t.Counters {
		o.Counters[n] = true
	}
	return o
}

// delta is the difference between a desired table and an observed one,
// sorted into the buckets one netlink batch applies in order. It has a
// field per bucket (16) on purpose: ops emits the batch in the order of
// these fields (the table, element deletions, chain flushes and deletions, set and
// counter deletions, then counters, sets, chains, rules and elements added),
// and folding them into one list of operations would move that order into
// a sort the reader has to trust instead of see.
type delta struct {
	fam         nftables.TableFamily
	addTable    bool
	delElems    map[string][]ElemSpec // by set
	flushChains []string              // rewritten: flushed, then every rule added again
	delChains   []string
	delSets     []string
	delCounters []string
	addCounters []string
	addSets     []*SetSpec // created empty; elements follow in addElems / seeding
	addChains   []*ChainSpec
	addRules    []*ChainSpec          // chains whose rules are (re)added, in full
	addElems    map[string][]ElemSpec // by set
	shapes      map[string]*SetSpec   // the desired sets elements are added to
	diffs       []diff
	missingSets []string        // sets the kernel does not have at all (their elements are not noted one by one)
	fresh       map[string]bool // cap sets created for exposures new to the kernel (AddSet.Fresh)
}

func newDelta(f nftables.TableFamily) *delta {
	return &delta{fam: f, delElems: map[string][]ElemSpec{}, addElems: map[string][]ElemSpec{}, shapes: map[string]*SetSpec{},
		fresh: map[string]bool{}}
}

// objKind is the kind of object a difference is about.
type objKind uint8

const (
	objTable objKind = iota
	objChain
	objRules
	objSet
	objElem
	objCounter
)

// diff is one difference found: an object of the desired table missing,
// unexpected or different in the observed one.
type diff struct {
	kind  objKind
	name  string // chain, set or counter; the set of an element
	key   string // an element's key
	what  string // missing | unexpected | differs
	label string // an element's name in the report: its comment, or its key
}

func (d diff) object(f nftables.TableFamily) string {
	switch d.kind {
	case objTable:
		return "table " + familyName(f) + " " + TableName
	case objChain:
		return "chain " + d.name
	case objRules:
		return "rules of chain " + d.name
	case objSet:
		return "set " + d.name
	case objElem:
		return "element " + d.name + "[" + d.label + "]"
	}
	return "counter " + d.name
}

func (d diff) whatText() string {
	if d.kind == objRules {
		return "differ"
	}
	return d.what
}

func (p *delta) note(d diff) { p.diffs = append(p.diffs, d) }

// merge appends q's changes to p (deltas of disjoint objects: one per unit).
func (p *delta) merge(q *delta) {
	p.addTable = p.addTable || q.addTable
	p.flushChains = append(p.flushChains, q.flushChains...)
	p.delChains = append(p.delChains, q.delChains...)
	p.delSets = append(p.delSets, q.delSets...)
	p.delCounters = append(p.delCounters, q.delCounters...)
	p.addCounters = append(p.addCounters, q.addCounters...)
	p.addSets = append(p.addSets, q.addSets...)
	p.addChains = append(p.addChains, q.addChains...)
	p.addRules = append(p.addRules, q.addRules...)
	p.diffs = append(p.diffs, q.diffs...)
	p.missingSets = append(p.missingSets, q.missingSets...)
	for k, v := range q.delElems {
		p.delElems[k] = append(p.delElems[k], v...)
	}
	for k, v := range q.addElems {
		p.addElems[k] = append(p.addElems[k], v...)
	}
	maps.Copy(p.shapes, q.shapes)
	maps.Copy(p.fresh, q.fresh)
}

// ops is the delta as one batch's operations, in order.
func (p *delta) ops(counters map[string]CounterValue) []Op {
	f := p.fam
	var out []Op
	if p.addTable {
		out = append(out, AddTable{f})
	}
	for _, n := range slices.Sorted(maps.Keys(p.delElems)) {
		out = append(out, DelElems{f, n, p.delElems[n]})
	}
	// Rules go before what they reference: the chains rewritten and the
	// chains deleted are flushed first, then sets go (with their elements,
	// which may jump to chains), then chains.
	flushed := map[string]bool{}
	for _, n := range p.flushChains {
		flushed[n] = true
		out = append(out, FlushChain{f, n})
	}
	for _, n := range p.delChains {
		if !flushed[n] {
			out = append(out, FlushChain{f, n})
		}
	}
	for _, n := range p.delSets {
		out = append(out, DelSet{f, n})
	}
	for _, n := range p.delChains {
		out = append(out, DelChain{f, n})
	}
	for _, n := range p.delCounters {
		out = append(out, DelCounter{f, n})
	}
	for _, n := range p.addCounters {
		out = append(out, AddCounter{f, n, counters[n]})
	}
	for _, s := range p.addSets {
		out = append(out, AddSet{f, s.sized(len(p.addElems[s.Name])), p.fresh[s.Name]})
	}
	for _, c := range p.addChains {
		out = append(out, AddChain{f, c})
	}
	for _, c := range p.addRules {
		out = append(out, AddRules{f, c})
	}
	for _, n := range slices.Sorted(maps.Keys(p.addElems)) {
		out = append(out, AddElems{f, p.shapes[n], p.addElems[n]})
	}
	return out
}

// makeDelta compares desired with observed. It is pure: no kernel involved.
// An observed set's elements are compared only when they were read (Elems
// non-nil); sets whose elements were not read are taken to hold what
// skipElems says brokkr applied, and their elements are left to the caller.
func makeDelta(d *TableSpec, o *Observed, skipElems func(set string) bool) *delta {
	p := newDelta(d.Family)
	if !o.Exists {
		p.addTable = true
		p.note(diff{kind: objTable, what: "missing"})
		o = EmptyObserved()
	}

	// Sets: a set of another shape is deleted and created again, and every
	// chain that references it is rewritten.
	recreated := map[string]bool{}
	for _, n := range sortedKeys(d.Sets) {
		s := d.Sets[n]
		os, ok := o.Sets[n]
		switch {
		case !ok:
			p.note(diff{kind: objSet, name: n, what: "missing"})
			p.missingSets = append(p.missingSets, n)
		case !s.sameShape(os.Shape):
			p.note(diff{kind: objSet, name: n, what: "differs"})
			p.delSets = append(p.delSets, n)
		default:
			continue
		}
		recreated[n] = true
		p.addSets = append(p.addSets, s)
		if len(s.Elems) > 0 {
			// A set created again holds its elements in a new form (an
			// upgrade); a missing set's elements are the set's own
			// difference. Neither is noted element by element.
			p.shapes[n] = s
			es := make([]ElemSpec, 0, len(s.Elems))
			for _, k := range keysOf(s.Elems) {
				es = append(es, s.Elems[k])
			}
			p.addElems[n] = es
		}
	}
	for _, n := range sortedKeys(o.Sets) {
		if _, ok := d.Sets[n]; !ok {
			p.note(diff{kind: objSet, name: n, what: "unexpected"})
			p.delSets = append(p.delSets, n)
		}
	}
	// Elements of sets that stay.
	for _, n := range sortedKeys(d.Sets) {
		s := d.Sets[n]
		if recreated[n] || s.Stateful || skipElems != nil && skipElems(n) {
			continue
		}
		p.diffElems(s, o.Sets[n].Elems)
	}

	// Counters.
	for _, n := range sortedKeys(d.Counters) {
		if !o.Counters[n] {
			p.note(diff{kind: objCounter, name: n, what: "missing"})
			p.addCounters = append(p.addCounters, n)
		}
	}
	for _, n := range sortedKeys(o.Counters) {
		if _, ok := d.Counters[n]; !ok {
			p.note(diff{kind: objCounter, name: n, what: "unexpected"})
			p.delCounters = append(p.delCounters, n)
		}
	}

	// Chains.
	for _, n := range sortedKeys(d.Chains) {
		c := d.Chains[n]
		oc, ok := o.Chains[n]
		switch {
		case !ok:
			p.note(diff{kind: objChain, name: n, what: "missing"})
			p.addChains = append(p.addChains, c)
			p.addRules = append(p.addRules, c)
		case !c.Hook.Same(oc.Hook):
			p.note(diff{kind: objChain, name: n, what: "differs"})
			p.delChains = append(p.delChains, n)
			p.addChains = append(p.addChains, c)
			p.addRules = append(p.addRules, c)
		case !sameRules(c, oc) || referencesAny(c, recreated):
			if !sameRules(c, oc) {
				p.note(diff{kind: objRules, name: n, what: "differ"})
			}
			p.flushChains = append(p.flushChains, n)
			p.addRules = append(p.addRules, c)
		}
	}
	for _, n := range sortedKeys(o.Chains) {
		if _, ok := d.Chains[n]; !ok {
			p.note(diff{kind: objChain, name: n, what: "unexpected"})
			p.delChains = append(p.delChains, n)
		}
	}
	return p
}

// diffElems plans the elements of set s (desired) against have (what the
// kernel holds): an element missing or different is added, one unexpected
// or different deleted first.
func (p *delta) diffElems(s *SetSpec, have map[string]ElemSpec) {
	n := s.Name
	for _, k := range keysOf(have) {
		if de, ok := s.Elems[k]; !ok || !de.Same(have[k]) {
			what := "unexpected"
			if ok {
				what = "differs"
			}
			p.note(diff{kind: objElem, name: n, key: k, what: what, label: elemLabel(have[k], de)})
			p.delElems[n] = append(p.delElems[n], have[k])
		}
	}
	for _, k := range keysOf(s.Elems) {
		oe, ok := have[k]
		if !ok || !oe.Same(s.Elems[k]) {
			if !ok {
				p.note(diff{kind: objElem, name: n, key: k, what: "missing", label: elemLabel(s.Elems[k], ElemSpec{})})
			}
			p.shapes[n] = s
			p.addElems[n] = append(p.addElems[n], s.Elems[k])
		}
	}
}

// keysOf is m's keys, sorted while that is cheap (a deterministic batch
// for the fixed part and the tests); a map of a 100,000 exposures' elements
// is taken in map order: the order of elements in a batch means nothing.
func keysOf[V any](m map[string]V) []string {
	if len(m) <= 4096 {
		return sortedKeys(m)
	}
	ks := make([]string, 0, len(m))
	for k := range m {
		ks = append(ks, k)
	}
	return ks
}

func elemLabel(o, d ElemSpec) string {
	if o.Comment != "" {
		return o.Comment
	}
	if d.Comment != "" {
		return d.Comment
	}
	return fmt.Sprintf("%x", o.Key)
}

func sameRules(c *ChainSpec, oc *ObsChain) bool {
	if len(c.Rules) != len(oc.Rules) {
		return false
	}
	for i, r := range c.Rules {
		if r.Fp != oc.Rules[i] {
			return false
		}
	}
	return true
}

func referencesAny(c *ChainSpec, sets map[string]bool) bool {
	if len(sets) == 0 {
		return false
	}
	for _, r := range c.Rules {
		for _, e := range r.Exprs {
			switch x := e.(type) {
			case *expr.Lookup:
				if sets[x.SetName] {
					return true
				}
			case *expr.Dynset:
				if sets[x.SetName] {
					return true
				}
			}
		}
	}
	return false
}

func familyName(f nftables.TableFamily) string {
	switch f {
	case nftables.TableFamilyINet:
		return "inet"
	case nftables.TableFamilyBridge:
		return "bridge"
	}
	return fmt.Sprint(f)
}

// sameObject reports whether the object of d is defined the same in a and
// b (both whole tables; nil is a table that does not exist): a difference
// on such an object is drift, not a change of the desired state.
func sameObject(a, b *TableSpec, d diff) bool {
	if a == nil || b == nil {
		return a == b
	}
	switch d.kind {
	case objTable:
		return true
	case objChain, objRules:
		ca, oka := a.Chains[d.name]
		cb, okb := b.Chains[d.name]
		if !oka || !okb {
			return oka == okb
		}
		return ca.Hook.Same(cb.Hook) && sameRules(ca, &ObsChain{Rules: fps(cb)})
	case objSet:
		sa, oka := a.Sets[d.name]
		sb, okb := b.Sets[d.name]
		if !oka || !okb {
			return oka == okb
		}
		return sa.Shape() == sb.Shape()
	case objElem:
		ea, oka := elemOf(a, d.name, d.key)
		eb, okb := elemOf(b, d.name, d.key)
		if !oka || !okb {
			return oka == okb
		}
		return ea.Same(eb) && ea.Comment == eb.Comment
	}
	_, oka := a.Counters[d.name]
	_, okb := b.Counters[d.name]
	return oka == okb
}

func elemOf(t *TableSpec, set, key string) (ElemSpec, bool) {
	s, ok := t.Sets[set]
	if !ok {
		return ElemSpec{}, false
	}
	e, ok := s.Elems[key]
	return e, ok
}

func fps(c *ChainSpec) []string {
	out := make([]string, len(c.Rules))
	for i, r := range c.Rules {
		out[i] = r.Fp
	}
	return out
}
