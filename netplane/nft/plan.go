package nft

import (
	"encoding/hex"
	"fmt"
	"sort"
	"strings"

	"github.com/google/nftables"
	"github.com/google/nftables/expr"
)

// observed is what the kernel has in one of brokkr's tables.
type observed struct {
	exists   bool
	chains   map[string]*obsChain
	sets     map[string]*obsSet
	counters map[string]bool
}

type obsChain struct {
	hook  *hookSpec
	rules []string // rule fingerprints in order ("" for a rule brokkr did not write)
}

type obsSet struct {
	shape setShape
	elems map[string]elemSpec // nil when not read (stateful sets)
}

// setShape is what a set is, apart from its elements.
type setShape struct {
	keyType, keyLen, dataType uint32
	isMap, dynamic            bool
	size                      uint32
}

const verdictDataType = 0xffffff00 // NFT_DATA_VERDICT, how the kernel stores a vmap's data type

func (s *setSpec) shapeOf() setShape {
	sh := setShape{keyType: s.key.GetNFTMagic(), keyLen: s.key.Bytes, isMap: s.isMap, dynamic: s.dynamic, size: s.size}
	if s.isMap {
		sh.dataType = s.data.GetNFTMagic()
		if s.data.Name == nftables.TypeVerdict.Name {
			sh.dataType = verdictDataType
		}
	}
	return sh
}

func emptyObserved() *observed {
	return &observed{chains: map[string]*obsChain{}, sets: map[string]*obsSet{}, counters: map[string]bool{}}
}

// observedFrom is what the kernel would hold after t was applied exactly.
func observedFrom(t *tableSpec) *observed {
	o := emptyObserved()
	o.exists = true
	for n, c := range t.chains {
		oc := &obsChain{hook: c.hook}
		for _, r := range c.rules {
			oc.rules = append(oc.rules, r.fp)
		}
		o.chains[n] = oc
	}
	for n, s := range t.sets {
		os := &obsSet{shape: s.shapeOf()}
		if !s.stateful {
			os.elems = make(map[string]elemSpec, len(s.elems))
			for k, e := range s.elems {
				os.elems[k] = e
			}
		}
		o.sets[n] = os
	}
	for n := range t.counters {
		o.counters[n] = true
	}
	return o
}

// plan is the difference between desired and observed for one table, in the
// order one netlink batch must apply it.
type plan struct {
	family      nftables.TableFamily
	addTable    bool
	delElems    map[string][]elemSpec // by set
	flushChains []string              // rewritten: flushed, then every rule added again
	delChains   []string
	delSets     []string
	delCounters []string
	addCounters []string
	addSets     []*setSpec // created empty; elements follow in addElems / seeding
	addChains   []*chainSpec
	addRules    []*chainSpec          // chains whose rules are (re)added, in full
	addElems    map[string][]elemSpec // by set
	seed        []*setSpec            // stateful sets created: fill from conntrack
	diffs       []diff
}

// diff is one difference found, described for the report.
type diff struct {
	object string // e.g. "chain exp-web", "element exp-any[web]"
	what   string // missing | unexpected | differs
}

func (d diff) String() string { return d.object + " " + d.what }

func (p *plan) empty() bool { return len(p.diffs) == 0 }

// makePlan compares desired with observed. It is pure: no kernel involved.
func makePlan(d *tableSpec, o *observed) *plan {
	p := &plan{family: d.family, delElems: map[string][]elemSpec{}, addElems: map[string][]elemSpec{}}
	note := func(object, what string) { p.diffs = append(p.diffs, diff{object, what}) }
	if !o.exists {
		p.addTable = true
		note("table "+familyName(d.family)+" "+TableName, "missing")
		o = emptyObserved()
	}

	// Sets: a set of another shape is deleted and created again, and every
	// chain that references it is rewritten.
	recreated := map[string]bool{}
	for _, n := range sortedKeys(d.sets) {
		s := d.sets[n]
		os, ok := o.sets[n]
		switch {
		case !ok:
			note("set "+n, "missing")
		case os.shape != s.shapeOf():
			note("set "+n, "differs")
			p.delSets = append(p.delSets, n)
		default:
			continue
		}
		recreated[n] = true
		p.addSets = append(p.addSets, s)
		if s.stateful {
			p.seed = append(p.seed, s)
		}
		for _, k := range sortedKeys(s.elems) {
			p.addElems[n] = append(p.addElems[n], s.elems[k])
		}
	}
	for _, n := range sortedKeys(o.sets) {
		if _, ok := d.sets[n]; !ok {
			note("set "+n, "unexpected")
			p.delSets = append(p.delSets, n)
		}
	}
	// Elements of sets that stay.
	for _, n := range sortedKeys(d.sets) {
		s := d.sets[n]
		if recreated[n] || s.stateful {
			continue
		}
		os := o.sets[n]
		for _, k := range sortedKeys(os.elems) {
			if de, ok := s.elems[k]; !ok || !de.same(os.elems[k]) {
				note(fmt.Sprintf("element %s[%s]", n, elemLabel(os.elems[k], de)), map[bool]string{true: "differs", false: "unexpected"}[ok])
				p.delElems[n] = append(p.delElems[n], os.elems[k])
			}
		}
		for _, k := range sortedKeys(s.elems) {
			oe, ok := os.elems[k]
			if !ok || !oe.same(s.elems[k]) {
				if !ok {
					note(fmt.Sprintf("element %s[%s]", n, s.elems[k].comment), "missing")
				}
				p.addElems[n] = append(p.addElems[n], s.elems[k])
			}
		}
	}

	// Counters.
	for _, n := range sortedKeys(d.counters) {
		if !o.counters[n] {
			note("counter "+n, "missing")
			p.addCounters = append(p.addCounters, n)
		}
	}
	for _, n := range sortedKeys(o.counters) {
		if _, ok := d.counters[n]; !ok {
			note("counter "+n, "unexpected")
			p.delCounters = append(p.delCounters, n)
		}
	}

	// Chains.
	for _, n := range sortedKeys(d.chains) {
		c := d.chains[n]
		oc, ok := o.chains[n]
		switch {
		case !ok:
			note("chain "+n, "missing")
			p.addChains = append(p.addChains, c)
			p.addRules = append(p.addRules, c)
		case !c.hook.same(oc.hook):
			note("chain "+n, "differs")
			p.delChains = append(p.delChains, n)
			p.addChains = append(p.addChains, c)
			p.addRules = append(p.addRules, c)
		case !sameRules(c, oc) || referencesAny(c, recreated):
			if !sameRules(c, oc) {
				note("rules of chain "+n, "differ")
			}
			p.flushChains = append(p.flushChains, n)
			p.addRules = append(p.addRules, c)
		}
	}
	for _, n := range sortedKeys(o.chains) {
		if _, ok := d.chains[n]; !ok {
			note("chain "+n, "unexpected")
			p.delChains = append(p.delChains, n)
		}
	}
	return p
}

func elemLabel(o, d elemSpec) string {
	if o.comment != "" {
		return o.comment
	}
	if d.comment != "" {
		return d.comment
	}
	return fmt.Sprintf("%x", o.key)
}

func sameRules(c *chainSpec, oc *obsChain) bool {
	if len(c.rules) != len(oc.rules) {
		return false
	}
	for i, r := range c.rules {
		if r.fp != oc.rules[i] {
			return false
		}
	}
	return true
}

func referencesAny(c *chainSpec, sets map[string]bool) bool {
	if len(sets) == 0 {
		return false
	}
	for _, r := range c.rules {
		for _, e := range r.exprs {
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
func fingerprints(t *tableSpec) map[string]string {
	if t == nil {
		return nil
	}
	fp := map[string]string{"table " + familyName(t.family) + " " + TableName: "x"}
	// Built without fmt for the per-exposure objects: at 10,000 exposures
	// this runs over 30,000 of them.
	for n, c := range t.chains {
		var b strings.Builder
		if c.hook == nil {
			b.WriteString("<nil>")
		} else {
			b.WriteString(fmt.Sprint(c.hook))
		}
		for _, r := range c.rules {
			b.WriteString(r.fp)
		}
		s := b.String()
		fp["chain "+n] = s
		fp["rules of chain "+n] = s
	}
	for n, s := range t.sets {
		fp["set "+n] = fmt.Sprint(s.shapeOf())
		for _, e := range s.elems {
			fp["element "+n+"["+e.comment+"]"] = hex.EncodeToString(e.key) + "/" + hex.EncodeToString(e.val) + "/" + e.verdict
		}
	}
	for n := range t.counters {
		fp["counter "+n] = "x"
	}
	return fp
}

// split sorts the diffs of p into repairs (drift: desired unchanged since
// prev) and changes.
func split(p *plan, prev, cur map[string]string) (repaired, changed []string) {
	for _, d := range p.diffs {
		if prev != nil && prev[d.object] == cur[d.object] {
			repaired = append(repaired, d.String())
		} else {
			changed = append(changed, d.String())
		}
	}
	sort.Strings(repaired)
	sort.Strings(changed)
	return repaired, changed
}
