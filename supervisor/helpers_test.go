package supervisor

import (
	"context"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
	"go.uber.org/goleak"
)

func TestMain(m *testing.M) { goleak.VerifyTestMain(m) }

// testWait bounds every wait for something that must happen. Only a broken
// run waits this long, so it is sized for a loaded CI, not for speed.
const testWait = 30 * time.Second

// gauge counts how many goroutines are inside operations for one VM at the
// same moment and keeps the high-water mark: "one pass at a time" is
// observed through it rather than assumed from the code's shape.
type gauge struct {
	mu   sync.Mutex
	in   map[string]int
	high map[string]int
}

func newGauge() *gauge { return &gauge{in: map[string]int{}, high: map[string]int{}} }

func (g *gauge) enter(vm string) func() {
	g.mu.Lock()
	g.in[vm]++
	g.high[vm] = max(g.high[vm], g.in[vm])
	g.mu.Unlock()
	return func() {
		g.mu.Lock()
		g.in[vm]--
		g.mu.Unlock()
	}
}

func (g *gauge) highWater(vm string) int {
	g.mu.Lock()
	defer g.mu.Unlock()
	return g.high[vm]
}

// procHV is a Hypervisor whose instances are real processes (a shell
// command, started with Setsid like a VMM), so the engine's pidfd watching,
// reaping and identity checks run for real. Hooks stage slow operations.
type procHV struct {
	t       *testing.T
	command []string // default: sleep 600
	gauge   *gauge
	// beforeStart, when set, runs inside Start before the process is made.
	beforeStart func(ctx context.Context, lc LaunchConfig) error
	// beforeStop, when set, runs inside Stop before the process is killed.
	beforeStop func(ctx context.Context, inst Instance)
	// suspendHook, when set, runs inside Suspend at each stage ("paused":
	// before the state is written; "saved": after saved, before the
	// process ends); an error fails the suspend there (and, like a real
	// backend, runs the guest again, unless ctx has ended: a daemon that
	// died there does nothing more).
	suspendHook func(ctx context.Context, stage string) error
	// restoreHook runs inside Restore once the new process exists
	// ("loaded"), and continueHook inside Continue; an error fails them.
	restoreHook  func(ctx context.Context, lc LaunchConfig) error
	continueHook func(ctx context.Context, inst Instance) error
	stateBytes   int // bytes written besides the guest's id

	mu       sync.Mutex
	starts   []LaunchConfig
	stops    []string
	pids     []int
	pidName  map[int]string
	guestOf  map[int]string // pid -> the guest it runs (its first pid)
	paused   map[int]bool
	restores int
}

// startNaming starts cmd and returns once its command line names needle.
// exec.Cmd.Start returns when the exec has begun, before the kernel has set
// the new command line: /proc/<pid>/cmdline reads empty for a while (seen in
// 841 of 2,000 starts read at once). A real backend returns only once its VMM
// answers, long after; a fake that returned earlier let a daemon's scan for
// unrecorded VMMs miss the process it was meant to find.
func startNaming(cmd *exec.Cmd, needle string) error {
	if err := cmd.Start(); err != nil {
		return err
	}
	path := fmt.Sprintf("/proc/%d/cmdline", cmd.Process.Pid)
	for deadline := time.Now().Add(testWait); time.Now().Before(deadline); time.Sleep(time.Millisecond) {
		if b, err := os.ReadFile(path); err == nil && strings.Contains(string(b), needle) {
			return nil
		}
	}
	_ = cmd.Process.Kill()
	_ = cmd.Wait()
	return fmt.Errorf("pid %d never named %s on its command line", cmd.Process.Pid, needle)
}

func newProcHV(t *testing.T) *procHV {
	h := &procHV{t: t, command: []string{"sleep", "600"}, gauge: newGauge(), pidName: map[int]string{},
		guestOf: map[int]string{}, paused: map[int]bool{}}
	t.Cleanup(h.killAll)
	return h
}

func (h *procHV) Kind() string { return "proc" }

func (h *procHV) Start(ctx context.Context, lc LaunchConfig) (Instance, error) {
	defer h.gauge.enter(lc.Name)()
	if h.beforeStart != nil {
		if err := h.beforeStart(ctx, lc); err != nil {
			return Instance{}, err
		}
	}
	h.mu.Lock()
	h.starts = append(h.starts, lc)
	cmdline := h.command
	h.mu.Unlock()
	cmd := exec.Command(cmdline[0], cmdline[1:]...)
	cmd.SysProcAttr = &syscall.SysProcAttr{Setsid: true}
	if err := cmd.Start(); err != nil {
		return Instance{}, err
	}
	inst, err := Identify(cmd.Process.Pid)
	cmd.Process.Release()
	if err != nil {
		return Instance{}, err
	}
	h.mu.Lock()
	h.pids = append(h.pids, inst.PID)
	h.pidName[inst.PID] = lc.Name
	h.guestOf[inst.PID] = fmt.Sprint(inst.PID)
	h.mu.Unlock()
	return inst, nil
}

// Suspend writes the guest's id (and stateBytes more) into dir/state, calls
// saved, and kills the process.
func (h *procHV) Suspend(ctx context.Context, inst Instance, dir string, saved func() error) error {
	if err := CheckIdentity(inst); err != nil {
		return err
	}
	h.mu.Lock()
	guest := h.guestOf[inst.PID]
	h.paused[inst.PID] = true
	pad := h.stateBytes
	h.mu.Unlock()
	stage := func(s string) error {
		if h.suspendHook == nil {
			return nil
		}
		return h.suspendHook(ctx, s)
	}
	fail := func(err error) error {
		if ctx.Err() == nil {
			h.mu.Lock()
			h.paused[inst.PID] = false
			h.mu.Unlock()
		}
		return err
	}
	if err := stage("paused"); err != nil {
		return fail(err)
	}
	if err := os.WriteFile(filepath.Join(dir, "state"), append([]byte(guest+"\n"), make([]byte, pad)...), 0o600); err != nil {
		return fail(err)
	}
	if err := saved(); err != nil {
		return fail(err)
	}
	if err := stage("saved"); err != nil {
		return err // saved: the state is on disk and the guest stays paused
	}
	pfd, err := OpenPidfd(inst)
	if err != nil {
		return nil
	}
	defer pfd.Close()
	_ = pfd.Signal(syscall.SIGKILL)
	return pfd.Wait(ctx)
}

// Restore starts a process for the guest in dir/state, paused. It has the
// run directory on its command line and leads its session, as a VMM does,
// so that a daemon that died inside Restore leaves a findable orphan.
func (h *procHV) Restore(ctx context.Context, lc LaunchConfig, dir string) (Instance, error) {
	b, err := os.ReadFile(filepath.Join(dir, "state"))
	if err != nil {
		return Instance{}, err
	}
	guest, _, _ := strings.Cut(string(b), "\n")
	cmd := exec.Command("sh", "-c", "while :; do sleep 1; done", filepath.Join(lc.RunDir, "vmm"))
	cmd.SysProcAttr = &syscall.SysProcAttr{Setsid: true}
	if err := startNaming(cmd, lc.RunDir); err != nil {
		return Instance{}, err
	}
	inst, err := Identify(cmd.Process.Pid)
	cmd.Process.Release()
	if err != nil {
		return Instance{}, err
	}
	h.mu.Lock()
	h.pids = append(h.pids, inst.PID)
	h.pidName[inst.PID] = lc.Name
	h.guestOf[inst.PID] = guest
	h.paused[inst.PID] = true
	h.restores++
	h.mu.Unlock()
	if h.restoreHook != nil {
		if err := h.restoreHook(ctx, lc); err != nil {
			if ctx.Err() == nil {
				_ = syscall.Kill(inst.PID, syscall.SIGKILL)
				_, _ = syscall.Wait4(inst.PID, nil, 0, nil)
			}
			return Instance{}, err
		}
	}
	return inst, nil
}

func (h *procHV) Continue(ctx context.Context, inst Instance) error {
	if err := CheckIdentity(inst); err != nil {
		return err
	}
	if h.continueHook != nil {
		if err := h.continueHook(ctx, inst); err != nil {
			return err
		}
	}
	h.mu.Lock()
	h.paused[inst.PID] = false
	h.mu.Unlock()
	return nil
}

// guest is the guest a live pid runs and whether it is paused.
func (h *procHV) guest(pid int) (string, bool) {
	h.mu.Lock()
	defer h.mu.Unlock()
	return h.guestOf[pid], h.paused[pid]
}

func (h *procHV) restoreCount() int {
	h.mu.Lock()
	defer h.mu.Unlock()
	return h.restores
}

func (h *procHV) Adopt(ctx context.Context, inst Instance) error {
	defer h.gauge.enter("adopt")()
	return CheckIdentity(inst)
}

func (h *procHV) Info(ctx context.Context, inst Instance) (VMState, error) {
	if err := CheckIdentity(inst); err != nil {
		return VMShutdown, err
	}
	return VMRunning, nil
}

func (h *procHV) Stop(ctx context.Context, inst Instance, grace time.Duration) error {
	h.mu.Lock()
	h.stops = append(h.stops, fmt.Sprint(inst.PID))
	name := h.pidName[inst.PID]
	h.mu.Unlock()
	defer h.gauge.enter(name)()
	if h.beforeStop != nil {
		h.beforeStop(ctx, inst)
	}
	pfd, err := OpenPidfd(inst)
	if err != nil {
		return nil
	}
	defer pfd.Close()
	_ = pfd.Signal(syscall.SIGKILL)
	return pfd.Wait(ctx)
}

func (h *procHV) startCount() int {
	h.mu.Lock()
	defer h.mu.Unlock()
	return len(h.starts)
}

func (h *procHV) startList() []LaunchConfig {
	h.mu.Lock()
	defer h.mu.Unlock()
	return append([]LaunchConfig(nil), h.starts...)
}

func (h *procHV) killAll() {
	h.mu.Lock()
	pids := append([]int(nil), h.pids...)
	h.mu.Unlock()
	for _, pid := range pids {
		_ = syscall.Kill(pid, syscall.SIGKILL)
		var ws syscall.WaitStatus
		_, _ = syscall.Wait4(pid, &ws, 0, nil)
	}
}

// stageImages is an ImageFetcher whose Fetch can be wedged per call.
type stageImages struct {
	gauge *gauge
	// fetch, when set, replaces the default (the path itself).
	fetch func(ctx context.Context, src Source, progress func(done, total int64)) (string, error)
}

func (s *stageImages) Fetch(ctx context.Context, src Source, progress func(done, total int64)) (string, error) {
	if s.gauge != nil {
		// Sources in these tests are named /img/<vm>/..., so the gauge is per VM.
		defer s.gauge.enter(filepath.Base(filepath.Dir(src.Location)))()
	}
	if s.fetch != nil {
		return s.fetch(ctx, src, progress)
	}
	return src.Location, nil
}

func (s *stageImages) PrepareDisk(ctx context.Context, base, dst string, size int64) error {
	return os.WriteFile(dst, nil, 0o600)
}

// wedge returns a fetch that reports 40% and then blocks until release is
// closed (or ctx ends), signalling arrived once per call.
func wedge(arrived chan<- string, release <-chan struct{}) func(context.Context, Source, func(int64, int64)) (string, error) {
	return func(ctx context.Context, src Source, progress func(int64, int64)) (string, error) {
		progress(40, 100)
		select {
		case arrived <- src.Location:
		default:
		}
		select {
		case <-release:
			return src.Location, nil
		case <-ctx.Done():
			return "", ctx.Err()
		}
	}
}

type fixture struct {
	t      *testing.T
	hv     *procHV
	images *stageImages
	cfg    Config
	eng    *Engine
}

func newFixture(t *testing.T, mod func(*Config)) *fixture {
	t.Helper()
	f := &fixture{t: t, hv: newProcHV(t), images: &stageImages{}}
	f.cfg = Config{
		StateDir: t.TempDir(), RunDir: t.TempDir(),
		Hypervisor: f.hv, Images: f.images,
		BackoffBase: 20 * time.Millisecond, StopGrace: time.Second, StartTimeout: 5 * time.Second,
	}
	if mod != nil {
		mod(&f.cfg)
	}
	f.eng = f.open()
	return f
}

func (f *fixture) open() *Engine {
	e, err := NewEngine(f.cfg)
	require.NoError(f.t, err)
	f.t.Cleanup(e.Stop)
	return e
}

func vmSpec(name string, mods ...func(*VMSpec)) VMSpec {
	s := VMSpec{Name: name, CPUs: 1, MemoryMiB: 64, Kernel: Source{Location: "/img/" + name + "/vmlinuz"}, Power: PowerRunning, Restart: RestartAlways}
	for _, m := range mods {
		m(&s)
	}
	return s
}

// stepBound is how long one Step may take with workers wedged: Step only
// takes short locks, so anything near this is Step waiting on a worker. The
// seed's budget is 2 s; this is well inside it.
const stepBound = 500 * time.Millisecond

// stepNoWait runs one Step and fails the test if it does not come back
// within stepBound: every caller has a VM wedged, so a Step that waited on
// a worker fails here with a reason instead of hanging.
func stepNoWait(t *testing.T, e *Engine, desired ...VMSpec) Report {
	t.Helper()
	done := make(chan Report, 1)
	go func() { done <- e.Step(context.Background(), desired) }()
	select {
	case r := <-done:
		return r
	case <-time.After(stepBound):
		t.Fatalf("Step blocked on a busy VM (more than %s)", stepBound)
		return Report{}
	}
}

func rowOf(r Report, name string) *VMStatus {
	for i := range r.VMs {
		if r.VMs[i].Name == name {
			return &r.VMs[i]
		}
	}
	return nil
}

// waitRow steps until the VM's row satisfies ok (the daemon's 1 s tick,
// compressed), or fails with the last row seen. The deadline is generous:
// it only bounds a failing run, and CI shares two cores.
func waitRow(t *testing.T, e *Engine, name string, ok func(VMStatus) bool, desired ...VMSpec) VMStatus {
	t.Helper()
	var last VMStatus
	deadline := time.Now().Add(testWait)
	for time.Now().Before(deadline) {
		if r := rowOf(e.Step(context.Background(), desired), name); r != nil {
			last = *r
			if ok(last) {
				return last
			}
		}
		time.Sleep(10 * time.Millisecond)
	}
	t.Fatalf("VM %s never reached the expected state; last row %+v", name, last)
	return last
}

// waitReaped steps with nothing desired until the engine holds no worker.
func waitReaped(t *testing.T, e *Engine) {
	t.Helper()
	deadline := time.Now().Add(testWait)
	for e.workerCount() > 0 && time.Now().Before(deadline) {
		e.Step(context.Background(), nil)
		time.Sleep(10 * time.Millisecond)
	}
}

func phaseIs(p string) func(VMStatus) bool { return func(s VMStatus) bool { return s.Phase == p } }

func waitFor(t *testing.T, ch <-chan string, what string) string {
	t.Helper()
	select {
	case v := <-ch:
		return v
	case <-time.After(testWait):
		t.Fatalf("timed out waiting for %s", what)
		return ""
	}
}
