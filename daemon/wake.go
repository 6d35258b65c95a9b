package daemon

import (
	"context"
	"errors"
	"fmt"
	"sync"
	"time"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/brokkr/brokkr/bpf"
	"github.com/brokkr/brokkr/daemon/api"
	"github.com/brokkr/brokkr/internal/spec"
	"github.com/brokkr/brokkr/supervisor"
)

// Wakes ties a suspended VM's callers to its resume (docs/ARCHITECTURE.md,
// "Suspend and resume"). The supervisor tells it each VM's phase as it
// changes (Phase, its Config.Notify); the proxy asks it to wake the VM of a
// caller it holds (Wake) and waits on the channel it gets; the daemon
// routes the wake (Route): to the supervisor for a VM its idleSuspend
// suspended, or to the VM's desired power for one an operator did.
// Everything here is an event: nothing polls.
type Wakes struct {
	mu      sync.Mutex
	asleep  map[string]*sleeper
	route   func(vm string)
	changed func() // told after a VM falls asleep or wakes (kernelWakes.sync)
}

// sleeper is one VM that is suspending, suspended or resuming.
type sleeper struct {
	ready   chan struct{} // closed when the VM leaves those phases
	askedAt time.Time     // when its wake was last routed (zero: never)
	waiting bool          // a caller asked before there was a route
}

// wakeAgain is how long a routed wake stands before another caller asks
// again (the first was refused or lost: the VM is still asleep).
const wakeAgain = 5 * time.Second

// NewWakes returns a board with no VM asleep.
func NewWakes() *Wakes { return &Wakes{asleep: map[string]*sleeper{}} }

// asleepPhase: the guest does not answer in this phase, but will again
// once resumed.
func asleepPhase(phase string) bool {
	switch spec.Phase(phase) {
	case spec.PhaseSuspending, spec.PhaseSuspended, spec.PhaseResuming:
		return true
	}
	return false
}

// Phase records a VM's new phase (supervisor.Config.Notify). Leaving the
// asleep phases releases every caller held for the VM: running, or given
// up (stopped, failed), which their dial then finds out.
func (w *Wakes) Phase(vm, phase string) {
	w.mu.Lock()
	s := w.asleep[vm]
	flipped := true
	switch {
	case asleepPhase(phase) && s == nil:
		w.asleep[vm] = &sleeper{ready: make(chan struct{})}
	case !asleepPhase(phase) && s != nil:
		close(s.ready)
		delete(w.asleep, vm)
	default:
		flipped = false
	}
	changed := w.changed
	w.mu.Unlock()
	if flipped && changed != nil {
		changed()
	}
}

func (w *Wakes) onChange(f func()) {
	w.mu.Lock()
	w.changed = f
	w.mu.Unlock()
}

// Wake asks for vm to be resumed and returns a channel closed once it runs
// again; nil when it is not asleep. It is called per held connection, so
// it only takes a lock; the first caller's wake is routed (once per
// wakeAgain), the others wait on the same channel.
func (w *Wakes) Wake(vm string) <-chan struct{} {
	w.mu.Lock()
	defer w.mu.Unlock()
	s := w.asleep[vm]
	if s == nil {
		return nil
	}
	s.waiting = true
	if w.route != nil && (s.askedAt.IsZero() || time.Since(s.askedAt) > wakeAgain) {
		s.askedAt = time.Now()
		go w.route(vm)
	}
	return s.ready
}

// Asleep reports whether vm is suspending, suspended or resuming.
func (w *Wakes) Asleep(vm string) bool {
	w.mu.Lock()
	defer w.mu.Unlock()
	return w.asleep[vm] != nil
}

// Route sets where wakes go (the daemon's WakeVM), and routes those asked
// before it was set.
func (w *Wakes) Route(route func(vm string)) {
	w.mu.Lock()
	defer w.mu.Unlock()
	w.route = route
	for vm, s := range w.asleep {
		if s.waiting && s.askedAt.IsZero() {
			s.askedAt = time.Now()
			go route(vm)
		}
	}
}

// WakeVM resumes a suspended VM for a caller: a VM whose desired power is
// suspended becomes running (persisted, as `brokkr vm resume` does), and
// the supervisor is told the resume is a wake (it counts and times it, and
// resumes a VM its idleSuspend suspended). The wake goes first: a worker
// keeps a wake it cannot act on yet for the spec that follows, while a spec
// that came first would resume the VM before the wake arrived, uncounted.
func (d *Daemon) WakeVM(vm string) {
	d.mu.Lock()
	_, m := d.snapLocked()
	v, ok := m.VM(vm)
	d.mu.Unlock()
	if !ok {
		return
	}
	d.sup.Wake(vm)
	if v.Power == spec.PowerSuspended {
		if err := d.SetPower(vm, spec.PowerRunning); err != nil {
			d.log.Warn("a caller could not wake a suspended VM", "vm", vm, "err", err)
			return
		}
		d.log.Info("a caller woke a suspended VM: its desired power is running now", "vm", vm)
	}
}

// suspendAction is `brokkr vm suspend|resume`: the desired power, and for a
// resume also a wake (a VM its idleSuspend suspended is desired running
// already).
func (d *Daemon) suspendAction(vm, action string) error {
	if action == "suspend" {
		return d.SetPower(vm, spec.PowerSuspended)
	}
	d.mu.Lock()
	_, m := d.snapLocked()
	_, ok := m.VM(vm)
	d.mu.Unlock()
	if !ok {
		return fmt.Errorf("%w: %q", ErrNoSuchVM, vm)
	}
	d.sup.Wake(vm) // first, as in WakeVM
	return d.SetPower(vm, spec.PowerRunning)
}

// VMTraffic sums the counters of the VM's exposures from the pinned slots
// (supervisor.Config.Traffic, for idleSuspend): read, never counted by the
// daemon. A VM with no exposure has no traffic; no counters at all is
// unknown.
func (d *Daemon) VMTraffic(vm string) (supervisor.Traffic, bool) {
	if d.store == nil {
		return supervisor.Traffic{}, false
	}
	_, model := d.snapshot()
	var t supervisor.Traffic
	for _, e := range model.Exposures {
		if e.Target.VM != vm {
			continue
		}
		if c, ok := d.store.Lookup(e.Name); ok {
			t.Active += c.Active
			t.Accepted += c.Accepted
		}
	}
	return t, true
}

// ObserveResume records how long a wake took, from the first caller to the
// guest running (supervisor.Config.Resumed).
func (d *Daemon) ObserveResume(vm string, took time.Duration) {
	d.m.resume.observe(vm, took.Seconds())
}

var (
	descVMResume = prometheus.NewDesc("brokkr_vm_resume_seconds",
		"Time from a suspended VM's first caller to the guest running again.", []string{"vm"}, nil)
	resumeBuckets = []float64{.1, .25, .5, .75, 1, 1.5, 2, 3, 5, 10, 30}
)

// resumeTimes is brokkr_vm_resume_seconds, one histogram per VM, served
// with the status's VMs: every VM has its series from the start (at zero),
// and a removed VM's goes with it.
type resumeTimes struct {
	mu   sync.Mutex
	byVM map[string]*resumeHist
}

type resumeHist struct {
	count   uint64
	sum     float64
	buckets map[float64]uint64 // cumulative, by upper bound
}

func (r *resumeTimes) observe(vm string, secs float64) {
	r.mu.Lock()
	defer r.mu.Unlock()
	h := r.byVM[vm]
	if h == nil {
		h = &resumeHist{buckets: map[float64]uint64{}}
		r.byVM[vm] = h
	}
	h.count++
	h.sum += secs
	for _, b := range resumeBuckets {
		if secs <= b {
			h.buckets[b]++
		}
	}
}

func (r *resumeTimes) metric(vm string) prometheus.Metric {
	r.mu.Lock()
	defer r.mu.Unlock()
	h := r.byVM[vm]
	if h == nil {
		h = &resumeHist{}
	}
	buckets := make(map[float64]uint64, len(resumeBuckets))
	for _, b := range resumeBuckets {
		buckets[b] = h.buckets[b]
	}
	return prometheus.MustNewConstHistogram(descVMResume, h.count, h.sum, buckets, vm)
}

// asleepReason is an exposure's reason while its VM is suspended.
const asleepReason = "suspended: wakes on first caller"

// markAsleep gives the active exposures of an asleep VM their reason.
func markAsleep(st *api.Status) {
	asleep := map[string]bool{}
	for _, v := range st.VMs {
		if asleepPhase(v.Phase) {
			asleep[v.Name] = true
		}
	}
	if len(asleep) == 0 {
		return
	}
	for i := range st.Exposures {
		e := &st.Exposures[i]
		if e.VM == "" || !asleep[e.VM] || e.State != string(spec.StateActive) {
			continue
		}
		if e.Reason == "" {
			e.Reason = asleepReason
		} else {
			e.Reason = asleepReason + "; " + e.Reason
		}
	}
}

// kernelWakes is the daemon's side of the kernel paths' wake (bpf.Wake):
// it keeps exposure_wake_v2's flags in step with which VMs are asleep (at
// every phase change the board hears of, and again at every pass), and
// turns each event the nat path or the socket path sends into a WakeVM.
type kernelWakes struct {
	d     *Daemon
	w     *bpf.Wake
	board *Wakes

	mu      sync.Mutex
	set     map[int]bool      // what each slot's flag was last set to (asleep)
	askedAt map[int]time.Time // when a slot's event came
}

func newKernelWakes(d *Daemon, w *bpf.Wake, board *Wakes) *kernelWakes {
	if w == nil || board == nil || d.store == nil {
		return nil
	}
	k := &kernelWakes{d: d, w: w, board: board, set: map[int]bool{}, askedAt: map[int]time.Time{}}
	board.onChange(k.sync)
	return k
}

// sync sets the flag of every kernel-path exposure of a VM to whether the
// VM is asleep; only changes are written, and every flag once when this
// daemon first sees it (a wake the previous one was asked for and did not
// route is re-armed so). A wake asked more than wakeAgain ago for a VM
// still asleep is re-armed too, so the next caller asks again.
func (k *kernelWakes) sync() {
	if k == nil {
		return
	}
	_, model := k.d.snapshot()
	k.mu.Lock()
	defer k.mu.Unlock()
	for _, e := range model.Exposures {
		if !e.Target.IsVM() || (!e.UsesKernel() && !e.UsesSocketPath()) {
			continue
		}
		slot, ok := k.d.store.SlotOf(e.Name)
		if !ok {
			continue
		}
		asleep := k.board.Asleep(e.Target.VM)
		was, known := k.set[slot]
		var err error
		switch {
		case asleep && (!known || !was):
			err = k.w.Sleep(slot)
		case !asleep && (!known || was):
			err = k.w.Awake(slot)
			delete(k.askedAt, slot)
		case asleep && !k.askedAt[slot].IsZero() && time.Since(k.askedAt[slot]) > wakeAgain:
			delete(k.askedAt, slot)
			err = k.w.Sleep(slot)
		}
		if err != nil {
			k.d.log.Warn(bpf.WakeMapName, "exposure", e.Name, "err", err)
			continue
		}
		k.set[slot] = asleep
	}
}

// serve turns wake events into wakes until ctx ends.
func (k *kernelWakes) serve(ctx context.Context) {
	if k == nil {
		return
	}
	for {
		slot, err := k.w.Next(ctx)
		if errors.Is(err, bpf.ErrWakeClosed) || (err != nil && ctx.Err() != nil) {
			return
		}
		if err != nil {
			k.d.log.Warn("wake events", "err", err)
			continue
		}
		name := k.d.store.NameOf(slot)
		_, model := k.d.snapshot()
		for _, e := range model.Exposures {
			if e.Name == name && e.Target.IsVM() {
				k.mu.Lock()
				k.askedAt[slot] = time.Now()
				k.mu.Unlock()
				k.d.log.Info("a caller on a kernel path wakes a suspended VM", "vm", e.Target.VM, "exposure", name)
				go k.d.WakeVM(e.Target.VM)
				break
			}
		}
	}
}
