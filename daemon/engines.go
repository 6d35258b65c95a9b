package daemon

import (
	"context"
	"fmt"
	"sync"
	"time"

	"github.com/brokkr/brokkr/netplane"
	"github.com/brokkr/brokkr/proxy"
	"github.com/brokkr/brokkr/supervisor"
)

// The three engines the control loop drives. These are the seams between
// the daemon and the parts it ties together (supervisor.Engine,
// netplane.Plane, proxy.Manager satisfy them); tests of the loop's own
// decisions drive them with small recorders.
type (
	Supervisor interface {
		Step(ctx context.Context, desired []supervisor.VMSpec) supervisor.Report
		Restart(name string) error
		// Wake resumes a VM its idleSuspend suspended (wake.go).
		Wake(name string) bool
		Stop()
	}
	Network interface {
		Converge(ctx context.Context, d netplane.Desired) netplane.Report
		Validate(d netplane.Desired) []error
		Close() error
	}
	Proxy interface {
		Converge(desired []proxy.Spec) []proxy.Status
		StopAll()
	}
)

// bounded runs one engine's pass with a deadline so that one engine cannot
// stall the others. A pass that overruns keeps running in its goroutine (an
// engine call cannot be abandoned half-way safely); until it returns, later
// passes skip that engine and report it as stalled rather than piling up
// goroutines behind it.
type bounded[T any] struct {
	name  string
	mu    sync.Mutex
	busy  bool
	since time.Time
	done  chan struct{} // closed when the in-flight call returns
	last  T
	have  bool
}

// run calls fn with a context that ends after timeout, and waits at most
// timeout plus a grace for it. ok is false when fn did not finish in time (or
// is still busy from an earlier pass); res is then the last result.
func (b *bounded[T]) run(parent context.Context, timeout time.Duration, fn func(ctx context.Context) T) (res T, err error) {
	b.mu.Lock()
	if b.busy {
		res, since := b.last, b.since
		b.mu.Unlock()
		return res, fmt.Errorf("%s: still busy with a pass started at %s", b.name, since.UTC().Format(time.TimeOnly))
	}
	b.busy, b.since = true, time.Now()
	done := make(chan struct{})
	b.done = done
	b.mu.Unlock()

	ctx, cancel := context.WithTimeout(parent, timeout)
	out := make(chan T, 1)
	go func() {
		defer cancel()
		r := fn(ctx)
		b.mu.Lock()
		b.last, b.have, b.busy = r, true, false
		b.mu.Unlock()
		out <- r
		close(done)
	}()
	grace := timeout + timeout/2
	select {
	case r := <-out:
		return r, nil
	case <-time.After(grace):
		b.mu.Lock()
		res = b.last
		b.mu.Unlock()
		return res, fmt.Errorf("%s: pass took longer than %s; skipped until it returns", b.name, grace)
	}
}

// lastResult is the result of the last call that returned.
func (b *bounded[T]) lastResult() T {
	b.mu.Lock()
	defer b.mu.Unlock()
	return b.last
}

// wait blocks until no call is in flight or ctx ends.
func (b *bounded[T]) wait(ctx context.Context) {
	b.mu.Lock()
	busy, done := b.busy, b.done
	b.mu.Unlock()
	if !busy {
		return
	}
	select {
	case <-done:
	case <-ctx.Done():
	}
}
