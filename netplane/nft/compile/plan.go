package compile

import (
	"encoding/hex"
	"fmt"
	"sort"
	"strings"

	"github.com/google/nftables"
	"github.com/google/nftables/expr"
)

// observed is what the kernel has in one of brokkr's tables.
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
	Elems map[string]ElemSpec // nil when not read (stateful sets)
}

// SetShape is what a set is, apart from its elements.
type SetShape struct {
	KeyType, KeyLen, DataType uint32
	IsMap, Dynamic            bool
	Size                      uint32
}

const verdictDataType = 0xffffff00 // NFT_DATA_VERDICT, how the kernel stores a vmap's data type

func (s *SetSpec) Shape() SetShape {
	sh := SetShape{KeyType: s.Key.GetNFTMagic(), KeyLen: s.Key.Bytes, IsMap: s.IsMap, Dynamic: s.Dynamic, Size: s.Size}
	if s.IsMap {
		sh.DataType = s.Data.GetNFTMagic()
		if s.Data.Name == nftables.TypeVerdict.Name {
			sh.DataType = verdictDataType
		}
	}
	return sh
}

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
				os.Elems[k] = e
			}
		}
		o.Sets[n] = os
	}
	for n := range t.Counters {
		o.Counters[n] = true
	}
	return o
}

// plan is the difference between desired and observed for one table, in the
// order one netlink batch must apply it.
type Plan struct {
	Family      nftables.TableFamily
	AddTable    bool
	DelElems    map[string][]ElemSpec // by set
	FlushChains []string              // rewritten: flushed, then every rule added again
	DelChains   []string
	DelSets     []string
	DelCounters []string
	AddCounters []string
	AddSets     []*SetSpec // created empty; elements follow in addElems / seeding
	AddChains   []*ChainSpec
	AddRules    []*ChainSpec          // chains whose rules are (re)added, in full
	AddElems    map[string][]ElemSpec // by set
	Seed        []*SetSpec            // stateful sets created: fill from conntrack
	Diffs       []Diff
}

// diff is one difference found, described for the report.
type Diff struct {
	Object string // e.g. "chain exp-web", "element exp-any[web]"
	What   string // missing | unexpected | differs
}

func (d Diff) String() string { return d.Object + " " + d.What }

// Merge appends q's changes to p (plans of disjoint objects: one per unit).
func (p *Plan) Merge(q *Plan) {
	p.FlushChains = append(p.FlushChains, q.FlushChains...)
	p.DelChains = append(p.DelChains, q.DelChains...)
	p.DelSets = append(p.DelSets, q.DelSets...)
	p.DelCounters = append(p.DelCounters, q.DelCounters...)
	p.AddCounters = append(p.AddCounters, q.AddCounters...)
	p.AddSets = append(p.AddSets, q.AddSets...)
	p.AddChains = append(p.AddChains, q.AddChains...)
	p.AddRules = append(p.AddRules, q.AddRules...)
	p.Seed = append(p.Seed, q.Seed...)
	p.Diffs = append(p.Diffs, q.Diffs...)
	for k, v := range q.DelElems {
		p.DelElems[k] = append(p.DelElems[k], v...)
	}
	for k, v := range q.AddElems {
		p.AddElems[k] = append(p.AddElems[k], v...)
	}
}

// NewPlan is a plan that changes nothing yet.
func NewPlan(f nftables.TableFamily) *Plan {
	return &Plan{Family: f, DelElems: map[string][]ElemSpec{}, AddElems: map[string][]ElemSpec{}}
}

func (p *Plan) Empty() bool { return len(p.Diffs) == 0 }

// MakePlan compares desired with observed. It is pure: no kernel involved.
func MakePlan(d *TableSpec, o *Observed) *Plan {
	p := NewPlan(d.Family)
	note := func(object, what string) { p.Diffs = append(p.Diffs, Diff{object, what}) }
	if !o.Exists {
		p.AddTable = true
		note("table "+familyName(d.Family)+" "+TableName, "missing")
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
			note("set "+n, "missing")
		case os.Shape != s.Shape():
			note("set "+n, "differs")
			p.DelSets = append(p.DelSets, n)
		default:
			continue
		}
		recreated[n] = true
		p.AddSets = append(p.AddSets, s)
		if s.Stateful {
			p.Seed = append(p.Seed, s)
		}
		for _, k := range sortedKeys(s.Elems) {
			p.AddElems[n] = append(p.AddElems[n], s.Elems[k])
		}
	}
	for _, n := range sortedKeys(o.Sets) {
		if _, ok := d.Sets[n]; !ok {
			note("set "+n, "unexpected")
			p.DelSets = append(p.DelSets, n)
		}
	}
	// Elements of sets that stay.
	for _, n := range sortedKeys(d.Sets) {
		s := d.Sets[n]
		if recreated[n] || s.Stateful {
			continue
		}
		os := o.Sets[n]
		for _, k := range sortedKeys(os.Elems) {
			if de, ok := s.Elems[k]; !ok || !de.Same(os.Elems[k]) {
				note(fmt.Sprintf("element %s[%s]", n, elemLabel(os.Elems[k], de)), map[bool]string{true: "differs", false: "unexpected"}[ok])
				p.DelElems[n] = append(p.DelElems[n], os.Elems[k])
			}
		}
		for _, k := range sortedKeys(s.Elems) {
			oe, ok := os.Elems[k]
			if !ok || !oe.Same(s.Elems[k]) {
				if !ok {
					note(fmt.Sprintf("element %s[%s]", n, s.Elems[k].Comment), "missing")
				}
				p.AddElems[n] = append(p.AddElems[n], s.Elems[k])
			}
		}
	}

	// Counters.
	for _, n := range sortedKeys(d.Counters) {
		if !o.Counters[n] {
			note("counter "+n, "missing")
			p.AddCounters = append(p.AddCounters, n)
		}
	}
	for _, n := range sortedKeys(o.Counters) {
		if _, ok := d.Counters[n]; !ok {
			note("counter "+n, "unexpected")
			p.DelCounters = append(p.DelCounters, n)
		}
	}

	// Chains.
	for _, n := range sortedKeys(d.Chains) {
		c := d.Chains[n]
		oc, ok := o.Chains[n]
		switch {
		case !ok:
			note("chain "+n, "missing")
			p.AddChains = append(p.AddChains, c)
			p.AddRules = append(p.AddRules, c)
		case !c.Hook.Same(oc.Hook):
			note("chain "+n, "differs")
			p.DelChains = append(p.DelChains, n)
			p.AddChains = append(p.AddChains, c)
			p.AddRules = append(p.AddRules, c)
		case !sameRules(c, oc) || referencesAny(c, recreated):
			if !sameRules(c, oc) {
				note("rules of chain "+n, "differ")
			}
			p.FlushChains = append(p.FlushChains, n)
			p.AddRules = append(p.AddRules, c)
		}
	}
	for _, n := range sortedKeys(o.Chains) {
		if _, ok := d.Chains[n]; !ok {
			note("chain "+n, "unexpected")
			p.DelChains = append(p.DelChains, n)
		}
	}
	return p
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

// fingerprints of every object of a desired table, to tell a repaired drift
// (the object did not change between two desired states but the kernel
// differed) from an intended change.
func Fingerprints(t *TableSpec) map[string]string {
	if t == nil {
		return nil
	}
	fp := map[string]string{"table " + familyName(t.Family) + " " + TableName: "x"}
	// Built without fmt for the per-exposure objects: at 10,000 exposures
	// this runs over 30,000 of them.
	for n, c := range t.Chains {
		var b strings.Builder
		if c.Hook == nil {
			b.WriteString("<nil>")
		} else {
			b.WriteString(fmt.Sprint(c.Hook))
		}
		for _, r := range c.Rules {
			b.WriteString(r.Fp)
		}
		s := b.String()
		fp["chain "+n] = s
		fp["rules of chain "+n] = s
	}
	for n, s := range t.Sets {
		fp["set "+n] = fmt.Sprint(s.Shape())
		for _, e := range s.Elems {
			fp["element "+n+"["+e.Comment+"]"] = hex.EncodeToString(e.Key) + "/" + hex.EncodeToString(e.Val) + "/" + e.Verdict
		}
	}
	for n := range t.Counters {
		fp["counter "+n] = "x"
	}
	return fp
}

// split sorts the diffs of p into repairs (drift: desired unchanged since
// prev) and changes.
func Split(p *Plan, prev, cur map[string]string) (repaired, changed []string) {
	for _, d := range p.Diffs {
		if prev != nil && prev[d.Object] == cur[d.Object] {
			repaired = append(repaired, d.String())
		} else {
			changed = append(changed, d.String())
		}
	}
	sort.Strings(repaired)
	sort.Strings(changed)
	return repaired, changed
}
