package supervisor

import (
	"context"
	"encoding/json"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

// kill -9 of a VM's process is noticed through its pidfd and the VM is
// started again under "always", with the restart counted.
func TestKilledVMIsRestartedAndCounted(t *testing.T) {
	f := newFixture(t, nil)
	s := vmSpec("vm")
	first := waitRow(t, f.eng, "vm", phaseIs(PhaseRunning), s)
	require.NoError(t, syscall.Kill(first.PID, syscall.SIGKILL))
	again := waitRow(t, f.eng, "vm", func(r VMStatus) bool {
		return r.Phase == PhaseRunning && r.PID != first.PID
	}, s)
	assert.Equal(t, 1, again.Restarts)
	assert.Equal(t, 2, f.hv.startCount())
}

// A VM that keeps dying is restarted with delays that double.
func TestCrashLoopBacksOffExponentially(t *testing.T) {
	f := newFixture(t, func(c *Config) { c.BackoffBase = 50 * time.Millisecond })
	f.hv.command = []string{"sh", "-c", "exit 3"}
	var mu sync.Mutex
	var stamps []time.Time
	f.hv.beforeStart = func(context.Context, LaunchConfig) error {
		mu.Lock()
		defer mu.Unlock()
		stamps = append(stamps, time.Now())
		return nil
	}
	s := vmSpec("vm")
	waitRow(t, f.eng, "vm", func(r VMStatus) bool {
		return r.Restarts >= 4 && strings.Contains(r.Detail, "exit status 3; restarting in")
	}, s)
	f.eng.Stop()
	mu.Lock()
	defer mu.Unlock()
	require.GreaterOrEqual(t, len(stamps), 5)
	// Gaps: >= 50, 100, 200, 400 ms (each also includes the process's life).
	for i, want := range []time.Duration{50, 100, 200, 400} {
		gap := stamps[i+1].Sub(stamps[i])
		assert.GreaterOrEqual(t, gap, want*time.Millisecond, "restart %d came too early", i+1)
	}
	assert.Greater(t, stamps[4].Sub(stamps[3]), stamps[2].Sub(stamps[1]), "the delay must grow")
}

// The backoff returns to its base after a run longer than StableRun.
func TestBackoffResetsAfterStableRun(t *testing.T) {
	f := newFixture(t, func(c *Config) {
		c.BackoffBase = 100 * time.Millisecond
		c.StableRun = 300 * time.Millisecond
	})
	f.hv.command = []string{"sh", "-c", "exit 1"}
	var mu sync.Mutex
	var stamps []time.Time
	f.hv.beforeStart = func(context.Context, LaunchConfig) error {
		mu.Lock()
		defer mu.Unlock()
		stamps = append(stamps, time.Now())
		if len(stamps) == 5 {
			f.hv.command = []string{"sh", "-c", "sleep 0.5; exit 1"} // one stable run
		}
		return nil
	}
	waitRow(t, f.eng, "vm", func(r VMStatus) bool { return r.Restarts >= 5 }, vmSpec("vm"))
	f.eng.Stop()
	mu.Lock()
	defer mu.Unlock()
	require.GreaterOrEqual(t, len(stamps), 6)
	// Four quick crashes grew the delay to 1.6 s; after the stable run it is
	// back to 100 ms (the gap also holds the 0.5 s run itself).
	after := stamps[5].Sub(stamps[4]) - 500*time.Millisecond
	assert.Less(t, after, time.Second, "after a stable run the delay is back to the base")
}

// The delay sequence itself: doubling from the base, capped, reset by a
// stable run.
func TestBackoffSequence(t *testing.T) {
	w := &worker{e: &Engine{cfg: Config{BackoffBase: 100 * time.Millisecond, BackoffMax: time.Minute, StableRun: time.Minute}}}
	var got []time.Duration
	for range 12 {
		w.bumpBackoff(time.Second)
		got = append(got, w.delay)
	}
	want := []time.Duration{100, 200, 400, 800, 1600, 3200, 6400, 12800, 25600, 51200, 60000, 60000}
	for i := range want {
		assert.Equal(t, want[i]*time.Millisecond, got[i], "delay %d", i)
	}
	w.bumpBackoff(2 * time.Minute)
	assert.Equal(t, 100*time.Millisecond, w.delay, "a stable run resets the delay")
}

// Restart policies: never leaves a crashed VM down; on-failure leaves a
// clean exit down but restarts a failure.
func TestRestartPolicies(t *testing.T) {
	t.Run("never", func(t *testing.T) {
		f := newFixture(t, nil)
		s := vmSpec("vm", func(s *VMSpec) { s.Restart = RestartNever })
		up := waitRow(t, f.eng, "vm", phaseIs(PhaseRunning), s)
		require.NoError(t, syscall.Kill(up.PID, syscall.SIGKILL))
		r := waitRow(t, f.eng, "vm", phaseIs(PhaseFailed), s)
		assert.Contains(t, r.Detail, "killed")
		assert.Contains(t, r.Detail, `restart policy "never"`)
		time.Sleep(200 * time.Millisecond)
		assert.Equal(t, 1, f.hv.startCount())
	})
	t.Run("on-failure/clean", func(t *testing.T) {
		f := newFixture(t, nil)
		f.hv.command = []string{"sh", "-c", "sleep 0.2; exit 0"}
		s := vmSpec("vm", func(s *VMSpec) { s.Restart = RestartOnFailure })
		r := waitRow(t, f.eng, "vm", phaseIs(PhaseStopped), s)
		assert.Contains(t, r.Detail, "exit status 0")
		time.Sleep(200 * time.Millisecond)
		assert.Equal(t, 1, f.hv.startCount())
	})
	t.Run("on-failure/failed", func(t *testing.T) {
		f := newFixture(t, nil)
		f.hv.command = []string{"sh", "-c", "sleep 0.2; exit 2"}
		s := vmSpec("vm", func(s *VMSpec) { s.Restart = RestartOnFailure })
		waitRow(t, f.eng, "vm", func(r VMStatus) bool { return r.Restarts >= 1 }, s)
	})
}

// Power stopped stops the VM; power running starts it again; an operator
// Restart gives a new process at once.
func TestPowerAndOperatorRestart(t *testing.T) {
	f := newFixture(t, nil)
	on := vmSpec("vm")
	off := vmSpec("vm", func(s *VMSpec) { s.Power = PowerStopped })
	up := waitRow(t, f.eng, "vm", phaseIs(PhaseRunning), on)
	waitRow(t, f.eng, "vm", phaseIs(PhaseStopped), off)
	assert.Error(t, CheckIdentity(Instance{PID: up.PID}))
	up2 := waitRow(t, f.eng, "vm", phaseIs(PhaseRunning), on)
	require.NoError(t, f.eng.Restart("vm"))
	up3 := waitRow(t, f.eng, "vm", func(r VMStatus) bool { return r.Phase == PhaseRunning && r.PID != up2.PID }, on)
	assert.Equal(t, 1, up3.Restarts)
	assert.Error(t, f.eng.Restart("nope"))
}

// The record is written atomically (no temp files left) and holds the
// process identity a later daemon adopts by.
func TestRecordIsWrittenAtomically(t *testing.T) {
	f := newFixture(t, nil)
	up := waitRow(t, f.eng, "vm", phaseIs(PhaseRunning), vmSpec("vm"))
	dir := filepath.Join(f.cfg.StateDir, "vms", "vm")
	b, err := os.ReadFile(filepath.Join(dir, "record.json"))
	require.NoError(t, err)
	var rec record
	require.NoError(t, json.Unmarshal(b, &rec))
	require.NotNil(t, rec.Instance)
	assert.Equal(t, up.PID, rec.Instance.PID)
	st, err := ProcStartTime(up.PID)
	require.NoError(t, err)
	assert.Equal(t, st, rec.Instance.StartTime)
	ents, err := os.ReadDir(dir)
	require.NoError(t, err)
	for _, e := range ents {
		assert.False(t, strings.HasSuffix(e.Name(), ".tmp"), "temp file %s left behind", e.Name())
	}
}

// A record that cannot be read is reported with the file named, is never
// overwritten or deleted (not even when the VM leaves desired state), and
// nothing is started for that VM.
func TestCorruptRecordIsReportedNeverDropped(t *testing.T) {
	f := newFixture(t, nil)
	dir := filepath.Join(f.cfg.StateDir, "vms", "vm")
	require.NoError(t, os.MkdirAll(dir, 0o700))
	garbage := []byte(`{"version":1,"name":"vm","instance":{"PID":`)
	require.NoError(t, os.WriteFile(filepath.Join(dir, "record.json"), garbage, 0o600))
	f.eng.Stop()
	f.eng = f.open()

	r := waitRow(t, f.eng, "vm", phaseIs(PhaseFailed), vmSpec("vm"))
	assert.Contains(t, r.Detail, filepath.Join(dir, "record.json"))
	for range 5 {
		r := rowOf(stepNoWait(t, f.eng), "vm") // not desired any more
		require.NotNil(t, r, "a VM with an unreadable record vanished from the report")
		assert.Equal(t, PhaseFailed, r.Phase)
		time.Sleep(20 * time.Millisecond)
	}
	b, err := os.ReadFile(filepath.Join(dir, "record.json"))
	require.NoError(t, err)
	assert.Equal(t, garbage, b, "the unreadable record was overwritten")
	assert.Equal(t, 0, f.hv.startCount())
}

// A new engine over the same StateDir adopts the running process: same pid,
// no second Start.
func TestNewEngineAdoptsRunningVM(t *testing.T) {
	f := newFixture(t, nil)
	s := vmSpec("vm")
	up := waitRow(t, f.eng, "vm", phaseIs(PhaseRunning), s)
	f.eng.Stop()
	f.eng = f.open()
	again := waitRow(t, f.eng, "vm", phaseIs(PhaseRunning), s)
	assert.Equal(t, up.PID, again.PID)
	assert.Equal(t, 1, f.hv.startCount(), "adoption must not start a second process")
	// Still watched after adoption: a kill is noticed and restarted.
	require.NoError(t, syscall.Kill(up.PID, syscall.SIGKILL))
	waitRow(t, f.eng, "vm", func(r VMStatus) bool { return r.Phase == PhaseRunning && r.PID != up.PID }, s)
}

// A daemon SIGKILLed inside Start leaves a VMM that no record names: the
// record says only that a start was under way. The next daemon finds that
// process by the VM's run directory and kills it before it starts afresh, so
// one VMM runs the VM, not two (with cloud-hypervisor the second could not
// even start: the first holds the VM's API socket).
func TestAVMMStartedButNeverRecordedIsKilledBeforeANewStart(t *testing.T) {
	f := newFixture(t, nil)
	orphan, decoys := make(chan *exec.Cmd, 1), make(chan *exec.Cmd, 1)
	f.hv.beforeStart = func(ctx context.Context, lc LaunchConfig) error {
		// What a backend does first: a process in its own session with
		// the VM's run directory on its command line...
		cmd, err := waitingProc(t, filepath.Join(lc.RunDir, "api.sock"), true)
		if err != nil {
			return err
		}
		orphan <- cmd
		// A process that only names the run directory (an operator's
		// tail of the console log) leads no session: it must survive.
		decoy, err := waitingProc(t, filepath.Join(lc.RunDir, "console.log"), false)
		if err != nil {
			return err
		}
		decoys <- decoy
		// ...and the daemon dies before Start returns.
		<-ctx.Done()
		return ctx.Err()
	}
	s := vmSpec("vm")
	stepNoWait(t, f.eng, s)
	var cmd *exec.Cmd
	select {
	case cmd = <-orphan:
	case <-time.After(5 * time.Second):
		t.Fatal("Start was never called")
	}
	f.eng.Stop()
	f.hv.beforeStart = nil
	f.eng = f.open()
	up := waitRow(t, f.eng, "vm", phaseIs(PhaseRunning), s)
	assert.NotEqual(t, cmd.Process.Pid, up.PID)
	var ws syscall.WaitStatus
	got, err := syscall.Wait4(cmd.Process.Pid, &ws, syscall.WNOHANG, nil)
	require.NoError(t, err)
	require.Equal(t, cmd.Process.Pid, got, "the unrecorded VMM is still running")
	assert.True(t, ws.Signaled() && ws.Signal() == syscall.SIGKILL, "killed, got %v", ws)
	decoy := <-decoys
	got, err = syscall.Wait4(decoy.Process.Pid, &ws, syscall.WNOHANG, nil)
	require.NoError(t, err)
	assert.Zero(t, got, "a process that merely names the run directory was killed")
}

// waitingProc starts a shell that waits on its stdin with arg on its command
// line, in a session of its own if setsid; the test's cleanup ends it.
func waitingProc(t *testing.T, arg string, setsid bool) (*exec.Cmd, error) {
	cmd := exec.Command("sh", "-c", "read x", arg)
	cmd.SysProcAttr = &syscall.SysProcAttr{Setsid: setsid}
	stdin, err := cmd.StdinPipe()
	if err != nil {
		return nil, err
	}
	if err := startNaming(cmd, arg); err != nil {
		return nil, err
	}
	t.Cleanup(func() { stdin.Close(); _ = cmd.Process.Kill(); _ = cmd.Wait() })
	return cmd, nil
}

// A recorded pid that died while the daemon was down is not adopted; the
// restart policy applies.
func TestDeadRecordedVMIsRestartedPerPolicy(t *testing.T) {
	f := newFixture(t, nil)
	s := vmSpec("vm")
	up := waitRow(t, f.eng, "vm", phaseIs(PhaseRunning), s)
	f.eng.Stop()
	require.NoError(t, syscall.Kill(up.PID, syscall.SIGKILL))
	var ws syscall.WaitStatus
	_, _ = syscall.Wait4(up.PID, &ws, 0, nil)
	f.eng = f.open()
	again := waitRow(t, f.eng, "vm", func(r VMStatus) bool { return r.Phase == PhaseRunning && r.PID != up.PID }, s)
	assert.Equal(t, 1, again.Restarts)

	never := vmSpec("vm", func(s *VMSpec) { s.Restart = RestartNever })
	waitRow(t, f.eng, "vm", phaseIs(PhaseRunning), never)
	f.eng.Stop()
	require.NoError(t, syscall.Kill(again.PID, syscall.SIGKILL))
	_, _ = syscall.Wait4(again.PID, &ws, 0, nil)
	f.eng = f.open()
	r := waitRow(t, f.eng, "vm", phaseIs(PhaseFailed), never)
	assert.Contains(t, r.Detail, "not running after daemon restart")
}

// Two engines over one StateDir (two daemons): the per-VM lock lets only
// one act; the other reports the lock and starts nothing. When the first
// goes away, the second adopts the same process.
func TestPerVMLockPreventsTwoSupervisors(t *testing.T) {
	f := newFixture(t, nil)
	s := vmSpec("vm")
	up := waitRow(t, f.eng, "vm", phaseIs(PhaseRunning), s)

	other := f.open()
	r := waitRow(t, other, "vm", phaseIs(PhaseFailed), s)
	assert.Contains(t, r.Detail, "locked by another supervisor")
	time.Sleep(100 * time.Millisecond)
	assert.Equal(t, 1, f.hv.startCount(), "a second supervisor started a second process")

	f.eng.Stop() // releases the lock; VM keeps running
	adopted := waitRow(t, other, "vm", phaseIs(PhaseRunning), s)
	assert.Equal(t, up.PID, adopted.PID)
	assert.Equal(t, 1, f.hv.startCount())
}

// A start that fails is retried with backoff under "always" and the row
// carries the error.
func TestFailedStartIsReportedAndRetried(t *testing.T) {
	f := newFixture(t, nil)
	fails := 2
	f.hv.beforeStart = func(context.Context, LaunchConfig) error {
		if fails > 0 {
			fails--
			return assert.AnError
		}
		return nil
	}
	s := vmSpec("vm")
	r := waitRow(t, f.eng, "vm", phaseIs(PhaseRunning), s)
	assert.Equal(t, 2, r.Restarts)
}

// A Start that hangs is cut off at StartTimeout and says so.
func TestHungStartTimesOut(t *testing.T) {
	f := newFixture(t, func(c *Config) { c.StartTimeout = 200 * time.Millisecond })
	f.hv.beforeStart = func(ctx context.Context, _ LaunchConfig) error {
		<-ctx.Done()
		return ctx.Err()
	}
	r := waitRow(t, f.eng, "vm", phaseIs(PhaseFailed), vmSpec("vm", func(s *VMSpec) { s.Restart = RestartNever }))
	assert.Contains(t, r.Detail, "timed out after 200ms")
}

// The console copier caps console.log and keeps the newest bytes.
func TestCappedLogRotates(t *testing.T) {
	p := filepath.Join(t.TempDir(), "console.log")
	l, err := openCappedLog(p, 100)
	require.NoError(t, err)
	for i := range 25 {
		_, err := l.Write([]byte(strings.Repeat(string(rune('a'+i)), 10)))
		require.NoError(t, err)
	}
	require.NoError(t, l.Close())
	cur, _ := os.ReadFile(p)
	old, _ := os.ReadFile(p + ".1")
	assert.LessOrEqual(t, len(cur), 100)
	assert.Len(t, old, 100)
	assert.True(t, strings.HasSuffix(string(cur), strings.Repeat("y", 10)), "newest output kept")
}
