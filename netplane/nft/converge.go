package nft

import (
	"fmt"

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
	res, err := t.run(p)
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
// exposures.
func (t *Table) Update(set []Exposure, remove []string) (Result, error) {
	t.mu.Lock()
	defer t.mu.Unlock()
	var fixed *Rules
	if t.before != nil && len(set) > 0 {
		r := t.fixed
		r.Exposures = set
		if err := t.before(&r); err != nil {
			return Result{}, err
		}
		if r.OverflowPort != t.fixed.OverflowPort {
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
	res, err := t.run(p)
	if err == nil && fixed != nil {
		t.fixed = *fixed
	}
	return res, err
}

// observation reads both tables, unless the ruleset generation shows that
// nobody committed anything since the last batch (nil: the kernel holds
// exactly the state). A shared map whose digest is what the state applied
// is not decoded.
func (t *Table) observation() (*compile.Observation, error) {
	if g, err := t.k.generation(); err == nil && t.genValid && g == t.gen && t.state.Applied() {
		return nil, nil
	}
	read := func(set string, d compile.Digest) bool { return !t.state.Trusts(set, d) }
	inet, err := t.k.observe(famInet, read)
	if err != nil {
		return nil, err
	}
	bridge, err := t.k.observe(famBridge, read)
	if err != nil {
		return nil, err
	}
	return &compile.Observation{Inet: inet, Bridge: bridge}, nil
}

// verifyMin: element batches at least this large are read back (their
// digest) after the commit.
const verifyMin = 64

// run applies a plan: its batch, or if that fails (or does not verify) the
// whole-table replace; then the state records it and the flows of the
// changed host sides are flushed (mu held).
func (t *Table) run(p *compile.Plan) (Result, error) {
	res := Result{Changes: p.Changes, Repaired: p.Repairs}
	committed := false
	if !p.Empty() {
		err := t.k.apply(p.Ops)
		if err == nil {
			t.state.Commit(p)
			committed = true
			err = t.verify(p)
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
			if err := t.k.apply(p.Replacement(counts)); err != nil {
				t.genValid = false // the next pass reads the kernel again
				return res, fmt.Errorf("nft: replacing the tables: %w", err)
			}
			if !committed {
				t.state.Commit(p)
			}
			if err := t.verify(p); err != nil {
				t.genValid = false
				return res, err
			}
		}
	} else {
		t.state.Commit(p)
	}
	g, err := t.k.generation()
	t.gen, t.genValid = g, err == nil
	res.Flushed = t.flush(p.Changes)
	if t.applied != nil {
		t.applied(p.Changes)
	}
	return res, nil
}

// verify reads back the digest of every set the plan added many elements
// to, against the state that recorded the plan: google/nftables reports no
// error when the kernel stores part of an oversized list.
func (t *Table) verify(p *compile.Plan) error {
	for set, n := range p.AddedElems() {
		if n < verifyMin {
			continue
		}
		want := t.state.Digest(set)
		got, err := t.k.digest(famInet, set)
		if err != nil {
			return fmt.Errorf("nft: verify %s: %w", set, err)
		}
		if got != want {
			return fmt.Errorf("nft: set %s holds %d elements (digest %x), want %d (%x)", set, got.Count, got.Sum, want.Count, want.Sum)
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
