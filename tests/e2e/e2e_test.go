package e2e

import (
	"context"
	"crypto/sha256"
	"encoding/json"
	"fmt"
	"net"
	"net/http"
	"os"
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

// The tests below walk the whole contract with one VM: they share a daemon
// (sharedEnv), each finds it at its base, and each runs alone with
// go test -run. Their order in this file only saves time: the URL-kernel
// test comes last because undoing it boots the VM again.

func TestANatExposureIsReachableFromTheClient(t *testing.T) {
	e := sharedEnv(t)
	body, err := httpGet(e.client, hostIP+":8080")
	require.NoError(t, err)
	assert.Contains(t, body, "brokkr-guest name=e2e")
}

func TestAProxyExposureIsReachableFromTheClient(t *testing.T) {
	e := sharedEnv(t)
	c := hold(t, e.client, hostIP+":7100")
	c.Close()
}

func TestAnAutoExposureIsReachableFromTheHostsLoopbackAndFromOutside(t *testing.T) {
	e := sharedEnv(t)
	body, err := httpGet(e.host, "127.0.0.1:8081")
	require.NoError(t, err, "loopback callers are served by the proxy")
	assert.Contains(t, body, "brokkr-guest name=e2e")
	body, err = httpGet(e.host, "[::1]:8081")
	require.NoError(t, err, "IPv6 loopback callers too")
	assert.Contains(t, body, "brokkr-guest name=e2e")
	body, err = httpGet(e.client, hostIP+":8081")
	require.NoError(t, err, "outside callers by nftables")
	assert.Contains(t, body, "brokkr-guest name=e2e")
}

func TestUDPExposuresCarryDatagramsBothWaysInNatAndProxyMode(t *testing.T) {
	e := sharedEnv(t)
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
}

// overTheCap fills the exposure's cap of 2 with held connections, checks
// that a third caller is refused and that the two still carry bytes, and
// closes them.
func (e *env) overTheCap(name, addr string) {
	t := e.t
	t.Helper()
	// Connections of earlier tests must have drained: the cap counts what
	// is open, and a pipe ends a moment after its caller.
	e.waitStatus(name+" idle", 5*time.Second, func(st api.Status) bool {
		ex, _ := exposure(st, name)
		return ex.Active == 0
	})
	a, b := hold(t, e.client, addr), hold(t, e.client, addr)
	assert.True(t, refused(e.client, addr), "%s: a third caller must be refused at maxConns 2", name)
	// the two under the cap still work
	got, err := echo(a, "still")
	assert.NoError(t, err)
	assert.Equal(t, "still", got)
	a.Close()
	b.Close()
}

func TestCallersPastTheCapAreRefusedAndCounted(t *testing.T) {
	e := sharedEnv(t)
	for _, x := range []struct{ name, addr string }{{"echo-nat", hostIP + ":7000"}, {"echo-proxy", hostIP + ":7100"}} {
		e.overTheCap(x.name, x.addr)
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
}

func TestStatusVMLsAndExposeLsPrintReadableTables(t *testing.T) {
	e := sharedEnv(t)
	out, _, code := e.brokkr("status")
	require.Equal(t, 0, code)
	assert.Regexp(t, `(?m)^e2e\s+running\s+\d+\s+10\.213\.7\.`, out)
	assert.Regexp(t, `(?m)^echo-proxy\s+active\s+proxy\s+\*:7100/tcp\s+e2e:7000\s+2\s`, out, "no hostAddress: every address (*)")
	out, _, code = e.brokkr("vm", "ls")
	require.Equal(t, 0, code)
	assert.Regexp(t, `(?m)^e2e\s+running`, out)
	out, _, code = e.brokkr("expose", "ls", "-o", "json")
	require.Equal(t, 0, code)
	var xs []api.Exposure
	require.NoError(t, json.Unmarshal([]byte(out), &xs))
	assert.Len(t, xs, 6)
}

func TestMetricsCarryTheExposuresTheVMAndTheLoop(t *testing.T) {
	e := sharedEnv(t)
	// A refused caller of its own, so the refused counter has something
	// to show whichever test ran before.
	e.overTheCap("echo-proxy", hostIP+":7100")
	text, err := api.NewClient(e.sock).Metrics(context.Background())
	require.NoError(t, err)
	for _, want := range []string{
		`brokkr_vm_phase{phase="running",vm="e2e"} 1`,
		`brokkr_exposure_state{exposure="web-nat",state="active"} 1`,
		`brokkr_exposure_max_connections{exposure="echo-proxy"} 2`,
		`brokkr_exposure_info{exposure="echo-proxy",host_address="",host_port="7100",mode="proxy",protocol="tcp"} 1`,
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
}

func TestASIGKILLedDaemonRestartsAdoptsTheVMAndKeepsTheCounters(t *testing.T) {
	e := sharedEnv(t)
	// Calls and a refusal of its own, so both counters have something to
	// keep whichever test ran before.
	e.overTheCap("echo-nat", hostIP+":7000")
	before := e.waitStatus("the calls counted", 5*time.Second, func(st api.Status) bool {
		ex, _ := exposure(st, "echo-nat")
		return ex.Accepted >= 2 && ex.Refused >= 1
	})
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
}

func TestAFlushedNftTableIsRepairedWithinTwoSeconds(t *testing.T) {
	e := sharedEnv(t)
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
}

// A removed exposure closes its port, flushes its conntrack entries and
// frees its counter slot: created again, it starts from zero.
func TestARemovedExposureClosesItsPortAndFlushesItsConntrackEntries(t *testing.T) {
	e := sharedEnv(t)
	// A call through echo-proxy, so a counter that starts from zero below
	// was freed, not never used.
	p := hold(t, e.client, hostIP+":7100")
	p.Close()
	e.waitStatus("echo-proxy used", 5*time.Second, func(st api.Status) bool {
		x, _ := exposure(st, "echo-proxy")
		return x.Accepted >= 1
	})
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

	// Created again (the base config file, which still has it).
	_, errs, code = e.brokkr("apply", "-f", e.cfgPath)
	require.Equal(t, 0, code, errs)
	st := e.waitStatus("echo-proxy created again", 5*time.Second, func(st api.Status) bool {
		x, ok := exposure(st, "echo-proxy")
		return ok && x.State == "active"
	})
	x, _ := exposure(st, "echo-proxy")
	assert.Zero(t, x.Accepted, "a re-created exposure starts from zero: its slot was freed on removal")
	c := hold(t, e.client, hostIP+":7100")
	c.Close()
}

func TestATargetExposureReachesAGuestBrokkrDoesNotRun(t *testing.T) {
	e := sharedEnv(t)
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
}

func TestAnInvalidConfigIsRejectedWithFieldNamedErrorsAndNothingChanges(t *testing.T) {
	e := sharedEnv(t)
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
}

func TestTheConsoleLogStreamsThroughTheAPI(t *testing.T) {
	e := sharedEnv(t)
	out, errs, code := e.brokkr("vm", "console", vmName, "--no-follow")
	require.Equal(t, 0, code, errs)
	assert.Contains(t, out, "BROKKR-GUEST-READY name=e2e")
}

func TestSIGHUPReloadsTheConfigFile(t *testing.T) {
	e := sharedEnv(t)
	// A bad file first: rejected as a whole, nothing changes. Only the log
	// written from here on counts: the shared daemon's log holds earlier
	// tests' lines.
	logStart := int64(0)
	if fi, err := os.Stat(e.logPath); err == nil {
		logStart = fi.Size()
	}
	before := e.status()
	require.NoError(t, os.WriteFile(e.cfgPath, []byte(strings.Replace(e.config(""), "memory: 256M", "memory: lots", 1)), 0o600))
	require.NoError(t, e.daemon.Process.Signal(syscall.SIGHUP))
	deadline := time.Now().Add(5 * time.Second)
	for {
		b, _ := os.ReadFile(e.logPath)
		b = b[min(int64(len(b)), logStart):]
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
	e.waitStatus("reloaded", 5*time.Second, func(st api.Status) bool {
		x, ok := exposure(st, "echo-proxy")
		_, auto := exposure(st, "web-auto")
		return ok && x.State == "active" && !auto
	})
	c := hold(t, e.client, hostIP+":7100")
	c.Close()
}

func TestVMStopAndStartPersistTheDesiredPower(t *testing.T) {
	e := sharedEnv(t)
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
}

func TestVMRestartBootsTheVMAgain(t *testing.T) {
	e := sharedEnv(t)
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
}

func TestSIGTERMLeavesTheVMAndTheNftRulesInPlace(t *testing.T) {
	e := sharedEnv(t)
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
}

func TestAKernelAndInitramfsFromURLsAreDownloadedCheckedAndBooted(t *testing.T) {
	e := sharedEnv(t)
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
}
