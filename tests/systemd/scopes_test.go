package systemd

import (
	"context"
	"encoding/json"
	"errors"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	sddbus "github.com/coreos/go-systemd/v22/dbus"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/brokkr/brokkr/internal/procfs"
	"github.com/brokkr/brokkr/supervisor"
	"github.com/brokkr/brokkr/supervisor/chv"
	"github.com/brokkr/brokkr/supervisor/scope"
	"github.com/brokkr/brokkr/tests/chfake"
)

const webScope = "/brokkr.slice/brokkr-vm-web.scope"

func running(r supervisor.VMStatus) bool { return r.Phase == supervisor.PhaseRunning }

// alive says pid is still the process that started at start (not a reused
// pid, not a zombie).
func alive(pid int, start uint64) bool {
	st, err := procfs.ReadProcStat(pid)
	return err == nil && st.StartTime == start && !st.Exited()
}

// The VMM runs in brokkr-vm-web.scope under brokkr.slice, not in the
// daemon's service; stopping the daemon's unit (default KillMode, which
// kills everything in the unit's cgroup) leaves it running; the next
// daemon adopts it in its scope (same pid, no second VMM); destroying the
// VM ends the process and the scope.
func TestVMMRunsInItsScopeAndOutlivesTheDaemonUnit(t *testing.T) {
	scopeLifecycle(t, newWorld(t), "chfake")
}

// The same with the qemu backend booting the test guest (TCG): qemu, too,
// is placed right after it starts.
func TestQEMURunsInItsScopeAndOutlivesTheDaemonUnit(t *testing.T) {
	if testing.Short() {
		t.Skip("starts a real qemu (-short)")
	}
	if _, err := exec.LookPath("qemu-system-x86_64"); err != nil {
		t.Skip("qemu-system-x86_64 not installed (scripts/deps.sh installs qemu-system-x86)")
	}
	img := findGuestImage(t)
	scopeLifecycle(t, newWorld(t), "qemu-system-x86_64", envQEMU+"="+img.Kernel+":"+img.Initramfs)
}

// scopeLifecycle runs the daemon with env; its VMM's executable is named exe.
func scopeLifecycle(t *testing.T, w *world, exe string, env ...string) {
	ctx := context.Background()
	w.desire("web")
	w.startDaemon("brk-daemon-1.service", "", env...)
	up := w.waitRow("brk-daemon-1.service", "web", running)
	pid := up.PID
	require.NotZero(t, pid)
	path, err := supervisor.ProcExe(pid)
	require.NoError(t, err)
	assert.Equal(t, exe, filepath.Base(path), "the VMM runs")
	start, err := supervisor.ProcStartTime(pid)
	require.NoError(t, err)

	mainPID, err := w.m.conn.GetServicePropertyContext(ctx, "brk-daemon-1.service", "MainPID")
	require.NoError(t, err)
	daemonPID := int(mainPID.Value.Value().(uint32))
	assert.Equal(t, "/app.slice/brk-daemon-1.service", w.m.relCgroup(daemonPID), "the daemon runs in its service")
	assert.Equal(t, webScope, w.m.relCgroup(pid), "the VMM runs in its own scope under brokkr.slice")
	unit, err := w.m.conn.GetUnitNameByPID(ctx, uint32(pid))
	require.NoError(t, err)
	assert.Equal(t, scope.Unit("web"), unit)
	km, err := w.m.conn.GetServicePropertyContext(ctx, "brk-daemon-1.service", "KillMode")
	require.NoError(t, err)
	assert.Equal(t, "control-group", km.Value.Value(), "the daemon's unit keeps systemd's default KillMode")
	for prop, want := range map[string]string{"Slice": scope.Slice, "DevicePolicy": "closed"} {
		p, err := w.m.conn.GetUnitTypePropertyContext(ctx, unit, "Scope", prop)
		require.NoError(t, err)
		assert.Equal(t, want, p.Value.Value(), "scope property %s", prop)
	}
	cm, err := w.m.conn.GetUnitPropertyContext(ctx, unit, "CollectMode")
	require.NoError(t, err)
	assert.Equal(t, "inactive-or-failed", cm.Value.Value())

	w.stopDaemon("brk-daemon-1.service")
	assert.NotEqual(t, "active", w.m.activeState("brk-daemon-1.service"), "the daemon's unit stopped")
	assert.True(t, alive(pid, start), "the VMM survives the stop of the daemon's unit")
	assert.Equal(t, "active", w.m.activeState(scope.Unit("web")))

	w.removeStatus()
	w.startDaemon("brk-daemon-2.service", "", env...)
	again := w.waitRow("brk-daemon-2.service", "web", running)
	assert.Equal(t, pid, again.PID, "the next daemon adopts the VMM in its scope")
	assert.Zero(t, again.Restarts)
	assert.Empty(t, again.Detail)
	assert.Equal(t, []string{strconv.Itoa(pid)}, w.procsIn(webScope), "one VMM in the scope, no second one started")

	// Something the VMM left in its scope (a helper it forked) must not
	// keep the scope alive once the VM is destroyed.
	left := startSleep(t)
	require.NoError(t, os.WriteFile(filepath.Join(w.m.cgroup, webScope, "cgroup.procs"), []byte(strconv.Itoa(left.pid())), 0))

	w.desire() // destroy
	w.waitGone("brk-daemon-2.service", "web")
	assert.False(t, alive(pid, start), "destroying the VM ends its VMM")
	left.waitTerminated(t, "destroying the VM stops what is left in its scope")
	require.Eventually(t, func() bool { return w.m.activeState(scope.Unit("web")) == "" }, 10*time.Second, 50*time.Millisecond,
		"the scope is gone once the VM is destroyed")
	_, err = os.Stat(filepath.Join(w.m.cgroup, webScope))
	assert.ErrorIs(t, err, os.ErrNotExist, "the scope's cgroup is removed")
}

// A VMM started by a daemon from before scopes sits in the daemon's
// cgroup (its unit had KillMode=process, so it survived that daemon's
// stop); the next daemon adopts it and moves it into its scope, after
// which a stop with the default KillMode no longer reaches it.
func TestAdoptionMovesAVMMIntoItsScope(t *testing.T) {
	w := newWorld(t)
	w.desire("web")
	w.startDaemon("brk-daemon-1.service", "process", envNoPlace+"=1")
	up := w.waitRow("brk-daemon-1.service", "web", running)
	pid := up.PID
	start, err := supervisor.ProcStartTime(pid)
	require.NoError(t, err)
	assert.Equal(t, "/app.slice/brk-daemon-1.service", w.m.relCgroup(pid), "without a Placer the VMM stays in the daemon's cgroup")
	w.stopDaemon("brk-daemon-1.service")
	require.True(t, alive(pid, start), "KillMode=process left the VMM running")

	w.removeStatus()
	w.startDaemon("brk-daemon-2.service", "")
	again := w.waitRow("brk-daemon-2.service", "web", running)
	assert.Equal(t, pid, again.PID)
	assert.Empty(t, again.Detail)
	assert.Equal(t, webScope, w.m.relCgroup(pid), "adoption moved the VMM into its scope")

	w.stopDaemon("brk-daemon-2.service")
	assert.True(t, alive(pid, start), "the VMM survives a stop of the daemon's unit with the default KillMode")
}

// The Placer against the real manager, with plain processes: Place is
// idempotent; a scope of the VM's name that outlived its process (here: a
// leftover still running in it) is stopped and made anew around the new
// process; Release ends the scope and what is in it, and is fine when the
// scope is gone already.
func TestPlacerStaleScopeAndRelease(t *testing.T) {
	requireSystemd(t)
	m := startManager(t)
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	p := scope.New(m.dial)
	defer p.Close()

	const rel = "/brokkr.slice/brokkr-vm-x.scope"

	a := startSleep(t)
	require.NoError(t, p.Place(ctx, "x", a.pid()))
	assert.Equal(t, rel, m.relCgroup(a.pid()))
	require.NoError(t, p.Place(ctx, "x", a.pid()), "placing a pid already in its scope")
	assert.Equal(t, rel, m.relCgroup(a.pid()))

	b := startSleep(t)
	require.NoError(t, p.Place(ctx, "x", b.pid()), "a stale scope of the same name")
	assert.Equal(t, rel, m.relCgroup(b.pid()))
	a.waitTerminated(t, "the stale scope's leftover was stopped")

	require.NoError(t, p.Release(ctx, "x"))
	b.waitTerminated(t, "Release stopped what was in the scope")
	assert.Equal(t, "", m.activeState(scope.Unit("x")))
	require.NoError(t, p.Release(ctx, "x"), "releasing a scope that is gone")

	err := p.Place(ctx, "x", 0)
	assert.ErrorContains(t, err, "pid 0")
}

// Under systemd, a VMM that cannot get its scope is not left running in
// the daemon's cgroup (the unit's stop would kill it): the start fails,
// saying which scope, and the process is gone.
func TestStartFailsWhenTheScopeCannotBeMade(t *testing.T) {
	if skipWhy != "" {
		t.Skip(skipWhy)
	}
	dir, err := os.MkdirTemp("", "brk-sdf")
	require.NoError(t, err)
	t.Cleanup(func() { killFakes(dir); os.RemoveAll(dir) })
	bin := filepath.Join(dir, "cloud-hypervisor")
	require.NoError(t, chfake.WriteLauncher(bin, fakeBin, specPath))
	kernel := filepath.Join(dir, "vmlinuz")
	require.NoError(t, os.WriteFile(kernel, []byte("x"), 0o600))

	p := scope.New(dialBus("unix:path=" + filepath.Join(dir, "no-bus-here")))
	defer p.Close()
	eng, err := supervisor.NewEngine(supervisor.Config{
		StateDir: filepath.Join(dir, "state"), RunDir: filepath.Join(dir, "run"),
		Hypervisor: chv.New(bin), Placer: p, StartTimeout: 10 * time.Second, BackoffBase: time.Minute,
	})
	require.NoError(t, err)
	defer eng.Stop()
	spec := supervisor.VMSpec{Name: "web", CPUs: 1, MemoryMiB: 64, Kernel: supervisor.Source{Location: kernel}, Power: supervisor.PowerRunning}
	var row supervisor.VMStatus
	require.Eventually(t, func() bool {
		row = eng.Step(context.Background(), []supervisor.VMSpec{spec}).VMs[0]
		return row.Phase == supervisor.PhaseFailed
	}, 20*time.Second, 20*time.Millisecond)
	assert.Contains(t, row.Detail, "scope brokkr-vm-web.scope")
	assert.Zero(t, row.PID)
	assert.Empty(t, fakes(dir), "the VMM whose scope failed is not left running")
}

// Under systemd (here: the manager's /run/systemd/system) with no answer
// on any bus, Detect says so, naming both ways it tried; it is not taken
// for a host without systemd (brokkrd puts this one in status).
func TestDetectUnderSystemdWithoutABus(t *testing.T) {
	w := newWorld(t)
	w.startDaemon("brk-daemon-1.service", "", "DBUS_SYSTEM_BUS_ADDRESS=unix:path="+filepath.Join(w.dir, "no-bus-here"))
	require.Eventually(t, func() bool { return strings.Contains(w.daemonLog("brk-daemon-1.service"), "no placer") },
		10*time.Second, 50*time.Millisecond, "daemon log:\n%s", w.daemonLog("brk-daemon-1.service"))
	log := w.daemonLog("brk-daemon-1.service")
	t.Log(strings.TrimSpace(log))
	assert.Contains(t, log, "systemd runs this host but does not answer")
	assert.Contains(t, log, "no-bus-here")
	assert.Contains(t, log, "/run/systemd/private")
	assert.NotContains(t, log, scope.ErrNoSystemd.Error())
}

// waitGone waits until the daemon no longer reports the VM.
func (w *world) waitGone(unit, vm string) {
	w.t.Helper()
	require.Eventually(w.t, func() bool {
		b, err := os.ReadFile(filepath.Join(w.dir, "status.json"))
		if err != nil {
			return false
		}
		var rows []supervisor.VMStatus
		if json.Unmarshal(b, &rows) != nil {
			return false
		}
		for _, r := range rows {
			if r.Name == vm {
				return false
			}
		}
		return true
	}, 30*time.Second, 50*time.Millisecond, "VM %s still reported; daemon log:\n%s", vm, w.daemonLog(unit))
}

// sleeper is a long sleep in its own session; done is closed when it has
// been waited for, with err its Wait.
type sleeper struct {
	cmd  *exec.Cmd
	done chan struct{}
	err  error
}

func startSleep(t *testing.T) *sleeper {
	t.Helper()
	s := &sleeper{cmd: exec.Command("sleep", "600"), done: make(chan struct{})}
	s.cmd.SysProcAttr = &syscall.SysProcAttr{Setsid: true}
	require.NoError(t, s.cmd.Start())
	go func() { s.err = s.cmd.Wait(); close(s.done) }()
	t.Cleanup(func() { _ = s.cmd.Process.Kill(); <-s.done })
	return s
}

func (s *sleeper) pid() int { return s.cmd.Process.Pid }

// waitTerminated says whether the sleep ended by SIGTERM (what systemd
// sends when it stops a scope) within 10 s.
func (s *sleeper) waitTerminated(t *testing.T, what string) {
	t.Helper()
	select {
	case <-s.done:
		assert.ErrorContains(t, s.err, "signal: terminated", what)
	case <-time.After(10 * time.Second):
		t.Fatalf("%s: the process still runs", what)
	}
}

// findGuestImage reads the test guest's kernel and initramfs from
// .cache/guest/env (tests/guest/build.sh; BROKKR_GUEST_DIR overrides the
// directory), or skips saying how to build it.
func findGuestImage(t *testing.T) (img struct{ Kernel, Initramfs string }) {
	t.Helper()
	dir := os.Getenv("BROKKR_GUEST_DIR")
	if dir == "" {
		dir = filepath.Join("..", "..", ".cache", "guest")
	}
	b, err := os.ReadFile(filepath.Join(dir, "env"))
	if err != nil {
		t.Skipf("no guest image (%v): run `make guest-image` (tests/guest/build.sh)", err)
	}
	for _, l := range strings.Split(string(b), "\n") {
		k, v, _ := strings.Cut(l, "=")
		switch k {
		case "GUEST_KERNEL":
			img.Kernel = v
		case "GUEST_INITRAMFS":
			img.Initramfs = v
		}
	}
	if img.Kernel == "" || img.Initramfs == "" {
		t.Skipf("%s/env lacks GUEST_KERNEL or GUEST_INITRAMFS: rerun tests/guest/build.sh", dir)
	}
	return img
}

// Adoption never stops a VM because its scope cannot be made: with the bus
// unreachable the adopted VMM keeps running, its row says why it is not in
// its scope, and once the bus answers a later pass moves it there.
func TestAdoptedVMMOutsideItsScopeKeepsRunning(t *testing.T) {
	if skipWhy != "" {
		t.Skip(skipWhy)
	}
	m := startManager(t)
	dir, err := os.MkdirTemp("", "brk-sda")
	require.NoError(t, err)
	t.Cleanup(func() { killFakes(dir); os.RemoveAll(dir) })
	bin := filepath.Join(dir, "cloud-hypervisor")
	require.NoError(t, chfake.WriteLauncher(bin, fakeBin, specPath))
	kernel := filepath.Join(dir, "vmlinuz")
	require.NoError(t, os.WriteFile(kernel, []byte("x"), 0o600))
	spec := supervisor.VMSpec{Name: "web", CPUs: 1, MemoryMiB: 64, Kernel: supervisor.Source{Location: kernel}, Power: supervisor.PowerRunning}
	engine := func(p supervisor.Placer) *supervisor.Engine {
		eng, err := supervisor.NewEngine(supervisor.Config{
			StateDir: filepath.Join(dir, "state"), RunDir: filepath.Join(dir, "run"),
			Hypervisor: chv.New(bin), Placer: p, StartTimeout: 10 * time.Second,
		})
		require.NoError(t, err)
		return eng
	}
	row := func(eng *supervisor.Engine, ok func(supervisor.VMStatus) bool) supervisor.VMStatus {
		t.Helper()
		var r supervisor.VMStatus
		for deadline := time.Now().Add(20 * time.Second); time.Now().Before(deadline); time.Sleep(20 * time.Millisecond) {
			if r = eng.Step(context.Background(), []supervisor.VMSpec{spec}).VMs[0]; ok(r) {
				return r
			}
		}
		t.Fatalf("the VM never reached the expected state; last row %+v", r)
		return r
	}

	first := engine(nil) // a daemon from before scopes
	up := row(first, running)
	first.Stop()

	var busUp atomic.Bool
	p := scope.New(func(ctx context.Context) (*sddbus.Conn, error) {
		if !busUp.Load() {
			return nil, errors.New("the bus is down")
		}
		return m.dial(ctx)
	})
	defer p.Close()
	second := engine(p)
	defer second.Stop()
	r := row(second, func(r supervisor.VMStatus) bool { return r.Phase == supervisor.PhaseRunning && r.Detail != "" })
	assert.Equal(t, up.PID, r.PID, "adopted, not restarted")
	assert.Contains(t, r.Detail, "not in its own scope")
	assert.Contains(t, r.Detail, "the bus is down")
	assert.NotEqual(t, webScope, m.relCgroup(up.PID))

	busUp.Store(true)
	r = row(second, func(r supervisor.VMStatus) bool { return r.Phase == supervisor.PhaseRunning && r.Detail == "" })
	assert.Equal(t, up.PID, r.PID)
	assert.Equal(t, webScope, m.relCgroup(up.PID), "a later pass moved the VMM into its scope")
}

// The VMM leaves brokkrd.service's cgroup, and with it the unit's device
// policy: its scope carries the same one. A process in the scope opens
// /dev/net/tun (allowed) but not /dev/loop-control; the same script outside
// any scope opens both.
func TestScopeKeepsTheUnitsDevicePolicy(t *testing.T) {
	requireSystemd(t)
	for _, d := range []string{"/dev/net/tun", "/dev/loop-control"} {
		if _, err := os.Stat(d); err != nil {
			t.Skipf("needs %s: %v", d, err)
		}
	}
	m := startManager(t)
	p := scope.New(m.dial)
	defer p.Close()
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()

	// Waits for ./go, so that it opens the devices only once placed.
	const script = `while [ ! -e go ]; do sleep 0.02; done
for d in /dev/net/tun /dev/loop-control; do
  if (exec 3<$d) 2>/dev/null; then echo "$d opened"; else echo "$d denied"; fi
done`
	try := func(vm string) string {
		t.Helper()
		dir := t.TempDir()
		c := exec.Command("/bin/sh", "-c", script)
		c.Dir = dir
		c.SysProcAttr = &syscall.SysProcAttr{Setsid: true}
		var out strings.Builder
		c.Stdout = &out
		require.NoError(t, c.Start())
		if vm != "" {
			if err := p.Place(ctx, vm, c.Process.Pid); err != nil {
				_ = c.Process.Kill()
				_ = c.Wait()
				t.Fatal(err)
			}
		}
		require.NoError(t, os.WriteFile(filepath.Join(dir, "go"), nil, 0o600))
		require.NoError(t, c.Wait())
		return out.String()
	}
	assert.Equal(t, "/dev/net/tun opened\n/dev/loop-control opened\n", try(""), "outside any scope")
	assert.Equal(t, "/dev/net/tun opened\n/dev/loop-control denied\n", try("dev"), "in the VM's scope")
}
