package compile

import (
	"errors"
	"fmt"
	"maps"
	"net/netip"
	"sort"
	"strconv"

	"github.com/google/nftables"
)

// HostSide is where an exposure is published: its protocol, host address
// (invalid: every local address) and host port. Conntrack entries of a
// host side are flushed when what is published there changes.
type HostSide struct {
	Proto    uint8
	Addr     netip.Addr
	Port     uint16
	PortLast uint16 // the last port of a range (Port the first); 0: one port
}

// HostSide of e: its host address as given (the invalid one for every
// address of both families, a family's unspecified one for every address
// of that family).
func (e Exposure) HostSide() HostSide {
	h := HostSide{ProtoNum(e.Protocol), e.HostAddr, e.HostPort, 0}
	if e.IsRange() {
		h.PortLast = e.HostPortLast
	}
	return h
}

// clashes are the host sides another exposure may not have beside e's:
// e's own, and where e is a wildcard, the wildcards it overlaps (the same
// element of exp-any or exp-any6).
func (h HostSide) clashes() []HostSide {
	any4, any6 := h, h
	any4.Addr, any6.Addr = netip.IPv4Unspecified(), netip.IPv6Unspecified()
	both := h
	both.Addr = netip.Addr{}
	switch {
	case !h.Addr.IsValid():
		return []HostSide{h, any4, any6}
	case h.Addr.IsUnspecified():
		return []HostSide{h, both}
	}
	return []HostSide{h}
}

func (h HostSide) String() string {
	a := "*"
	if h.Addr.IsValid() {
		a = h.Addr.String()
	}
	if h.Addr.Is6() {
		a = "[" + a + "]"
	}
	port := strconv.Itoa(int(h.Port))
	if h.PortLast > h.Port {
		port += "-" + strconv.Itoa(int(h.PortLast))
	}
	return protoName(h.Proto) + " " + a + ":" + port
}

// ChangeKind is what happened to an exposure.
type ChangeKind uint8

const (
	Created ChangeKind = iota + 1
	Changed
	Removed
)

func (k ChangeKind) String() string {
	switch k {
	case Created:
		return "created"
	case Changed:
		return "changed"
	case Removed:
		return "removed"
	}
	return "kind " + strconv.Itoa(int(k))
}

// Change is one exposure created, changed or removed by a plan. An
// exposure that moves to another host side is two changes: removed where it
// was, created where it is.
type Change struct {
	Exposure Exposure // as it is now; as it was, for Removed
	Kind     ChangeKind
	HostSide HostSide // where it is (was) published
	// Flush: the plan changes what the kernel publishes at HostSide, so
	// the conntrack entries there must go (no flow keeps going where it
	// went before). False for a repair, which restores what the flows
	// already follow, and for a change of the cap alone.
	Flush bool
}

func (c Change) String() string {
	return fmt.Sprintf("exposure %s %s (%s)", c.Exposure.Name, c.Kind, c.HostSide)
}

// Repair is one object the kernel held differently from what brokkr had
// applied (drift), put back by the plan.
type Repair struct {
	Object string // "chain dispatch", "element exp-any[web]", "table inet brokkr"
	What   string // missing | unexpected | differs | differ
}

func (r Repair) String() string { return r.Object + " " + r.What }

// Observation is what the kernel holds in both tables. A nil Observation
// stands for "exactly what the state applied": the runtime passes nil when
// the ruleset generation shows that nobody committed since its last batch.
type Observation struct {
	Inet, Bridge *Observed
}

// Plan is one batch: its operations, the exposures it changes, the drift it
// repairs. Commit records it once the batch is in the kernel.
type Plan struct {
	Ops     []Op
	Changes []Change
	Repairs []Repair

	next planned
	repl func(Counts) []Op // the same target state, as a whole-table replace
}

// planned is what Commit records.
type planned struct {
	inet, bridge *TableSpec
	setBased     bool
	changed      map[string]*Exposure // nil: removed
	unitAt       []*unit              // the changed exposures' units, in the target's order (nil: removed)
	marks        map[uint32]string    // the changed exposures by mark
	sides        map[HostSide]string  // and by host side
	first        bool                 // planned against a state with no exposure
	kept         *firstKept           // what Commit keeps of a first apply (PrepareCommit), or nil
}

// firstKept is what a state keeps of a first apply: every exposure
// indexed, and the digest of the units' elements per shared map.
type firstKept struct {
	exps    appliedSet
	digests map[string]Digest
}

// PrepareCommit builds, ahead of Commit, what a first apply's Commit keeps
// (100,000 exposures indexed and their units' digests summed: tens of
// milliseconds), from the plan alone, so that it runs while the kernel
// takes the batch. Nothing else may use the plan until it returns; a plan
// that is not a first apply has nothing to prepare.
func (p *Plan) PrepareCommit() {
	if n := &p.next; n.first && n.kept == nil {
		n.kept = n.keep()
	}
}

func (n *planned) keep() *firstKept {
	k := &firstKept{exps: newAppliedSet(len(n.changed)), digests: map[string]Digest{}}
	for _, e := range n.changed {
		if e != nil {
			k.exps.put(*e)
		}
	}
	var sums digestSums
	for _, u := range n.unitAt {
		sums.add(u)
	}
	sums.addTo(k.digests)
	return k
}

// digestSums sums units' elements per shared set. The sets are a few: a
// slice looked through per element costs less than a map lookup per
// element of 100,000 units.
type digestSums []setDigest

type setDigest struct {
	set string
	d   Digest
}

func (ds *digestSums) add(u *unit) {
	if u == nil {
		return
	}
elems:
	for _, ue := range u.elems {
		for i := range *ds {
			if (*ds)[i].set == ue.set {
				(*ds)[i].d = (*ds)[i].d.add(ue.e)
				continue elems
			}
		}
		*ds = append(*ds, setDigest{ue.set, Digest{}.add(ue.e)})
	}
}

// addTo adds the sums into m.
func (ds digestSums) addTo(m map[string]Digest) {
	for _, s := range ds {
		m[s.set] = m[s.set].Plus(s.d)
	}
}

// Empty reports whether the plan has nothing to send.
func (p *Plan) Empty() bool { return len(p.Ops) == 0 }

// Replacement is the plan's target state as one batch that deletes both
// tables and creates them whole, for when the plan's batch failed. The
// counters that are created again start at what c says the kernel held.
func (p *Plan) Replacement(c Counts) []Op { return p.repl(c) }

// State is what brokkr applied to its tables, as the compiler built it: the
// fixed part of both tables and the exposures (each exposure's unit is
// built again from it when needed). Plan compares a wanted state with it
// (and with what the kernel holds, when the kernel may differ); Commit
// records a plan the kernel took. A State is not safe for concurrent use.
type State struct {
	inet, bridge *TableSpec // nil before the first Commit
	setBased     bool
	exps         appliedSet
	marks        map[uint32]string   // mark id → exposure
	sides        map[HostSide]string // host side → exposure
	unitDigests  map[string]Digest   // the units' elements, per shared set
}

// NewState is a state that has applied nothing.
func NewState() *State {
	return &State{exps: newAppliedSet(0), marks: map[uint32]string{}, sides: map[HostSide]string{}, unitDigests: map[string]Digest{}}
}

// Applied reports whether a plan was committed (the state knows the tables).
func (s *State) Applied() bool { return s.inet != nil }

// Exposure returns the applied exposure named name.
func (s *State) Exposure(name string) (Exposure, bool) {
	return s.exps.get(name)
}

// Digest is the digest of what the state applied to a set of the inet
// table (shared maps: the fixed part's elements and every unit's).
func (s *State) Digest(set string) Digest {
	d := Digest{}
	if s.inet != nil {
		if st, ok := s.inet.Sets[set]; ok {
			d = DigestOf(st.Elems)
		}
	}
	return d.Plus(s.unitDigests[set])
}

// want is a target state: the fixed parts, the exposures that differ from
// the state's (nil: removed), and every exposure of the target.
type want struct {
	inet, bridge *TableSpec
	setBased     bool
	changed      map[string]*Exposure
	order        []string            // the changed names, in a fixed order (the desired state's)
	expAt        []*Exposure         // the changed exposures (nil: removed), by position in order
	unitAt       []*unit             // the changed exposures' units, built once, by position in order
	nUnits       int                 // how many of unitAt are not nil
	units        map[string]*unit    // unitAt by name, made on first use (unitNamed): a first apply needs none
	marks        map[uint32]string   // the changed exposures by mark (check)
	sides        map[HostSide]string // and by host side
	all          func(yield func(Exposure) bool)
	n            int
}

// unitNamed is the unit of the changed exposure named name.
func (w *want) unitNamed(name string) (*unit, bool) {
	if w.units == nil {
		w.units = make(map[string]*unit, w.nUnits)
		for i, u := range w.unitAt {
			if u != nil {
				w.units[w.order[i]] = u
			}
		}
	}
	u, ok := w.units[name]
	return u, ok
}

// Plan compares the whole desired state r with the state (obs nil: the
// kernel holds exactly what the state applied) or with what the kernel was
// observed to hold. Input no table can express is an error naming the
// field, and nothing is planned.
func (s *State) Plan(r Rules, obs *Observation) (*Plan, error) {
	inet, bridge, err := buildFixed(r)
	if err != nil {
		return nil, err
	}
	// At least this many exposures are new to the state (all of them on a
	// first apply): the maps are made that big at once, not rehashed on
	// the way to 100,000.
	hint := max(0, len(r.Exposures)-s.exps.len())
	_, setBased := r.setBased()
	w := &want{inet: inet, bridge: bridge, setBased: setBased, changed: make(map[string]*Exposure, hint), n: len(r.Exposures)}
	rebuild := s.Applied() && setBased != s.setBased
	if s.exps.len() == 0 {
		// Every exposure is new: the changed ones are all of them.
		w.order, w.expAt = make([]string, 0, len(r.Exposures)), make([]*Exposure, 0, len(r.Exposures))
		for i := range r.Exposures {
			e := &r.Exposures[i]
			n := len(w.changed)
			if w.changed[e.Name] = e; len(w.changed) == n {
				return nil, fieldErr("exposures["+e.Name+"].name", "%q is there twice", e.Name)
			}
			w.order, w.expAt = append(w.order, e.Name), append(w.expAt, e)
		}
	} else {
		w.order, w.expAt = make([]string, 0, hint), make([]*Exposure, 0, hint)
		a := &s.exps
		a.pass++
		for i := range r.Exposures {
			e := &r.Exposures[i]
			if idx, ok := a.index[e.Name]; ok {
				if a.seen[idx] == a.pass {
					return nil, fieldErr("exposures["+e.Name+"].name", "%q is there twice", e.Name)
				}
				a.seen[idx] = a.pass
				if a.list[idx] == *e && !rebuild {
					continue
				}
			} else if _, twice := w.changed[e.Name]; twice {
				return nil, fieldErr("exposures["+e.Name+"].name", "%q is there twice", e.Name)
			}
			w.changed[e.Name] = e
			w.order, w.expAt = append(w.order, e.Name), append(w.expAt, e)
		}
		var gone []string
		for idx, used := range a.used {
			if used && a.seen[idx] != a.pass {
				n := a.list[idx].Name
				w.changed[n] = nil
				gone = append(gone, n)
			}
		}
		sort.Strings(gone)
		w.order = append(w.order, gone...)
		w.expAt = append(w.expAt, make([]*Exposure, len(gone))...)
	}
	w.all = func(yield func(Exposure) bool) {
		for _, e := range r.Exposures {
			if !yield(e) {
				return
			}
		}
	}
	return s.plan(w, obs)
}

// PlanUpdate is Plan for a change of some exposures only: set creates or
// replaces each of them, remove deletes them by name (a name that is not
// applied is ignored); every other exposure stays as applied, and so does
// the fixed part unless fixed gives it anew (its Exposures are ignored).
// With obs nil it costs O(len(set)+len(remove)).
func (s *State) PlanUpdate(fixed *Rules, set []Exposure, remove []string, obs *Observation) (*Plan, error) {
	if !s.Applied() {
		return nil, errors.New("no whole desired state applied yet")
	}
	w := &want{inet: s.inet, bridge: s.bridge, setBased: s.setBased, changed: map[string]*Exposure{}}
	if fixed != nil {
		var err error
		if w.inet, w.bridge, err = buildFixed(*fixed); err != nil {
			return nil, err
		}
		if _, setBased := fixed.setBased(); setBased != s.setBased {
			return nil, errors.New("the cap's mode changes only with the whole desired state")
		}
	}
	for _, n := range remove {
		if _, ok := s.exps.get(n); ok {
			if _, twice := w.changed[n]; !twice {
				w.order, w.expAt = append(w.order, n), append(w.expAt, nil)
			}
			w.changed[n] = nil
		}
	}
	for i := range set {
		e := &set[i]
		if _, ok := w.changed[e.Name]; ok {
			return nil, fieldErr("exposures["+e.Name+"].name", "%q is set or removed twice", e.Name)
		}
		if old, ok := s.exps.get(e.Name); !ok || old != *e {
			w.changed[e.Name] = e
			w.order, w.expAt = append(w.order, e.Name), append(w.expAt, e)
		}
	}
	w.n = s.exps.len()
	for n, e := range w.changed {
		if _, ok := s.exps.get(n); !ok && e != nil {
			w.n++
		} else if ok && e == nil {
			w.n--
		}
	}
	w.all = func(yield func(Exposure) bool) {
		more := true
		s.exps.each(func(e Exposure) bool {
			if _, ok := w.changed[e.Name]; ok {
				return true
			}
			more = yield(e)
			return more
		})
		if !more {
			return
		}
		for _, e := range w.changed {
			if e != nil && !yield(*e) {
				return
			}
		}
	}
	return s.plan(w, obs)
}

// check refuses exposures the tables cannot hold: each changed one must be
// buildable, and no two exposures of the target may share a mark id or a
// host side (the maps would keep one of them).
func (w *want) check(s *State) error {
	marks := make(map[uint32]string, len(w.changed))
	sides := make(map[HostSide]string, len(w.changed))
	w.marks, w.sides = marks, sides
	for i, n := range w.order {
		e := w.expAt[i]
		if e == nil || e.LoopbackOnly() {
			continue
		}
		if err := e.buildable(); err != nil {
			return err
		}
		owner := func(m map[uint32]string, s map[uint32]string, id uint32) (string, bool) {
			if o, ok := m[id]; ok {
				return o, true
			}
			if o, ok := s[id]; ok {
				if _, moved := w.changed[o]; !moved {
					return o, true
				}
			}
			return "", false
		}
		if o, ok := owner(marks, s.marks, e.MarkID); ok {
			return fieldErr("exposures["+n+"].markID", "%d is exposure %s's too", e.MarkID, o)
		}
		marks[e.MarkID] = n
		hs := e.HostSide()
		for _, c := range hs.clashes() {
			if o, ok := sides[c]; ok {
				return fieldErr("exposures["+n+"].hostPort", "%s is exposure %s's too", hs, o)
			}
			if o, ok := s.sides[c]; ok {
				if _, moved := w.changed[o]; !moved {
					return fieldErr("exposures["+n+"].hostPort", "%s is exposure %s's too", hs, o)
				}
			}
		}
		sides[hs] = n
	}
	return nil
}

func (s *State) plan(w *want, obs *Observation) (*Plan, error) {
	if err := w.check(s); err != nil {
		return nil, err
	}
	if obs == nil && !s.Applied() {
		return nil, errors.New("nothing applied yet: the kernel must be observed")
	}
	w.unitAt = make([]*unit, len(w.order))
	for i := range w.order {
		e := w.expAt[i]
		if e == nil {
			continue
		}
		u, err := unitOf(*e, w.setBased)
		if err != nil {
			return nil, err
		}
		w.unitAt[i] = u
		w.nUnits++
	}
	p := &Plan{next: planned{inet: w.inet, bridge: w.bridge, setBased: w.setBased, changed: w.changed,
		unitAt: w.unitAt, marks: w.marks, sides: w.sides, first: s.exps.len() == 0}}
	oldU := func(n string) *unit {
		e, ok := s.exps.get(n)
		if !ok {
			return nil
		}
		u, err := unitOf(e, s.setBased)
		if err != nil {
			return &unit{} // it was built once: cannot happen
		}
		return u
	}
	var dInet, dBridge *delta
	var touched map[string]bool // exposures whose routing elements the batch changes (nil: every changed one)
	if obs != nil && !obs.Inet.Exists {
		// No inet table at all (a first apply, a deleted table): create
		// it, with no whole-table diff (100,000 exposures in one batch).
		// Every changed exposure is published where nothing was; the
		// others, as applied before the table went, are repairs.
		dInet, touched = w.fromNothing(s), nil
		dBridge = makeDelta(w.bridge, obs.Bridge, nil)
		classify(p, dBridge, s.bridgeIfApplied(), w.bridge, map[string]bool{})
		if s.Applied() {
			p.Repairs = append([]Repair{{Object: "table inet " + TableName, What: "missing"}}, p.Repairs...)
		}
	} else if obs == nil && !sharesRecreated(w.inet, s.inet) {
		dInet, dBridge, touched = w.fastDeltas(s, oldU)
	} else {
		if obs == nil {
			// A shared map is recreated: every unit's elements go in again,
			// planned against the applied state as the kernel holds it.
			obs = &Observation{Inet: ObservedFrom(s.whole()), Bridge: ObservedFrom(s.bridge)}
		}
		var err error
		dInet, dBridge, touched, err = w.fullDeltas(s, obs, p, oldU)
		if err != nil {
			return nil, err
		}
	}
	p.Ops = append(dInet.ops(nil), dBridge.ops(nil)...)
	p.Changes = append(w.changes(s, touched), p.Changes...)
	p.repl = func(c Counts) []Op { return w.replacement(s, c) }
	return p, nil
}

// sharesRecreated reports whether a shared map of want has another shape
// than the applied one (it is deleted and created again, with every unit's
// elements).
func sharesRecreated(want, applied *TableSpec) bool {
	if applied == nil {
		return false
	}
	for n, s := range want.Sets {
		if !s.PerExposure {
			continue
		}
		if a, ok := applied.Sets[n]; !ok || a.Shape() != s.Shape() {
			return true
		}
	}
	return false
}

// fastDeltas plans against the state itself: the fixed parts whole (they
// are small), and the units of the changed exposures only, each against its
// previous self.
func (w *want) fastDeltas(s *State, oldU func(string) *unit) (dInet, dBridge *delta, touched map[string]bool) {
	dInet = makeDelta(w.inet, ObservedFrom(s.inet), nil)
	dBridge = makeDelta(w.bridge, ObservedFrom(s.bridge), nil)
	touched = make(map[string]bool, len(w.order)) // w.order: the changed exposures
	for i, n := range w.order {
		from := len(dInet.diffs)
		old, u := oldU(n), w.unitAt[i]
		if old == nil && u != nil && u.own == nil {
			// New, with shared elements only (100,000 of them in an apply
			// onto a running table): every element is added, and a
			// routing one is the exposure's publication.
			for _, ue := range u.elems {
				if _, ok := dInet.shapes[ue.set]; !ok {
					dInet.shapes[ue.set] = w.inet.Sets[ue.set]
				}
				dInet.addElems[ue.set] = append(dInet.addElems[ue.set], ue.e)
				if routing(ue.set) {
					touched[n] = true
				}
			}
			continue
		}
		unitDeltaInto(dInet, w.inet, old, u)
		if old == nil && u != nil && u.own != nil {
			// New to a state the kernel holds exactly: its cap set is
			// created here, and no connection has its mark yet.
			for name, set := range u.own.Sets {
				if set.Stateful {
					dInet.fresh[name] = true
				}
			}
		}
		for _, d := range dInet.diffs[from:] {
			if d.kind == objElem && routing(d.name) {
				touched[n] = true
				break
			}
		}
	}
	return dInet, dBridge, touched
}

// routing reports whether a set's elements decide where a connection goes
// (its mark by where it was dialled, its guest by its mark): a change there
// flushes the exposure's host side; a change of the cap's objects does not.
func routing(set string) bool {
	switch set {
	case MapExpAddr, MapExpAny, MapExpTarget, MapExpAddrRange, MapExpAnyRange, MapExpTargetAddr, MapExpTargetPort,
		MapExpAddr6, MapExpAny6, MapExpTarget6,
		MapExpAddr6Range, MapExpAny6Range, MapExpTargetAddr6, MapExpTargetPort6:
		return true
	}
	return false
}

// dispatchMap reports whether a set is looked up by where the caller
// dialled (an exposure's host side is its elements' keys).
func dispatchMap(set string) bool {
	switch set {
	case MapExpAddr, MapExpAny, MapExpAddrRange, MapExpAnyRange, MapExpAddr6, MapExpAny6, MapExpAddr6Range, MapExpAny6Range:
		return true
	}
	return false
}

// unitDelta plans one exposure's unit from old to cur (nil: none).
func unitDelta(shared *TableSpec, old, cur *unit) *delta {
	d := newDelta(nftables.TableFamilyINet)
	unitDeltaInto(d, shared, old, cur)
	return d
}

// fewElems is up to how many elements a unit's are looked up by a scan
// (most units have two to four); past it, through an index (a shifted port
// range has one per port).
const fewElems = 8

// elemLookup finds an element of elems by set and key.
func elemLookup(elems []unitElem) func(set string, key []byte) (ElemSpec, bool) {
	if len(elems) <= fewElems {
		return func(set string, key []byte) (ElemSpec, bool) {
			for _, ue := range elems {
				if ue.set == set && string(ue.e.Key) == string(key) {
					return ue.e, true
				}
			}
			return ElemSpec{}, false
		}
	}
	type at struct{ set, key string }
	m := make(map[at]ElemSpec, len(elems))
	for _, ue := range elems {
		m[at{ue.set, string(ue.e.Key)}] = ue.e
	}
	return func(set string, key []byte) (ElemSpec, bool) {
		e, ok := m[at{set, string(key)}]
		return e, ok
	}
}

// unitDeltaInto adds to d the plan of one exposure's unit from old to cur
// (nil: none). It runs for every exposure of a first apply, so the common
// unit is compared without building anything.
func unitDeltaInto(d *delta, shared *TableSpec, old, cur *unit) {
	if old == nil {
		old = &unit{}
	}
	if cur == nil {
		cur = &unit{}
	}
	inOld, inCur := elemLookup(old.elems), elemLookup(cur.elems)
	for _, ue := range old.elems {
		if ne, ok := inCur(ue.set, ue.e.Key); !ok || !ne.Same(ue.e) || ne.Comment != ue.e.Comment {
			d.note(diff{kind: objElem, name: ue.set, key: string(ue.e.Key), what: "unexpected", label: ue.e.Comment})
			d.delElems[ue.set] = append(d.delElems[ue.set], ue.e)
		}
	}
	for _, ue := range cur.elems {
		if oe, ok := inOld(ue.set, ue.e.Key); !ok || !oe.Same(ue.e) || oe.Comment != ue.e.Comment {
			d.note(diff{kind: objElem, name: ue.set, key: string(ue.e.Key), what: "missing", label: ue.e.Comment})
			if _, ok := d.shapes[ue.set]; !ok {
				d.shapes[ue.set] = shared.Sets[ue.set]
			}
			d.addElems[ue.set] = append(d.addElems[ue.set], ue.e)
		}
	}
	ownOld, ownCur := old.own, cur.own
	if ownOld == nil && ownCur == nil {
		return
	}
	if ownCur == nil {
		ownCur = NewTableSpec(nftables.TableFamilyINet)
	}
	oo := EmptyObserved()
	oo.Exists = true
	if ownOld != nil {
		oo = ObservedFrom(ownOld)
	}
	d.merge(makeDelta(ownCur, oo, nil))
}

// whole is the applied inet table, every unit in it.
func (s *State) whole() *TableSpec {
	return assemble(s.inet, s.exps.len(), func(yield func(*unit) bool) {
		s.exps.each(func(e Exposure) bool {
			u, err := unitOf(e, s.setBased)
			return err != nil || yield(u)
		})
	})
}

// wholeOf is the target's inet table, every unit in it.
func wholeOf(w *want) (*TableSpec, error) {
	var err error
	t := assemble(w.inet, w.n, func(yield func(*unit) bool) {
		for e := range w.all {
			u, ok := w.unitNamed(e.Name)
			if !ok {
				var uerr error
				if u, uerr = unitOf(e, w.setBased); uerr != nil {
					err = uerr
					return
				}
			}
			if !yield(u) {
				return
			}
		}
	})
	return t, err
}

// fullDeltas plans the whole target against what the kernel holds. A
// difference is a change when the object is defined differently in the
// target than in what the state applied, and drift (a repair) otherwise.
// Shared maps whose observed digest is what the state applied were not
// read: only the changed exposures' elements are planned there.
func (w *want) fullDeltas(s *State, obs *Observation, p *Plan, oldU func(string) *unit) (dInet, dBridge *delta, touched map[string]bool, err error) {
	wi, err := wholeOf(w)
	if err != nil {
		return nil, nil, nil, err
	}
	var prevInet *TableSpec
	if s.Applied() {
		prevInet = s.whole()
	}
	unread := func(set string) bool {
		os, ok := obs.Inet.Sets[set]
		return ok && os.Elems == nil && wi.Sets[set] != nil && !wi.Sets[set].Stateful
	}
	anyUnread := false
	for n := range wi.Sets {
		if !unread(n) {
			continue
		}
		anyUnread = true
		if os := obs.Inet.Sets[n]; !os.Trusted && (!s.Applied() || os.Digest != s.Digest(n)) {
			return nil, nil, nil, fmt.Errorf("set %s: its elements differ from what was applied and were not read", n)
		}
	}
	dInet = makeDelta(wi, obs.Inet, unread)
	dBridge = makeDelta(w.bridge, obs.Bridge, nil)
	// The sets not read hold what the state applied: their elements
	// follow the changed units.
	for i, n := range w.order {
		if !anyUnread {
			break
		}
		u := unitDelta(w.inet, oldU(n), w.unitAt[i])
		keep := newDelta(nftables.TableFamilyINet)
		for set, es := range u.delElems {
			if unread(set) {
				keep.delElems[set] = es
			}
		}
		for set, es := range u.addElems {
			if unread(set) {
				keep.addElems[set] = es
				keep.shapes[set] = wi.Sets[set]
			}
		}
		for _, d := range u.diffs {
			if d.kind == objElem && unread(d.name) {
				keep.note(d)
			}
		}
		dInet.merge(keep)
	}
	touched = map[string]bool{}
	classify(p, dInet, prevInet, wi, touched)
	classify(p, dBridge, s.bridgeIfApplied(), w.bridge, touched)
	return dInet, dBridge, touched, nil
}

func (s *State) bridgeIfApplied() *TableSpec {
	if s.Applied() {
		return s.bridge
	}
	return nil
}

// classify sorts the differences of d into repairs (the object is defined
// the same in cur, the target, as in prev, what was applied: drift) and
// changes; the exposures whose routing elements change are touched, and a
// dispatch element no exposure owns (left by one deleted while no daemon
// ran) is removed and flushed as an orphan.
func classify(p *Plan, d *delta, prev, cur *TableSpec, touched map[string]bool) {
	for _, df := range d.diffs {
		if prev != nil && sameObject(prev, cur, df) {
			p.Repairs = append(p.Repairs, Repair{df.object(d.fam), df.whatText()})
			continue
		}
		own := owners(prev, cur, df)
		if df.kind == objElem && routing(df.name) {
			for _, o := range own {
				touched[o] = true
			}
		}
		if len(own) == 0 && df.kind == objElem && df.what != "missing" {
			if hs, ok := dispatchSide(df.name, []byte(df.key)); ok {
				p.Changes = append(p.Changes, Change{Exposure{Name: df.label}, Removed, hs, true})
			}
		}
	}
	// A dispatch map missing as a whole (a first apply): every exposure in
	// it is new where it is published, unless it was applied there before.
	for _, n := range d.missingSets {
		if !dispatchMap(n) || cur == nil || cur.Sets[n] == nil {
			continue
		}
		for _, e := range cur.Sets[n].Elems {
			if prev == nil || !sameObject(prev, cur, diff{kind: objElem, name: n, key: string(e.Key)}) {
				touched[e.Owner] = true
			}
		}
	}
	sort.Slice(p.Repairs, func(i, j int) bool { return p.Repairs[i].String() < p.Repairs[j].String() })
	sort.Slice(p.Changes, func(i, j int) bool { return p.Changes[i].Exposure.Name < p.Changes[j].Exposure.Name })
}

// fromNothing plans the inet table from nothing: its fixed part, and every
// unit of the target, the shared maps' elements in one slice per map.
func (w *want) fromNothing(s *State) *delta {
	d := makeDelta(w.inet, EmptyObserved(), nil)
	own := NewTableSpec(nftables.TableFamilyINet)
	// The few shared maps, by name: a slice each, made at its size.
	type bySet struct {
		name  string
		elems []ElemSpec
	}
	var sets []bySet
	elemsOf := func(name string) *[]ElemSpec {
		for i := range sets {
			if sets[i].name == name {
				return &sets[i].elems
			}
		}
		sets = append(sets, bySet{name, make([]ElemSpec, 0, w.n)})
		return &sets[len(sets)-1].elems
	}
	addUnit := func(e Exposure, u *unit) {
		for _, ue := range u.elems {
			es := elemsOf(ue.set)
			*es = append(*es, ue.e)
		}
		if u.own != nil {
			maps.Copy(own.Counters, u.own.Counters)
			maps.Copy(own.Chains, u.own.Chains)
			maps.Copy(own.Sets, u.own.Sets)
		}
	}
	if w.nUnits == w.n {
		// Every exposure is new to the state (the first apply).
		for i := range w.order {
			if u := w.unitAt[i]; u != nil {
				addUnit(*w.expAt[i], u)
			}
		}
	} else {
		for e := range w.all {
			u, ok := w.unitNamed(e.Name)
			if !ok {
				var err error
				if u, err = unitOf(e, w.setBased); err != nil {
					continue // built once already: cannot happen
				}
			}
			addUnit(e, u)
		}
	}
	for _, bs := range sets {
		d.addElems[bs.name] = bs.elems
		d.shapes[bs.name] = w.inet.Sets[bs.name]
	}
	if len(own.Chains)+len(own.Sets)+len(own.Counters) > 0 {
		o := EmptyObserved()
		o.Exists = true
		d.merge(makeDelta(own, o, nil))
	}
	return d
}

// owners lists the exposures an object belongs to in a and b.
func owners(a, b *TableSpec, d diff) []string {
	var out []string
	for _, t := range []*TableSpec{a, b} {
		if t == nil {
			continue
		}
		switch d.kind {
		case objChain, objRules:
			if c, ok := t.Chains[d.name]; ok && c.Owner != "" {
				out = append(out, c.Owner)
			}
		case objSet:
			if s, ok := t.Sets[d.name]; ok && s.Owner != "" {
				out = append(out, s.Owner)
			}
		case objElem:
			if e, ok := elemOf(t, d.name, d.key); ok && e.Owner != "" {
				out = append(out, e.Owner)
			}
		case objCounter:
			if c, ok := t.Counters[d.name]; ok && c.Exposure != "" {
				out = append(out, c.Exposure)
			}
		}
	}
	return out
}

// changes lists the exposures the target creates, changes or removes,
// against the state; touched are those whose routing elements the batch
// changes in the kernel (only they flush).
func (w *want) changes(s *State, touched0 map[string]bool) []Change {
	touched := func(n string) bool { return touched0 == nil || touched0[n] }
	out := make([]Change, 0, len(w.changed))
	fresh := s.exps.len() == 0
	for i, n := range w.order {
		cur := w.expAt[i]
		var old Exposure
		had := false
		if !fresh {
			old, had = s.exps.get(n)
		}
		published := func(e Exposure) bool { return !e.LoopbackOnly() }
		// A host side newly published has no TCP flow to move: brokkr
		// publishes only a port no host socket holds, and conntrack meets a
		// new SYN on an entry left closed or in TIME_WAIT by killing it and
		// tracking the SYN anew (through the DNAT). A UDP entry has no such
		// end: one made before the element (a datagram to the unpublished
		// port) would keep its flow off the guest until it times out. So
		// only a UDP creation flushes (kube-proxy clears conntrack for UDP
		// alone too), and a sandbox platform's add of a TCP port costs no
		// walk of the host's conntrack table.
		createdFlush := func(e Exposure) bool { return published(e) && e.Protocol != "tcp" }
		switch {
		case cur == nil:
			out = append(out, Change{old, Removed, old.HostSide(), touched(n) && published(old)})
		case !had:
			out = append(out, Change{*cur, Created, cur.HostSide(), touched(n) && createdFlush(*cur)})
		case old.HostSide() != cur.HostSide() || old.LoopbackOnly() != cur.LoopbackOnly():
			out = append(out, Change{old, Removed, old.HostSide(), touched(n) && published(old)},
				Change{*cur, Created, cur.HostSide(), touched(n) && createdFlush(*cur)})
		default:
			// Only where the flows go decides: a new cap keeps them.
			retarget := old.GuestAddr != cur.GuestAddr || old.GuestAddr6 != cur.GuestAddr6 || old.GuestPort != cur.GuestPort || old.GuestPortLast != cur.GuestPortLast || old.MarkID != cur.MarkID
			out = append(out, Change{*cur, Changed, cur.HostSide(), touched(n) && published(*cur) && retarget})
		}
	}
	return out
}

// replacement is the target as ops that delete both tables and create them
// whole (what Plan.Replacement returns).
func (w *want) replacement(s *State, c Counts) []Op {
	wi, err := wholeOf(w)
	if err != nil {
		return nil // the target was built once already: cannot happen
	}
	for n, set := range wi.Sets {
		if !set.Counter || len(c.Elems[n]) == 0 {
			continue
		}
		for k, e := range set.Elems {
			e.Counter = c.Elems[n][k]
			set.Elems[k] = e
		}
	}
	counters := c.Named
	fi, fb := nftables.TableFamilyINet, nftables.TableFamilyBridge
	// Create-if-missing, then delete: the batch fails on neither.
	ops := []Op{AddTable{fi}, AddTable{fb}, DelTable{fi}, DelTable{fb}}
	ops = append(ops, makeDelta(wi, EmptyObserved(), nil).ops(counters)...)
	return append(ops, makeDelta(w.bridge, EmptyObserved(), nil).ops(counters)...)
}

// Commit records p as applied.
func (s *State) Commit(p *Plan) {
	n := p.next
	rebuild := s.inet != nil && n.setBased != s.setBased
	if s.exps.len() == 0 {
		// A first apply: every exposure is new, and check indexed them.
		k := n.kept // PrepareCommit's, when it ran
		if k == nil {
			k = n.keep()
		}
		s.exps, s.unitDigests = k.exps, k.digests
		s.marks, s.sides = n.marks, n.sides
		s.inet, s.bridge, s.setBased = n.inet, n.bridge, n.setBased
		return
	}
	if grow := len(n.changed); grow > s.exps.len() {
		// Many more than applied (100,000 onto a running table): the
		// indexes are made at their new size once, not grown step by step.
		s.exps.grow(grow)
		s.marks = grownMap(s.marks, grow)
		s.sides = grownMap(s.sides, grow)
	}
	for name, e := range n.changed {
		if old, ok := s.exps.get(name); ok {
			s.forget(name, old, !rebuild)
		}
		if e != nil {
			s.exps.put(*e)
			if !e.LoopbackOnly() {
				s.marks[e.MarkID] = name
				s.sides[e.HostSide()] = name
			}
		}
	}
	s.inet, s.bridge, s.setBased = n.inet, n.bridge, n.setBased
	if rebuild {
		s.unitDigests = map[string]Digest{}
		var sums digestSums
		s.exps.each(func(e Exposure) bool {
			if u, err := unitOf(e, s.setBased); err == nil {
				sums.add(u)
			}
			return true
		})
		sums.addTo(s.unitDigests)
		return
	}
	var sums digestSums
	for _, u := range n.unitAt {
		sums.add(u)
	}
	sums.addTo(s.unitDigests)
}

// grownMap is m with room for more entries than it holds.
func grownMap[K comparable, V any](m map[K]V, more int) map[K]V {
	g := make(map[K]V, len(m)+more)
	maps.Copy(g, m)
	return g
}

// forget takes an applied exposure out of the indexes (and, digests, of
// the digests).
func (s *State) forget(name string, e Exposure, digests bool) {
	s.exps.del(name)
	if s.marks[e.MarkID] == name {
		delete(s.marks, e.MarkID)
	}
	if s.sides[e.HostSide()] == name {
		delete(s.sides, e.HostSide())
	}
	if !digests {
		return
	}
	if u, err := unitOf(e, s.setBased); err == nil {
		for _, ue := range u.elems {
			s.unitDigests[ue.set] = s.unitDigests[ue.set].sub(ue.e)
		}
	}
}

// Reset forgets everything applied (the tables were deleted).
func (s *State) Reset() { *s = *NewState() }

// CountingSets are the inet table's sets whose elements have counters.
func (s *State) CountingSets() []string {
	var out []string
	if s.inet != nil {
		for n, st := range s.inet.Sets {
			if st.Counter {
				out = append(out, n)
			}
		}
	}
	sort.Strings(out)
	return out
}

// MarkKey is the key of an exposure's element in the maps keyed by mark
// (exp-target): its ct mark, host-endian like the kernel's register.
func MarkKey(id uint32) []byte { return connMark(id) }

// Trusts reports whether the kernel's elements of set need not be read: it
// is a shared map whose observed digest d is what the state applied.
func (s *State) Trusts(set string, d Digest) bool {
	if s.inet == nil {
		return false
	}
	st, ok := s.inet.Sets[set]
	return ok && st.PerExposure && d == s.Digest(set)
}

// Each calls fn for every applied exposure.
func (s *State) Each(fn func(Exposure)) {
	s.exps.each(func(e Exposure) bool { fn(e); return true })
}

// Shared reports whether set is one of the inet table's maps that every
// exposure has elements in.
func (s *State) Shared(set string) bool {
	if s.inet == nil {
		return false
	}
	st, ok := s.inet.Sets[set]
	return ok && st.PerExposure
}
