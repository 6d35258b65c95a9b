package main

import (
	"bytes"
	"encoding/json"
	"errors"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/brokkr/brokkr/daemon/api"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	"go.uber.org/goleak"
)

func TestMain(m *testing.M) { goleak.VerifyTestMain(m) }

func run(t *testing.T, args ...string) (string, string, int) {
	t.Helper()
	root := newRoot()
	var out, errb bytes.Buffer
	root.SetOut(&out)
	root.SetErr(&errb)
	root.SetArgs(socketFirst(args))
	err := root.Execute()
	if err != nil {
		var se silentError
		if !errors.As(err, &se) {
			errb.WriteString(err.Error())
		}
	}
	return out.String(), errb.String(), exitCode(err)
}

func TestExitCodes(t *testing.T) {
	dir := t.TempDir()
	good := filepath.Join(dir, "good.yaml")
	bad := filepath.Join(dir, "bad.yaml")
	require.NoError(t, os.WriteFile(good, []byte("vms: [{name: a, kernel: /k}]\n"), 0o600))
	require.NoError(t, os.WriteFile(bad, []byte("vms:\n  - name: a\n    memory: 12Q\n    kernel: /k\n"), 0o600))

	out, _, code := run(t, "validate", "-f", good)
	assert.Equal(t, 0, code)
	assert.Contains(t, out, "valid (1 VMs, 0 exposures)")

	_, errs, code := run(t, "validate", "-f", bad)
	assert.Equal(t, 1, code, "an invalid config is a user error")
	assert.Contains(t, errs, `vms[0].memory: "12Q" is not a size`)

	_, _, code = run(t, "validate")
	assert.Equal(t, 1, code, "-f is required")
	_, _, code = run(t, "vm", "start")
	assert.Equal(t, 1, code, "a missing argument is a user error")
	_, _, code = run(t, "status", "--nope")
	assert.Equal(t, 1, code, "an unknown flag is a user error")
	_, _, code = run(t, "frobnicate")
	assert.Equal(t, 1, code)

	_, errs, code = run(t, "--socket", filepath.Join(dir, "none.sock"), "status")
	assert.Equal(t, 2, code, "an unreachable daemon is a system error")
	assert.Contains(t, errs, "cannot reach brokkrd")

	_, _, code = run(t, "--socket", filepath.Join(dir, "none.sock"), "apply", "-f", bad)
	assert.Equal(t, 1, code, "apply checks the file before calling the daemon")

	_, _, code = run(t, "stats", "--bpf-dir", dir)
	assert.Equal(t, 2, code, "no pinned map is a system error")

	assert.Equal(t, 1, exitCode(&api.HTTPError{Code: 404}))
	assert.Equal(t, 1, exitCode(&api.HTTPError{Code: 422}))
	assert.Equal(t, 2, exitCode(&api.HTTPError{Code: 500}))
}

func TestPlanPrinting(t *testing.T) {
	var b bytes.Buffer
	printPlan(&b, &api.Plan{DryRun: true, VMs: api.Changes{Added: []string{"web"}}, Exposures: api.Changes{Removed: []string{"old"}, Changed: []string{"x"}},
		Warnings: []string{"stateDir: differs"}})
	assert.Equal(t, "would change (dry run):\n  + vm web\n  ~ exposure x\n  - exposure old\nwarning: stateDir: differs\n", b.String())
	b.Reset()
	printPlan(&b, &api.Plan{Applied: true})
	assert.Equal(t, "no changes\n", b.String())
}

func TestConverged(t *testing.T) {
	st := &api.Status{VMs: []api.VM{{Name: "a", Phase: "starting", Power: "running"}}, Exposures: []api.Exposure{{Name: "e", State: "pending"}}}
	done, failed := converged(st)
	assert.False(t, done)
	assert.Empty(t, failed)
	st.VMs[0].Phase, st.Exposures[0].State = "running", "active"
	done, _ = converged(st)
	assert.True(t, done)
	st.Exposures[0].State, st.Exposures[0].Reason = "failed", "bind: address in use"
	done, failed = converged(st)
	assert.False(t, done)
	assert.Equal(t, []string{"exposure e failed: bind: address in use"}, failed)
}

func TestProgressBar(t *testing.T) {
	assert.Equal(t, "[########............]", bar(api.VM{Phase: "creating", Detail: "downloading kernel image 40%", Progress: &api.Progress{Done: 40 << 20, Total: 100 << 20}}))
	assert.NotContains(t, bar(api.VM{Phase: "creating", Detail: "a 40% detail without progress"}), "#", "the bar is drawn from progress, never from the text")
	assert.True(t, strings.HasPrefix(bar(api.VM{Phase: "running"}), "[===================="))
}

func TestStatusShowsBothVersionsAndWarnsWhenTheyDiffer(t *testing.T) {
	cli := api.CurrentBuild()
	f := newFakeDaemon(t, api.Status{VMs: []api.VM{}, Exposures: []api.Exposure{}, Daemon: &cli})
	out, errs, code := run(t, "--socket", f.sock, "status")
	assert.Equal(t, 0, code)
	assert.Contains(t, out, "brokkr "+cli.String()+", brokkrd "+cli.String())
	assert.NotContains(t, errs, "warning")

	old := api.Build{Version: "v0.1.0", Commit: "0123456789ab", GoVersion: "go1.25.0"}
	f.set(func(st *api.Status) { st.Daemon = &old })
	out, errs, code = run(t, "--socket", f.sock, "status", "-o", "json")
	assert.Equal(t, 0, code, "a version difference is a warning, not a failure")
	assert.Contains(t, errs, "warning: brokkr (CLI) is "+cli.Version)
	assert.Contains(t, errs, "brokkrd is v0.1.0 0123456789ab")
	var st api.Status
	require.NoError(t, json.Unmarshal([]byte(out), &st), "the warning stays out of the JSON")
	assert.Equal(t, "v0.1.0", st.Daemon.Version)

	f.set(func(st *api.Status) { st.Daemon = nil })
	_, errs, _ = run(t, "--socket", f.sock, "status")
	assert.Contains(t, errs, "brokkrd does not report its version")
}

func TestVersionFlag(t *testing.T) {
	out, _, code := run(t, "--version")
	assert.Equal(t, 0, code)
	b := api.CurrentBuild()
	assert.Equal(t, "brokkr "+b.String()+"\n", out)
	assert.Contains(t, out, b.GoVersion)
}

func TestValidateWarnsWhenProxyCapsExceedTheDescriptorBudget(t *testing.T) {
	f := filepath.Join(t.TempDir(), "big.yaml")
	require.NoError(t, os.WriteFile(f, []byte(`exposures:
  - {name: big, target: 10.213.0.200, guestPort: 80, hostPort: 8080, mode: proxy, maxConns: 40000}
  - {name: small, target: 10.213.0.200, guestPort: 81, hostPort: 8081, mode: nat, maxConns: 40000}
`), 0o600))
	out, errs, code := run(t, "validate", "-f", f)
	assert.Equal(t, 0, code, "a warning, not an error")
	assert.Contains(t, out, "valid")
	assert.Contains(t, errs, "warning: descriptor budget")
	assert.Contains(t, errs, "big (40000)")
	assert.NotContains(t, errs, "small", "nat mode is carried by the kernel")
}
