package supervisor

import (
	"context"
	"errors"
	"os"
	"path/filepath"
	"strconv"
	"sync"
	"testing"
	"time"

	"github.com/brokkr/brokkr/internal/procfs"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"golang.org/x/sys/unix"
)

func suspended(s *VMSpec) { s.Power = PowerSuspended }

func readRec(t *testing.T, f *fixture, name string) *record {
	t.Helper()
	r, err := readRecord(filepath.Join(f.cfg.StateDir, "vms", name), name)
	require.NoError(t, err)
	require.NotNil(t, r)
	return r
}

// liveVMMs are the processes the fake started that still run.
func (h *procHV) liveVMMs() []int {
	h.mu.Lock()
	defer h.mu.Unlock()
	var out []int
	for _, pid := range h.pids {
		if st, err := procfs.ReadProcStat(pid); err == nil && !st.Exited() {
			out = append(out, pid)
		}
	}
	return out
}

// power: suspended saves the guest and ends its process; power: running
// brings the same guest back in a new process, and the state goes.
func TestPowerSuspendedSavesAndResumesTheSameGuest(t *testing.T) {
	f := newFixture(t, nil)
	f.hv.stateBytes = 256 << 10
	up := waitRow(t, f.eng, "vm", phaseIs(PhaseRunning), vmSpec("vm"))
	down := waitRow(t, f.eng, "vm", phaseIs(PhaseSuspended), vmSpec("vm", suspended))
	assert.Zero(t, down.PID)
	assert.GreaterOrEqual(t, down.StateBytes, int64(256<<10), "the state's size on disk")
	assert.Empty(t, f.hv.liveVMMs(), "no process runs while suspended")
	rec := readRec(t, f, "vm")
	require.NotNil(t, rec.Suspended)
	assert.False(t, rec.Suspended.Idle)
	assert.Nil(t, rec.Instance)
	assert.Equal(t, "proc", rec.Suspended.Kind)
	// It stays suspended: nothing is started while it is desired so.
	for range 5 {
		assert.Equal(t, PhaseSuspended, rowOf(stepNoWait(t, f.eng, vmSpec("vm", suspended)), "vm").Phase)
		time.Sleep(10 * time.Millisecond)
	}

	back := waitRow(t, f.eng, "vm", phaseIs(PhaseRunning), vmSpec("vm"))
	assert.NotEqual(t, up.PID, back.PID)
	assert.Zero(t, back.StateBytes)
	guest, paused := f.hv.guest(back.PID)
	assert.Equal(t, guest, f.hv.guestOf[up.PID], "the same guest, restored")
	assert.False(t, paused, "continued after the restore")
	assert.Equal(t, 1, f.hv.startCount(), "resumed, not booted")
	assert.Zero(t, back.Restarts)
	assert.Zero(t, back.Wakes, "an operator's resume is not a wake")
	_, err := os.Stat(filepath.Join(f.cfg.StateDir, "vms", "vm", stateDirName))
	assert.ErrorIs(t, err, os.ErrNotExist, "the state is removed once the guest runs")
	assert.Equal(t, []int{back.PID}, f.hv.liveVMMs())
}

// A state that cannot be written leaves the VM running in its process with
// the reason in the row, and it is tried again only after SuspendRetry.
func TestAFailedSuspendLeavesTheVMRunning(t *testing.T) {
	f := newFixture(t, func(c *Config) { c.SuspendRetry = 300 * time.Millisecond })
	var mu sync.Mutex
	var tries []time.Time
	f.hv.suspendHook = func(ctx context.Context, stage string) error {
		if stage != "paused" {
			return nil
		}
		mu.Lock()
		defer mu.Unlock()
		tries = append(tries, time.Now())
		return errors.New("write state: no space left on device")
	}
	up := waitRow(t, f.eng, "vm", phaseIs(PhaseRunning), vmSpec("vm"))
	r := waitRow(t, f.eng, "vm", func(r VMStatus) bool {
		mu.Lock()
		defer mu.Unlock()
		return len(tries) >= 2 && r.Phase == PhaseRunning
	}, vmSpec("vm", suspended))
	assert.Equal(t, up.PID, r.PID, "the same process runs on")
	assert.Contains(t, r.Detail, "suspend failed: write state: no space left on device")
	_, paused := f.hv.guest(up.PID)
	assert.False(t, paused, "the guest runs again")
	mu.Lock()
	assert.GreaterOrEqual(t, tries[1].Sub(tries[0]), 300*time.Millisecond, "retried before SuspendRetry")
	mu.Unlock()
	rec := readRec(t, f, "vm")
	assert.False(t, rec.Suspending)
	assert.Nil(t, rec.Suspended)
	// Running it again (power running) clears nothing it should not.
	r = waitRow(t, f.eng, "vm", phaseIs(PhaseRunning), vmSpec("vm"))
	assert.Equal(t, up.PID, r.PID)
}

// A real full disk (a small tmpfs as stateDir): the state does not fit, the
// VM runs on, and the record is intact.
func TestSuspendOntoAFullDiskKeepsTheVMRunning(t *testing.T) {
	state := smallTmpfs(t, 1<<20)
	f := newFixture(t, func(c *Config) { c.StateDir = state })
	f.hv.stateBytes = 4 << 20
	up := waitRow(t, f.eng, "vm", phaseIs(PhaseRunning), vmSpec("vm"))
	r := waitRow(t, f.eng, "vm", func(r VMStatus) bool { return r.Phase == PhaseRunning && r.Detail != "" }, vmSpec("vm", suspended))
	assert.Equal(t, PhaseRunning, r.Phase)
	assert.Equal(t, up.PID, r.PID)
	assert.Contains(t, r.Detail, "no space left on device")
	_, err := os.Stat(filepath.Join(state, "vms", "vm", stateDirName))
	assert.ErrorIs(t, err, os.ErrNotExist, "the partial state is removed")
	rec := readRec(t, f, "vm")
	require.NotNil(t, rec.Instance)
	assert.Equal(t, up.PID, rec.Instance.PID)
}

// A state that cannot be restored gives way to a cold boot, with the
// reason: the VM is never lost for it.
func TestAStateThatDoesNotLoadBootsCold(t *testing.T) {
	f := newFixture(t, nil)
	up := waitRow(t, f.eng, "vm", phaseIs(PhaseRunning), vmSpec("vm"))
	waitRow(t, f.eng, "vm", phaseIs(PhaseSuspended), vmSpec("vm", suspended))
	require.NoError(t, os.Remove(filepath.Join(f.cfg.StateDir, "vms", "vm", stateDirName, "state")))
	r := waitRow(t, f.eng, "vm", phaseIs(PhaseRunning), vmSpec("vm"))
	assert.Contains(t, r.Detail, "resume failed: ")
	assert.Contains(t, r.Detail, "; booted cold")
	assert.Equal(t, 2, f.hv.startCount(), "booted afresh")
	guest, _ := f.hv.guest(r.PID)
	assert.NotEqual(t, f.hv.guestOf[up.PID], guest)
	assert.Nil(t, readRec(t, f, "vm").Suspended)
}

// A spec changed while suspended makes the state useless: the resume boots
// cold, saying why.
func TestASpecChangedWhileSuspendedBootsCold(t *testing.T) {
	f := newFixture(t, nil)
	waitRow(t, f.eng, "vm", phaseIs(PhaseRunning), vmSpec("vm"))
	waitRow(t, f.eng, "vm", phaseIs(PhaseSuspended), vmSpec("vm", suspended))
	bigger := func(s *VMSpec) { s.MemoryMiB = 128 }
	r := waitRow(t, f.eng, "vm", func(r VMStatus) bool { return r.Detail != "" }, vmSpec("vm", suspended, bigger))
	assert.Equal(t, PhaseSuspended, r.Phase)
	assert.Contains(t, r.Detail, "the spec changed since the suspend")
	r = waitRow(t, f.eng, "vm", phaseIs(PhaseRunning), vmSpec("vm", bigger))
	assert.Contains(t, r.Detail, "the spec changed while it was suspended; booted cold")
	assert.Equal(t, 0, f.hv.restoreCount())
	assert.Equal(t, 128, f.hv.startList()[1].MemoryMiB)
}

// trafficOf is a settable Config.Traffic.
type trafficOf struct {
	mu sync.Mutex
	t  Traffic
	ok bool
}

func (c *trafficOf) read(string) (Traffic, bool) {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.t, c.ok
}

func (c *trafficOf) set(active, accepted uint64) {
	c.mu.Lock()
	c.t, c.ok = Traffic{Active: active, Accepted: accepted}, true
	c.mu.Unlock()
}

// idleSuspend suspends a VM once no connection has been open or new for
// that long, not while one is open or callers keep coming; a wake brings
// it back, counted and timed.
func TestIdleSuspendAndWake(t *testing.T) {
	traffic := &trafficOf{}
	var mu sync.Mutex
	var resumed []time.Duration
	f := newFixture(t, func(c *Config) {
		c.Traffic, c.IdleCheck = traffic.read, 10*time.Millisecond
		c.Resumed = func(vm string, took time.Duration) {
			mu.Lock()
			resumed = append(resumed, took)
			mu.Unlock()
		}
	})
	const idle = 300 * time.Millisecond
	spec := vmSpec("vm", func(s *VMSpec) { s.IdleSuspend = idle })
	traffic.set(1, 1) // one connection open
	up := waitRow(t, f.eng, "vm", phaseIs(PhaseRunning), spec)
	// Held for three idle periods: an open connection keeps it running.
	for end := time.Now().Add(3 * idle); time.Now().Before(end); time.Sleep(20 * time.Millisecond) {
		r := rowOf(stepNoWait(t, f.eng, spec), "vm")
		require.Equal(t, PhaseRunning, r.Phase, "suspended with a connection open")
	}
	// New connections, none held: still running while they keep coming.
	var quiet time.Time // the last new connection
	for i := uint64(2); i < 12; i++ {
		traffic.set(0, i)
		quiet = time.Now()
		time.Sleep(idle / 5)
		require.Equal(t, PhaseRunning, rowOf(stepNoWait(t, f.eng, spec), "vm").Phase, "suspended while callers came")
	}
	r := waitRow(t, f.eng, "vm", phaseIs(PhaseSuspended), spec)
	assert.GreaterOrEqual(t, time.Since(quiet), idle, "suspended before the idle time")
	assert.Zero(t, r.PID)
	require.True(t, readRec(t, f, "vm").Suspended.Idle)
	// Desired running all along, yet it stays suspended until a caller.
	for range 5 {
		assert.Equal(t, PhaseSuspended, rowOf(stepNoWait(t, f.eng, spec), "vm").Phase)
		time.Sleep(20 * time.Millisecond)
	}
	require.True(t, f.eng.Wake("vm"))
	assert.False(t, f.eng.Wake("nope"))
	back := waitRow(t, f.eng, "vm", phaseIs(PhaseRunning), spec)
	assert.NotEqual(t, up.PID, back.PID)
	assert.Equal(t, 1, back.Wakes)
	mu.Lock()
	require.Len(t, resumed, 1)
	mu.Unlock()
	guest, _ := f.hv.guest(back.PID)
	assert.Equal(t, f.hv.guestOf[up.PID], guest)
	// A wake for a running VM does nothing.
	f.eng.Wake("vm")
	time.Sleep(50 * time.Millisecond)
	assert.Equal(t, back.PID, rowOf(stepNoWait(t, f.eng, spec), "vm").PID)
	// And it is suspended again once idle.
	waitRow(t, f.eng, "vm", phaseIs(PhaseSuspended), spec)
}

// Counters that cannot be read are taken for traffic: the VM is not
// suspended on a guess.
func TestUnknownTrafficIsNotIdle(t *testing.T) {
	traffic := &trafficOf{} // ok false
	f := newFixture(t, func(c *Config) { c.Traffic, c.IdleCheck = traffic.read, 10*time.Millisecond })
	spec := vmSpec("vm", func(s *VMSpec) { s.IdleSuspend = 50 * time.Millisecond })
	waitRow(t, f.eng, "vm", phaseIs(PhaseRunning), spec)
	for end := time.Now().Add(500 * time.Millisecond); time.Now().Before(end); time.Sleep(20 * time.Millisecond) {
		require.Equal(t, PhaseRunning, rowOf(stepNoWait(t, f.eng, spec), "vm").Phase)
	}
}

// killedAt stops the engine while the hook is blocked, as a SIGKILL of the
// daemon at that point would leave things (the hook returns only once the
// engine's context has ended, and the worker then touches nothing).
func killedAt(t *testing.T, f *fixture, arrived <-chan struct{}) {
	t.Helper()
	select {
	case <-arrived:
	case <-time.After(testWait):
		t.Fatal("the hook was never reached")
	}
	f.eng.Stop()
}

func blockUntilDone(arrived chan<- struct{}) func(ctx context.Context) error {
	return func(ctx context.Context) error {
		select {
		case arrived <- struct{}{}:
		default:
		}
		<-ctx.Done()
		return ctx.Err()
	}
}

// A daemon killed at any step of a suspend or a resume: the next one ends
// with the VM suspended or running, the same guest, one process at most.
func TestADaemonKilledInsideASuspendOrResume(t *testing.T) {
	for _, c := range []struct {
		name string
		arm  func(h *procHV, arrived chan<- struct{})
		// the desired power while the daemon dies and after
		during, after Power
		want          string
	}{
		{"suspending", func(h *procHV, a chan<- struct{}) {
			block := blockUntilDone(a)
			h.suspendHook = func(ctx context.Context, s string) error {
				if s == "paused" {
					return block(ctx)
				}
				return nil
			}
		}, PowerSuspended, PowerSuspended, PhaseSuspended},
		{"suspending, then running", func(h *procHV, a chan<- struct{}) {
			block := blockUntilDone(a)
			h.suspendHook = func(ctx context.Context, s string) error {
				if s == "paused" {
					return block(ctx)
				}
				return nil
			}
		}, PowerSuspended, PowerRunning, PhaseRunning},
		{"saved, VMM not ended", func(h *procHV, a chan<- struct{}) {
			block := blockUntilDone(a)
			h.suspendHook = func(ctx context.Context, s string) error {
				if s == "saved" {
					return block(ctx)
				}
				return nil
			}
		}, PowerSuspended, PowerSuspended, PhaseSuspended},
		{"saved, VMM not ended, then running", func(h *procHV, a chan<- struct{}) {
			block := blockUntilDone(a)
			h.suspendHook = func(ctx context.Context, s string) error {
				if s == "saved" {
					return block(ctx)
				}
				return nil
			}
		}, PowerSuspended, PowerRunning, PhaseRunning},
		{"resuming, VMM not recorded", func(h *procHV, a chan<- struct{}) {
			block := blockUntilDone(a)
			h.restoreHook = func(ctx context.Context, _ LaunchConfig) error { return block(ctx) }
		}, PowerRunning, PowerRunning, PhaseRunning},
		{"resuming, VMM recorded, not continued", func(h *procHV, a chan<- struct{}) {
			block := blockUntilDone(a)
			h.continueHook = func(ctx context.Context, _ Instance) error { return block(ctx) }
		}, PowerRunning, PowerRunning, PhaseRunning},
		{"resuming, then suspended", func(h *procHV, a chan<- struct{}) {
			block := blockUntilDone(a)
			h.restoreHook = func(ctx context.Context, _ LaunchConfig) error { return block(ctx) }
		}, PowerRunning, PowerSuspended, PhaseSuspended},
	} {
		t.Run(c.name, func(t *testing.T) {
			f := newFixture(t, nil)
			up := waitRow(t, f.eng, "vm", phaseIs(PhaseRunning), vmSpec("vm"))
			guest, _ := f.hv.guest(up.PID)
			resuming := c.during == PowerRunning
			if resuming {
				waitRow(t, f.eng, "vm", phaseIs(PhaseSuspended), vmSpec("vm", suspended))
			}
			arrived := make(chan struct{}, 1)
			c.arm(f.hv, arrived)
			stepNoWait(t, f.eng, vmSpec("vm", func(s *VMSpec) { s.Power = c.during }))
			killedAt(t, f, arrived)
			f.hv.suspendHook, f.hv.restoreHook, f.hv.continueHook = nil, nil, nil

			f.eng = f.open()
			r := waitRow(t, f.eng, "vm", phaseIs(c.want), vmSpec("vm", func(s *VMSpec) { s.Power = c.after }))
			live := f.hv.liveVMMs()
			if c.want == PhaseRunning {
				require.Equal(t, []int{r.PID}, live, "exactly one process runs the VM")
				got, paused := f.hv.guest(r.PID)
				assert.Equal(t, guest, got, "the same guest")
				assert.False(t, paused, "and it runs")
				rec := readRec(t, f, "vm")
				assert.False(t, rec.Suspending || rec.Resuming || rec.Suspended != nil, "record settled: %+v", rec)
			} else {
				assert.Empty(t, live, "no process runs while suspended")
				rec := readRec(t, f, "vm")
				require.NotNil(t, rec.Suspended)
				assert.False(t, rec.Suspending || rec.Resuming)
				// And it comes back as the same guest.
				r = waitRow(t, f.eng, "vm", phaseIs(PhaseRunning), vmSpec("vm"))
				got, _ := f.hv.guest(r.PID)
				assert.Equal(t, guest, got, "the same guest")
				assert.Equal(t, []int{r.PID}, f.hv.liveVMMs())
			}
			assert.Equal(t, 1, f.hv.startCount(), "never booted cold")
		})
	}
}

// A VM removed or stopped while suspended: its state goes with it.
func TestStopOrRemoveOfASuspendedVMDropsItsState(t *testing.T) {
	f := newFixture(t, nil)
	waitRow(t, f.eng, "vm", phaseIs(PhaseRunning), vmSpec("vm"))
	waitRow(t, f.eng, "vm", phaseIs(PhaseSuspended), vmSpec("vm", suspended))
	waitRow(t, f.eng, "vm", phaseIs(PhaseStopped), vmSpec("vm", func(s *VMSpec) { s.Power = PowerStopped }))
	_, err := os.Stat(filepath.Join(f.cfg.StateDir, "vms", "vm", stateDirName))
	assert.ErrorIs(t, err, os.ErrNotExist)
	r := waitRow(t, f.eng, "vm", phaseIs(PhaseRunning), vmSpec("vm"))
	assert.Equal(t, 2, f.hv.startCount(), "a stopped VM boots cold")
	waitRow(t, f.eng, "vm", phaseIs(PhaseSuspended), vmSpec("vm", suspended))
	waitReaped(t, f.eng)
	_, err = os.Stat(filepath.Join(f.cfg.StateDir, "vms", "vm"))
	assert.ErrorIs(t, err, os.ErrNotExist)
	assert.Error(t, CheckIdentity(Instance{PID: r.PID}))
}

// smallTmpfs is nstest.SmallTmpfs, which this package cannot import (nstest
// imports it).
func smallTmpfs(t *testing.T, size int64) string {
	t.Helper()
	if os.Geteuid() != 0 || os.Getenv("BROKKR_TEST_UNPRIVILEGED") != "" {
		t.Skip("needs root: mounts a tmpfs")
	}
	dir := t.TempDir()
	require.NoError(t, unix.Mount("tmpfs", dir, "tmpfs", 0, "size="+strconv.FormatInt(size, 10)+",mode=0700"))
	t.Cleanup(func() { _ = unix.Unmount(dir, unix.MNT_DETACH) })
	return dir
}

// A VMM that does not end after its guest was saved is ended harder (its
// state is good): the VM ends suspended, its state kept, no process left.
func TestAVMMThatDoesNotEndAfterTheSaveIsEnded(t *testing.T) {
	f := newFixture(t, nil)
	f.hv.suspendHook = func(ctx context.Context, stage string) error {
		if stage == "saved" {
			return errors.New("vmm.shutdown: HTTP 500")
		}
		return nil
	}
	up := waitRow(t, f.eng, "vm", phaseIs(PhaseRunning), vmSpec("vm"))
	r := waitRow(t, f.eng, "vm", phaseIs(PhaseSuspended), vmSpec("vm", suspended))
	assert.Zero(t, r.PID)
	assert.Empty(t, f.hv.liveVMMs())
	assert.Error(t, CheckIdentity(Instance{PID: up.PID}))
	rec := readRec(t, f, "vm")
	require.NotNil(t, rec.Suspended, "the state is kept")
	assert.Nil(t, rec.Instance)
	f.hv.suspendHook = nil
	back := waitRow(t, f.eng, "vm", phaseIs(PhaseRunning), vmSpec("vm"))
	got, _ := f.hv.guest(back.PID)
	assert.Equal(t, f.hv.guestOf[up.PID], got, "the same guest, restored")
}
