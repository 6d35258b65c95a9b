package systemd

import (
	"bufio"
	"context"
	"encoding/json"
	"fmt"
	"log/slog"
	"os"
	"os/signal"
	"path/filepath"
	"slices"
	"strings"
	"syscall"
	"testing"
	"time"

	sddbus "github.com/coreos/go-systemd/v22/dbus"
	"github.com/godbus/dbus/v5"
	"go.uber.org/goleak"

	"github.com/brokkr/brokkr/internal/atomicfile"
	"github.com/brokkr/brokkr/internal/nstest"
	"github.com/brokkr/brokkr/supervisor"
	"github.com/brokkr/brokkr/supervisor/chv"
	"github.com/brokkr/brokkr/supervisor/qemu"
	"github.com/brokkr/brokkr/supervisor/scope"
	"github.com/brokkr/brokkr/tests/chfake"
)

// The "daemon" of these tests is this test binary run again with
// BRK_SCOPETEST_DIR set, as a service of the test's systemd: a supervisor
// Engine with the real cloud-hypervisor backend driving the contract fake
// (tests/chfake) as a real process, and the Placer from scope.Detect, in a
// control loop like brokkrd's. It reads the names of the VMs desired from
// DIR/desired (one a line), writes each pass's report to DIR/status.json,
// and on SIGTERM stops its Engine (the VMs keep running) and exits.
const (
	envDir     = "BRK_SCOPETEST_DIR"
	envNoPlace = "BRK_SCOPETEST_NOPLACE" // "1": no Placer, as a brokkrd before scopes
	// "kernel:initramfs": the qemu backend booting that guest (TCG),
	// instead of the cloud-hypervisor backend and its fake.
	envQEMU = "BRK_SCOPETEST_QEMU"
)

var (
	fakeBin  string // the built contract fake
	specPath string // cloud-hypervisor.yaml
	skipWhy  string
)

func TestMain(m *testing.M) {
	if dir := os.Getenv(envDir); dir != "" {
		os.Exit(runDaemon(dir))
	}
	code := func() int {
		var cleanup func()
		var err error
		fakeBin, specPath, skipWhy, cleanup, err = chfake.ForTests()
		defer cleanup()
		if err != nil {
			fmt.Fprintln(os.Stderr, err)
			return 1
		}
		return m.Run()
	}()
	if code == 0 {
		if err := goleak.Find(); err != nil {
			fmt.Fprintln(os.Stderr, "goleak:", err)
			code = 1
		}
	}
	os.Exit(code)
}

func runDaemon(dir string) int {
	log := slog.New(slog.NewTextHandler(os.Stderr, nil))
	ctx, stop := signal.NotifyContext(context.Background(), syscall.SIGTERM)
	defer stop()
	cfg := supervisor.Config{
		StateDir: filepath.Join(dir, "state"), RunDir: filepath.Join(dir, "run"),
		Hypervisor: chv.New(filepath.Join(dir, "cloud-hypervisor")),
		StopGrace:  2 * time.Second, StartTimeout: 30 * time.Second,
		Logger: log,
	}
	kernel, initramfs := filepath.Join(dir, "vmlinuz"), ""
	if g := os.Getenv(envQEMU); g != "" {
		kernel, initramfs, _ = strings.Cut(g, ":")
		cfg.Hypervisor = qemu.New("", qemu.WithAccel(qemu.AccelTCG), qemu.WithConsoleFile(), qemu.WithLogger(log))
	}
	if os.Getenv(envNoPlace) != "1" {
		p, err := scope.Detect(ctx)
		if err != nil {
			log.Error("no placer", "err", err)
			return 1
		}
		defer p.Close()
		cfg.Placer = p
	}
	eng, err := supervisor.NewEngine(cfg)
	if err != nil {
		log.Error("engine", "err", err)
		return 1
	}
	defer eng.Stop()
	tick := time.NewTicker(50 * time.Millisecond)
	defer tick.Stop()
	for {
		var desired []supervisor.VMSpec
		b, _ := os.ReadFile(filepath.Join(dir, "desired"))
		for _, name := range strings.Fields(string(b)) {
			spec := supervisor.VMSpec{Name: name, CPUs: 1, MemoryMiB: 128,
				Kernel: supervisor.Source{Location: kernel}, Power: supervisor.PowerRunning}
			if initramfs != "" {
				spec.Initramfs = &supervisor.Source{Location: initramfs}
			}
			desired = append(desired, spec)
		}
		rep := eng.Step(ctx, desired)
		out, _ := json.Marshal(rep.VMs)
		if err := atomicfile.Write(filepath.Join(dir, "status.json"), out, 0o600); err != nil {
			log.Error("status", "err", err)
		}
		select {
		case <-ctx.Done():
			return 0
		case <-tick.C:
		}
	}
}

// world is one test's daemon directory and the systemd it runs under.
type world struct {
	t   *testing.T
	m   *manager
	dir string
}

func newWorld(t *testing.T) *world {
	t.Helper()
	if skipWhy != "" {
		t.Skip(skipWhy)
	}
	m := startManager(t)
	dir, err := os.MkdirTemp("", "brk-sdd")
	if err != nil {
		t.Fatal(err)
	}
	w := &world{t: t, m: m, dir: dir}
	t.Cleanup(func() {
		killFakes(dir)
		os.RemoveAll(dir)
	})
	if err := chfake.WriteLauncher(filepath.Join(dir, "cloud-hypervisor"), fakeBin, specPath); err != nil {
		t.Fatal(err)
	}
	w.write("vmlinuz", "not really a kernel", 0o600)
	w.desire()
	return w
}

func (w *world) write(name, content string, mode os.FileMode) {
	w.t.Helper()
	if err := os.WriteFile(filepath.Join(w.dir, name), []byte(content), mode); err != nil {
		w.t.Fatal(err)
	}
}

// desire sets the VMs the daemon wants.
func (w *world) desire(names ...string) { w.write("desired", strings.Join(names, "\n"), 0o600) }

// startDaemon runs the daemon as the transient service unit, with
// systemd's default KillMode (control-group), as dist/brokkrd.service now
// has; killMode overrides it (a unit from before scopes had "process").
func (w *world) startDaemon(unit string, killMode string, env ...string) {
	w.t.Helper()
	exe, err := os.Executable()
	if err != nil {
		w.t.Fatal(err)
	}
	// The caller's env may override these (systemd refuses a variable
	// set twice).
	for _, kv := range []string{envDir + "=" + w.dir, "DBUS_SYSTEM_BUS_ADDRESS=" + w.m.busAddress()} {
		k, _, _ := strings.Cut(kv, "=")
		if !slices.ContainsFunc(env, func(e string) bool { return strings.HasPrefix(e, k+"=") }) {
			env = append(env, kv)
		}
	}
	props := []sddbus.Property{
		sddbus.PropDescription("brokkr scope test daemon"),
		sddbus.PropExecStart([]string{exe, "-test.run=^$"}, true),
		prop("Environment", env),
		prop("StandardOutputFile", filepath.Join(w.dir, unit+".log")),
		prop("StandardErrorFile", filepath.Join(w.dir, unit+".log")),
		prop("CollectMode", "inactive-or-failed"),
	}
	if killMode != "" {
		props = append(props, prop("KillMode", killMode))
	}
	w.m.waitJob("start "+unit, func(done chan<- string) error {
		_, err := w.m.conn.StartTransientUnitContext(context.Background(), unit, "fail", props, done)
		return err
	})
	w.t.Cleanup(func() { _, _ = w.m.conn.StopUnitContext(context.Background(), unit, "replace", nil) })
}

func (w *world) stopDaemon(unit string) {
	w.t.Helper()
	w.m.waitJob("stop "+unit, func(done chan<- string) error {
		_, err := w.m.conn.StopUnitContext(context.Background(), unit, "replace", done)
		return err
	})
}

// daemonLog is what the daemon of unit wrote, for failure messages.
func (w *world) daemonLog(unit string) string {
	b, _ := os.ReadFile(filepath.Join(w.dir, unit+".log"))
	return string(b)
}

// waitRow waits until the daemon reports the VM in a row that ok accepts.
func (w *world) waitRow(unit, vm string, ok func(supervisor.VMStatus) bool) supervisor.VMStatus {
	w.t.Helper()
	var last supervisor.VMStatus
	deadline := time.Now().Add(30 * time.Second)
	for time.Now().Before(deadline) {
		var rows []supervisor.VMStatus
		b, err := os.ReadFile(filepath.Join(w.dir, "status.json"))
		if err == nil && json.Unmarshal(b, &rows) == nil {
			for _, r := range rows {
				if r.Name == vm {
					last = r
					if ok(r) {
						return r
					}
				}
			}
		}
		time.Sleep(50 * time.Millisecond)
	}
	w.t.Fatalf("VM %s never reached the expected state; last row %+v; daemon log:\n%s", vm, last, w.daemonLog(unit))
	return last
}

func (w *world) removeStatus() { _ = os.Remove(filepath.Join(w.dir, "status.json")) }

// fakes lists the fake VMMs started from dir (found by their cmdline).
func fakes(dir string) []int { return nstest.LiveProcs(dir) }

// killFakes ends every fake VMM started from dir, so a failed test leaves
// no process behind.
func killFakes(dir string) {
	for _, pid := range fakes(dir) {
		_ = syscall.Kill(pid, syscall.SIGKILL)
	}
}

// procsIn lists the pids in a cgroup (relative to the manager's).
func (w *world) procsIn(rel string) []string {
	w.t.Helper()
	f, err := os.Open(filepath.Join(w.m.cgroup, rel, "cgroup.procs"))
	if err != nil {
		return nil
	}
	defer f.Close()
	var pids []string
	sc := bufio.NewScanner(f)
	for sc.Scan() {
		pids = append(pids, sc.Text())
	}
	return pids
}

func prop(name string, v any) sddbus.Property {
	return sddbus.Property{Name: name, Value: dbus.MakeVariant(v)}
}
