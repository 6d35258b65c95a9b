package chv

import (
	"context"
	"os"
	"path/filepath"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/brokkr/brokkr/supervisor"
)

// The engine driving the real backend against the fake VMM process.

func (e *env) engine(mod func(*supervisor.Config)) *supervisor.Engine {
	e.t.Helper()
	cfg := supervisor.Config{
		StateDir: filepath.Join(e.dir, "state"), RunDir: filepath.Join(e.dir, "run"),
		Hypervisor: e.backend, BackoffBase: 50 * time.Millisecond,
		StopGrace: time.Second, StartTimeout: 5 * time.Second,
	}
	if mod != nil {
		mod(&cfg)
	}
	eng, err := supervisor.NewEngine(cfg)
	require.NoError(e.t, err)
	e.t.Cleanup(eng.Stop)
	return eng
}

func (e *env) spec(name string, mods ...func(*supervisor.VMSpec)) supervisor.VMSpec {
	kernel := filepath.Join(e.dir, "vmlinuz")
	if _, err := os.Stat(kernel); err != nil {
		require.NoError(e.t, os.WriteFile(kernel, []byte("not really a kernel"), 0o600))
	}
	s := supervisor.VMSpec{Name: name, CPUs: 1, MemoryMiB: 64, Kernel: supervisor.Source{Location: kernel},
		Cmdline: "console=ttyS0", Power: supervisor.PowerRunning, Restart: supervisor.RestartAlways}
	for _, m := range mods {
		m(&s)
	}
	return s
}

func waitRow(t *testing.T, eng *supervisor.Engine, name string, ok func(supervisor.VMStatus) bool, desired ...supervisor.VMSpec) supervisor.VMStatus {
	t.Helper()
	var last supervisor.VMStatus
	deadline := time.Now().Add(30 * time.Second)
	for time.Now().Before(deadline) {
		for _, r := range eng.Step(context.Background(), desired).VMs {
			if r.Name == name {
				last = r
				if ok(r) {
					return r
				}
			}
		}
		time.Sleep(20 * time.Millisecond)
	}
	t.Fatalf("VM %s never reached the expected state; last row %+v", name, last)
	return last
}

func running(r supervisor.VMStatus) bool { return r.Phase == supervisor.PhaseRunning }

// The daemon restarts: a new Engine over the same StateDir adopts the VMM
// (same pid) and never starts a second one. The serial console reaches
// console.log through the engine, before and after the restart.
func TestEngineAdoptsVMMAcrossRestart(t *testing.T) {
	e := newEnv(t)
	s := e.spec("web")
	eng := e.engine(nil)
	up := waitRow(t, eng, "web", running, s)
	console := filepath.Join(e.dir, "state", "vms", "web", "console.log")
	require.Eventually(t, func() bool {
		b, _ := os.ReadFile(console)
		return strings.Contains(string(b), "chfake: booting")
	}, 30*time.Second, 20*time.Millisecond, "serial output never reached console.log")

	eng.Stop()
	require.NoError(t, supervisor.CheckIdentity(supervisor.Instance{PID: up.PID, StartTime: mustStart(t, up.PID)}),
		"the VMM must survive the engine")
	eng2 := e.engine(nil)
	again := waitRow(t, eng2, "web", running, s)
	assert.Equal(t, up.PID, again.PID, "adopted, not restarted")
	assert.Equal(t, []int{up.PID}, fakePIDs(e.dir), "exactly one VMM for the VM")
	assert.Equal(t, 1, strings.Count(strings.Join(e.calls(), "\n"), "vm.create"), "a second VM was created")
	assert.GreaterOrEqual(t, strings.Count(strings.Join(e.calls(), "\n"), "vmm.ping"), 2, "adoption asks the API")

	// Removing the VM stops it through the API and deletes its state.
	require.Eventually(t, func() bool { return len(eng2.Step(context.Background(), nil).VMs) == 0 },
		30*time.Second, 20*time.Millisecond, "the removed VM's row and worker never went away")
	assert.Empty(t, fakePIDs(e.dir))
	assert.NoDirExists(t, filepath.Join(e.dir, "state", "vms", "web"))
	assert.Contains(t, e.calls(), "PUT vm.power-button 204")
}

func mustStart(t *testing.T, pid int) uint64 {
	st, err := supervisor.ProcStartTime(pid)
	require.NoError(t, err)
	return st
}

// kill -9 of the VMM is noticed at once and the VM restarted under
// "always"; under "never" it stays down and says why.
func TestEngineRestartsKilledVMM(t *testing.T) {
	e := newEnv(t)
	s := e.spec("vm")
	eng := e.engine(nil)
	up := waitRow(t, eng, "vm", running, s)
	require.NoError(t, syscall.Kill(up.PID, syscall.SIGKILL))
	again := waitRow(t, eng, "vm", func(r supervisor.VMStatus) bool { return running(r) && r.PID != up.PID }, s)
	assert.Equal(t, 1, again.Restarts)
	assert.Equal(t, []int{again.PID}, fakePIDs(e.dir))

	never := e.spec("vm", func(s *supervisor.VMSpec) { s.Restart = supervisor.RestartNever })
	waitRow(t, eng, "vm", running, never)
	require.NoError(t, syscall.Kill(again.PID, syscall.SIGKILL))
	r := waitRow(t, eng, "vm", func(r supervisor.VMStatus) bool { return r.Phase == supervisor.PhaseFailed }, never)
	assert.Contains(t, r.Detail, "killed by signal 9")
	assert.Empty(t, fakePIDs(e.dir))
}

// A VMM that crashes after every boot is restarted with a growing delay,
// and the restart count climbs.
func TestEngineCrashLoopBacksOff(t *testing.T) {
	e := newEnv(t, "CHFAKE_CRASH_AFTER=100ms")
	eng := e.engine(nil)
	s := e.spec("vm")
	r := waitRow(t, eng, "vm", func(r supervisor.VMStatus) bool {
		return r.Restarts >= 3 && strings.Contains(r.Detail, "exit status 1; restarting in")
	}, s)
	assert.LessOrEqual(t, len(fakePIDs(e.dir)), 1, "never two VMMs for one VM")
	assert.Contains(t, r.Detail, "pid ")
}

// A VMM whose boot hangs is cut off at StartTimeout with a detail saying so.
func TestEngineReportsBootTimeout(t *testing.T) {
	e := newEnv(t, "CHFAKE_HANG_BOOT=1")
	// Long enough for the fake to reach vm.boot on a loaded machine (it then
	// hangs there), so the timeout always names that step.
	eng := e.engine(func(c *supervisor.Config) { c.StartTimeout = 2 * time.Second })
	s := e.spec("vm", func(s *supervisor.VMSpec) { s.Restart = supervisor.RestartNever })
	r := waitRow(t, eng, "vm", func(r supervisor.VMStatus) bool { return r.Phase == supervisor.PhaseFailed }, s)
	assert.Contains(t, r.Detail, "start: timed out after 2s")
	assert.Contains(t, r.Detail, "vm.boot")
	assert.Empty(t, fakePIDs(e.dir))
}

// console.log stays under its cap: older output rotates to console.log.1.
func TestEngineCapsConsoleLog(t *testing.T) {
	e := newEnv(t, "CHFAKE_CONSOLE_BYTES=5000")
	eng := e.engine(func(c *supervisor.Config) { c.ConsoleMaxBytes = 1024 })
	waitRow(t, eng, "vm", running, e.spec("vm"))
	dir := filepath.Join(e.dir, "state", "vms", "vm")
	// 5,000 bytes through a 1,024-byte cap: rotated, and never over the cap.
	require.Eventually(t, func() bool {
		old, err1 := os.Stat(filepath.Join(dir, "console.log.1"))
		cur, err2 := os.Stat(filepath.Join(dir, "console.log"))
		return err1 == nil && err2 == nil && old.Size() == 1024 && cur.Size() > 0 && cur.Size() <= 1024
	}, 30*time.Second, 20*time.Millisecond, "console.log was not capped and rotated")
}

// Two engines over one StateDir (a second daemon started by mistake): the
// per-VM lock lets one act; the other reports the lock and creates nothing.
// When the first goes, the second adopts the same VMM.
func TestTwoEnginesNeverRunTwoVMMs(t *testing.T) {
	e := newEnv(t)
	s := e.spec("vm")
	first := e.engine(nil)
	up := waitRow(t, first, "vm", running, s)
	second := e.engine(nil)
	r := waitRow(t, second, "vm", func(r supervisor.VMStatus) bool { return r.Phase == supervisor.PhaseFailed }, s)
	assert.Contains(t, r.Detail, "locked by another supervisor")
	time.Sleep(200 * time.Millisecond)
	assert.Equal(t, []int{up.PID}, fakePIDs(e.dir), "a second VMM was started")

	first.Stop()
	again := waitRow(t, second, "vm", running, s)
	assert.Equal(t, up.PID, again.PID)
	assert.Equal(t, []int{up.PID}, fakePIDs(e.dir))
	assert.Equal(t, 1, strings.Count(strings.Join(e.calls(), "\n"), "vm.create"))
}

// A daemon that shuts down while a VM's stop is still in its grace period
// leaves the VMM alone (no escalation to kill); the next engine adopts it
// and finishes the job.
func TestEngineStopDuringVMStopLeavesVMM(t *testing.T) {
	e := newEnv(t, "CHFAKE_IGNORE_POWER_BUTTON=1")
	// The grace outlasts any CI stall: the engine must be stopped inside it.
	eng := e.engine(func(c *supervisor.Config) { c.StopGrace = time.Minute })
	up := waitRow(t, eng, "vm", running, e.spec("vm"))
	off := e.spec("vm", func(s *supervisor.VMSpec) { s.Power = supervisor.PowerStopped })
	waitRow(t, eng, "vm", func(r supervisor.VMStatus) bool { return r.Phase == supervisor.PhaseStopping }, off)
	require.Eventually(t, func() bool { return strings.Contains(strings.Join(e.calls(), "\n"), "vm.power-button") },
		30*time.Second, 10*time.Millisecond)
	eng.Stop()
	assert.Equal(t, []int{up.PID}, fakePIDs(e.dir), "the engine's shutdown killed a VM it was stopping")

	eng2 := e.engine(func(c *supervisor.Config) { c.StopGrace = 200 * time.Millisecond })
	waitRow(t, eng2, "vm", func(r supervisor.VMStatus) bool { return r.Phase == supervisor.PhaseStopped }, off)
	assert.Empty(t, fakePIDs(e.dir))
}
