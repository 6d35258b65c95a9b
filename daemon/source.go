package daemon

import (
	"context"

	"github.com/brokkr/brokkr/daemon/api"
	"github.com/brokkr/brokkr/daemon/config"
)

// Source is where desired state comes from when it is not this host's
// config file or `brokkr apply`: etcd today (daemon/fleet), a Kubernetes
// CRD later. A source only hands whole configs to Apply, the same path a
// local apply takes, so validation, persistence and convergence stay in one
// place; it never touches the engines.
type Source interface {
	// Run feeds t until ctx ends; it must keep t on its last applied state
	// whatever happens to the source (a partition never tears anything down).
	Run(ctx context.Context, t Target)
	// Report is shown in the status as "source".
	Report() api.Source
}

// Target is what a Source drives; *Daemon is one.
type Target interface {
	// Host is the config brokkrd started with (directories, hypervisor,
	// the source's own section); a source builds whole configs on it.
	Host() *config.Config
	Apply(cfg *config.Config, dryRun bool) (api.Plan, error)
	Status() api.Status
	// Passed delivers after control-loop passes (coalesced), so a source
	// can report status changes without polling.
	Passed() <-chan struct{}
	// Generations says how many times the desired state has changed, and
	// from which of those the current status was converged: a change is
	// reflected in Status once reported >= the desired right after Apply.
	Generations() (desired, reported uint64)
}

// Host returns the config brokkrd was started with.
func (d *Daemon) Host() *config.Config { return d.host }

// Passed is signalled after every pass; one pending signal at most.
func (d *Daemon) Passed() <-chan struct{} { return d.passed }

// Generations is Target.Generations.
func (d *Daemon) Generations() (desired, reported uint64) {
	d.mu.Lock()
	defer d.mu.Unlock()
	return d.gen, d.statusGen
}

// ErrRemoteSource refuses a local apply on a node whose desired state comes
// from a Source: the next remote revision would silently undo it.
type ErrRemoteSource struct{ Source api.Source }

func (e ErrRemoteSource) Error() string {
	return "this node takes its desired state from " + e.Source.Kind + " (fleet mode, node " + e.Source.Node +
		"): change it with `brokkr fleet apply --node " + e.Source.Node + " -f FILE`"
}
