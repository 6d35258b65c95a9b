package supervisor

import (
	"context"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"syscall"
	"time"

	"golang.org/x/sys/unix"
)

// worker owns one VM. Its goroutine is the only code that acts on the VM, so
// the VM's operations are serial without a per-VM mutex; mu guards only the
// mailbox (desired, flags) and the published row.
type worker struct {
	e    *Engine
	name string
	wake chan struct{} // cap 1: any number of deliveries coalesce into one wake
	quit chan struct{} // closed when the engine reaps or stops this worker
	gen  uint64        // the last Step that named this VM; guarded by Engine.mu

	mu        sync.Mutex
	desired   *VMSpec   // newest desired spec; nil = not desired
	seen      bool      // some Step has said whether the VM is desired
	fresh     bool      // desired changed since the worker last took it
	restart   bool      // operator asked for a restart
	busy      bool      // a pass is running
	hasRecord bool      // a record exists on disk (so the VM is still ours)
	wakeAt    time.Time // when Engine.Wake first asked for a resume (zero: not asked)
	status    VMStatus
	fetchID   uint64 // names the fetch whose progress may update the row

	// Owned by the worker goroutine.
	lock      *os.File
	rec       *record // nil until load succeeds (and again after destroy)
	inst      *Instance
	watch     *watch
	exits     chan exitEvent
	lastExit  *exitEvent // the VM stopped on its own; restart policy decides
	failedFor *VMSpec    // spec whose start or run failed (a new spec retries at once)
	unplaced  string     // why the adopted VMM is not in its scope ("" = it is, or no Placer)
	delay     time.Duration
	nextStart time.Time
	timer     *time.Timer
	timerAt   time.Time
	idle      idleClock
	// suspendFailed says why the last suspend failed (the VM runs on);
	// suspendRetry is when the next one may be tried.
	suspendFailed string
	suspendRetry  time.Time
	// coldReason says why the VM was booted cold instead of resumed.
	coldReason string
}

// exitEvent says the watched process ended (or a start failed).
type exitEvent struct {
	w      *watch
	at     time.Time
	status ExitStatus
	reason string // what is shown in the row
}

// watch follows one running instance: a pidfd waiter and the console copier.
type watch struct {
	pfd    *Pidfd
	cancel context.CancelFunc // ends the exit waiter
	done   chan struct{}      // closed when the exit waiter has returned
	// The console copier has a lifetime of its own: a stop ends the waiter
	// first (so the exit is not taken for a crash) but the guest's shutdown
	// messages must still reach console.log.
	consoleCancel context.CancelFunc
	consoleDone   chan struct{}
}

func newWorker(e *Engine, name string) *worker {
	return &worker{
		e: e, name: name,
		wake:   make(chan struct{}, 1),
		quit:   make(chan struct{}),
		exits:  make(chan exitEvent, 1),
		status: VMStatus{Name: name, Phase: PhasePending},
	}
}

func (w *worker) signal() {
	select {
	case w.wake <- struct{}{}:
	default:
	}
}

// deliver hands the worker its newest desired spec. A worker that is busy
// finds only the newest one when it comes free: intermediate specs are
// overwritten, never acted on.
func (w *worker) deliver(spec *VMSpec) {
	w.mu.Lock()
	changed := !w.seen || w.desired == nil || !specEqual(w.desired, spec)
	if changed {
		w.desired, w.seen, w.fresh = cloneSpec(spec), true, true
	}
	w.mu.Unlock()
	if changed {
		w.signal()
	}
}

func (w *worker) deliverAbsent() {
	w.mu.Lock()
	changed := !w.seen || w.desired != nil
	if changed {
		w.desired, w.seen, w.fresh = nil, true, true
	}
	w.mu.Unlock()
	if changed {
		w.signal()
	}
}

func (w *worker) requestRestart() {
	w.mu.Lock()
	w.restart, w.fresh = true, true
	w.mu.Unlock()
	w.signal()
}

// reapable: not desired, no record left, and nothing running or pending. A
// busy worker is never reaped: the next delivery would spawn a second
// worker for the same VM beside it.
func (w *worker) reapable() bool {
	w.mu.Lock()
	defer w.mu.Unlock()
	return w.seen && w.desired == nil && !w.fresh && !w.busy && !w.hasRecord && len(w.wake) == 0
}

// row returns a copy of the published status: the report owns it.
func (w *worker) row() VMStatus {
	w.mu.Lock()
	defer w.mu.Unlock()
	return w.status
}

func (w *worker) publish(phase, detail string) {
	w.mu.Lock()
	changed := w.status.Phase != phase
	defer func() {
		if n := w.e.cfg.Notify; changed && n != nil {
			n(w.name, phase)
		}
	}()
	w.status.Phase, w.status.Detail, w.status.Progress = phase, detail, nil
	w.status.PID = 0
	if w.inst != nil {
		w.status.PID = w.inst.PID
	}
	w.status.StateBytes = 0
	if w.rec != nil {
		w.status.Restarts, w.status.Wakes = w.rec.Restarts, w.rec.Wakes
		if w.rec.Suspended != nil && w.inst == nil {
			w.status.StateBytes = w.rec.Suspended.Bytes
		}
	}
	w.mu.Unlock()
}

// take starts a pass: it marks the worker busy and hands over the newest
// desired state in the same critical section, so there is no moment at
// which pending work exists while the worker looks idle.
func (w *worker) take() (spec *VMSpec, seen, restart bool, wakeAt time.Time) {
	w.mu.Lock()
	defer w.mu.Unlock()
	w.busy, w.fresh = true, false
	spec, seen, restart, wakeAt = w.desired, w.seen, w.restart, w.wakeAt
	w.restart, w.wakeAt = false, time.Time{}
	return spec, seen, restart, wakeAt
}

// isFresh reports whether desired state changed since this pass took it.
func (w *worker) isFresh() bool {
	w.mu.Lock()
	defer w.mu.Unlock()
	return w.fresh
}

func (w *worker) endPass() {
	w.mu.Lock()
	w.busy = false
	w.mu.Unlock()
}

func (w *worker) timerC() <-chan time.Time {
	if w.timer == nil {
		return nil
	}
	return w.timer.C
}

// arm makes sure a pass runs at or before at: an earlier pending timer is
// kept (passes are idempotent, so an early one only looks again).
func (w *worker) arm(at time.Time) {
	if w.timer != nil {
		if !w.timerAt.After(at) {
			return
		}
		w.timer.Stop()
	}
	w.timer, w.timerAt = time.NewTimer(max(time.Until(at), 0)), at
}

func (w *worker) disarm() {
	if w.timer != nil {
		w.timer.Stop()
		w.timer = nil
	}
}

func (w *worker) run(ctx context.Context) {
	defer w.shutdown()
	for {
		select {
		case <-w.quit:
			return
		case <-ctx.Done():
			return
		case <-w.wake:
		case ev := <-w.exits:
			w.onExit(ev)
		case <-w.timerC():
			w.timer = nil
		}
		select {
		case <-w.quit:
			return
		default:
		}
		w.pass(ctx)
	}
}

// shutdown runs when the worker ends (reaped or engine stopped): it stops
// watching but leaves the hypervisor running for the next daemon to adopt.
func (w *worker) shutdown() {
	w.disarm()
	w.stopWatch()
	if w.lock != nil {
		w.lock.Close()
		w.lock = nil
	}
}

func (w *worker) pass(ctx context.Context) {
	spec, seen, restartReq, wakeAt := w.take()
	defer w.endPass()

	if err := w.acquireLock(); err != nil {
		w.publish(PhaseFailed, err.Error())
		w.arm(time.Now().Add(time.Second)) // the other owner may go away
		return
	}
	if err := w.load(ctx); err != nil {
		// Never overwritten, never dropped: the operator must look at it.
		w.publish(PhaseFailed, err.Error())
		return
	}
	if !seen {
		w.publishObserved()
		return
	}
	if spec == nil {
		w.destroy(ctx)
		return
	}
	if spec.Power == PowerStopped {
		w.disarm()
		w.lastExit, w.failedFor, w.delay = nil, nil, 0
		if w.inst != nil && !w.stopVM(ctx) {
			return
		}
		w.dropState() // a stopped VM boots cold
		w.saveSpec(spec)
		w.publish(PhaseStopped, "")
		return
	}
	if restartReq {
		w.lastExit, w.failedFor, w.delay = nil, nil, 0
		w.disarm()
		w.dropState() // a restart is a cold boot
	}
	if w.stayIdle(spec, wakeAt) || spec.Power == PowerSuspended {
		w.keepWake(wakeAt)
		w.keepSuspended(ctx, spec)
		return
	}
	if w.rec.Suspended != nil && w.inst == nil {
		w.resume(ctx, spec, wakeAt)
		return
	}
	if w.failedFor != nil && !sameMachine(w.failedFor, spec) {
		// A new spec deserves a fresh try, not the old one's backoff.
		w.lastExit, w.failedFor, w.delay = nil, nil, 0
		w.disarm()
	}
	countRestart := false
	if w.inst != nil {
		if !restartReq && sameMachine(&w.rec.Spec, spec) {
			w.saveSpec(spec) // power/restart policy may have changed
			if w.unplaced != "" {
				w.placeAdopted(ctx)
			}
			if w.idleFor(spec) {
				w.suspend(ctx, spec, true)
				return
			}
			w.publish(PhaseRunning, w.runningDetail())
			return
		}
		if !w.stopVM(ctx) {
			return
		}
		countRestart = true
	}
	if w.lastExit != nil {
		if !restartAllowed(spec.Restart, w.lastExit.status) {
			phase := PhaseFailed
			if w.lastExit.status.Clean() {
				phase = PhaseStopped
			}
			w.publish(phase, fmt.Sprintf("%s; restart policy %q", w.lastExit.reason, policy(spec.Restart)))
			return
		}
		if wait := time.Until(w.nextStart); wait > 0 {
			w.arm(w.nextStart)
			w.publish(PhaseStarting, fmt.Sprintf("%s; restarting in %s", w.lastExit.reason, wait.Round(time.Millisecond)))
			return
		}
		countRestart = true
	}
	w.create(ctx, spec, countRestart)
}

func policy(p Restart) Restart {
	if p == "" {
		return RestartAlways
	}
	return p
}

// restartAllowed applies the restart policy to how the VM ended. An exit
// status we could not read (the VM ended while the daemon was down) counts
// as a failure.
func restartAllowed(p Restart, st ExitStatus) bool {
	switch policy(p) {
	case RestartNever:
		return false
	case RestartOnFailure:
		return !st.Clean()
	default:
		return true
	}
}

// acquireLock takes the per-VM flock that proves this worker is the only one
// acting on the VM: not another worker, not another daemon.
func (w *worker) acquireLock() error {
	if w.lock != nil {
		return nil
	}
	dir := w.e.vmDir(w.name)
	if err := os.MkdirAll(dir, 0o700); err != nil {
		return err
	}
	p := filepath.Join(dir, "lock")
	f, err := os.OpenFile(p, os.O_RDWR|os.O_CREATE, 0o600)
	if err != nil {
		return err
	}
	if err := unix.Flock(int(f.Fd()), unix.LOCK_EX|unix.LOCK_NB); err != nil {
		f.Close()
		if errors.Is(err, unix.EWOULDBLOCK) {
			return fmt.Errorf("VM is locked by another supervisor (%s)", p)
		}
		return fmt.Errorf("lock %s: %w", p, err)
	}
	w.lock = f
	return nil
}

// load reads the record once (and again after a failure, so an operator's
// fix is picked up), then adopts the process it names.
func (w *worker) load(ctx context.Context) error {
	if w.rec != nil {
		return nil
	}
	rec, err := readRecord(w.e.vmDir(w.name), w.name)
	if err != nil {
		w.mu.Lock()
		w.hasRecord = true
		w.mu.Unlock()
		return err
	}
	w.rec = rec
	if rec == nil {
		w.rec = &record{Name: w.name}
		return nil
	}
	w.mu.Lock()
	w.hasRecord = true
	w.mu.Unlock()
	if rec.Starting || (rec.Resuming && rec.Instance == nil) {
		w.killUnrecorded(ctx)
	}
	switch {
	case rec.Instance != nil && rec.Suspended != nil && !rec.Resuming:
		w.endSaved(ctx, *rec.Instance)
	case rec.Instance != nil:
		w.adopt(ctx, *rec.Instance)
		w.settleAdopted(ctx)
	case rec.Suspended == nil:
		w.dropState() // leftovers of a suspend that never completed
	}
	return nil
}

// killUnrecorded kills the VMMs a daemon started for this VM and died before
// recording (SIGKILLed inside Start): left alone, such a process holds the
// VM's sockets, so every new start fails, and it runs a guest nobody owns.
// It is found by the VM's run directory on its command line.
func (w *worker) killUnrecorded(ctx context.Context) {
	for _, inst := range SessionLeadersNaming(w.e.runDir(w.name) + "/") {
		pfd, err := OpenPidfd(inst)
		if err != nil {
			continue // gone meanwhile
		}
		w.e.cfg.Logger.Warn("killing a VMM the previous daemon started but never recorded", "vm", w.name, "pid", inst.PID)
		_ = pfd.Signal(syscall.SIGKILL)
		wctx, cancel := context.WithTimeout(ctx, 10*time.Second)
		_ = pfd.Wait(wctx)
		cancel()
		pfd.Close()
	}
	// A VMM Restore started had not run its guest (Continue comes only
	// after the instance is recorded): the saved state is still good.
	w.rec.Starting, w.rec.Resuming = false, false
	w.save()
}

func (w *worker) adopt(ctx context.Context, inst Instance) {
	w.publish(PhaseStarting, "adopting pid "+fmt.Sprint(inst.PID))
	actx, cancel := context.WithTimeout(ctx, 10*time.Second)
	err := w.e.cfg.Hypervisor.Adopt(actx, inst)
	cancel()
	if err == nil {
		err = w.startWatch(inst)
	}
	if err != nil {
		w.e.cfg.Logger.Warn("recorded VM process is not running", "vm", w.name, "pid", inst.PID, "err", err)
		w.rec.Instance = nil
		w.save()
		w.lastExit = &exitEvent{at: time.Now(), reason: fmt.Sprintf("pid %d not running after daemon restart (%v)", inst.PID, err)}
		w.failedFor = cloneSpec(&w.rec.Spec)
		w.nextStart = time.Now()
		w.publish(PhaseFailed, w.lastExit.reason)
		return
	}
	w.e.cfg.Logger.Info("adopted VM", "vm", w.name, "pid", inst.PID)
	w.unplaced = ""
	w.placeAdopted(ctx)
	if w.rec.Suspending || w.rec.Resuming {
		return // its guest may be paused: settleAdopted says when it runs
	}
	w.publish(PhaseRunning, w.unplaced)
}

// placeAdopted moves an adopted VMM into its scope: one an older daemon
// started may sit in the daemon's own cgroup, where a stop of the daemon's
// unit would reach it. A failure never stops the VM: unplaced says why in
// its row, and a pass every placeRetry tries again.
func (w *worker) placeAdopted(ctx context.Context) {
	p := w.e.cfg.Placer
	if p == nil || w.inst == nil {
		return
	}
	pctx, cancel := context.WithTimeout(ctx, 10*time.Second)
	err := p.Place(pctx, w.name, w.inst.PID)
	cancel()
	if err == nil {
		w.unplaced = ""
		return
	}
	if w.unplaced == "" {
		w.e.cfg.Logger.Warn("adopted VM stays outside its scope", "vm", w.name, "pid", w.inst.PID, "err", err)
	}
	w.unplaced = "not in its own scope: " + err.Error()
	w.arm(time.Now().Add(placeRetry)) // a pass, which tries again
}

// placeRetry is how often an adopted VMM outside its scope is tried again.
const placeRetry = 5 * time.Second

// publishObserved reports what is known before any Step spoke of the VM.
func (w *worker) publishObserved() {
	if w.inst != nil {
		w.publish(PhaseRunning, w.unplaced)
	} else if w.rec.Suspended != nil {
		w.publish(PhaseSuspended, "")
	} else if w.lastExit != nil {
		w.publish(PhaseFailed, w.lastExit.reason)
	} else {
		w.publish(PhasePending, "")
	}
}

func (w *worker) save() {
	if err := w.saveChecked(); err != nil {
		w.e.cfg.Logger.Error("write record", "vm", w.name, "err", err)
	}
}

// saveChecked writes the record and says whether it reached the disk: a
// step whose crash safety rests on the record (a suspend, a resume) does
// not go ahead without it.
func (w *worker) saveChecked() error {
	w.rec.Name = w.name
	if err := writeRecord(w.e.vmDir(w.name), w.rec); err != nil {
		return err
	}
	w.mu.Lock()
	w.hasRecord = true
	w.mu.Unlock()
	return nil
}

func (w *worker) saveSpec(spec *VMSpec) {
	if w.rec.Spec.Name != "" && specEqual(&w.rec.Spec, spec) {
		return
	}
	w.rec.Spec = *cloneSpec(spec)
	w.save()
}

// create fetches images, prepares the disk and starts the hypervisor, all
// inside one create slot, publishing each step into the row as it goes.
func (w *worker) create(ctx context.Context, spec *VMSpec, countRestart bool) {
	w.disarm()
	if w.e.creates != nil {
		select {
		case w.e.creates <- struct{}{}:
		default:
			w.publish(PhaseCreating, "waiting for a create slot")
			select {
			case w.e.creates <- struct{}{}:
			case <-w.wake:
				// Newer desired state (or a restart request) arrived while
				// waiting: this pass's spec is stale. The next pass takes
				// the newest, so put the wake back and leave.
				w.signal()
				return
			case <-ctx.Done():
				return
			}
		}
		if w.isFresh() {
			// The slot and a newer spec arrived together.
			<-w.e.creates
			return
		}
		defer func() { <-w.e.creates }()
	}
	lc, err := w.launchConfig(ctx, spec)
	if err != nil {
		if ctx.Err() == nil {
			w.fail(spec, err.Error())
		}
		return
	}
	if countRestart {
		w.rec.Restarts++
	}
	w.rec.Spec = *cloneSpec(spec)
	w.rec.Instance = nil
	w.rec.Starting = true
	w.save() // the intent survives a crash halfway through Start
	w.publish(PhaseStarting, "starting "+w.e.cfg.Hypervisor.Kind())
	sctx, cancel := context.WithTimeout(ctx, w.e.cfg.StartTimeout)
	if p := w.e.cfg.Placer; p != nil {
		lc.Place = func(pid int) error { return p.Place(sctx, w.name, pid) }
	}
	inst, err := w.e.cfg.Hypervisor.Start(sctx, lc)
	timedOut := errors.Is(sctx.Err(), context.DeadlineExceeded)
	cancel()
	if err != nil {
		if ctx.Err() != nil {
			return // the engine is stopping
		}
		msg := "start: " + err.Error()
		if timedOut {
			msg = fmt.Sprintf("start: timed out after %s: %v", w.e.cfg.StartTimeout, err)
		}
		w.rec.Starting = false // the backend killed what it started
		w.save()
		w.fail(spec, msg)
		return
	}
	recorded := inst
	recorded.Console = nil // the copier's, never the record's
	w.rec.Instance = &recorded
	w.rec.Starting = false
	w.rec.StartedAt = time.Now()
	w.save()
	if err := w.startWatch(inst); err != nil {
		// Exited before we could watch it: handled like any other exit.
		w.rec.Instance = nil
		w.save()
		w.fail(spec, "exited at once: "+err.Error())
		return
	}
	w.lastExit, w.failedFor, w.unplaced = nil, nil, ""
	w.startIdleClock(spec)
	w.publish(PhaseRunning, w.runningDetail())
}

// fail records a failed start as an exit: the restart policy and backoff
// apply to it like to a crash.
func (w *worker) fail(spec *VMSpec, reason string) {
	w.lastExit = &exitEvent{at: time.Now(), reason: reason}
	w.failedFor = cloneSpec(spec)
	w.bumpBackoff(0)
	if restartAllowed(spec.Restart, ExitStatus{}) {
		w.arm(w.nextStart)
	}
	w.publish(PhaseFailed, reason)
}

// bumpBackoff doubles the restart delay, or resets it after a stable run.
func (w *worker) bumpBackoff(uptime time.Duration) {
	cfg := &w.e.cfg
	if w.delay == 0 || uptime >= cfg.StableRun {
		w.delay = cfg.BackoffBase
	} else {
		w.delay = min(2*w.delay, cfg.BackoffMax)
	}
	w.nextStart = time.Now().Add(w.delay)
}

func (w *worker) launchConfig(ctx context.Context, spec *VMSpec) (LaunchConfig, error) {
	dir, run := w.e.vmDir(w.name), w.e.runDir(w.name)
	if err := os.MkdirAll(run, 0o700); err != nil {
		return LaunchConfig{}, err
	}
	lc := LaunchConfig{
		Name: w.name, Dir: dir, RunDir: run,
		CPUs: spec.CPUs, MemoryMiB: spec.MemoryMiB, Cmdline: strings.TrimSpace(spec.Cmdline + " " + KernelIPParam(spec.IP, spec.Name)),
		Tap: spec.Tap, MAC: spec.MAC,
		ConsoleLog: filepath.Join(dir, "console.log"), ConsoleSize: w.e.cfg.ConsoleMaxBytes,
	}
	var err error
	if lc.Kernel, err = w.fetch(ctx, "kernel", spec.Kernel); err != nil {
		return lc, err
	}
	if spec.Initramfs != nil {
		if lc.Initramfs, err = w.fetch(ctx, "initramfs", *spec.Initramfs); err != nil {
			return lc, err
		}
	}
	if spec.Disk != nil {
		lc.DiskPath = filepath.Join(dir, "disk.raw")
		if _, err := os.Stat(lc.DiskPath); errors.Is(err, os.ErrNotExist) {
			base, err := w.fetch(ctx, "disk", spec.Disk.Source)
			if err != nil {
				return lc, err
			}
			w.publish(PhaseCreating, "preparing disk")
			if err := w.e.cfg.Images.PrepareDisk(ctx, base, lc.DiskPath, spec.Disk.Size); err != nil {
				return lc, fmt.Errorf("disk: %w", err)
			}
		} else if err != nil {
			return lc, fmt.Errorf("disk: %w", err)
		}
	}
	return lc, nil
}

func (w *worker) fetch(ctx context.Context, role string, src Source) (string, error) {
	what := "downloading " + role + " image"
	w.publish(PhaseCreating, what)
	w.mu.Lock()
	w.fetchID++
	id := w.fetchID
	w.mu.Unlock()
	defer func() {
		w.mu.Lock()
		w.fetchID++ // a progress call that comes late is dropped
		w.mu.Unlock()
	}()
	p, err := w.e.cfg.Images.Fetch(ctx, src, func(done, total int64) {
		// May run on the fetcher's goroutine (a download shared by several
		// VMs): touch only the row, under its mutex.
		if total > 0 {
			w.mu.Lock()
			defer w.mu.Unlock()
			if w.fetchID != id {
				return
			}
			w.status.Phase, w.status.Detail = PhaseCreating, fmt.Sprintf("%s %d%%", what, done*100/total)
			w.status.Progress = &Progress{Done: done, Total: total}
		}
	})
	if err != nil {
		return "", fmt.Errorf("%s: %w", role, err)
	}
	return p, nil
}

// startWatch opens a pidfd on the instance and parks a goroutine on it: the
// worker hears of the exit the moment it happens.
func (w *worker) startWatch(inst Instance) error {
	console := inst.Console
	inst.Console = nil // the copier owns it from here
	pfd, err := OpenPidfd(inst)
	if err != nil {
		if console != nil {
			console.Close()
		}
		return err
	}
	ctx, cancel := context.WithCancel(w.e.ctx)
	cctx, ccancel := context.WithCancel(w.e.ctx)
	wt := &watch{pfd: pfd, cancel: cancel, done: make(chan struct{}), consoleCancel: ccancel, consoleDone: make(chan struct{})}
	w.inst, w.watch = &inst, wt
	if inst.ConsoleSocket != "" {
		go func() {
			defer close(wt.consoleDone)
			err := copyConsole(cctx, console, inst.ConsoleSocket, filepath.Join(w.e.vmDir(w.name), "console.log"), w.e.cfg.ConsoleMaxBytes)
			if err != nil && cctx.Err() == nil {
				w.e.cfg.Logger.Warn("console copy", "vm", w.name, "err", err)
			}
		}()
	} else {
		if console != nil {
			console.Close()
		}
		close(wt.consoleDone)
	}
	go func() {
		defer close(wt.done)
		if pfd.Wait(ctx) != nil {
			return
		}
		// The status is filled in by the worker, which reaps.
		ev := exitEvent{w: wt, at: time.Now(), reason: "exited"}
		select {
		case w.exits <- ev:
		case <-ctx.Done():
		}
	}()
	return nil
}

// stopWatch ends the watcher goroutines and closes the pidfd.
func (w *worker) stopWatch() {
	if w.watch == nil {
		return
	}
	w.watch.cancel()
	<-w.watch.done
	w.watch.endConsole(0)
	w.watch.pfd.Close()
	w.watch = nil
}

// endConsole gives the console copier up to linger to drain what the guest
// wrote last (its socket closes when the VMM exits), then ends it.
func (wt *watch) endConsole(linger time.Duration) {
	if linger > 0 {
		select {
		case <-wt.consoleDone:
		case <-time.After(linger):
		}
	}
	wt.consoleCancel()
	<-wt.consoleDone
}

// onExit handles the death of the running instance.
func (w *worker) onExit(ev exitEvent) {
	if ev.w != w.watch || w.watch == nil {
		return // an old instance's event
	}
	st := w.watch.pfd.Reap()
	w.stopWatch()
	uptime := time.Duration(0)
	if w.rec != nil && !w.rec.StartedAt.IsZero() {
		uptime = ev.at.Sub(w.rec.StartedAt)
	}
	pid := w.inst.PID
	w.inst = nil
	w.rec.Instance = nil
	w.save()
	ev.status = st
	ev.reason = fmt.Sprintf("pid %d %s", pid, st)
	w.lastExit = &ev
	w.failedFor = cloneSpec(&w.rec.Spec)
	w.bumpBackoff(uptime)
	w.e.cfg.Logger.Warn("VM process exited", "vm", w.name, "pid", pid, "status", st.String(), "uptime", uptime)
}

// stopVM stops the running instance through the backend (power button,
// grace, forced). It reports false when the process survived.
func (w *worker) stopVM(ctx context.Context) bool {
	inst := *w.inst
	w.publish(PhaseStopping, "")
	wt := w.watch
	pfd := wt.pfd
	// Keep the pidfd and the console copier: stop only the waiter, so the
	// exit is not taken for a crash while the shutdown still reaches the log.
	wt.cancel()
	<-wt.done
	err := w.e.cfg.Hypervisor.Stop(ctx, inst, w.e.cfg.StopGrace)
	if pfd.Exited() {
		wt.endConsole(2 * time.Second)
	} else {
		wt.endConsole(0)
	}
	if !pfd.Exited() {
		if err == nil {
			err = errors.New("process still running")
		}
		// Still alive: watch it again and say so.
		pfd.Close()
		w.watch, w.inst = nil, nil
		if werr := w.startWatch(inst); werr != nil {
			w.inst = nil
		}
		w.publish(PhaseFailed, "stop: "+err.Error())
		return w.inst == nil
	}
	pfd.Reap()
	pfd.Close()
	w.watch, w.inst = nil, nil
	w.rec.Instance = nil
	w.save()
	return true
}

// destroy stops the VM and removes everything brokkr keeps for it.
func (w *worker) destroy(ctx context.Context) {
	w.disarm()
	if w.inst != nil && !w.stopVM(ctx) {
		return
	}
	if p := w.e.cfg.Placer; p != nil {
		// The scope goes by itself once its process is gone; this also ends
		// whatever the VMM left behind in it.
		pctx, cancel := context.WithTimeout(ctx, 15*time.Second)
		err := p.Release(pctx, w.name)
		cancel()
		if err != nil {
			w.e.cfg.Logger.Warn("release the VM's scope", "vm", w.name, "err", err)
		}
	}
	var errs []error
	for _, d := range []string{w.e.runDir(w.name), w.e.vmDir(w.name)} {
		if err := os.RemoveAll(d); err != nil {
			errs = append(errs, err)
		}
	}
	if w.lock != nil {
		w.lock.Close()
		w.lock = nil
	}
	if err := errors.Join(errs...); err != nil {
		w.publish(PhaseFailed, "remove: "+err.Error())
		return
	}
	w.rec, w.lastExit, w.failedFor, w.delay = nil, nil, nil, 0
	w.mu.Lock()
	w.hasRecord = false
	w.mu.Unlock()
	// From here to the end of the pass only busy keeps this worker from
	// being reaped (and a second one spawned beside it).
	w.e.cfg.Logger.Info("VM removed", "vm", w.name)
	w.publish(PhaseStopped, "removed")
}
