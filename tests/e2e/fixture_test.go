package e2e

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"sort"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/brokkr/brokkr/daemon/api"
	"github.com/brokkr/brokkr/internal/nstest"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

const (
	hostIP    = "192.0.2.1"
	clientIP  = "192.0.2.2"
	hostIP6   = "2001:db8:7::1"
	clientIP6 = "2001:db8:7::2"
	vmName    = "e2e"
)

// fixture is one brokkrd in namespaces of its own: a host namespace it runs
// in and a client namespace joined to it by veth. It holds what outlives a
// single test when the fixture is shared (see sharedEnv).
type fixture struct {
	host, client *nstest.NS
	state, run   string
	bpfDir       string
	cfgPath      string
	logPath      string
	sock         string
	daemon       *exec.Cmd
	done         chan error
	guest        string
	cgroup       string // BROKKR_CGROUP for the daemon ("" = off: no socket path)
	// baseDesired is desired.json as the base config left it (the shared
	// fixture only): a test that changed the desired state leaves it
	// different, and the next test's reset applies the base again.
	baseDesired []byte
}

// env is a fixture seen from one test: its failures and logs go to t.
type env struct {
	t testing.TB
	*fixture
}

const configTemplate = `
stateDir: {{state}}
runDir: {{run}}
bpfDir: {{bpf}}
network:
  bridge: brk-e2e0
  cidr: 10.213.7.1/24
hypervisor:
  kind: qemu
  maxConcurrentCreates: 1
vms:
  - name: e2e
    memory: 256M
    kernel: {{guest}}/vmlinuz
    initramfs: {{guest}}/initramfs.cpio.gz
    cmdline: "console=ttyS0 brokkr.name=e2e"
exposures:
{{exposures}}`

// allExposures is the shared fixture's base: every mode and protocol
// against the one VM.
const allExposures = `  - {name: web-nat, vm: e2e, guestPort: 8080, hostPort: 8080, mode: nat}
  - {name: web-auto, vm: e2e, guestPort: 8080, hostPort: 8081, mode: auto}
  - {name: echo-nat, vm: e2e, guestPort: 7000, hostPort: 7000, mode: nat, maxConns: 2}
  - {name: echo-proxy, vm: e2e, guestPort: 7000, hostPort: 7100, mode: proxy, maxConns: 2}
  - {name: udp-nat, vm: e2e, protocol: udp, guestPort: 7001, hostPort: 7001, mode: nat}
  - {name: udp-proxy, vm: e2e, protocol: udp, guestPort: 7001, hostPort: 7101, mode: proxy}
`

// requireVM skips a test that boots a real VM where it cannot, and returns
// the guest image's directory.
func requireVM(t testing.TB) string {
	t.Helper()
	nstest.RequireRoot(t)
	if testing.Short() {
		t.Skip("-short: boots a real VM")
	}
	guest := filepath.Join(repoRoot(t), ".cache", "guest")
	for _, f := range []string{"vmlinuz", "initramfs.cpio.gz"} {
		if _, err := os.Stat(filepath.Join(guest, f)); err != nil {
			t.Skipf("the guest image is missing (%v): run make guest-image", err)
		}
	}
	if _, err := exec.LookPath("qemu-system-x86_64"); err != nil {
		t.Skip("qemu-system-x86_64 is not installed (scripts/deps.sh)")
	}
	return guest
}

// newFixture makes the namespaces and directories of one daemon (not yet
// started); everything is removed through tb.Cleanup. prefix names the
// veth ends and the temporary directories (e2e, e2n).
func newFixture(tb testing.TB, prefix string) *fixture {
	tb.Helper()
	f := &fixture{}
	f.host = nstest.New(tb, "host")
	f.client = nstest.New(tb, "client")
	nstest.Link(tb, f.host, "brk-"+prefix+"-h", hostIP+"/24", f.client, "brk-"+prefix+"-c", clientIP+"/24")
	// Dual-stack, as users' hosts are: the client reaches the host over
	// IPv6 too.
	f.host.MustRun(tb, "ip", "-6", "addr", "add", hostIP6+"/64", "dev", "brk-"+prefix+"-h", "nodad")
	f.client.MustRun(tb, "ip", "-6", "addr", "add", clientIP6+"/64", "dev", "brk-"+prefix+"-c", "nodad")
	state, err := os.MkdirTemp("", "brk-"+prefix+"-state-")
	require.NoError(tb, err)
	run, err := os.MkdirTemp("", "brk-"+prefix+"-") // short: unix socket paths live below it
	require.NoError(tb, err)
	f.state, f.run = state, run
	// Named after the host namespace: two fixtures alive at once (the
	// shared one and a test's own) never share pins.
	f.bpfDir = fmt.Sprintf("/sys/fs/bpf/%s-%d", f.host.Name, os.Getpid())
	f.sock = filepath.Join(run, "brokkr.sock")
	f.logPath = filepath.Join(state, "brokkrd.log")
	f.cfgPath = filepath.Join(state, "brokkr.yaml")
	tb.Cleanup(f.teardown)
	return f
}

// newEnv is a daemon of the test's own with the VM and every exposure
// configured (not yet started), removed when the test ends.
func newEnv(t *testing.T) *env {
	t.Helper()
	guest := requireVM(t)
	e := &env{t: t, fixture: newFixture(t, "e2e")}
	e.guest = guest
	e.writeConfig(e.cfgPath, allExposures)
	t.Cleanup(e.logOnFailure)
	return e
}

// shared is the package's one shared fixture: a daemon with the VM booted
// and the base exposures active. The first test that needs it starts it
// (a TCG boot costs seconds, once); TestMain stops it.
var shared struct {
	once     sync.Once
	f        *fixture // set as soon as its namespaces exist
	ready    bool     // the daemon started and the VM serves
	by       string   // the test that started it
	cleanups []func()
}

// sharedTB is what the shared fixture is built with: a failure while
// building it fails the test that happens to start it, but cleanups wait
// for TestMain, and namespace names come from the fixture, not from that
// test.
type sharedTB struct{ testing.TB }

func (sharedTB) Name() string { return "e2e-shared" }

func (sharedTB) Cleanup(fn func()) { shared.cleanups = append(shared.cleanups, fn) }

// stopShared removes the shared fixture, if a test started it.
func stopShared() {
	for i := len(shared.cleanups) - 1; i >= 0; i-- {
		shared.cleanups[i]()
	}
	shared.cleanups = nil
}

// sharedEnv is the shared fixture, at its base, for t: started if no test
// has yet, else reset from whatever the last test changed. Every test
// that uses it can run alone; none depends on another having run first.
func sharedEnv(t *testing.T) *env {
	t.Helper()
	guest := requireVM(t)
	t.Cleanup(func() {
		if shared.f != nil {
			(&env{t: t, fixture: shared.f}).logOnFailure()
		}
	})
	shared.once.Do(func() {
		shared.by = t.Name()
		shared.f = newFixture(sharedTB{t}, "e2e")
		e := &env{t: t, fixture: shared.f}
		e.guest = guest
		e.writeConfig(e.cfgPath, allExposures)
		e.startDaemon()

		// apply --wait reports convergence: the VM is running and the
		// exposures are active.
		out, errs, code := e.brokkr("apply", "-f", e.cfgPath, "--wait", "--timeout", "4m")
		require.Equal(t, 0, code, "apply --wait: %s %s", out, errs)
		st := e.status()
		assert.Contains(t, out, "converged")
		v := vm(st, vmName)
		require.Equal(t, "running", v.Phase)
		require.NotZero(t, v.PID)
		require.NotEmpty(t, v.Address)
		t.Logf("VM %s running: pid %d, address %s, tap %s", v.Name, v.PID, v.Address, v.Tap)
		// The guest leases its address before its services listen; brokkr's
		// "active" cannot know when a guest's own service is up.
		e.waitGuestServing(hostIP + ":8080")
		b, err := os.ReadFile(filepath.Join(e.state, "desired.json"))
		require.NoError(t, err)
		e.baseDesired = b
		shared.ready = true
	})
	if !shared.ready {
		t.Fatalf("the shared daemon did not start (in %s)", shared.by)
	}
	e := &env{t: t, fixture: shared.f}
	e.reset()
	return e
}

// journalHeaderLen is the length of stateDir/desired.journal's header
// (daemon/journal.go): "brokkr desired journal v1\n" and
// "base sha256:<64 hex>\n".
const journalHeaderLen = 26 + 12 + 64 + 1

// reset brings the shared fixture back to its base: the daemon up, the base
// config file applied, the VM running, every exposure active and the guest
// serving. A test undoes nothing itself; the next one to need the fixture
// does it here, and a clean fixture costs only a status call and one HTTP
// request.
func (e *env) reset() {
	e.t.Helper()
	e.writeConfig(e.cfgPath, allExposures)
	if !e.daemonUp() {
		e.stopDaemon(syscall.SIGKILL)
		e.startDaemon()
	}
	desired := filepath.Join(e.state, "desired.json")
	// brokkr expose add/rm leave desired.json as it is and append to the
	// journal beside it (README, "Files"): records after its header are
	// changes of exposures alone.
	j, _ := os.ReadFile(filepath.Join(e.state, "desired.journal"))
	journalled := len(j) > journalHeaderLen
	if cur, err := os.ReadFile(desired); err != nil || !bytes.Equal(cur, e.baseDesired) || journalled {
		args := []string{"apply", "-f", e.cfgPath}
		if exposuresOnly := journalled && bytes.Equal(cur, e.baseDesired); !exposuresOnly && !e.otherExposuresOnly(cur) {
			args = append(args, "--wait", "--timeout", "4m")
		}
		out, errs, code := e.brokkr(args...)
		require.Equal(e.t, 0, code, "resetting the shared daemon: %s %s", out, errs)
		cur, err := os.ReadFile(desired)
		require.NoError(e.t, err)
		require.Equal(e.t, string(e.baseDesired), string(cur), "the base desired state is back")
	}
	// Through the API, not the CLI: every test pays for this check.
	base := strings.Count(allExposures, "{name:")
	atBase := func(st *api.Status) bool {
		v := vm(*st, vmName)
		if v.Phase != "running" || v.PID == 0 || len(st.Exposures) != base {
			return false
		}
		for _, x := range st.Exposures {
			if x.State != "active" {
				return false
			}
		}
		return true
	}
	client := api.NewClient(e.sock)
	defer client.CloseIdle()
	deadline := time.Now().Add(4 * time.Minute)
	for {
		st, err := client.Status(context.Background())
		if err == nil && atBase(st) {
			break
		}
		if time.Now().After(deadline) {
			b, _ := json.MarshalIndent(st, "", "  ")
			e.t.Fatalf("the shared daemon is not back at its base within 4 min: %v\n%s", err, b)
		}
		time.Sleep(250 * time.Millisecond)
	}
	e.waitGuestServing(hostIP + ":8080")
}

// otherExposuresOnly reports whether the desired state cur differs from the
// base in its exposures alone, and in their names. Then the VM is not booted
// again and the status shows the base's exposures, all active, only once a
// pass has applied them: reset can wait on the status, without apply
// --wait's fixed wait for a first pass it cannot see.
func (f *fixture) otherExposuresOnly(cur []byte) bool {
	type desired struct {
		VMs       json.RawMessage `json:"vms"`
		Exposures []struct {
			Name string `json:"name"`
		} `json:"exposures"`
	}
	var now, base desired
	if json.Unmarshal(cur, &now) != nil || json.Unmarshal(f.baseDesired, &base) != nil || !bytes.Equal(now.VMs, base.VMs) {
		return false
	}
	names := func(d desired) string {
		var n []string
		for _, x := range d.Exposures {
			n = append(n, x.Name)
		}
		sort.Strings(n)
		return strings.Join(n, " ")
	}
	return names(now) != names(base)
}

func (f *fixture) config(exposures string) string {
	r := strings.NewReplacer("{{state}}", f.state, "{{run}}", f.run, "{{bpf}}", f.bpfDir, "{{guest}}", f.guest,
		"{{exposures}}", exposures)
	return r.Replace(configTemplate)
}

func (e *env) writeConfig(path, exposures string) {
	require.NoError(e.t, os.WriteFile(path, []byte(e.config(exposures)), 0o600))
}

// logOnFailure shows the end of brokkrd's log and of the VM's console when
// the test failed.
func (e *env) logOnFailure() {
	if !e.t.Failed() {
		return
	}
	if b, err := os.ReadFile(e.logPath); err == nil {
		lines := strings.Split(string(b), "\n")
		e.t.Logf("brokkrd log (last 60 lines):\n%s", strings.Join(lines[max(0, len(lines)-60):], "\n"))
	}
	if b, err := os.ReadFile(filepath.Join(e.state, "vms", vmName, "console.log")); err == nil {
		e.t.Logf("console.log:\n%s", tail(string(b), 3000))
	}
}

// teardown stops the daemon and kills the VM it leaves running by design,
// then removes the pins and the directories; the namespaces go with nstest.
func (f *fixture) teardown() {
	f.stopDaemon(syscall.SIGTERM)
	for _, pid := range f.vmmPIDs() {
		_ = syscall.Kill(pid, syscall.SIGKILL)
	}
	os.RemoveAll(f.bpfDir)
	os.RemoveAll(f.run)
	os.RemoveAll(f.state)
}

func tail(s string, n int) string {
	if len(s) > n {
		return s[len(s)-n:]
	}
	return s
}

func (e *env) startDaemon() {
	e.t.Helper()
	logf, err := os.OpenFile(e.logPath, os.O_CREATE|os.O_APPEND|os.O_WRONLY, 0o600)
	require.NoError(e.t, err)
	cmd := e.host.Command(filepath.Join(bin, "brokkrd"), "--config", e.cfgPath)
	// Never attach the socket path to the host's root cgroup from a test:
	// a test that wants it names a child cgroup of its own.
	cg := e.cgroup
	if cg == "" {
		cg = "off"
	}
	cmd.Env = append(os.Environ(), "BROKKR_CGROUP="+cg)
	cmd.Stdout, cmd.Stderr = logf, logf
	require.NoError(e.t, cmd.Start())
	logf.Close()
	e.daemon = cmd
	e.done = make(chan error, 1)
	go func() { e.done <- cmd.Wait() }()
	deadline := time.Now().Add(20 * time.Second)
	for time.Now().Before(deadline) {
		if _, err := api.NewClient(e.sock).Status(context.Background()); err == nil {
			return
		}
		select {
		case err := <-e.done:
			e.done <- err
			e.t.Fatalf("brokkrd exited at start: %v", err)
		case <-time.After(100 * time.Millisecond):
		}
	}
	e.t.Fatal("brokkrd did not answer on its socket within 20 s")
}

// daemonUp reports whether the daemon was started and has not exited.
func (f *fixture) daemonUp() bool {
	if f.daemon == nil {
		return false
	}
	select {
	case err := <-f.done:
		f.done <- err
		return false
	default:
		return true
	}
}

// stopDaemon signals brokkrd (nsenter execs it, so the pid is brokkrd's)
// and waits for it.
func (f *fixture) stopDaemon(sig syscall.Signal) {
	if f.daemon == nil {
		return
	}
	_ = f.daemon.Process.Signal(sig)
	select {
	case <-f.done:
	case <-time.After(20 * time.Second):
		_ = f.daemon.Process.Kill()
		<-f.done
	}
	f.daemon = nil
}

// brokkr runs the CLI against this daemon and returns stdout, stderr, exit code.
func (e *env) brokkr(args ...string) (string, string, int) {
	cmd := exec.Command(filepath.Join(bin, "brokkr"), args...)
	cmd.Env = append(os.Environ(), "BROKKR_SOCKET="+e.sock)
	var out, errb bytes.Buffer
	cmd.Stdout, cmd.Stderr = &out, &errb
	err := cmd.Run()
	code := 0
	var ee *exec.ExitError
	if errors.As(err, &ee) {
		code = ee.ExitCode()
	} else if err != nil {
		e.t.Fatalf("brokkr %v: %v", args, err)
	}
	return out.String(), errb.String(), code
}

// status is `brokkr status -o json`, parsed; anything failed fails the test.
func (e *env) status() api.Status {
	e.t.Helper()
	return e.statusCodes(0)
}

// statusCodes is status accepting the exit codes given: 3 (something
// failed) still prints the whole status.
func (e *env) statusCodes(codes ...int) api.Status {
	e.t.Helper()
	out, errs, code := e.brokkr("status", "-o", "json")
	require.Contains(e.t, codes, code, "brokkr status: %s", errs)
	var st api.Status
	require.NoError(e.t, json.Unmarshal([]byte(out), &st), out)
	return st
}

func (e *env) waitStatus(what string, timeout time.Duration, ok func(api.Status) bool) api.Status {
	e.t.Helper()
	deadline := time.Now().Add(timeout)
	var st api.Status
	for time.Now().Before(deadline) {
		// A wait goes through what it waits for: a VM restarted under load
		// may show a failed start (exit 3) before its retry runs it, which
		// a CI-like run read and stopped at. The state waited for decides.
		st = e.statusCodes(0, 3)
		if ok(st) {
			return st
		}
		time.Sleep(250 * time.Millisecond)
	}
	b, _ := json.MarshalIndent(st, "", "  ")
	e.t.Fatalf("%s: not reached within %s; last status:\n%s", what, timeout, b)
	return st
}

// vmmPIDs lists the hypervisor processes of this daemon (by runDir in
// their command line).
func (f *fixture) vmmPIDs() []int { return nstest.LiveProcs("qemu-system", f.run+"/") }

// waitGuestServing waits until the guest's HTTP service answers through addr.
func (e *env) waitGuestServing(addr string) {
	e.t.Helper()
	deadline := time.Now().Add(90 * time.Second)
	var err error
	var body string
	for time.Now().Before(deadline) {
		if body, err = httpGet(e.client, addr); err == nil && strings.Contains(body, "brokkr-guest") {
			return
		}
		time.Sleep(250 * time.Millisecond)
	}
	e.t.Fatalf("the guest does not answer through %s: %v %q", addr, err, body)
}
