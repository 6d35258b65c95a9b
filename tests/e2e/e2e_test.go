package e2e

import (
	"bytes"
	"context"
	"crypto/sha256"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/brokkr/brokkr/daemon/api"
	"github.com/brokkr/brokkr/internal/nstest"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

const (
	hostIP   = "192.0.2.1"
	clientIP = "192.0.2.2"
	vmName   = "e2e"
)

// env is one brokkrd in its own namespaces, driven through the binaries.
type env struct {
	t            *testing.T
	host, client *nstest.NS
	state, run   string
	bpfDir       string
	cfgPath      string
	logPath      string
	sock         string
	daemon       *exec.Cmd
	done         chan error
	guest        string
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

const allExposures = `  - {name: web-nat, vm: e2e, guestPort: 8080, hostPort: 8080, mode: nat}
  - {name: web-auto, vm: e2e, guestPort: 8080, hostPort: 8081, mode: auto}
  - {name: echo-nat, vm: e2e, guestPort: 7000, hostPort: 7000, mode: nat, maxConns: 2}
  - {name: echo-proxy, vm: e2e, guestPort: 7000, hostPort: 7100, mode: proxy, maxConns: 2}
  - {name: udp-nat, vm: e2e, protocol: udp, guestPort: 7001, hostPort: 7001, mode: nat}
  - {name: udp-proxy, vm: e2e, protocol: udp, guestPort: 7001, hostPort: 7101, mode: proxy}
`

func newEnv(t *testing.T) *env {
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
	e := &env{t: t, guest: guest}
	e.host = nstest.New(t, "host")
	e.client = nstest.New(t, "client")
	nstest.Link(t, e.host, "brk-e2e-h", hostIP+"/24", e.client, "brk-e2e-c", clientIP+"/24")
	e.state = t.TempDir()
	run, err := os.MkdirTemp("", "brk-e2e-") // short: unix socket paths live below it
	require.NoError(t, err)
	e.run = run
	e.bpfDir = fmt.Sprintf("/sys/fs/bpf/brk-e2e-%d", os.Getpid())
	e.sock = filepath.Join(run, "brokkr.sock")
	e.logPath = filepath.Join(e.state, "brokkrd.log")
	e.cfgPath = filepath.Join(e.state, "brokkr.yaml")
	e.writeConfig(e.cfgPath, allExposures)
	t.Cleanup(e.cleanup)
	return e
}

func (e *env) config(exposures string) string {
	r := strings.NewReplacer("{{state}}", e.state, "{{run}}", e.run, "{{bpf}}", e.bpfDir, "{{guest}}", e.guest,
		"{{exposures}}", exposures)
	return r.Replace(configTemplate)
}

func (e *env) writeConfig(path, exposures string) {
	require.NoError(e.t, os.WriteFile(path, []byte(e.config(exposures)), 0o600))
}

// cleanup stops the daemon and kills the VM it leaves running by design,
// then removes the pins; the namespaces go with nstest.
func (e *env) cleanup() {
	if e.t.Failed() {
		if b, err := os.ReadFile(e.logPath); err == nil {
			lines := strings.Split(string(b), "\n")
			e.t.Logf("brokkrd log (last 60 lines):\n%s", strings.Join(lines[max(0, len(lines)-60):], "\n"))
		}
		if b, err := os.ReadFile(filepath.Join(e.state, "vms", vmName, "console.log")); err == nil {
			e.t.Logf("console.log:\n%s", tail(string(b), 3000))
		}
	}
	e.stopDaemon(syscall.SIGTERM)
	for _, pid := range e.vmmPIDs() {
		_ = syscall.Kill(pid, syscall.SIGKILL)
	}
	os.RemoveAll(e.bpfDir)
	os.RemoveAll(e.run)
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
	// Never attach the socket path to the host's root cgroup from a test.
	cmd.Env = append(os.Environ(), "BROKKR_CGROUP=off")
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

// stopDaemon signals brokkrd (nsenter execs it, so the pid is brokkrd's)
// and waits for it.
func (e *env) stopDaemon(sig syscall.Signal) {
	if e.daemon == nil {
		return
	}
	_ = e.daemon.Process.Signal(sig)
	select {
	case <-e.done:
	case <-time.After(20 * time.Second):
		_ = e.daemon.Process.Kill()
		<-e.done
	}
	e.daemon = nil
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

// status is `brokkr status -o json`, parsed.
func (e *env) status() api.Status {
	e.t.Helper()
	out, errs, code := e.brokkr("status", "-o", "json")
	require.Equal(e.t, 0, code, "brokkr status: %s", errs)
	var st api.Status
	require.NoError(e.t, json.Unmarshal([]byte(out), &st), out)
	return st
}

func (e *env) waitStatus(what string, timeout time.Duration, ok func(api.Status) bool) api.Status {
	e.t.Helper()
	deadline := time.Now().Add(timeout)
	var st api.Status
	for time.Now().Before(deadline) {
		st = e.status()
		if ok(st) {
			return st
		}
		time.Sleep(250 * time.Millisecond)
	}
	b, _ := json.MarshalIndent(st, "", "  ")
	e.t.Fatalf("%s: not reached within %s; last status:\n%s", what, timeout, b)
	return st
}

func vm(st api.Status, name string) api.VM {
	for _, v := range st.VMs {
		if v.Name == name {
			return v
		}
	}
	return api.VM{}
}

func exposure(st api.Status, name string) (api.Exposure, bool) {
	for _, x := range st.Exposures {
		if x.Name == name {
			return x, true
		}
	}
	return api.Exposure{}, false
}

// vmmPIDs lists the hypervisor processes of this test's daemon (by runDir
// in their command line).
func (e *env) vmmPIDs() []int {
	ents, _ := os.ReadDir("/proc")
	var pids []int
	for _, ent := range ents {
		pid, err := strconv.Atoi(ent.Name())
		if err != nil {
			continue
		}
		b, err := os.ReadFile(filepath.Join("/proc", ent.Name(), "cmdline"))
		if err != nil || !bytes.Contains(b, []byte("qemu-system")) {
			continue
		}
		if bytes.Contains(b, []byte(e.run+"/")) {
			pids = append(pids, pid)
		}
	}
	return pids
}

// dial opens a TCP connection from inside ns.
func dial(ns *nstest.NS, addr string, timeout time.Duration) (net.Conn, error) {
	var c net.Conn
	err := ns.Do(func() error {
		var err error
		c, err = net.DialTimeout("tcp", addr, timeout)
		return err
	})
	return c, err
}

// httpGet fetches / through addr from ns with a plain HTTP/1.0 request.
func httpGet(ns *nstest.NS, addr string) (string, error) {
	c, err := dial(ns, addr, 3*time.Second)
	if err != nil {
		return "", err
	}
	defer c.Close()
	_ = c.SetDeadline(time.Now().Add(5 * time.Second))
	if _, err := io.WriteString(c, "GET / HTTP/1.0\r\nHost: guest\r\n\r\n"); err != nil {
		return "", err
	}
	b, err := io.ReadAll(c)
	return string(b), err
}

// echo sends msg on an open connection and reads it back.
func echo(c net.Conn, msg string) (string, error) {
	_ = c.SetDeadline(time.Now().Add(5 * time.Second))
	if _, err := io.WriteString(c, msg); err != nil {
		return "", err
	}
	buf := make([]byte, len(msg))
	_, err := io.ReadFull(c, buf)
	return string(buf), err
}

// hold opens a connection that is carried end to end (the echo came back).
func hold(t *testing.T, ns *nstest.NS, addr string) net.Conn {
	t.Helper()
	c, err := dial(ns, addr, 5*time.Second)
	require.NoError(t, err, "dial %s", addr)
	got, err := echo(c, "hold")
	require.NoError(t, err)
	require.Equal(t, "hold", got)
	return c
}

// refused reports whether a caller to addr is turned away: the dial fails,
// or the connection ends without carrying a byte.
func refused(ns *nstest.NS, addr string) bool {
	c, err := dial(ns, addr, 3*time.Second)
	if err != nil {
		return true
	}
	defer c.Close()
	got, err := echo(c, "over")
	return err != nil || got != "over"
}

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

// gone reports whether pid has exited (a zombie counts: its parent has not
// reaped it yet) within timeout.
func gone(pid int, timeout time.Duration) bool {
	deadline := time.Now().Add(timeout)
	for {
		b, err := os.ReadFile(fmt.Sprintf("/proc/%d/stat", pid))
		if err != nil {
			return true
		}
		if i := bytes.LastIndexByte(b, ')'); i > 0 && i+2 < len(b) && b[i+2] == 'Z' {
			return true
		}
		if time.Now().After(deadline) {
			return false
		}
		time.Sleep(100 * time.Millisecond)
	}
}

type bpftoolEntry struct {
	Name     string `json:"name"`
	HostPort uint32 `json:"host_port"`
	Accepted uint64 `json:"accepted"`
	Refused  uint64 `json:"refused"`
	Active   uint64 `json:"active"`
	BytesIn  uint64 `json:"bytes_in"`
	BytesOut uint64 `json:"bytes_out"`
}

// bpftoolDump reads the pinned map with bpftool itself, as an operator would.
func (e *env) bpftoolDump(t *testing.T) map[string]bpftoolEntry {
	t.Helper()
	out, err := exec.Command("bpftool", "-j", "map", "dump", "pinned", filepath.Join(e.bpfDir, "exposure_stats")).Output()
	require.NoError(t, err, "bpftool map dump")
	var raw []struct {
		Value     json.RawMessage `json:"value"`
		Formatted *struct {
			Value json.RawMessage `json:"value"`
		} `json:"formatted"`
	}
	require.NoError(t, json.Unmarshal(out, &raw))
	got := map[string]bpftoolEntry{}
	for _, r := range raw {
		v := r.Value
		if r.Formatted != nil {
			v = r.Formatted.Value
		}
		var ent bpftoolEntry
		if json.Unmarshal(v, &ent) == nil && ent.Name != "" {
			got[ent.Name] = ent
		}
	}
	return got
}

func conntrackEntries(t *testing.T, ns *nstest.NS, port int) int {
	t.Helper()
	out, _ := ns.Run("conntrack", "-L", "-p", "tcp", "--orig-port-dst", strconv.Itoa(port))
	n := 0
	for _, l := range strings.Split(out, "\n") {
		if strings.HasPrefix(l, "tcp ") {
			n++
		}
	}
	return n
}

// TestEndToEnd boots one VM and walks the whole contract with it: the
// subtests share the VM (a TCG boot costs seconds) and run in order.
func TestEndToEnd(t *testing.T) {
	e := newEnv(t)
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
	echoProxyRemoved := false

	t.Run("nat exposure reachable from the client namespace", func(t *testing.T) {
		body, err := httpGet(e.client, hostIP+":8080")
		require.NoError(t, err)
		assert.Contains(t, body, "brokkr-guest name=e2e")
	})

	t.Run("proxy exposure reachable from the client namespace", func(t *testing.T) {
		c := hold(t, e.client, hostIP+":7100")
		c.Close()
	})

	t.Run("auto exposure reachable from the host's loopback and from outside", func(t *testing.T) {
		body, err := httpGet(e.host, "127.0.0.1:8081")
		require.NoError(t, err, "loopback callers are served by the proxy")
		assert.Contains(t, body, "brokkr-guest name=e2e")
		body, err = httpGet(e.host, "[::1]:8081")
		require.NoError(t, err, "IPv6 loopback callers too")
		assert.Contains(t, body, "brokkr-guest name=e2e")
		body, err = httpGet(e.client, hostIP+":8081")
		require.NoError(t, err, "outside callers by nftables")
		assert.Contains(t, body, "brokkr-guest name=e2e")
	})

	t.Run("udp exposures carry datagrams both ways in nat and proxy mode", func(t *testing.T) {
		for _, addr := range []string{hostIP + ":7001", hostIP + ":7101"} {
			var got string
			err := e.client.Do(func() error {
				c, err := net.Dial("udp", addr)
				if err != nil {
					return err
				}
				defer c.Close()
				buf := make([]byte, 64)
				for try := 0; try < 10; try++ { // UDP: a datagram may be lost; ask again
					if _, err := c.Write([]byte("datagram")); err != nil {
						return err
					}
					_ = c.SetReadDeadline(time.Now().Add(time.Second))
					n, err := c.Read(buf)
					if err == nil {
						got = string(buf[:n])
						return nil
					}
				}
				return fmt.Errorf("no answer from %s", addr)
			})
			require.NoError(t, err)
			assert.Equal(t, "datagram", got, addr)
		}
	})

	t.Run("callers past the cap are refused and counted", func(t *testing.T) {
		for _, x := range []struct{ name, addr string }{{"echo-nat", hostIP + ":7000"}, {"echo-proxy", hostIP + ":7100"}} {
			// Earlier subtests' connections must have drained: the cap
			// counts what is open, and a pipe ends a moment after its caller.
			e.waitStatus(x.name+" idle", 5*time.Second, func(st api.Status) bool {
				ex, _ := exposure(st, x.name)
				return ex.Active == 0
			})
			a, b := hold(t, e.client, x.addr), hold(t, e.client, x.addr)
			assert.True(t, refused(e.client, x.addr), "%s: a third caller must be refused at maxConns 2", x.name)
			// the two under the cap still work
			got, err := echo(a, "still")
			assert.NoError(t, err)
			assert.Equal(t, "still", got)
			a.Close()
			b.Close()
			st := e.waitStatus(x.name+" refused counted", 5*time.Second, func(st api.Status) bool {
				ex, _ := exposure(st, x.name)
				return ex.Refused >= 1
			})
			ex, _ := exposure(st, x.name)
			assert.GreaterOrEqual(t, ex.Accepted, uint64(2), x.name)
			dump := e.bpftoolDump(t)
			require.Contains(t, dump, x.name, "bpftool shows the exposure's slot by name")
			assert.GreaterOrEqual(t, dump[x.name].Refused, uint64(1), "%s: refused in bpftool", x.name)
			assert.GreaterOrEqual(t, dump[x.name].Accepted, uint64(2), "%s: accepted in bpftool", x.name)
		}
		out, _, code := e.brokkr("stats", "--bpf-dir", e.bpfDir)
		require.Equal(t, 0, code)
		assert.Contains(t, out, "echo-nat")
	})

	t.Run("readable tables: status, vm ls, expose ls", func(t *testing.T) {
		out, _, code := e.brokkr("status")
		require.Equal(t, 0, code)
		assert.Regexp(t, `(?m)^e2e\s+running\s+\d+\s+10\.213\.7\.`, out)
		assert.Regexp(t, `(?m)^echo-proxy\s+active\s+proxy\s+0\.0\.0\.0:7100/tcp\s+e2e:7000\s+2\s`, out)
		out, _, code = e.brokkr("vm", "ls")
		require.Equal(t, 0, code)
		assert.Regexp(t, `(?m)^e2e\s+running`, out)
		out, _, code = e.brokkr("expose", "ls", "-o", "json")
		require.Equal(t, 0, code)
		var xs []api.Exposure
		require.NoError(t, json.Unmarshal([]byte(out), &xs))
		assert.Len(t, xs, 6)
	})

	t.Run("metrics carry the exposures, the VM and the loop", func(t *testing.T) {
		text, err := api.NewClient(e.sock).Metrics(context.Background())
		require.NoError(t, err)
		for _, want := range []string{
			`brokkr_vm_phase{phase="running",vm="e2e"} 1`,
			`brokkr_exposure_state{exposure="web-nat",state="active"} 1`,
			`brokkr_exposure_max_connections{exposure="echo-proxy"} 2`,
			`brokkr_exposure_info{exposure="echo-proxy",host_address="0.0.0.0",host_port="7100",mode="proxy",protocol="tcp"} 1`,
			`brokkr_converge_duration_seconds_count{engine="netplane"}`,
		} {
			assert.Contains(t, text, want)
		}
		for _, line := range strings.Split(text, "\n") {
			if strings.HasPrefix(line, `brokkr_exposure_refused_total{exposure="echo-proxy"`) {
				v, err := strconv.ParseFloat(line[strings.LastIndexByte(line, ' ')+1:], 64)
				require.NoError(t, err)
				assert.GreaterOrEqual(t, v, 1.0)
				return
			}
		}
		t.Fatal("no brokkr_exposure_refused_total for echo-proxy")
	})

	t.Run("SIGKILLed daemon restarts, adopts the VM and keeps the counters", func(t *testing.T) {
		before := e.status()
		pid := vm(before, vmName).PID
		exBefore, _ := exposure(before, "echo-nat")
		e.stopDaemon(syscall.SIGKILL)
		require.NoError(t, syscall.Kill(pid, 0), "the VM outlives its daemon")

		e.startDaemon()
		st := e.waitStatus("VM adopted", 60*time.Second, func(st api.Status) bool { return vm(st, vmName).Phase == "running" })
		assert.Equal(t, pid, vm(st, vmName).PID, "adopted: the same process")
		assert.Equal(t, []int{pid}, e.vmmPIDs(), "no second hypervisor process")
		ex, _ := exposure(st, "echo-nat")
		assert.GreaterOrEqual(t, ex.Accepted, exBefore.Accepted, "counters kept across the restart")
		assert.GreaterOrEqual(t, ex.Refused, exBefore.Refused)
		body, err := httpGet(e.client, hostIP+":8080")
		require.NoError(t, err)
		assert.Contains(t, body, "brokkr-guest")
	})

	t.Run("a flushed nft table is repaired within two seconds", func(t *testing.T) {
		e.host.MustRun(t, "nft", "flush", "table", "inet", "brokkr")
		start := time.Now()
		var body string
		var err error
		for time.Since(start) < 2*time.Second {
			if body, err = httpGet(e.client, hostIP+":8080"); err == nil && strings.Contains(body, "brokkr-guest") {
				break
			}
			time.Sleep(100 * time.Millisecond)
		}
		require.NoError(t, err, "web-nat not reachable 2 s after the flush")
		t.Logf("repaired after %s", time.Since(start).Round(10*time.Millisecond))
		out := e.host.MustRun(t, "nft", "list", "table", "inet", "brokkr")
		assert.Contains(t, out, "web-nat")
	})

	t.Run("a removed exposure closes its port and flushes its conntrack entries", func(t *testing.T) {
		held := hold(t, e.client, hostIP+":7000")
		defer held.Close()
		require.Positive(t, conntrackEntries(t, e.host, 7000), "a held connection has a conntrack entry")

		smaller := filepath.Join(e.state, "smaller.yaml")
		e.writeConfig(smaller, `  - {name: web-nat, vm: e2e, guestPort: 8080, hostPort: 8080, mode: nat}
  - {name: web-auto, vm: e2e, guestPort: 8080, hostPort: 8081, mode: auto}
`)
		out, errs, code := e.brokkr("apply", "-f", smaller)
		require.Equal(t, 0, code, errs)
		assert.Contains(t, out, "- exposure echo-nat")
		assert.Contains(t, out, "- exposure echo-proxy")
		e.waitStatus("exposures removed", 5*time.Second, func(st api.Status) bool {
			_, a := exposure(st, "echo-nat")
			_, b := exposure(st, "echo-proxy")
			return !a && !b
		})
		deadline := time.Now().Add(3 * time.Second)
		for conntrackEntries(t, e.host, 7000) > 0 && time.Now().Before(deadline) {
			time.Sleep(100 * time.Millisecond)
		}
		assert.Zero(t, conntrackEntries(t, e.host, 7000), "conntrack entries of the removed exposure flushed")
		assert.True(t, refused(e.client, hostIP+":7000"), "nat port closed")
		assert.True(t, refused(e.client, hostIP+":7100"), "proxy port closed")
		assert.NotContains(t, e.host.MustRun(t, "nft", "list", "table", "inet", "brokkr"), "echo-nat")
		dump := e.bpftoolDump(t)
		assert.NotContains(t, dump, "echo-nat", "the slot of a deleted exposure is freed")
		assert.NotContains(t, dump, "echo-proxy", "the slot of a deleted exposure is freed")
		echoProxyRemoved = true
	})

	t.Run("a target exposure reaches a guest brokkr does not run", func(t *testing.T) {
		// A namespace on the bridge stands in for a guest managed elsewhere.
		ext := nstest.New(t, "ext")
		nstest.Link(t, e.host, "brk-e2e-x", "", ext, "eth0", "10.213.7.200/24")
		e.host.MustRun(t, "ip", "link", "set", "brk-e2e-x", "master", "brk-e2e0")
		ext.MustRun(t, "ip", "route", "add", "default", "via", "10.213.7.1")
		srv := ext.Command("socat", "TCP-LISTEN:9000,fork,reuseaddr", "EXEC:cat")
		require.NoError(t, srv.Start())
		defer func() { _ = srv.Process.Kill(); _ = srv.Wait() }()

		withTarget := filepath.Join(e.state, "target.yaml")
		e.writeConfig(withTarget, `  - {name: web-nat, vm: e2e, guestPort: 8080, hostPort: 8080, mode: nat}
  - {name: web-auto, vm: e2e, guestPort: 8080, hostPort: 8081, mode: auto}
  - {name: ext-nat, target: 10.213.7.200, guestPort: 9000, hostPort: 9000, mode: nat}
  - {name: ext-proxy, target: 10.213.7.200, guestPort: 9000, hostPort: 9100, mode: proxy}
`)
		_, errs, code := e.brokkr("apply", "-f", withTarget, "--wait", "--timeout", "1m")
		require.Equal(t, 0, code, errs)
		for _, addr := range []string{hostIP + ":9000", hostIP + ":9100"} {
			var c net.Conn
			var err error
			deadline := time.Now().Add(10 * time.Second)
			for time.Now().Before(deadline) {
				if c, err = dial(e.client, addr, 2*time.Second); err == nil {
					break
				}
				time.Sleep(200 * time.Millisecond)
			}
			require.NoError(t, err, addr)
			got, err := echo(c, "outside")
			c.Close()
			require.NoError(t, err, addr)
			assert.Equal(t, "outside", got, addr)
		}
		// The explicit target is never handed to a brokkr guest.
		assert.NotEqual(t, "10.213.7.200", vm(e.status(), vmName).Address)
	})

	t.Run("an invalid config is rejected with field-named errors and nothing changes", func(t *testing.T) {
		desiredBefore, err := os.ReadFile(filepath.Join(e.state, "desired.json"))
		require.NoError(t, err)
		before := e.status()
		bad := filepath.Join(e.state, "bad.yaml")
		require.NoError(t, os.WriteFile(bad, []byte(strings.Replace(e.config(`  - {name: x, vm: ghost, guestPort: 1, hostPort: 70000}
`), "memory: 256M", "memory: 12Q", 1)), 0o600))

		_, errs, code := e.brokkr("apply", "-f", bad)
		assert.Equal(t, 1, code)
		assert.Contains(t, errs, `vms[0].memory: "12Q" is not a size`)
		assert.Contains(t, errs, `exposures[0].vm: "ghost" is not a VM in vms`)
		assert.Contains(t, errs, `exposures[0].hostPort: 70000 is out of range`)

		// The daemon holds the same line when called directly.
		b, err := os.ReadFile(bad)
		require.NoError(t, err)
		_, err = api.NewClient(e.sock).Apply(context.Background(), b, false)
		var he *api.HTTPError
		require.ErrorAs(t, err, &he)
		assert.Equal(t, 422, he.Code)
		assert.Contains(t, strings.Join(he.Fields, "\n"), `vms[0].memory: "12Q" is not a size`)

		desiredAfter, err := os.ReadFile(filepath.Join(e.state, "desired.json"))
		require.NoError(t, err)
		assert.Equal(t, string(desiredBefore), string(desiredAfter), "desired.json untouched")
		after := e.status()
		assert.Equal(t, len(before.Exposures), len(after.Exposures))
		assert.Equal(t, vm(before, vmName).PID, vm(after, vmName).PID)
	})

	t.Run("the console log streams through the API", func(t *testing.T) {
		out, errs, code := e.brokkr("vm", "console", vmName, "--no-follow")
		require.Equal(t, 0, code, errs)
		assert.Contains(t, out, "BROKKR-GUEST-READY name=e2e")
	})

	t.Run("SIGHUP reloads the config file", func(t *testing.T) {
		// A bad file first: rejected as a whole, nothing changes.
		before := e.status()
		require.NoError(t, os.WriteFile(e.cfgPath, []byte(strings.Replace(e.config(""), "memory: 256M", "memory: lots", 1)), 0o600))
		require.NoError(t, e.daemon.Process.Signal(syscall.SIGHUP))
		deadline := time.Now().Add(5 * time.Second)
		for {
			b, _ := os.ReadFile(e.logPath)
			if strings.Contains(string(b), "SIGHUP: reload rejected") {
				assert.Contains(t, string(b), `vms[0].memory: \"lots\" is not a size`)
				break
			}
			require.True(t, time.Now().Before(deadline), "no rejection logged")
			time.Sleep(100 * time.Millisecond)
		}
		assert.Equal(t, len(before.Exposures), len(e.status().Exposures), "nothing changed")

		e.writeConfig(e.cfgPath, `  - {name: web-nat, vm: e2e, guestPort: 8080, hostPort: 8080, mode: nat}
  - {name: echo-proxy, vm: e2e, guestPort: 7000, hostPort: 7100, mode: proxy, maxConns: 2}
`)
		require.NoError(t, e.daemon.Process.Signal(syscall.SIGHUP))
		st := e.waitStatus("reloaded", 5*time.Second, func(st api.Status) bool {
			x, ok := exposure(st, "echo-proxy")
			_, auto := exposure(st, "web-auto")
			return ok && x.State == "active" && !auto
		})
		if echoProxyRemoved {
			x, _ := exposure(st, "echo-proxy")
			assert.Zero(t, x.Accepted, "a re-created exposure starts from zero: its slot was freed on removal")
		}
		c := hold(t, e.client, hostIP+":7100")
		c.Close()
	})

	t.Run("vm stop and start persist the desired power", func(t *testing.T) {
		oldPID := vm(e.status(), vmName).PID
		_, errs, code := e.brokkr("vm", "stop", vmName)
		require.Equal(t, 0, code, errs)
		e.waitStatus("stopped", 90*time.Second, func(st api.Status) bool { return vm(st, vmName).Phase == "stopped" })
		assert.True(t, gone(oldPID, 5*time.Second), "the hypervisor process is gone")
		b, err := os.ReadFile(filepath.Join(e.state, "desired.json"))
		require.NoError(t, err)
		assert.Contains(t, string(b), `"power": "stopped"`)
		_, _, code = e.brokkr("vm", "start", "ghost")
		assert.Equal(t, 1, code, "an unknown VM is a user error")

		_, errs, code = e.brokkr("vm", "start", vmName)
		require.Equal(t, 0, code, errs)
		st := e.waitStatus("running again", 3*time.Minute, func(st api.Status) bool {
			x, _ := exposure(st, "web-nat")
			return vm(st, vmName).Phase == "running" && x.State == "active"
		})
		assert.NotEqual(t, oldPID, vm(st, vmName).PID)
		e.waitGuestServing(hostIP + ":8080")
	})

	t.Run("vm restart boots the VM again", func(t *testing.T) {
		old := vm(e.status(), vmName)
		_, errs, code := e.brokkr("vm", "restart", vmName)
		require.Equal(t, 0, code, errs)
		st := e.waitStatus("restarted", 3*time.Minute, func(st api.Status) bool {
			v := vm(st, vmName)
			return v.Phase == "running" && v.PID != 0 && v.PID != old.PID
		})
		assert.True(t, gone(old.PID, 5*time.Second), "the old hypervisor process is gone")
		assert.Equal(t, []int{vm(st, vmName).PID}, e.vmmPIDs(), "one hypervisor process")
		e.waitGuestServing(hostIP + ":8080")
	})

	t.Run("a kernel and initramfs from URLs are downloaded, checked and booted", func(t *testing.T) {
		// The image server runs in the host namespace, on its loopback,
		// where brokkrd fetches from.
		var ln net.Listener
		require.NoError(t, e.host.Do(func() error {
			var err error
			ln, err = net.Listen("tcp", "127.0.0.1:0")
			return err
		}))
		srv := &http.Server{Handler: http.FileServer(http.Dir(e.guest))}
		go func() { _ = srv.Serve(ln) }()
		defer srv.Close()
		base := "http://" + ln.Addr().String()
		sum := func(name string) string {
			b, err := os.ReadFile(filepath.Join(e.guest, name))
			require.NoError(t, err)
			return fmt.Sprintf("%x", sha256.Sum256(b))
		}
		cfg := e.config(`  - {name: web-nat, vm: e2e, guestPort: 8080, hostPort: 8080, mode: nat}
`)
		cfg = strings.Replace(cfg, "kernel: "+e.guest+"/vmlinuz",
			"kernel: "+base+"/vmlinuz\n    kernelSha256: "+sum("vmlinuz"), 1)
		cfg = strings.Replace(cfg, "initramfs: "+e.guest+"/initramfs.cpio.gz",
			"initramfs: "+base+"/initramfs.cpio.gz\n    initramfsSha256: "+sum("initramfs.cpio.gz"), 1)
		require.Contains(t, cfg, "kernelSha256")
		fromURL := filepath.Join(e.state, "url.yaml")
		require.NoError(t, os.WriteFile(fromURL, []byte(cfg), 0o600))

		old := vm(e.status(), vmName).PID
		out, errs, code := e.brokkr("apply", "-f", fromURL, "--wait", "--timeout", "4m")
		require.Equal(t, 0, code, "%s %s", out, errs)
		assert.Contains(t, out, "~ vm e2e")
		st := e.status()
		assert.NotEqual(t, old, vm(st, vmName).PID, "a changed kernel source is a new machine")
		e.waitGuestServing(hostIP + ":8080")
	})

	t.Run("SIGTERM leaves the VM and the nft rules in place", func(t *testing.T) {
		pid := vm(e.status(), vmName).PID
		e.stopDaemon(syscall.SIGTERM)
		assert.NoError(t, syscall.Kill(pid, 0), "VM still running")
		out := e.host.MustRun(t, "nft", "list", "table", "inet", "brokkr")
		assert.Contains(t, out, "web-nat")
		body, err := httpGet(e.client, hostIP+":8080")
		require.NoError(t, err, "the kernel path keeps serving without the daemon")
		assert.Contains(t, body, "brokkr-guest")
		out, _, code := e.brokkr("stats", "--bpf-dir", e.bpfDir)
		assert.Equal(t, 0, code, "stats works with the daemon down")
		assert.Contains(t, out, "web-nat")
	})
}
