package chv

import (
	"bufio"
	"context"
	"fmt"
	"net"
	"os"
	"path/filepath"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	"go.uber.org/goleak"
	"golang.org/x/sys/unix"

	"github.com/brokkr/brokkr/internal/nstest"
	"github.com/brokkr/brokkr/supervisor"
	"github.com/brokkr/brokkr/tests/chfake"
)

var (
	fakeBin  string // the built contract fake
	specPath string // cloud-hypervisor.yaml
	skipWhy  string
)

func TestMain(m *testing.M) {
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

// env is one test's world: a fake "cloud-hypervisor" binary (a wrapper that
// sets the misbehaviour and execs the fake), short socket paths, and a
// request log.
type env struct {
	t       *testing.T
	dir     string // short: unix socket paths must stay < 108 bytes
	bin     string
	reqLog  string
	backend *Backend
}

func newEnv(t *testing.T, behaviour ...string) *env {
	t.Helper()
	if skipWhy != "" {
		t.Skip(skipWhy)
	}
	dir, err := os.MkdirTemp("", "ch")
	require.NoError(t, err)
	e := &env{t: t, dir: dir, reqLog: filepath.Join(dir, "requests.log")}
	e.bin = filepath.Join(dir, "cloud-hypervisor")
	require.NoError(t, chfake.WriteLauncher(e.bin, fakeBin, specPath, append([]string{"CHFAKE_REQUEST_LOG=" + e.reqLog}, behaviour...)...))
	e.backend = New(e.bin)
	e.backend.ForceWait = 500 * time.Millisecond
	t.Cleanup(func() {
		killFakes(dir)
		os.RemoveAll(dir)
	})
	return e
}

func (e *env) launch(name string) supervisor.LaunchConfig {
	return supervisor.LaunchConfig{
		Name: name, Dir: filepath.Join(e.dir, "vms", name), RunDir: filepath.Join(e.dir, "run", name),
		CPUs: 2, MemoryMiB: 128, Kernel: "/boot/vmlinuz", Initramfs: "/boot/initrd",
		Cmdline: "console=ttyS0 ip=10.0.0.2", DiskPath: "/var/disk.raw", Tap: "brk-" + name,
		MAC: net.HardwareAddr{0x52, 0x54, 0, 1, 2, 3},
	}
}

func (e *env) requests() []string {
	b, _ := os.ReadFile(e.reqLog)
	var out []string
	sc := bufio.NewScanner(strings.NewReader(string(b)))
	sc.Buffer(make([]byte, 1<<20), 1<<20)
	for sc.Scan() {
		out = append(out, sc.Text())
	}
	return out
}

// calls returns "METHOD endpoint status" per request, without bodies.
func (e *env) calls() []string {
	var out []string
	for _, l := range e.requests() {
		f := strings.Fields(l)
		out = append(out, f[0]+" "+strings.TrimPrefix(f[1], "/api/v1/")+" "+f[2])
	}
	return out
}

// fakePIDs lists live fake processes whose command line mentions dir.
func fakePIDs(dir string) []int { return nstest.LiveProcs(dir, "--api-socket") }

func killFakes(dir string) {
	for _, pid := range fakePIDs(dir) {
		_ = syscall.Kill(pid, syscall.SIGKILL)
		var ws syscall.WaitStatus
		_, _ = syscall.Wait4(pid, &ws, 0, nil)
	}
}

func reap(pid int) {
	var ws syscall.WaitStatus
	_, _ = syscall.Wait4(pid, &ws, 0, nil)
}

// Start speaks the API in kata's order with complete bodies the schema
// accepts, in a process of its own session; Stop presses the power button
// and the VMM exits with the guest.
func TestStartAndStopSpeakTheAPI(t *testing.T) {
	e := newEnv(t)
	ctx := context.Background()
	inst, err := e.backend.Start(ctx, e.launch("web"))
	require.NoError(t, err)
	defer reap(inst.PID)

	sid, err := unix.Getsid(inst.PID)
	require.NoError(t, err)
	assert.Equal(t, inst.PID, sid, "the VMM must lead its own session to outlive the daemon")
	assert.Equal(t, filepath.Join(e.dir, "run", "web", "api.sock"), inst.APISocket)
	assert.Equal(t, fakeBin, inst.Exe)
	assert.NoError(t, supervisor.CheckIdentity(inst))

	assert.Equal(t, []string{
		"GET vmm.ping 200", "PUT vm.create 204", "GET vm.info 200", "PUT vm.boot 204", "GET vm.info 200",
	}, e.calls())
	var create string
	for _, l := range e.requests() {
		if strings.HasPrefix(l, "PUT /api/v1/vm.create") {
			create = l
		}
	}
	for _, want := range []string{
		`"boot_vcpus":2`, `"max_vcpus":2`, `"size":134217728`, `"kernel":"/boot/vmlinuz"`,
		`"initramfs":"/boot/initrd"`, `"cmdline":"console=ttyS0 ip=10.0.0.2"`, `"path":"/var/disk.raw"`,
		`"tap":"brk-web"`, `"mac":"52:54:00:01:02:03"`, `"serial":{"mode":"Socket"`, `"console":{"mode":"Off"}`,
	} {
		assert.Contains(t, create, want)
	}

	st, err := e.backend.Info(ctx, inst)
	require.NoError(t, err)
	assert.Equal(t, supervisor.VMRunning, st)
	counters, err := e.backend.Counters(ctx, inst)
	require.NoError(t, err)
	assert.Contains(t, counters, "_net0")

	require.NoError(t, e.backend.Stop(ctx, inst, 2*time.Second))
	assert.Error(t, supervisor.CheckIdentity(inst), "the VMM is gone after Stop")
	assert.Equal(t, "PUT vm.power-button 204", e.calls()[len(e.calls())-1])
	for _, c := range e.calls() {
		assert.NotContains(t, c, " 400", "the fake rejected a request body")
	}
}

// A guest still booting drops the first presses; Stop presses again while
// the grace lasts, so the guest powers off instead of being shut down.
func TestStopPressesThePowerButtonAgain(t *testing.T) {
	e := newEnv(t, "CHFAKE_DROP_PRESSES=2")
	e.backend.PowerButtonEvery = 100 * time.Millisecond
	inst, err := e.backend.Start(context.Background(), e.launch("vm"))
	require.NoError(t, err)
	defer reap(inst.PID)
	require.NoError(t, e.backend.Stop(context.Background(), inst, 5*time.Second))
	c := e.calls()
	assert.Equal(t, []string{"PUT vm.power-button 204", "PUT vm.power-button 204", "PUT vm.power-button 204"}, c[len(c)-3:],
		"three presses and nothing stronger")
	assert.Error(t, supervisor.CheckIdentity(inst))
}

// A guest that ignores the power button is stopped with vmm.shutdown after
// the grace; a VMM that also refuses that and ignores SIGTERM is killed.
func TestStopEscalates(t *testing.T) {
	t.Run("vmm.shutdown", func(t *testing.T) {
		e := newEnv(t, "CHFAKE_IGNORE_POWER_BUTTON=1")
		inst, err := e.backend.Start(context.Background(), e.launch("vm"))
		require.NoError(t, err)
		defer reap(inst.PID)
		require.NoError(t, e.backend.Stop(context.Background(), inst, 200*time.Millisecond))
		c := e.calls()
		assert.Equal(t, []string{"PUT vm.power-button 204", "PUT vm.shutdown 204", "PUT vmm.shutdown 204"}, c[len(c)-3:])
		assert.Error(t, supervisor.CheckIdentity(inst))
	})
	t.Run("SIGKILL", func(t *testing.T) {
		e := newEnv(t, "CHFAKE_IGNORE_POWER_BUTTON=1", "CHFAKE_REFUSE=vmm.shutdown", "CHFAKE_IGNORE_SIGTERM=1")
		inst, err := e.backend.Start(context.Background(), e.launch("vm"))
		require.NoError(t, err)
		require.NoError(t, e.backend.Stop(context.Background(), inst, 200*time.Millisecond))
		var ws syscall.WaitStatus
		_, err = syscall.Wait4(inst.PID, &ws, 0, nil)
		require.NoError(t, err)
		assert.Equal(t, syscall.SIGKILL, ws.Signal(), "only SIGKILL could end it")
	})
}

// A VMM that never finishes booting is cut off by ctx, and killed.
func TestHangOnBootTimesOut(t *testing.T) {
	e := newEnv(t, "CHFAKE_HANG_BOOT=1")
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Second) // reaches vm.boot even on a loaded machine
	defer cancel()
	_, err := e.backend.Start(ctx, e.launch("vm"))
	require.Error(t, err)
	assert.Contains(t, err.Error(), "vm.boot")
	assert.Empty(t, fakePIDs(e.dir), "a failed Start left its VMM running")
}

// A refused vm.create is an error carrying the VMM's answer.
func TestRefusedCreateIsReported(t *testing.T) {
	e := newEnv(t, "CHFAKE_REFUSE=vm.create")
	_, err := e.backend.Start(context.Background(), e.launch("vm"))
	require.Error(t, err)
	assert.Contains(t, err.Error(), "vm.create: HTTP 500: chfake: refused vm.create")
	assert.Empty(t, fakePIDs(e.dir))
}

// A socket left by a crashed VMM is removed (nobody answers on it); a socket
// with a live listener is never touched.
func TestStaleSocketIsRemovedLiveOneIsNot(t *testing.T) {
	e := newEnv(t)
	lc := e.launch("vm")
	require.NoError(t, os.MkdirAll(lc.RunDir, 0o700))
	sock := filepath.Join(lc.RunDir, APISocketName)

	l, err := net.Listen("unix", sock)
	require.NoError(t, err)
	_, err = e.backend.Start(context.Background(), lc)
	require.ErrorContains(t, err, "in use by a live process")
	_, err = os.Lstat(sock)
	require.NoError(t, err, "a live socket was removed")
	l.(*net.UnixListener).SetUnlinkOnClose(false)
	l.Close() // now stale: the file stays, nobody listens

	inst, err := e.backend.Start(context.Background(), lc)
	require.NoError(t, err)
	defer reap(inst.PID)
	require.NoError(t, e.backend.Stop(context.Background(), inst, time.Second))

	// kill -9 leaves the fake's socket behind, like older releases.
	inst, err = e.backend.Start(context.Background(), lc)
	require.NoError(t, err)
	killFakes(e.dir)
	_, err = os.Lstat(sock)
	require.NoError(t, err, "precondition: kill -9 left the socket")
	inst, err = e.backend.Start(context.Background(), lc)
	require.NoError(t, err, "a stale socket after kill -9 must not block the next start")
	require.NoError(t, e.backend.Stop(context.Background(), inst, time.Second))
	reap(inst.PID)
}

// Adopt accepts the recorded VMM and refuses anything else: another start
// time, another executable, or an API socket answered by another pid.
func TestAdoptChecksIdentity(t *testing.T) {
	e := newEnv(t)
	ctx := context.Background()
	a, err := e.backend.Start(ctx, e.launch("a"))
	require.NoError(t, err)
	b, err := e.backend.Start(ctx, e.launch("b"))
	require.NoError(t, err)
	defer func() { killFakes(e.dir) }()

	require.NoError(t, e.backend.Adopt(ctx, a))
	wrong := a
	wrong.StartTime++
	assert.ErrorIs(t, e.backend.Adopt(ctx, wrong), supervisor.ErrNotSameProcess)
	wrong = a
	wrong.Exe = "/usr/bin/true"
	assert.ErrorIs(t, e.backend.Adopt(ctx, wrong), supervisor.ErrNotSameProcess)
	wrong = a
	wrong.APISocket = b.APISocket
	assert.ErrorContains(t, e.backend.Adopt(ctx, wrong), fmt.Sprintf("answers with pid %d", b.PID))
}
