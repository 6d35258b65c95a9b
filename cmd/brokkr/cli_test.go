package main

import (
	"encoding/json"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/brokkr/brokkr/daemon/api"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

func twoVMs() api.Status {
	b := api.CurrentBuild()
	return api.Status{
		VMs: []api.VM{{Name: "web", Phase: "running", Power: "running", PID: 10}, {Name: "db", Phase: "running", Power: "running", PID: 11}},
		Exposures: []api.Exposure{{Name: "web-http", VM: "web", State: "active", Mode: "nat", HostAddress: "0.0.0.0", HostPort: 8080, Protocol: "tcp"},
			{Name: "db-pg", VM: "db", State: "active", Mode: "nat", HostAddress: "0.0.0.0", HostPort: 5432, Protocol: "tcp"}},
		Daemon: &b,
	}
}

func TestStatusExits3WhileAnythingIsFailed(t *testing.T) {
	f := newFakeDaemon(t, twoVMs())
	_, _, code := run(t, "status", "--socket", f.sock)
	assert.Equal(t, 0, code)

	f.set(func(st *api.Status) { st.VMs[1].Phase, st.VMs[1].Detail = "failed", "exited 1" })
	out, _, code := run(t, "status", "--socket", f.sock)
	assert.Equal(t, 3, code, "a failed VM")
	assert.Contains(t, out, "exited 1", "the table is printed before the exit")
	out, _, code = run(t, "status", "--socket", f.sock, "-o", "json")
	assert.Equal(t, 3, code, "with -o json too")
	assert.True(t, json.Valid([]byte(out)))

	f.set(func(st *api.Status) { st.VMs[1].Phase = "running"; st.Exposures[0].State = "failed" })
	_, _, code = run(t, "--socket", f.sock, "status")
	assert.Equal(t, 3, code, "a failed exposure")

	f.set(func(st *api.Status) { st.Exposures[0].State = "pending" })
	_, _, code = run(t, "--socket", f.sock, "status")
	assert.Equal(t, 0, code, "pending is not failed")
}

func TestListsFilterByNameAndPrintJSON(t *testing.T) {
	f := newFakeDaemon(t, twoVMs())
	out, _, code := run(t, "vm", "ls", "db", "--socket", f.sock, "-o", "json")
	require.Equal(t, 0, code)
	var vms []api.VM
	require.NoError(t, json.Unmarshal([]byte(out), &vms))
	require.Len(t, vms, 1)
	assert.Equal(t, "db", vms[0].Name)

	out, _, code = run(t, "--socket", f.sock, "expose", "ls", "-o", "json")
	require.Equal(t, 0, code)
	var es []api.Exposure
	require.NoError(t, json.Unmarshal([]byte(out), &es))
	assert.Len(t, es, 2)

	out, _, code = run(t, "--socket", f.sock, "expose", "ls", "web-http")
	require.Equal(t, 0, code)
	assert.Contains(t, out, "web-http")
	assert.NotContains(t, out, "db-pg")

	_, errs, code := run(t, "--socket", f.sock, "vm", "ls", "ghost")
	assert.Equal(t, 1, code)
	assert.Contains(t, errs, `no such vm "ghost"`)
}

func TestApplyJSON(t *testing.T) {
	f := newFakeDaemon(t, twoVMs())
	good := filepath.Join(t.TempDir(), "good.yaml")
	require.NoError(t, os.WriteFile(good, []byte("vms: [{name: web, kernel: /k}]\n"), 0o600))
	out, _, code := run(t, "apply", "-f", good, "--socket", f.sock, "-o", "json")
	require.Equal(t, 0, code)
	var p api.Plan
	require.NoError(t, json.Unmarshal([]byte(out), &p))
	assert.Equal(t, []string{"web"}, p.VMs.Added)
	_, _, code = run(t, "apply", "-f", good, "--socket", f.sock, "-o", "yaml")
	assert.Equal(t, 1, code)
}

func TestSocketOnlyWhereTheDaemonIsUsed(t *testing.T) {
	dir := t.TempDir()
	good := filepath.Join(dir, "good.yaml")
	require.NoError(t, os.WriteFile(good, []byte("bpfDir: "+filepath.Join(dir, "pins")+"\n"), 0o600))
	_, errs, code := run(t, "validate", "-f", good, "--socket", "/x.sock")
	assert.Equal(t, 1, code)
	assert.Contains(t, errs, "unknown flag: --socket")
	_, _, code = run(t, "--socket", "/x.sock", "stats")
	assert.Equal(t, 1, code, "stats has no --socket either")

	// stats takes bpfDir from --config.
	_, errs, code = run(t, "stats", "--config", good)
	assert.Equal(t, 2, code)
	assert.Contains(t, errs, filepath.Join(dir, "pins", "exposure_stats_v2"))
	_, _, code = run(t, "stats", "--config", good, "--bpf-dir", dir)
	assert.Equal(t, 1, code, "one place to look, not two")
}

func TestSocketFirst(t *testing.T) {
	assert.Equal(t, []string{"status", "--socket", "s"}, socketFirst([]string{"--socket", "s", "status"}))
	assert.Equal(t, []string{"vm", "ls", "--socket=s", "--", "x"}, socketFirst([]string{"--socket=s", "vm", "ls", "--", "x"}))
	assert.Equal(t, []string{"__complete", "vm", "stop", "--socket", "s", "w"}, socketFirst([]string{"__complete", "--socket", "s", "vm", "stop", "w"}))
	assert.Equal(t, []string{"status", "--socket", "s"}, socketFirst([]string{"status", "--socket", "s"}), "already in place")
}

func TestCompletionOfNamesFromTheDaemon(t *testing.T) {
	f := newFakeDaemon(t, twoVMs())
	out, _, code := run(t, "__complete", "--socket", f.sock, "vm", "stop", "")
	require.Equal(t, 0, code)
	lines := strings.Split(strings.TrimSpace(out), "\n")
	assert.Equal(t, []string{"web", "db", ":4"}, lines, "VM names, no file completion")

	out, _, _ = run(t, "__complete", "vm", "console", "--socket", f.sock, "w")
	assert.Equal(t, []string{"web", ":4"}, strings.Split(strings.TrimSpace(out), "\n"))

	out, _, _ = run(t, "__complete", "vm", "stop", "--socket", f.sock, "web", "")
	assert.Equal(t, []string{":4"}, strings.Split(strings.TrimSpace(out), "\n"), "stop takes one name")

	out, _, _ = run(t, "__complete", "expose", "ls", "--socket", f.sock, "web-http", "")
	assert.Equal(t, []string{"db-pg", ":4"}, strings.Split(strings.TrimSpace(out), "\n"), "names not given yet")

	// A daemon that is not there completes nothing, and says so in the directive.
	out, _, _ = run(t, "__complete", "vm", "stop", "--socket", filepath.Join(t.TempDir(), "none"), "")
	assert.Equal(t, []string{":5"}, strings.Split(strings.TrimSpace(out), "\n"))
}

func fastWait(t *testing.T) {
	oldPoll, oldGrace := pollEvery, failGrace
	pollEvery, failGrace = 20*time.Millisecond, 200*time.Millisecond
	t.Cleanup(func() { pollEvery, failGrace = oldPoll, oldGrace })
}

// later changes the fake's status after d, as the daemon's passes would.
func later(f *fakeDaemon, d time.Duration, change func(st *api.Status)) {
	time.AfterFunc(d, func() { f.set(change) })
}

func TestVMStopWait(t *testing.T) {
	fastWait(t)
	f := newFakeDaemon(t, twoVMs())
	f.onAction = func(st *api.Status, name, action string) {
		st.VMs[0].Power = "stopped"
		later(f, 100*time.Millisecond, func(st *api.Status) { st.VMs[0].Phase, st.VMs[0].Detail = "stopping", "power button pressed" })
		later(f, 250*time.Millisecond, func(st *api.Status) { st.VMs[0].Phase, st.VMs[0].Detail, st.VMs[0].PID = "stopped", "", 0 })
	}
	out, _, code := run(t, "vm", "stop", "web", "--wait", "--socket", f.sock)
	assert.Equal(t, 0, code)
	assert.Equal(t, []string{"web stop"}, f.sent())
	lines := strings.Split(strings.TrimSpace(out), "\n")
	assert.Equal(t, []string{"web: stop requested", "web: running", "web: stopping (power button pressed)", "web: stopped"}, lines[:4])
	assert.Regexp(t, `^web: stopped after \d`, lines[4])
}

func TestVMRestartWaitsForANewProcess(t *testing.T) {
	fastWait(t)
	f := newFakeDaemon(t, twoVMs())
	f.onAction = func(st *api.Status, name, action string) {
		later(f, 100*time.Millisecond, func(st *api.Status) { st.VMs[0].Phase, st.VMs[0].PID = "starting", 0 })
		later(f, 200*time.Millisecond, func(st *api.Status) { st.VMs[0].Phase, st.VMs[0].PID = "running", 99 })
	}
	start := time.Now()
	out, _, code := run(t, "vm", "restart", "web", "--wait", "--socket", f.sock)
	assert.Equal(t, 0, code)
	assert.GreaterOrEqual(t, time.Since(start), 200*time.Millisecond, "running in the old process is not restarted")
	assert.Contains(t, out, "web: starting\n")
	assert.Contains(t, out, "web: restarted after")
}

func TestVMWaitGivesUp(t *testing.T) {
	fastWait(t)
	f := newFakeDaemon(t, twoVMs())
	_, errs, code := run(t, "vm", "stop", "web", "--wait", "--timeout", "150ms", "--socket", f.sock)
	assert.Equal(t, 2, code, "a VM that never stops")
	assert.Contains(t, errs, "--wait: web is still running after 150ms, not stopped")

	f.set(func(st *api.Status) {
		st.VMs[1].Phase, st.VMs[1].PID, st.VMs[1].Detail = "failed", 0, "kernel not found"
	})
	_, errs, code = run(t, "vm", "start", "db", "--wait", "--socket", f.sock)
	assert.Equal(t, 2, code, "a VM failed for longer than the grace")
	assert.Contains(t, errs, "--wait: db failed: kernel not found")

	_, _, code = run(t, "vm", "start", "ghost", "--wait", "--socket", f.sock)
	assert.Equal(t, 1, code, "no such VM")
}

// status shows each VM's IPv6 address beside its IPv4 one (a dash where
// the guests have none), and the JSON carries it as address6.
func TestStatusShowsTheIPv6Address(t *testing.T) {
	st := twoVMs()
	st.VMs[0].Address, st.VMs[0].Address6 = "10.213.0.10", "fd00:6272:6b72:0:5054:ff:fe8c:7d82"
	f := newFakeDaemon(t, st)
	out, _, code := run(t, "status", "--socket", f.sock)
	require.Equal(t, 0, code)
	assert.Regexp(t, `(?m)^VM\s+PHASE\s+PID\s+ADDRESS\s+ADDRESS6\s+MAC`, out)
	assert.Regexp(t, `(?m)^web\s+running\s+10\s+10\.213\.0\.10\s+fd00:6272:6b72:0:5054:ff:fe8c:7d82\s`, out)
	assert.Regexp(t, `(?m)^db\s+running\s+11\s+-\s+-\s`, out)
	out, _, code = run(t, "status", "--socket", f.sock, "-o", "json")
	require.Equal(t, 0, code)
	var raw struct {
		VMs []map[string]any `json:"vms"`
	}
	require.NoError(t, json.Unmarshal([]byte(out), &raw))
	assert.Equal(t, "fd00:6272:6b72:0:5054:ff:fe8c:7d82", raw.VMs[0]["address6"])
	assert.Contains(t, raw.VMs[1], "address6", "present, empty, where a VM has none")
	assert.Equal(t, "", raw.VMs[1]["address6"])
}
