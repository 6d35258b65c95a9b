// Package nft applies brokkr's nftables tables. A Table makes the kernel
// hold what package compile plans: Converge for the whole desired state,
// Update for some exposures, each one netlink batch (falling back to
// replacing both tables in one batch), reporting the exposures it changed,
// the drift it repaired and the conntrack entries it flushed. Table itself
// only observes, applies and verifies, through the kernel interface; the
// decisions are the compiler's. Without the BPF nat path, SetCap runs the
// set-based cap beside it: the watcher that frees the places of closed
// connections (caps.go), the slow path that decides for callers who find a
// cap full (overflow.go), and the counters. Nothing outside brokkr's two
// tables is touched.
package nft

import (
	"fmt"
	"log/slog"
	"sync"

	"github.com/brokkr/brokkr/netplane/nft/compile"
)

// Table manages brokkr's tables in one network namespace.
type Table struct {
	k   kernel
	nl  *nlKernel // k, when it is the real one (the set-based cap needs its sockets)
	log *slog.Logger

	// mu: one Converge, Update or Delete at a time, and what they keep:
	// the applied state and the ruleset generation right after the last
	// batch (while it is unchanged nobody else has committed anything, so
	// the kernel still holds exactly the state).
	mu       sync.Mutex
	state    *compile.State
	fixed    Rules // the last whole desired state, without its exposures
	gen      uint32
	genValid bool
	// applied is told every change a batch made, after the batch (the
	// set-based cap's index of exposures).
	applied func([]compile.Change)
	// before runs ahead of each plan: it may fill in the rules (the cap's
	// slow-path listener port).
	before func(*Rules) error
	cap    *SetCap
	// flushes is where an Update's conntrack flushes run, off its path.
	flushes *flusher
}

// Option configures Open.
type Option func(*options)

type options struct {
	log *slog.Logger
}

// WithLogger sets the logger (default: slog.Default()).
func WithLogger(l *slog.Logger) Option { return func(o *options) { o.log = l } }

// Open binds to the namespace at netnsPath ("" = the caller's namespace).
func Open(netnsPath string, opts ...Option) (*Table, error) {
	o := options{log: slog.Default()}
	for _, f := range opts {
		f(&o)
	}
	k, err := openKernel(netnsPath)
	if err != nil {
		return nil, err
	}
	t := newTable(k, o.log)
	t.nl = k
	return t, nil
}

func newTable(k kernel, log *slog.Logger) *Table {
	return &Table{k: k, log: log, state: compile.NewState(), flushes: newFlusher(k, log)}
}

// Close stops a set-based cap still running beside the table and closes the
// sockets; the tables stay.
func (t *Table) Close() error {
	t.mu.Lock()
	c := t.cap
	t.mu.Unlock()
	if c != nil {
		_ = c.Close()
	}
	t.mu.Lock() // no batch is under way while the sockets close
	defer t.mu.Unlock()
	t.flushes.close()
	return t.k.close()
}

// Delete removes brokkr's tables (only those) and forgets what was applied.
func (t *Table) Delete() error {
	t.mu.Lock()
	defer t.mu.Unlock()
	ops := []compile.Op{compile.AddTable{Fam: famInet}, compile.AddTable{Fam: famBridge},
		compile.DelTable{Fam: famInet}, compile.DelTable{Fam: famBridge}}
	err := t.k.apply(ops)
	t.genValid = false
	if err != nil {
		return fmt.Errorf("nft: delete tables: %w", err)
	}
	changes := t.removedAll()
	t.state.Reset()
	if t.applied != nil {
		t.applied(changes)
	}
	return nil
}

// appliedAll is every applied exposure as created (mu held).
func (t *Table) appliedAll() []compile.Change {
	var out []compile.Change
	t.state.Each(func(e compile.Exposure) {
		out = append(out, compile.Change{Exposure: e, Kind: compile.Created, HostSide: e.HostSide()})
	})
	return out
}

// removedAll is every applied exposure as removed (mu held).
func (t *Table) removedAll() []compile.Change {
	var out []compile.Change
	t.state.Each(func(e compile.Exposure) {
		out = append(out, compile.Change{Exposure: e, Kind: compile.Removed, HostSide: e.HostSide()})
	})
	return out
}
