package nft

import (
	"fmt"
	"sync"

	"github.com/brokkr/brokkr/netplane/nft/compile"
	"github.com/google/nftables"
)

const (
	famInet   = nftables.TableFamilyINet
	famBridge = nftables.TableFamilyBridge
)

// Result is what one Converge or Update did.
type Result struct {
	Changes  []compile.Change // exposures created, changed or removed (and which host sides were flushed)
	Repaired []compile.Repair // drift: the kernel differed from what brokkr had applied
	Replaced error            // non-nil: the incremental batch failed (this error) and both tables were replaced whole
	Flushed  map[string]int   // conntrack entries deleted per exposure
}

// Converge makes both tables match r: one batch with the difference, or, if
// that fails, one batch that replaces both tables. r comes from the
// validated desired state (docs/ARCHITECTURE.md, "The desired-state
// model"); input the compiler cannot express applies nothing.
func (t *Table) Converge(r Rules) (Result, error) {
	t.mu.Lock()
	defer t.mu.Unlock()
	if t.before != nil {
		if err := t.before(&r); err != nil {
			return Result{}, err
		}
	}
	obs, err := t.observation()
	if err != nil {
		return Result{}, err
	}
	p, err := t.state.Plan(r, obs)
	if err != nil {
		return Result{}, fmt.Errorf("nft: %w", err)
	}
	res, err := t.run(p, false)
	if err == nil {
		r.Exposures = nil
		t.fixed = r
	}
	return res, err
}

// Update creates or replaces the exposures of set and deletes those named
// in remove, leaving every other exposure and the rest of the tables as
// the last Converge or Update applied them. While nobody else touched the
// tables it costs O(len(set)+len(remove)), whatever the number of
// exposures. The conntrack entries of the host sides it withdraws are
// flushed just after it returns (flusher), except those of a removed
// exposure idle says has no connection open on any path (nil: none is
// known idle): a walk of the host's conntrack table finds nothing of it.
func (t *Table) Update(set []Exposure, remove []string, idle func(exposure string) bool) (Result, error) {
	t.mu.Lock()
	defer t.mu.Unlock()
	var fixed *Rules
	if t.before != nil && len(set) > 0 {
		r := t.fixed
		r.Exposures = set
		if err := t.before(&r); err != nil {
			return Result{}, err
		}
		if r.Cap != t.fixed.Cap {
			// The slow path started for these: the fixed part points at it.
			r.Exposures = nil
			fixed = &r
		}
	}
	obs, err := t.observation()
	if err != nil {
		return Result{}, err
	}
	p, err := t.state.PlanUpdate(fixed, set, remove, obs)
	if err != nil {
		return Result{}, fmt.Errorf("nft: %w", err)
	}
	skipIdleFlushes(p.Changes, idle)
	res, err := t.run(p, true)
	if err == nil && fixed != nil {
		t.fixed = *fixed
	}
	return res, err
}

// observation reads what may differ from the state in both tables (nil:
// nothing, the kernel holds exactly the state). With the change
// notifications listened to, that is what other programs touched in
// brokkr's tables since the last pass: nothing at all when they committed
// elsewhere, and only the shared maps whose elements they touched (a map of
// 100,000 elements is seconds of kernel time to dump). Without them, an
// unchanged ruleset generation proves nobody committed anything; otherwise
// everything is read, and a shared map whose digest is what the state
// applied is not decoded.
func (t *Table) observation() (*compile.Observation, error) {
	f, ferr := t.k.foreign()
	g, gerr := t.k.generation()
	trusted := func(string) bool { return false }
	switch {
	case !t.state.Applied() || !t.genValid || gerr != nil:
		// Nothing applied, or the last batch's outcome is unknown.
	case ferr == nil && !f.lost:
		if !f.other && len(f.sets) == 0 {
			return nil, nil
		}
		trusted = func(set string) bool { return t.state.Shared(set) && !f.sets[set] }
	case g == t.gen:
		return nil, nil
	}
	read := func(set string, d compile.Digest) bool { return !t.state.Trusts(set, d) }
	inet, err := t.k.observe(famInet, trusted, read)
	if err != nil {
		return nil, err
	}
	bridge, err := t.k.observe(famBridge, func(string) bool { return false }, read)
	if err != nil {
		return nil, err
	}
	return &compile.Observation{Inet: inet, Bridge: bridge}, nil
}

// verifyMin: element batches at least this large are read back (some of
// their elements) after the commit.
const verifyMin = 64

// run applies a plan: its batch, or if that fails (or does not verify) the
// whole-table replace; then the state records it and the flows of the
// changed host sides are flushed (mu held): now, or with async by the
// flusher, after the return (Result.Flushed is then empty).
func (t *Table) run(p *compile.Plan, async bool) (Result, error) {
	res := Result{Changes: p.Changes, Repaired: p.Repairs}
	// A side an earlier Update withdrew is flushed before it is
	// published again.
	t.flushes.takeBefore(p.Changes)
	committed := false
	if !p.Empty() {
		// What Commit keeps of a first apply is built while the kernel
		// takes the batch (the plan is only read meanwhile).
		var prepared sync.WaitGroup
		prepared.Go(p.PrepareCommit)
		err := t.k.apply(p.Ops)
		prepared.Wait()
		if err == nil {
			t.state.Commit(p)
			committed = true
			err = t.verify(p.Ops)
		}
		if err != nil {
			t.log.Warn("nft: incremental update failed, replacing the tables", "err", err)
			res.Replaced = err
			counts, cerr := t.k.counts(t.state.CountingSets())
			if cerr != nil {
				// Unreadable: the counters start again at zero, but the
				// tables are still replaced.
				counts = compile.Counts{}
			}
			repl := p.Replacement(counts)
			if err := t.k.apply(repl); err != nil {
				t.genValid = false // the next pass reads the kernel again
				return res, fmt.Errorf("nft: replacing the tables: %w", err)
			}
			if !committed {
				t.state.Commit(p)
			}
			if err := t.verify(repl); err != nil {
				t.genValid = false
				return res, err
			}
		}
	} else {
		t.state.Commit(p)
	}
	g, err := t.k.generation()
	t.gen, t.genValid = g, err == nil
	if async {
		t.flushes.add(p.Changes)
	} else {
		res.Flushed = t.flush(p.Changes)
	}
	if t.applied != nil {
		t.applied(p.Changes)
	}
	return res, nil
}

// skipIdleFlushes clears Flush on the removals of exposures idle names,
// unless the exposure stays published elsewhere (a move to another host
// side, whose connections the gauge would count under the new side).
func skipIdleFlushes(changes []compile.Change, idle func(string) bool) {
	if idle == nil {
		return
	}
	stays := map[string]bool{}
	for _, c := range changes {
		if c.Kind != compile.Removed {
			stays[c.Exposure.Name] = true
		}
	}
	for i, c := range changes {
		if c.Kind == compile.Removed && c.Flush && !stays[c.Exposure.Name] && idle(c.Exposure.Name) {
			changes[i].Flush = false
		}
	}
}

// verify reads back, from every large element batch of the plan, one
// element per message and its last (looked up, not dumped): google/nftables
// once made the kernel store part of an oversized list with no error, and
// a list cut short loses its tail.
func (t *Table) verify(ops []compile.Op) error {
	for _, o := range ops {
		a, ok := o.(compile.AddElems)
		if !ok || len(a.Elems) < verifyMin {
			continue
		}
		var probes []compile.ElemSpec
		for i := maxElemCount - 1; i < len(a.Elems); i += maxElemCount {
			probes = append(probes, a.Elems[i])
		}
		probes = append(probes, a.Elems[len(a.Elems)-1])
		keys := make([][]byte, len(probes))
		for i, e := range probes {
			keys[i] = e.Key
		}
		got, err := t.k.lookup(a.Fam, a.Set.Name, keys)
		if err != nil {
			return fmt.Errorf("nft: verify %s: %w", a.Set.Name, err)
		}
		for _, want := range probes {
			if have, ok := got[string(want.Key)]; !ok || !have.Same(want) {
				return fmt.Errorf("nft: set %s does not hold element %s after the batch", a.Set.Name, want.Comment)
			}
		}
	}
	return nil
}

// flush deletes the conntrack entries of every host side a change asks for.
func (t *Table) flush(changes []compile.Change) map[string]int {
	var sides []compile.HostSide
	var names []string
	seen := map[compile.HostSide]bool{}
	for _, c := range changes {
		if c.Flush && !seen[c.HostSide] {
			seen[c.HostSide] = true
			sides = append(sides, c.HostSide)
			names = append(names, c.Exposure.Name)
		}
	}
	if len(sides) == 0 {
		return nil
	}
	counts, err := t.k.flush(sides)
	if err != nil {
		t.log.Warn("nft: conntrack flush failed", "err", err)
	}
	out := map[string]int{}
	for i, n := range counts {
		out[names[i]] += n
	}
	return out
}
