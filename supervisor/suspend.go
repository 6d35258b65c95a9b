package supervisor

import (
	"context"
	"fmt"
	"io/fs"
	"os"
	"path/filepath"
	"strings"
	"syscall"
	"time"
)

// Suspend and resume on the worker (docs/ARCHITECTURE.md, "Suspend and
// resume"). The record says at every step what a daemon killed there leaves
// behind, so the next one ends with the VM suspended or running, never lost
// and never in two processes:
//
//	running ─Suspending─► (Suspend: pause, save) ─saved: Suspended+Instance─►
//	    (VMM ends) ─Suspended─► ... ─Resuming─► (Restore: loaded, paused)
//	    ─Resuming+Instance─► (Continue) ─► running
//
// A guest runs only in a VMM the record names, and a saved state is
// restored only if no guest has run from it since (Continue comes after the
// restored VMM is recorded; a state whose restored VMM died after that is
// dropped for a cold boot, as the guest may have written its disk).

// stateDirName is the VM's saved state: stateDir/vms/<name>/suspend.
const stateDirName = "suspend"

func (w *worker) stateDir() string { return filepath.Join(w.e.vmDir(w.name), stateDirName) }

func (w *worker) requestWake() {
	w.mu.Lock()
	if w.wakeAt.IsZero() {
		w.wakeAt = time.Now()
	}
	w.fresh = true
	w.mu.Unlock()
	w.signal()
}

// wakeKeep is how long a wake waits for the desired state that acts on it:
// a VM whose power is suspended is woken by the daemon making it running,
// and the wake may reach the worker before that spec does.
const wakeKeep = 30 * time.Second

// keepWake puts a wake this pass cannot act on back in the mailbox, without
// a signal (the spec that acts on it brings one), unless it is stale.
func (w *worker) keepWake(wakeAt time.Time) {
	if wakeAt.IsZero() || time.Since(wakeAt) > wakeKeep {
		return
	}
	w.mu.Lock()
	if w.wakeAt.IsZero() {
		w.wakeAt = wakeAt
	}
	w.mu.Unlock()
}

// stayIdle: the VM was suspended by its idleSuspend, is still desired
// running with one, and no caller asked for it.
func (w *worker) stayIdle(spec *VMSpec, wakeAt time.Time) bool {
	st := w.rec.Suspended
	return st != nil && st.Idle && w.inst == nil && spec.Power == PowerRunning && spec.IdleSuspend > 0 && wakeAt.IsZero()
}

// keepSuspended brings the VM to (or keeps it in) suspended: power
// suspended, or idle.
func (w *worker) keepSuspended(ctx context.Context, spec *VMSpec) {
	idle := spec.Power != PowerSuspended
	if w.inst == nil {
		w.disarm()
		if st := w.rec.Suspended; st != nil {
			detail := ""
			if sameMachine(&w.rec.Spec, spec) {
				// The record keeps the spec the state was saved from:
				// only what does not touch the machine is taken.
				w.saveSpec(spec)
			} else {
				detail = "the spec changed since the suspend: the resume boots cold"
			}
			if st.Idle != idle {
				st.Idle = idle
				w.save()
			}
			w.publish(PhaseSuspended, detail)
			return
		}
		w.saveSpec(spec)
		w.publish(PhaseSuspended, "no saved state: the resume boots cold")
		return
	}
	if w.rec.Suspended != nil {
		// Saved, its VMM still there (it did not end after the save).
		w.endSaved(ctx, *w.inst)
		if w.inst == nil {
			w.publish(PhaseSuspended, "")
		}
		return
	}
	if !sameMachine(&w.rec.Spec, spec) {
		// A state of the old machine would be useless to the new one.
		if w.stopVM(ctx) {
			w.saveSpec(spec)
			w.publish(PhaseSuspended, "the spec changed: stopped; the resume boots cold")
		}
		return
	}
	if time.Now().Before(w.suspendRetry) {
		w.arm(w.suspendRetry)
		w.publish(PhaseRunning, w.runningDetail())
		return
	}
	w.suspend(ctx, spec, idle)
}

// suspend saves the running VM's state and ends its VMM. A state that
// cannot be saved leaves the VM running, the reason in its row, and the
// next try SuspendRetry away.
func (w *worker) suspend(ctx context.Context, spec *VMSpec, idle bool) {
	inst := *w.inst
	w.publish(PhaseSuspending, "saving the guest's state")
	t0 := time.Now()
	dir := w.stateDir()
	err := os.RemoveAll(dir)
	if err == nil {
		err = os.Mkdir(dir, 0o700)
	}
	if err == nil {
		w.saveSpec(spec)
		w.rec.Suspending = true
		err = w.saveChecked()
	}
	if err != nil {
		w.rec.Suspending = false
		w.suspendFailedWith(err)
		return
	}
	// Only the waiter stops: the VMM ending is not a crash, and the
	// console copier keeps the guest's last words.
	wt := w.watch
	wt.cancel()
	<-wt.done
	kind := w.e.cfg.Hypervisor.Kind()
	err = w.e.cfg.Hypervisor.Suspend(ctx, inst, dir, func() error {
		w.rec.Suspending = false
		w.rec.Suspended = &savedState{Bytes: diskUsage(dir), At: time.Now(), Kind: kind, Idle: idle}
		if err := w.saveChecked(); err != nil {
			w.rec.Suspending, w.rec.Suspended = true, nil
			return fmt.Errorf("record the saved state: %w", err)
		}
		return nil
	})
	if err != nil && w.rec.Suspended != nil && ctx.Err() == nil {
		// Saved, but the VMM did not end: the state is good and the guest
		// paused. endSaved ends it harder.
		w.e.cfg.Logger.Warn("the VMM did not end after its guest was saved", "vm", w.name, "pid", inst.PID, "err", err)
		w.endSaved(ctx, inst)
		if w.inst == nil {
			w.suspendFailed, w.suspendRetry, w.coldReason = "", time.Time{}, ""
			w.publish(PhaseSuspended, "")
		}
		return
	}
	if err != nil {
		if ctx.Err() != nil {
			return // the engine is stopping: the next one reads the record
		}
		w.rec.Suspending, w.rec.Suspended = false, nil
		w.save()
		_ = os.RemoveAll(dir)
		// Watch it again: alive (the backend ran the guest again) or dead
		// (the exit is handled like any other).
		wt.endConsole(0)
		wt.pfd.Close()
		w.watch, w.inst = nil, nil
		if werr := w.startWatch(inst); werr != nil {
			w.inst = nil
			w.rec.Instance = nil
			w.save()
			w.lastExit = &exitEvent{at: time.Now(), reason: fmt.Sprintf("pid %d ended during a failed suspend (%v)", inst.PID, err)}
			w.failedFor = cloneSpec(spec)
			w.nextStart = time.Now()
			w.arm(w.nextStart)
		}
		w.suspendFailedWith(err)
		return
	}
	wt.endConsole(2 * time.Second)
	wt.pfd.Reap()
	wt.pfd.Close()
	w.watch, w.inst = nil, nil
	w.rec.Instance = nil
	w.save()
	w.suspendFailed, w.suspendRetry, w.coldReason = "", time.Time{}, ""
	w.e.cfg.Logger.Info("VM suspended", "vm", w.name, "pid", inst.PID, "idle", idle,
		"bytes", w.rec.Suspended.Bytes, "took", time.Since(t0).Round(time.Millisecond))
	w.publish(PhaseSuspended, "")
}

func (w *worker) suspendFailedWith(err error) {
	w.suspendFailed = "suspend failed: " + err.Error()
	w.suspendRetry = time.Now().Add(w.e.cfg.SuspendRetry)
	w.e.cfg.Logger.Warn("VM not suspended: it runs on", "vm", w.name, "err", err, "retry", w.e.cfg.SuspendRetry)
	w.arm(w.suspendRetry)
	if w.inst != nil {
		w.publish(PhaseRunning, w.runningDetail())
	}
}

// resume starts the VM from its saved state; a state that cannot be
// restored gives way to a cold boot, with the reason in the row.
func (w *worker) resume(ctx context.Context, spec *VMSpec, wakeAt time.Time) {
	w.disarm()
	st := w.rec.Suspended
	switch {
	case !sameMachine(&w.rec.Spec, spec):
		w.coldBoot(ctx, spec, wakeAt, "the spec changed while it was suspended")
		return
	case st.Kind != w.e.cfg.Hypervisor.Kind():
		w.coldBoot(ctx, spec, wakeAt, fmt.Sprintf("the state was saved by %s, not %s", st.Kind, w.e.cfg.Hypervisor.Kind()))
		return
	}
	w.publish(PhaseResuming, "restoring the guest's state")
	lc, err := w.launchConfig(ctx, spec)
	if err != nil {
		if ctx.Err() == nil {
			w.fail(spec, err.Error()) // the state stays; the retry resumes
		}
		return
	}
	w.saveSpec(spec)
	w.rec.Resuming = true
	if err := w.saveChecked(); err != nil {
		// Without Resuming on disk a crash inside Restore would leave a
		// VMM nobody kills: do not start one.
		w.rec.Resuming = false
		w.fail(spec, "resume: record: "+err.Error())
		return
	}
	w.publish(PhaseResuming, "restoring the guest's state ("+w.e.cfg.Hypervisor.Kind()+")")
	sctx, cancel := context.WithTimeout(ctx, w.e.cfg.StartTimeout)
	if p := w.e.cfg.Placer; p != nil {
		lc.Place = func(pid int) error { return p.Place(sctx, w.name, pid) }
	}
	inst, err := w.e.cfg.Hypervisor.Restore(sctx, lc, w.stateDir())
	cancel()
	if err != nil {
		if ctx.Err() != nil {
			return
		}
		w.rec.Resuming = false // the backend killed what it started
		w.coldBoot(ctx, spec, wakeAt, "resume failed: "+err.Error())
		return
	}
	w.rec.Instance, w.rec.StartedAt = &inst, time.Now()
	w.save()
	if err := w.startWatch(inst); err != nil {
		w.rec.Instance, w.rec.Resuming = nil, false
		w.coldBoot(ctx, spec, wakeAt, "resume failed: the restored VMM exited at once: "+err.Error())
		return
	}
	if err := w.e.cfg.Hypervisor.Continue(ctx, inst); err != nil {
		if ctx.Err() != nil {
			return
		}
		reason := "resume failed: continue: " + err.Error()
		if !w.stopVM(ctx) {
			return
		}
		w.rec.Resuming = false
		w.coldBoot(ctx, spec, wakeAt, reason)
		return
	}
	w.rec.Resuming = false
	w.dropState()
	w.lastExit, w.failedFor, w.unplaced, w.coldReason, w.suspendFailed = nil, nil, "", "", ""
	w.woken(wakeAt)
	w.startIdleClock(spec)
	w.e.cfg.Logger.Info("VM resumed", "vm", w.name, "pid", inst.PID)
	w.publish(PhaseRunning, "")
}

// woken counts a resume a caller asked for and reports how long it took.
func (w *worker) woken(wakeAt time.Time) {
	if wakeAt.IsZero() || w.inst == nil {
		return
	}
	w.rec.Wakes++
	w.save()
	if f := w.e.cfg.Resumed; f != nil {
		f(w.name, time.Since(wakeAt))
	}
}

// coldBoot gives up the saved state and boots the VM afresh: the VM is
// never lost for a state that does not load.
func (w *worker) coldBoot(ctx context.Context, spec *VMSpec, wakeAt time.Time, reason string) {
	w.e.cfg.Logger.Warn("VM not resumed: booting it cold", "vm", w.name, "reason", reason)
	w.dropState()
	w.coldReason = reason + "; booted cold"
	w.create(ctx, spec, false)
	w.woken(wakeAt)
}

// dropState forgets the saved state (record first, then the files).
func (w *worker) dropState() {
	if w.rec.Suspended != nil || w.rec.Suspending || w.rec.Resuming {
		w.rec.Suspended, w.rec.Suspending, w.rec.Resuming = nil, false, false
		w.save()
	}
	if err := os.RemoveAll(w.stateDir()); err != nil {
		w.e.cfg.Logger.Warn("remove the saved state", "vm", w.name, "err", err)
	}
}

// endSaved ends a VMM whose guest is saved and paused: a daemon died
// between the save and the VMM's end, or the VMM did not end after it.
// Its end is no crash. Only a VMM that survives SIGKILL stays: recorded
// (nothing starts a second one) and the VM failed, saying so.
func (w *worker) endSaved(ctx context.Context, inst Instance) {
	if w.watch != nil {
		w.watch.cancel()
		<-w.watch.done
	}
	actx, cancel := context.WithTimeout(ctx, 10*time.Second)
	err := w.e.cfg.Hypervisor.Adopt(actx, inst) // still that VMM?
	cancel()
	if err == nil {
		w.e.cfg.Logger.Info("ending the VMM of a VM whose state was saved", "vm", w.name, "pid", inst.PID)
		err = w.e.cfg.Hypervisor.Stop(ctx, inst, 0)
		if pfd, perr := OpenPidfd(inst); perr == nil {
			alive := !pfd.Exited()
			pfd.Close()
			if alive {
				// Watched again: its end, when it comes, is an exit.
				if w.watch != nil {
					w.watch.endConsole(0)
					w.watch.pfd.Close()
					w.watch, w.inst = nil, nil
				}
				_ = w.startWatch(inst)
				w.publish(PhaseFailed, fmt.Sprintf("suspended, but its VMM pid %d does not end: %v", inst.PID, err))
				return
			}
		}
	}
	if w.watch != nil {
		w.watch.endConsole(2 * time.Second)
		w.watch.pfd.Reap()
		w.watch.pfd.Close()
		w.watch = nil
	} else if pfd, err := OpenPidfd(inst); err == nil {
		pfd.Reap()
		pfd.Close()
	}
	w.inst = nil
	w.rec.Instance = nil
	w.save()
}

// settleAdopted finishes what a daemon killed inside a suspend or a resume
// left: a live VMM's guest is continued and the state dropped (it is
// partial, or its guest runs again); a dead one's state is dropped and
// adopt has made its end an exit the restart policy acts on.
func (w *worker) settleAdopted(ctx context.Context) {
	if !w.rec.Suspending && !w.rec.Resuming {
		return
	}
	if w.inst != nil {
		if err := w.e.cfg.Hypervisor.Continue(ctx, *w.inst); err != nil {
			w.e.cfg.Logger.Warn("a guest left paused by a suspend or resume does not run: restarting it", "vm", w.name, "err", err)
			if w.stopVM(ctx) {
				w.lastExit = &exitEvent{at: time.Now(), reason: "continue after a daemon restart: " + err.Error()}
				w.failedFor = cloneSpec(&w.rec.Spec)
				w.nextStart = time.Now()
			}
		} else {
			w.e.cfg.Logger.Info("continued a guest left paused by a daemon that died", "vm", w.name)
		}
	}
	w.dropState()
	if w.inst != nil {
		w.publish(PhaseRunning, w.unplaced)
	}
}

// idleClock tracks the traffic of a VM with idleSuspend.
type idleClock struct {
	known    bool      // accepted holds a reading
	accepted uint64    // the last reading of Traffic.Accepted
	busy     time.Time // the last time a connection was open or new
}

func (c *idleClock) reset() { *c = idleClock{} }

// startIdleClock starts counting a VM's idle time from now (it has just
// started or resumed), and arms its first look.
func (w *worker) startIdleClock(spec *VMSpec) {
	w.idle.reset()
	w.idleFor(spec)
}

// idleFor reads the VM's traffic and says whether it has been idle for its
// idleSuspend (and a suspend may be tried); otherwise it arms the next
// look.
func (w *worker) idleFor(spec *VMSpec) bool {
	if spec.IdleSuspend <= 0 || w.e.cfg.Traffic == nil {
		return false
	}
	now := time.Now()
	t, ok := w.e.cfg.Traffic(w.name)
	c := &w.idle
	switch {
	case !ok:
		c.reset() // unknown is busy
	case !c.known || t.Active > 0 || t.Accepted != c.accepted:
		c.known, c.accepted, c.busy = true, t.Accepted, now
	}
	if c.known && now.Sub(c.busy) >= spec.IdleSuspend && !now.Before(w.suspendRetry) {
		return true
	}
	next := now.Add(w.e.cfg.IdleCheck)
	if due := c.busy.Add(spec.IdleSuspend); c.known && due.Before(next) {
		next = due
	}
	if next.Before(w.suspendRetry) {
		next = w.suspendRetry
	}
	w.arm(next)
	return false
}

// runningDetail is a running VM's detail: what is wrong though it runs.
func (w *worker) runningDetail() string {
	var parts []string
	for _, p := range []string{w.unplaced, w.coldReason, w.suspendFailed} {
		if p != "" {
			parts = append(parts, p)
		}
	}
	return strings.Join(parts, "; ")
}

// diskUsage is the space the files under dir take on disk.
func diskUsage(dir string) int64 {
	var n int64
	_ = filepath.WalkDir(dir, func(_ string, d fs.DirEntry, err error) error {
		if err != nil || d.IsDir() {
			return nil
		}
		if fi, err := d.Info(); err == nil {
			if st, ok := fi.Sys().(*syscall.Stat_t); ok {
				n += st.Blocks * 512
			}
		}
		return nil
	})
	return n
}
