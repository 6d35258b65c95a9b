package supervisor

import (
	"context"
	"log/slog"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

// A VM stuck in a long download must not hold up the report, and its row
// must say which step it is stuck in.
func TestWedgedVMDoesNotDelayReport(t *testing.T) {
	f := newFixture(t, nil)
	arrived, release := make(chan string, 1), make(chan struct{})
	f.images.fetch = wedge(arrived, release)

	stepNoWait(t, f.eng, vmSpec("slow"))
	waitFor(t, arrived, "the create to reach the download")

	row := rowOf(stepNoWait(t, f.eng, vmSpec("slow")), "slow")
	require.NotNil(t, row, "a VM in the middle of its create still has a row")
	assert.Equal(t, PhaseCreating, row.Phase)
	assert.Equal(t, "downloading kernel image 40%", row.Detail)
	require.NotNil(t, row.Progress, "a download carries its progress")
	assert.Equal(t, Progress{Done: 40, Total: 100}, *row.Progress)

	close(release)
	waitRow(t, f.eng, "slow", func(r VMStatus) bool { return r.Progress == nil }, vmSpec("slow"))
	waitRow(t, f.eng, "slow", phaseIs(PhaseRunning), vmSpec("slow"))
}

// Two VMs' slow creates overlap in time: neither waits for the other.
func TestVMsReconcileConcurrently(t *testing.T) {
	f := newFixture(t, nil)
	arrived, release := make(chan string, 2), make(chan struct{})
	f.images.fetch = wedge(arrived, release)

	stepNoWait(t, f.eng, vmSpec("a"), vmSpec("b"))
	got := map[string]bool{}
	for range 2 {
		got[waitFor(t, arrived, "both VMs inside their download at once")] = true
	}
	assert.Len(t, got, 2)
	close(release)
	waitRow(t, f.eng, "a", phaseIs(PhaseRunning), vmSpec("a"), vmSpec("b"))
	waitRow(t, f.eng, "b", phaseIs(PhaseRunning), vmSpec("a"), vmSpec("b"))
}

// Specs that arrive while the VM is busy replace one another: when the
// worker is free it acts on the newest, and the one in between is never
// started.
func TestNewestSpecWinsForBusyVM(t *testing.T) {
	f := newFixture(t, nil)
	arrived, release := make(chan string, 1), make(chan struct{})
	f.images.fetch = wedge(arrived, release)
	cpus := func(n int) func(*VMSpec) { return func(s *VMSpec) { s.CPUs = n } }

	stepNoWait(t, f.eng, vmSpec("vm", cpus(1)))
	waitFor(t, arrived, "the first create")
	stepNoWait(t, f.eng, vmSpec("vm", cpus(3))) // superseded before the worker is free
	stepNoWait(t, f.eng, vmSpec("vm", cpus(2)))
	close(release)

	waitRow(t, f.eng, "vm", func(s VMStatus) bool {
		return s.Phase == PhaseRunning && f.hv.startCount() == 2
	}, vmSpec("vm", cpus(2)))
	starts := f.hv.startList()
	require.Len(t, starts, 2)
	assert.Equal(t, 1, starts[0].CPUs)
	assert.Equal(t, 2, starts[1].CPUs, "the newest spec is the one applied")
	for _, s := range starts {
		assert.NotEqual(t, 3, s.CPUs, "the superseded spec was acted on")
	}
}

// A worker appears the first time a VM is seen (in desired state or in the
// records) and is reaped once the VM is gone from both.
func TestWorkerSpawnedOnFirstSightAndReapedWhenGone(t *testing.T) {
	f := newFixture(t, nil)
	assert.Equal(t, 0, f.eng.workerCount())
	f.eng.Step(context.Background(), []VMSpec{vmSpec("vm")})
	assert.Equal(t, 1, f.eng.workerCount(), "spawned on first sight")
	waitRow(t, f.eng, "vm", phaseIs(PhaseRunning), vmSpec("vm"))
	pid := rowOf(f.eng.Step(context.Background(), []VMSpec{vmSpec("vm")}), "vm").PID

	// The daemon restarts: the record alone makes a worker.
	f.eng.Stop()
	f.eng = f.open()
	assert.Equal(t, 1, f.eng.workerCount(), "a VM known only from its record has a worker before any Step")

	// Removed from desired: the worker stops the VM, deletes the record,
	// and is reaped on a later Step.
	waitReaped(t, f.eng)
	assert.Equal(t, 0, f.eng.workerCount(), "reaped once gone from desired state and records")
	assert.NoDirExists(t, filepath.Join(f.cfg.StateDir, "vms", "vm"))
	assert.Error(t, CheckIdentity(Instance{PID: pid}), "the removed VM's process was stopped")
	assert.Empty(t, f.eng.Step(context.Background(), nil).VMs)
}

// Stop ends every worker, including ones wedged mid-create, and leaves the
// hypervisor processes running.
func TestStopEndsEveryWorker(t *testing.T) {
	f := newFixture(t, nil)
	f.eng.Step(context.Background(), []VMSpec{vmSpec("up")})
	up := waitRow(t, f.eng, "up", phaseIs(PhaseRunning), vmSpec("up"))

	arrived := make(chan string, 1)
	f.images.fetch = wedge(arrived, make(chan struct{})) // never released
	stepNoWait(t, f.eng, vmSpec("up"), vmSpec("wedged"))
	waitFor(t, arrived, "the wedged create")
	require.Equal(t, 2, f.eng.workerCount())

	stopped := make(chan struct{})
	go func() { f.eng.Stop(); close(stopped) }()
	select {
	case <-stopped:
	case <-time.After(testWait):
		t.Fatal("Stop did not end a wedged worker")
	}
	assert.Equal(t, 0, f.eng.workerCount())
	assert.NoError(t, syscall.Kill(up.PID, 0), "Stop must leave VM processes running")
	// goleak in TestMain proves no worker or watcher goroutine outlived Stop.
}

// With MaxConcurrentCreates=2, a third create waits for a slot (and says so).
func TestCreatesAreCapped(t *testing.T) {
	f := newFixture(t, func(c *Config) { c.MaxConcurrentCreates = 2 })
	arrived, release := make(chan string, 3), make(chan struct{})
	f.images.fetch = wedge(arrived, release)
	all := []VMSpec{vmSpec("a"), vmSpec("b"), vmSpec("c")}

	stepNoWait(t, f.eng, all...)
	waitFor(t, arrived, "first create")
	waitFor(t, arrived, "second create")
	select {
	case vm := <-arrived:
		t.Fatalf("a third create (%s) ran beside two others under a cap of 2", vm)
	case <-time.After(300 * time.Millisecond):
	}
	waiting := 0
	for _, r := range stepNoWait(t, f.eng, all...).VMs {
		if r.Detail == "waiting for a create slot" {
			waiting++
		}
	}
	assert.Equal(t, 1, waiting, "the VM held back says why")
	close(release)
	for _, s := range all {
		waitRow(t, f.eng, s.Name, phaseIs(PhaseRunning), all...)
	}
	assert.Equal(t, 3, f.hv.startCount())
}

// MaxConcurrentCreates=0 means no cap.
func TestZeroCreateCapIsUnlimited(t *testing.T) {
	f := newFixture(t, nil)
	arrived, release := make(chan string, 4), make(chan struct{})
	f.images.fetch = wedge(arrived, release)
	all := []VMSpec{vmSpec("a"), vmSpec("b"), vmSpec("c"), vmSpec("d")}
	stepNoWait(t, f.eng, all...)
	for range 4 {
		waitFor(t, arrived, "all four creates at once")
	}
	close(release)
	for _, s := range all {
		waitRow(t, f.eng, s.Name, phaseIs(PhaseRunning), all...)
	}
}

// While one pass of a VM is parked in its create, new specs, an operator
// restart and a removal all arrive; none of them may start a second pass
// for that VM beside the first. The gauge sees every image fetch, Start and
// Stop for the VM, so two passes at once would show as a high-water of 2.
func TestOnePassAtATimePerVM(t *testing.T) {
	f := newFixture(t, nil)
	g := newGauge()
	f.images.gauge = g
	f.hv.gauge = g
	arrived, release := make(chan string, 8), make(chan struct{})
	f.images.fetch = wedge(arrived, release)

	stepNoWait(t, f.eng, vmSpec("vm"))
	waitFor(t, arrived, "the first pass")
	for i := 2; i < 6; i++ {
		stepNoWait(t, f.eng, vmSpec("vm", func(s *VMSpec) { s.CPUs = i }))
		require.NoError(t, f.eng.Restart("vm"))
	}
	stepNoWait(t, f.eng) // removed while busy
	stepNoWait(t, f.eng, vmSpec("vm", func(s *VMSpec) { s.CPUs = 9 }))
	select {
	case <-arrived:
		t.Fatal("a second pass entered the create while the first was parked in it")
	case <-time.After(300 * time.Millisecond):
	}
	close(release)
	waitRow(t, f.eng, "vm", func(s VMStatus) bool {
		st := f.hv.startList()
		return s.Phase == PhaseRunning && len(st) > 0 && st[len(st)-1].CPUs == 9
	}, vmSpec("vm", func(s *VMSpec) { s.CPUs = 9 }))
	assert.Equal(t, 1, g.highWater("vm"), "two operations for one VM overlapped")
}

// wedgeLog is a logger handler that blocks the goroutine logging msg (the
// first time) until release is closed: a test holds a worker at a chosen
// point of its pass with it.
type wedgeLog struct {
	msg              string
	arrived, release chan struct{}
	once             *sync.Once
}

func newWedgeLog(msg string) *wedgeLog {
	return &wedgeLog{msg: msg, arrived: make(chan struct{}), release: make(chan struct{}), once: &sync.Once{}}
}

func (h *wedgeLog) Enabled(context.Context, slog.Level) bool { return true }
func (h *wedgeLog) WithAttrs([]slog.Attr) slog.Handler       { return h }
func (h *wedgeLog) WithGroup(string) slog.Handler            { return h }
func (h *wedgeLog) Handle(_ context.Context, r slog.Record) error {
	if r.Message == h.msg {
		h.once.Do(func() { close(h.arrived); <-h.release })
	}
	return nil
}

// A busy worker is never reaped. The worker is held at the end of its
// removal of the VM, after its record is gone ("VM removed"): it has taken
// the absence (nothing fresh, no wake pending), it has no record, and it is
// not desired, so only its busy flag keeps Step from reaping it and, when
// the VM comes back, spawning a second worker beside it. (Fails with
// !w.busy removed from reapable: the worker is reaped while held.)
func TestBusyWorkerIsNeverReaped(t *testing.T) {
	wl := newWedgeLog("VM removed")
	f := newFixture(t, func(c *Config) { c.Logger = slog.New(wl) })
	waitRow(t, f.eng, "vm", phaseIs(PhaseRunning), vmSpec("vm"))

	stepNoWait(t, f.eng) // gone from desired state: the worker removes it
	select {
	case <-wl.arrived:
	case <-time.After(testWait):
		t.Fatal("the worker never finished removing the VM")
	}
	_, err := os.Stat(filepath.Join(f.cfg.StateDir, "vms", "vm", "record.json"))
	require.ErrorIs(t, err, os.ErrNotExist, "precondition: the record is gone")
	for range 3 {
		stepNoWait(t, f.eng) // still gone: nothing new for the worker
		assert.Equal(t, 1, f.eng.workerCount(), "a busy worker was reaped")
	}
	stepNoWait(t, f.eng, vmSpec("vm")) // back again: must reach the same worker
	assert.Equal(t, 1, f.eng.workerCount(), "a second worker beside the busy one")
	close(wl.release)
	waitRow(t, f.eng, "vm", phaseIs(PhaseRunning), vmSpec("vm"))
	assert.Equal(t, 1, f.eng.workerCount())

	// Once idle and gone from both desired state and records, it is reaped.
	stepNoWait(t, f.eng)
	waitReaped(t, f.eng)
	assert.Equal(t, 0, f.eng.workerCount())
}

// Every report owns its rows: writing into one report changes neither the
// engine nor any other report, even with reports taken concurrently (-race
// would flag any shared backing array or map).
func TestEveryReportOwnsItsRows(t *testing.T) {
	f := newFixture(t, nil)
	desired := []VMSpec{vmSpec("a"), vmSpec("b")}
	waitRow(t, f.eng, "a", phaseIs(PhaseRunning), desired...)
	waitRow(t, f.eng, "b", phaseIs(PhaseRunning), desired...)

	first := f.eng.Step(context.Background(), desired)
	second := f.eng.Step(context.Background(), desired)
	require.Len(t, first.VMs, 2)
	assert.NotSame(t, &first.VMs[0], &second.VMs[0])
	first.VMs[0].Phase, first.VMs[0].Detail, first.VMs[0].PID = "scribbled", "scribbled", -1
	third := f.eng.Step(context.Background(), desired)
	assert.Equal(t, PhaseRunning, third.VMs[0].Phase)
	assert.Equal(t, second.VMs[0], third.VMs[0], "a write into one report reached another")

	var wg sync.WaitGroup
	for range 4 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for range 50 {
				r := f.eng.Step(context.Background(), desired)
				for i := range r.VMs {
					r.VMs[i].Detail = strings.Repeat("x", i+1)
					r.VMs[i].Restarts++
				}
			}
		}()
	}
	wg.Wait()
	for _, r := range f.eng.Step(context.Background(), desired).VMs {
		assert.Empty(t, r.Detail)
		assert.Zero(t, r.Restarts)
	}
}

// The caller's desired slice is the caller's: reusing it after Step changes
// nothing in the engine.
func TestStepDoesNotKeepCallerSpecs(t *testing.T) {
	f := newFixture(t, nil)
	desired := []VMSpec{vmSpec("vm", func(s *VMSpec) { s.MAC = []byte{2, 0, 0, 0, 0, 1} })}
	f.eng.Step(context.Background(), desired)
	desired[0].MAC[5] = 9
	desired[0].CPUs = 7
	// Wait for the start without stepping again: a later Step would hand
	// the worker a fresh copy and hide a kept reference.
	require.Eventually(t, func() bool { return f.hv.startCount() >= 1 }, testWait, 10*time.Millisecond)
	waitRow(t, f.eng, "vm", phaseIs(PhaseRunning), vmSpec("vm", func(s *VMSpec) { s.MAC = []byte{2, 0, 0, 0, 0, 1} }))
	lc := f.hv.startList()[0]
	assert.Equal(t, 1, lc.CPUs)
	assert.Equal(t, byte(1), lc.MAC[5])
}

// Bad specs are reported with the field named and change nothing.
func TestInvalidSpecIsReportedAndNotApplied(t *testing.T) {
	f := newFixture(t, nil)
	good := vmSpec("vm")
	waitRow(t, f.eng, "vm", phaseIs(PhaseRunning), good)
	bad := good
	bad.CPUs = 0
	r := f.eng.Step(context.Background(), []VMSpec{bad, vmSpec("Bad_Name")})
	row := rowOf(r, "vm")
	require.NotNil(t, row)
	assert.Equal(t, PhaseFailed, row.Phase)
	assert.Contains(t, row.Detail, "cpus")
	assert.Contains(t, rowOf(r, "Bad_Name").Detail, "name")
	time.Sleep(100 * time.Millisecond)
	assert.Equal(t, 1, f.hv.startCount(), "an invalid spec must not stop or restart the VM")
	assert.Equal(t, 1, f.eng.workerCount())
	assert.Equal(t, PhaseRunning, rowOf(f.eng.Step(context.Background(), []VMSpec{good}), "vm").Phase)
}

// A VM waiting for a create slot boots from the newest desired state: under
// a cap of 1, with "a" holding the only slot, "b" is set stopped, "c" is
// deleted and "d" changed while they wait. None of b and c is ever booted,
// and d is booted once, from its new spec.
func TestAVMWaitingForACreateSlotBootsTheNewestSpec(t *testing.T) {
	f := newFixture(t, func(c *Config) { c.MaxConcurrentCreates = 1 })
	arrived, release := make(chan string, 1), make(chan struct{})
	wedged := wedge(arrived, release)
	f.images.fetch = func(ctx context.Context, src Source, progress func(int64, int64)) (string, error) {
		if strings.HasPrefix(src.Location, "/img/a/") {
			return wedged(ctx, src, progress)
		}
		return src.Location, nil
	}
	stepNoWait(t, f.eng, vmSpec("a"))
	waitFor(t, arrived, "a inside its create, holding the slot")
	all := []VMSpec{vmSpec("a"), vmSpec("b"), vmSpec("c"), vmSpec("d")}
	stepNoWait(t, f.eng, all...)
	for _, name := range []string{"b", "c", "d"} {
		waitRow(t, f.eng, name, func(s VMStatus) bool { return s.Detail == "waiting for a create slot" }, all...)
	}

	stopped := vmSpec("b", func(s *VMSpec) { s.Power = PowerStopped })
	changed := vmSpec("d", func(s *VMSpec) { s.CPUs = 2 })
	now := []VMSpec{vmSpec("a"), stopped, changed}
	stepNoWait(t, f.eng, now...)
	close(release)

	waitRow(t, f.eng, "a", phaseIs(PhaseRunning), now...)
	waitRow(t, f.eng, "b", phaseIs(PhaseStopped), now...)
	waitRow(t, f.eng, "d", phaseIs(PhaseRunning), now...)
	deadline := time.Now().Add(testWait)
	for rowOf(f.eng.Step(context.Background(), now), "c") != nil && time.Now().Before(deadline) {
		time.Sleep(10 * time.Millisecond)
	}
	assert.Nil(t, rowOf(f.eng.Step(context.Background(), now), "c"), "the deleted VM is gone")
	assert.NoDirExists(t, filepath.Join(f.cfg.StateDir, "vms", "c"))

	starts := map[string][]int{}
	for _, lc := range f.hv.startList() {
		starts[lc.Name] = append(starts[lc.Name], lc.CPUs)
	}
	assert.Equal(t, map[string][]int{"a": {1}, "d": {2}}, starts,
		"a VM set stopped or deleted while waiting was booted, or one was booted from its superseded spec")
}

// holdingHandler is a slog handler that parks the goroutine logging msg
// until release is closed, signalling arrived: it stops a worker at an
// exact point of its pass.
type holdingHandler struct {
	msg     string
	arrived chan<- struct{}
	release <-chan struct{}
}

func (h holdingHandler) Enabled(context.Context, slog.Level) bool { return true }
func (h holdingHandler) Handle(_ context.Context, r slog.Record) error {
	if r.Message == h.msg {
		select {
		case h.arrived <- struct{}{}:
		default:
		}
		<-h.release
	}
	return nil
}
func (h holdingHandler) WithAttrs([]slog.Attr) slog.Handler { return h }
func (h holdingHandler) WithGroup(string) slog.Handler      { return h }

// The window where only busyness protects a worker: a destroy pass that has
// removed the record (hasRecord is false, desired is nil, nothing is fresh)
// but has not ended. Steps in that window must not reap the worker, and a
// Step naming the VM again must reach the same worker rather than spawn a
// second one for it.
func TestAWorkerFinishingADestroyIsNotReaped(t *testing.T) {
	arrived, release := make(chan struct{}, 1), make(chan struct{})
	releaseAll := sync.OnceFunc(func() { close(release) })
	f := newFixture(t, func(c *Config) {
		c.Logger = slog.New(holdingHandler{msg: "VM removed", arrived: arrived, release: release})
	})
	t.Cleanup(releaseAll) // before the fixture's Stop, which waits for the held worker
	waitRow(t, f.eng, "vm", phaseIs(PhaseRunning), vmSpec("vm"))

	stepNoWait(t, f.eng) // removed from desired state: the destroy pass runs
	select {
	case <-arrived:
	case <-time.After(testWait):
		t.Fatal("the destroy pass never got past removing the record")
	}
	require.NoDirExists(t, filepath.Join(f.cfg.StateDir, "vms", "vm"), "precondition: the record is gone")
	for range 3 {
		stepNoWait(t, f.eng)
		require.Equal(t, 1, f.eng.workerCount(), "a worker still inside its destroy pass was reaped")
	}
	stepNoWait(t, f.eng, vmSpec("vm")) // wanted again while the destroy finishes
	assert.Equal(t, 1, f.eng.workerCount(), "a second worker was spawned for a VM whose worker is still busy")
	releaseAll()
	waitRow(t, f.eng, "vm", func(s VMStatus) bool { return s.Phase == PhaseRunning && f.hv.startCount() == 2 }, vmSpec("vm"))
}

// Step never waits on a worker, even one wedged inside a backend call: one
// VM is stuck in Hypervisor.Start, another in Hypervisor.Stop, and every
// Step (and Restart) returns within stepBound with their rows saying so.
func TestStepNeverWaitsOnAWorkerInsideABackendCall(t *testing.T) {
	f := newFixture(t, func(c *Config) { c.StartTimeout = time.Minute; c.StopGrace = time.Minute })
	in, release := make(chan string, 2), make(chan struct{})
	releaseAll := sync.OnceFunc(func() { close(release) })
	t.Cleanup(releaseAll) // before the fixture's Stop: the wedged calls must end
	park := func(ctx context.Context, what string) {
		select {
		case in <- what:
		default: // after the release, later calls pass straight through
		}
		select {
		case <-release:
		case <-ctx.Done():
		}
	}
	f.hv.beforeStart = func(ctx context.Context, lc LaunchConfig) error {
		if lc.Name == "starting" {
			park(ctx, "start")
		}
		return nil
	}
	f.hv.beforeStop = func(ctx context.Context, _ Instance) { park(ctx, "stop") }
	waitRow(t, f.eng, "stopping", phaseIs(PhaseRunning), vmSpec("stopping"))

	desired := []VMSpec{vmSpec("starting"), vmSpec("stopping", func(s *VMSpec) { s.Power = PowerStopped })}
	f.eng.Step(context.Background(), desired)
	got := map[string]bool{}
	for range 2 {
		got[waitFor(t, in, "both workers inside a backend call")] = true
	}
	require.Equal(t, map[string]bool{"start": true, "stop": true}, got)

	var slowest time.Duration
	var last Report
	for range 20 {
		t0 := time.Now()
		done := make(chan Report, 1)
		go func() { done <- f.eng.Step(context.Background(), desired) }()
		select {
		case last = <-done:
		case <-time.After(stepBound):
			t.Fatalf("Step took longer than %s with workers inside Start and Stop: it waits on a busy VM", stepBound)
		}
		slowest = max(slowest, time.Since(t0))
		t0 = time.Now()
		require.NoError(t, f.eng.Restart("starting"))
		require.Less(t, time.Since(t0), stepBound, "Restart waited on a busy VM")
		time.Sleep(5 * time.Millisecond)
	}
	t.Logf("slowest Step: %s", slowest)
	assert.Equal(t, VMStatus{Name: "starting", Phase: PhaseStarting, Detail: "starting proc"}, *rowOf(last, "starting"))
	assert.Equal(t, PhaseStopping, rowOf(last, "stopping").Phase)
	releaseAll()
}
