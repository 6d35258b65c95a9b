package e2e

import (
	"context"
	"fmt"
	"io"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	"golang.org/x/sys/unix"

	"github.com/brokkr/brokkr/daemon/api"
	"github.com/brokkr/brokkr/internal/nstest"
)

// Suspend and resume end to end, with the real guest under QEMU: brokkr vm
// suspend saves it to disk and ends its process, its exposures stay
// published, and its first callers wake it.

// webProxy is an uncapped proxy exposure for many first callers at once.
const webProxy = "  - {name: web-proxy, vm: e2e, guestPort: 8080, hostPort: 8180, mode: proxy, maxConns: 0}\n"

// applyVariant applies the base config with extra exposures and, when vmKeys
// is set, more keys on the VM (like "idleSuspend: 5s"), and waits until
// every exposure is active.
func (e *env) applyVariant(extra, vmKeys string) {
	e.t.Helper()
	cfg := e.config(allExposures + extra)
	if vmKeys != "" {
		cfg = strings.Replace(cfg, `cmdline: "console=ttyS0 brokkr.name=e2e"`, `cmdline: "console=ttyS0 brokkr.name=e2e"`+"\n    "+vmKeys, 1)
	}
	p := filepath.Join(e.state, "variant.yaml")
	require.NoError(e.t, os.WriteFile(p, []byte(cfg), 0o600))
	out, errs, code := e.brokkr("apply", "-f", p)
	require.Equal(e.t, 0, code, "apply: %s %s", out, errs)
	n := strings.Count(allExposures+extra, "{name:")
	e.waitStatus("the variant applied", time.Minute, func(st api.Status) bool {
		if len(st.Exposures) != n {
			return false
		}
		for _, x := range st.Exposures {
			if x.State != "active" {
				return false
			}
		}
		return true
	})
}

// getSlowly is httpGet with room for a wake: the caller's connect succeeds
// at once (the proxy accepts), its answer comes once the guest runs.
func getSlowly(ns *nstest.NS, addr string) (string, time.Duration, error) {
	t0 := time.Now()
	c, err := dial(ns, addr, 10*time.Second)
	if err != nil {
		return "", 0, err
	}
	defer c.Close()
	_ = c.SetDeadline(time.Now().Add(60 * time.Second))
	if _, err := io.WriteString(c, "GET / HTTP/1.0\r\nHost: guest\r\n\r\n"); err != nil {
		return "", 0, err
	}
	b := make([]byte, 1)
	if _, err := io.ReadFull(c, b); err != nil {
		return "", 0, err
	}
	first := time.Since(t0)
	rest, err := io.ReadAll(c)
	return string(b) + string(rest), first, err
}

func (e *env) guestBoots() int {
	b, _ := os.ReadFile(filepath.Join(e.state, "vms", vmName, "console.log"))
	return strings.Count(string(b), "BROKKR-GUEST: init")
}

// countVMMs samples the VM's hypervisor processes until stop is closed and
// reports the most seen at once.
func (e *env) countVMMs(stop <-chan struct{}) <-chan int {
	most := make(chan int, 1)
	go func() {
		n := 0
		for {
			n = max(n, len(e.vmmPIDs()))
			select {
			case <-stop:
				most <- n
				return
			case <-time.After(20 * time.Millisecond):
			}
		}
	}()
	return most
}

func TestASuspendedVMKeepsItsExposuresAndItsFirstCallersWakeIt(t *testing.T) {
	e := sharedEnv(t)
	e.applyVariant(webProxy, "")
	before := vm(e.status(), vmName)
	boots := e.guestBoots()
	held := hold(t, e.client, hostIP+":7100") // through the proxy, open across it all
	defer held.Close()

	_, errs, code := e.brokkr("vm", "suspend", vmName, "--wait", "--timeout", "2m")
	require.Equal(t, 0, code, errs)
	st := e.status()
	v := vm(st, vmName)
	assert.Equal(t, "suspended", v.Phase)
	assert.Zero(t, v.PID)
	assert.Positive(t, v.StateBytes, "the state's size on disk")
	assert.Empty(t, e.vmmPIDs(), "no hypervisor process holds guest RAM while suspended")
	assert.True(t, gone(before.PID, 5*time.Second))
	t.Logf("suspended: state %d bytes on disk", v.StateBytes)
	for _, x := range st.Exposures {
		assert.Equal(t, "active", x.State, "%s stays published", x.Name)
		assert.Contains(t, x.Reason, "suspended: wakes on first caller", x.Name)
	}
	b, err := os.ReadFile(filepath.Join(e.state, "desired.json"))
	require.NoError(t, err)
	assert.Contains(t, string(b), `"power": "suspended"`)
	table, _, _ := e.brokkr("vm", "ls")
	assert.Contains(t, table, "on disk")

	// Twenty first callers at once, through the proxy: every one answered.
	const callers = 20
	var wg sync.WaitGroup
	type answer struct {
		body  string
		first time.Duration
		err   error
	}
	answers := make(chan answer, callers)
	for range callers {
		wg.Go(func() {
			body, first, err := getSlowly(e.client, hostIP+":8180")
			answers <- answer{body, first, err}
		})
	}
	wg.Wait()
	close(answers)
	var slowest time.Duration
	for a := range answers {
		require.NoError(t, a.err)
		assert.Contains(t, a.body, "brokkr-guest name=e2e")
		slowest = max(slowest, a.first)
	}
	t.Logf("20 first callers answered, the slowest after %s", slowest.Round(time.Millisecond))
	st = e.waitStatus("running again", time.Minute, func(st api.Status) bool { return vm(st, vmName).Phase == "running" })
	v = vm(st, vmName)
	assert.Equal(t, before.Wakes+1, v.Wakes, "one wake for all callers")
	assert.Equal(t, boots, e.guestBoots(), "resumed, not booted")
	assert.Equal(t, []int{v.PID}, e.vmmPIDs())
	x, _ := exposure(st, "web-proxy")
	assert.Zero(t, x.Refused)
	assert.Zero(t, x.Dropped)
	assert.GreaterOrEqual(t, x.Accepted, uint64(callers))
	b, err = os.ReadFile(filepath.Join(e.state, "desired.json"))
	require.NoError(t, err)
	assert.Contains(t, string(b), `"power": "running"`, "woken: its desired power is running")
	got, err := echo(held, "still here")
	require.NoError(t, err, "a proxied connection open across the suspend lives on")
	assert.Equal(t, "still here", got)

	text, err := api.NewClient(e.sock).Metrics(context.Background())
	require.NoError(t, err)
	assert.Contains(t, text, fmt.Sprintf(`brokkr_vm_wakes_total{vm="e2e"} %d`, v.Wakes))
	assert.Contains(t, text, `brokkr_vm_resume_seconds_count{vm="e2e"}`)
}

func TestIdleSuspendWaitsForTheLastConnectionAndTheNextCallerWakesIt(t *testing.T) {
	e := sharedEnv(t)
	e.forgetUnansweredCallers()
	e.applyVariant(webProxy, "idleSuspend: 5s")
	boots := e.guestBoots()
	held := hold(t, e.client, hostIP+":7100")
	for end := time.Now().Add(12 * time.Second); time.Now().Before(end); time.Sleep(500 * time.Millisecond) {
		require.Equal(t, "running", vm(e.status(), vmName).Phase, "suspended with a connection open")
	}
	held.Close()
	closed := time.Now()
	e.waitStatus("suspended when idle", time.Minute, func(st api.Status) bool { return vm(st, vmName).Phase == "suspended" })
	idle := time.Since(closed)
	t.Logf("suspended %s after the last connection closed (idleSuspend 5s, counters read every 1 s)", idle.Round(100*time.Millisecond))
	assert.GreaterOrEqual(t, idle, 4*time.Second, "suspended before its idle time (less the 1 s between reads)")
	assert.Empty(t, e.vmmPIDs())
	b, err := os.ReadFile(filepath.Join(e.state, "desired.json"))
	require.NoError(t, err)
	assert.Contains(t, string(b), `"power": "running"`, "idle: the desired power stays running")

	body, first, err := getSlowly(e.client, hostIP+":8180")
	require.NoError(t, err)
	assert.Contains(t, body, "brokkr-guest name=e2e")
	t.Logf("the waking caller was answered after %s", first.Round(time.Millisecond))
	e.waitStatus("running again", time.Minute, func(st api.Status) bool { return vm(st, vmName).Phase == "running" })
	assert.Equal(t, boots, e.guestBoots(), "resumed, not booted")
}

// brokkrd SIGKILLed while the VM is suspending, suspended or resuming: the
// next daemon ends with the VM suspended or running, the same guest (not
// booted again), and never two hypervisor processes.
func TestASIGKILLedDaemonLeavesTheVMSuspendedOrRunning(t *testing.T) {
	e := sharedEnv(t)
	boots := e.guestBoots()
	stop := make(chan struct{})
	most := e.countVMMs(stop)
	client := api.NewClient(e.sock)
	defer client.CloseIdle()
	// killIn issues action and SIGKILLs the daemon as soon as the VM's
	// phase is phase (polled through the API), and reports the phase the
	// last status showed.
	killIn := func(action, phase string) string {
		t.Helper()
		_, errs, code := e.brokkr("vm", action, vmName)
		require.Equal(t, 0, code, errs)
		seen := ""
		for end := time.Now().Add(time.Minute); time.Now().Before(end); {
			st, err := client.Status(context.Background())
			if err == nil {
				seen = vm(*st, vmName).Phase
				if seen == phase {
					break
				}
			}
			time.Sleep(2 * time.Millisecond)
		}
		e.stopDaemon(syscall.SIGKILL)
		client.CloseIdle()
		e.startDaemon()
		return seen
	}
	settle := func(want string) api.VM {
		t.Helper()
		st := e.waitStatus("settled "+want, 2*time.Minute, func(st api.Status) bool { return vm(st, vmName).Phase == want })
		return vm(st, vmName)
	}

	seen := killIn("suspend", "suspending")
	t.Logf("killed with the VM %s", seen)
	v := settle("suspended")
	assert.Empty(t, e.vmmPIDs())

	// Killed while suspended: it stays so, and comes back when asked.
	e.stopDaemon(syscall.SIGKILL)
	e.startDaemon()
	v = settle("suspended")
	assert.Empty(t, e.vmmPIDs())
	assert.Positive(t, v.StateBytes)

	seen = killIn("resume", "resuming")
	t.Logf("killed with the VM %s", seen)
	v = settle("running")
	assert.Equal(t, []int{v.PID}, e.vmmPIDs())
	e.waitGuestServing(hostIP + ":8080")
	assert.Equal(t, boots, e.guestBoots(), "the same guest: never booted cold")
	close(stop)
	assert.LessOrEqual(t, <-most, 1, "never two hypervisor processes")
}

// A state that does not fit on the disk leaves the VM running in its
// process, the reason in its detail.
func TestSuspendOntoAFullDiskKeepsTheVMRunning(t *testing.T) {
	e := newEnv(t)
	// stateDir on a tmpfs of the test's own: room for the records, the
	// console log and the daemon's log, not for 256 MiB of guest.
	require.NoError(t, unix.Mount("tmpfs", e.state, "tmpfs", 0, "size=48m,mode=0700"))
	t.Cleanup(func() {
		e.teardown() // the daemon and the VM first: they write into it
		_ = unix.Unmount(e.state, unix.MNT_DETACH)
	})
	e.writeConfig(e.cfgPath, allExposures)
	e.startDaemon()
	out, errs, code := e.brokkr("apply", "-f", e.cfgPath, "--wait", "--timeout", "4m")
	require.Equal(t, 0, code, "apply --wait: %s %s", out, errs)
	e.waitGuestServing(hostIP + ":8080")
	pid := vm(e.status(), vmName).PID

	_, errs, code = e.brokkr("vm", "suspend", vmName)
	require.Equal(t, 0, code, errs)
	st := e.waitStatus("the suspend failed", 2*time.Minute, func(st api.Status) bool {
		return strings.Contains(vm(st, vmName).Detail, "suspend failed")
	})
	v := vm(st, vmName)
	t.Logf("detail: %s", v.Detail)
	assert.Equal(t, "running", v.Phase)
	assert.Equal(t, pid, v.PID, "the same process")
	assert.Contains(t, v.Detail, "No space left on device")
	assert.Equal(t, []int{pid}, e.vmmPIDs())
	body, err := httpGet(e.client, hostIP+":8080")
	require.NoError(t, err, "the guest serves on")
	assert.Contains(t, body, "brokkr-guest")
	_, err = os.Stat(filepath.Join(e.state, "vms", vmName, "suspend"))
	assert.ErrorIs(t, err, os.ErrNotExist, "the partial state is removed")
}

// The nat path: twenty outside callers of a suspended VM at once. The first
// SYN asks the kernel's one wake event; the SYNs are lost at the sleeping
// guest and their retransmissions reach the resumed one: every caller is
// answered, none refused, none reset, nothing counted dropped.
func TestNatCallersWakeASuspendedVMAndNoneIsRefused(t *testing.T) {
	e := sharedEnv(t)
	boots := e.guestBoots()
	st := e.status()
	before, _ := exposure(st, "web-nat")
	wakes := vm(st, vmName).Wakes
	_, errs, code := e.brokkr("vm", "suspend", vmName, "--wait", "--timeout", "2m")
	require.Equal(t, 0, code, errs)
	require.Empty(t, e.vmmPIDs())

	const callers = 20
	var wg sync.WaitGroup
	type answer struct {
		body  string
		first time.Duration
		err   error
	}
	answers := make(chan answer, callers)
	for range callers {
		wg.Go(func() {
			body, first, err := getSlowly(e.client, hostIP+":8080")
			answers <- answer{body, first, err}
		})
	}
	wg.Wait()
	close(answers)
	var firsts []time.Duration
	for a := range answers {
		require.NoError(t, a.err, "a nat caller of the suspended VM")
		assert.Contains(t, a.body, "brokkr-guest name=e2e")
		firsts = append(firsts, a.first)
	}
	slices.Sort(firsts)
	t.Logf("20 nat callers answered after %s (fastest) to %s (slowest)", firsts[0].Round(time.Millisecond), firsts[len(firsts)-1].Round(time.Millisecond))
	st = e.waitStatus("running again", time.Minute, func(st api.Status) bool { return vm(st, vmName).Phase == "running" })
	assert.Equal(t, wakes+1, vm(st, vmName).Wakes, "one wake for all callers")
	assert.Equal(t, boots, e.guestBoots(), "resumed, not booted")
	after := e.waitStatus("the calls counted", 10*time.Second, func(st api.Status) bool {
		x, _ := exposure(st, "web-nat")
		return x.Accepted >= before.Accepted+callers && x.Active == 0
	})
	x, _ := exposure(after, "web-nat")
	assert.Equal(t, before.Refused, x.Refused, "none refused")
	assert.Equal(t, before.Dropped, x.Dropped, "the wait is not counted as dropped")
}

// forgetUnansweredCallers clears what earlier tests left holding places of
// the shared VM's nat exposures: a caller that dialled while the guest was
// booting or down and gave up before it answered is admitted and holds its
// place until conntrack forgets its SYN (two minutes), and an open place
// keeps the VM from idling. Deleting those entries lets the nat path's
// sweep give the places back within its 2 s.
func (e *env) forgetUnansweredCallers() {
	t := e.t
	for _, fam := range []string{"ipv4", "ipv6"} {
		_, _ = e.host.Run("conntrack", "-D", "-f", fam, "-p", "tcp", "--state", "SYN_SENT")
	}
	t.Helper()
	e.waitStatus("no place held on the VM's TCP nat exposures", 30*time.Second, func(st api.Status) bool {
		for _, x := range st.Exposures {
			if x.VM == vmName && x.Mode == "nat" && x.Protocol == "tcp" && x.Active > 0 {
				return false
			}
		}
		return true
	})
}
