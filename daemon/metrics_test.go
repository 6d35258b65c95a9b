package daemon

import (
	"bytes"
	"context"
	"errors"
	"io"
	"net"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"sort"
	"strings"
	"testing"

	"github.com/brokkr/brokkr/bpf"
	"github.com/brokkr/brokkr/daemon/api"
	dto "github.com/prometheus/client_model/go"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

// promtool is Debian's prometheus package (scripts/deps.sh installs it).
// Missing, the tests fail rather than skip, except under -short: an
// unchecked exposition is how a renamed metric breaks every dashboard.
func promtool(t *testing.T) string {
	t.Helper()
	p, err := exec.LookPath("promtool")
	if err != nil {
		if testing.Short() {
			t.Skip("promtool not installed (scripts/deps.sh installs Debian's prometheus)")
		}
		t.Fatal("promtool not installed: run scripts/deps.sh (Debian's prometheus package)")
	}
	return p
}

func scrape(t *testing.T, r *rig) string {
	t.Helper()
	text, err := serve(t, r).Metrics(context.Background())
	require.NoError(t, err)
	return text
}

func TestMetricsNamesOnlyAndInfo(t *testing.T) {
	r := newRig(t, rigConfig)
	slot, err := r.store.Attach("ext", bpf.ProtoTCP, 2222)
	require.NoError(t, err)
	defer slot.Release(false)
	slot.AddBytes(10, 20)
	r.d.Pass(context.Background())
	text := scrape(t, r)
	b := api.CurrentBuild()
	for _, want := range []string{
		`brokkr_exposure_bytes_total{direction="in",exposure="ext"} 10`,
		`brokkr_exposure_bytes_total{direction="out",exposure="ext"} 20`,
		`brokkr_exposure_info{exposure="ext",host_address="",host_port="2222",mode="proxy",protocol="tcp"} 1`,
		`brokkr_exposure_info{exposure="lo-auto",host_address="127.0.0.1",host_port="5432",mode="auto",protocol="tcp"} 1`,
		`brokkr_build_info{commit="` + b.Commit + `",goversion="` + b.GoVersion + `",version="` + b.Version + `"} 1`,
		`brokkr_drift_repaired_total{engine="netplane"} 0`,
	} {
		assert.Contains(t, text, want)
	}
	assert.NotContains(t, text, "bytes_in_total")
	// Only the info series may carry what describes an exposure.
	for _, line := range strings.Split(text, "\n") {
		if strings.HasPrefix(line, "brokkr_exposure_") && !strings.HasPrefix(line, "brokkr_exposure_info{") {
			assert.NotRegexp(t, `mode=|protocol=|host_port=`, line)
		}
	}
}

func TestLastConvergeSuccessAndDriftRepaired(t *testing.T) {
	r := newRig(t, rigConfig)
	gauge := func() float64 { return gatherValue(t, r, "brokkr_last_converge_success_timestamp_seconds", "") }
	assert.Zero(t, gauge(), "no pass yet")
	select {
	case <-r.d.FirstPass():
		t.Fatal("FirstPass closed before any pass")
	default:
	}
	r.d.Pass(context.Background())
	<-r.d.FirstPass()
	first := gauge()
	assert.NotZero(t, first)
	assert.False(t, r.d.LastPass().IsZero())

	// A pass with an error leaves the timestamp where it was.
	r.d.m.passDone([]error{nil, errors.New("netplane: boom")}, 3)
	assert.Equal(t, first, gauge())
	assert.Equal(t, 3.0, gatherValue(t, r, "brokkr_drift_repaired_total", "netplane"))
	r.d.m.passDone([]error{nil, nil}, 2)
	assert.Greater(t, gauge(), first)
	assert.Equal(t, 5.0, gatherValue(t, r, "brokkr_drift_repaired_total", "netplane"))
}

// gatherValue reads one series (label value engine, or none) from the registry.
func gatherValue(t *testing.T, r *rig, name, engine string) float64 {
	t.Helper()
	fams, err := r.d.m.reg.Gather()
	require.NoError(t, err)
	for _, f := range fams {
		if f.GetName() != name {
			continue
		}
		for _, m := range f.GetMetric() {
			if engine != "" && labelOf(m, "engine") != engine {
				continue
			}
			if m.GetCounter() != nil {
				return m.GetCounter().GetValue()
			}
			return m.GetGauge().GetValue()
		}
	}
	t.Fatalf("no %s{engine=%q}", name, engine)
	return 0
}

func labelOf(m *dto.Metric, name string) string {
	for _, l := range m.GetLabel() {
		if l.GetName() == name {
			return l.GetValue()
		}
	}
	return ""
}

func TestMetricsPassPromtool(t *testing.T) {
	tool := promtool(t)
	r := newRig(t, rigConfig)
	r.d.Pass(context.Background())
	cmd := exec.Command(tool, "check", "metrics")
	cmd.Stdin = strings.NewReader(scrape(t, r))
	out, err := cmd.CombinedOutput()
	assert.NoError(t, err, "promtool check metrics:\n%s", out)
	assert.Empty(t, strings.TrimSpace(string(out)), "promtool found lint problems")
}

// The README's metric table is the list operators read: it must name
// exactly the brokkr_* families the daemon serves, with their types.
func TestReadmeListsEveryMetric(t *testing.T) {
	readme, err := os.ReadFile("../README.md")
	require.NoError(t, err)
	row := regexp.MustCompile("(?m)^\\| `(brokkr_[a-z_]+)` \\| ([a-z]+) \\|")
	documented := map[string]string{}
	for _, m := range row.FindAllStringSubmatch(string(readme), -1) {
		documented[m[1]] = m[2]
	}
	require.NotEmpty(t, documented, "README has no metric table")

	r := newRig(t, rigConfig)
	r.d.Pass(context.Background())
	fams, err := r.d.m.reg.Gather()
	require.NoError(t, err)
	served := map[string]string{}
	for _, f := range fams {
		if strings.HasPrefix(f.GetName(), "brokkr_") {
			served[f.GetName()] = strings.ToLower(f.GetType().String())
		}
	}
	assert.Equal(t, served, documented)
}

// The example alert rules load, pass their promtool unit tests, and name
// only metrics the daemon serves (a rule on a renamed metric never fires).
func TestAlertRules(t *testing.T) {
	tool := promtool(t)
	for _, args := range [][]string{{"check", "rules", "brokkr.rules.yml"}, {"test", "rules", "brokkr.rules.test.yml"}} {
		cmd := exec.Command(tool, args...)
		cmd.Dir = "../dist"
		out, err := cmd.CombinedOutput()
		assert.NoError(t, err, "promtool %v:\n%s", args, out)
	}
	rules, err := os.ReadFile(filepath.Join("..", "dist", "brokkr.rules.yml"))
	require.NoError(t, err)
	var body bytes.Buffer
	for _, l := range strings.Split(string(rules), "\n") {
		if !strings.HasPrefix(strings.TrimSpace(l), "#") {
			body.WriteString(l + "\n")
		}
	}
	r := newRig(t, rigConfig)
	r.d.Pass(context.Background())
	text := scrape(t, r)
	var names []string
	for _, n := range regexp.MustCompile(`brokkr_[a-z_]+`).FindAllString(body.String(), -1) {
		names = append(names, n)
		assert.Contains(t, text, "\n"+n, "the rules use %s, which the daemon does not serve", n)
	}
	sort.Strings(names)
	assert.Contains(t, names, "brokkr_vm_phase")
	assert.Contains(t, names, "brokkr_exposure_refused_total")
	assert.Contains(t, names, "brokkr_last_converge_success_timestamp_seconds")
}

func TestStatusCarriesTheDaemonsBuild(t *testing.T) {
	r := newRig(t, rigConfig)
	st, err := serve(t, r).Status(context.Background())
	require.NoError(t, err)
	require.NotNil(t, st.Daemon)
	assert.Equal(t, api.CurrentBuild(), *st.Daemon)
}

func TestMetricsOverTCPServeOnlyMetrics(t *testing.T) {
	r := newRig(t, rigConfig)
	r.d.Pass(context.Background())
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	require.NoError(t, err)
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- r.d.ServeMetrics(ctx, ln) }()
	defer func() { cancel(); require.NoError(t, <-done) }()
	get := func(path string) (int, string) {
		resp, err := http.Get("http://" + ln.Addr().String() + path)
		require.NoError(t, err)
		defer resp.Body.Close()
		b, _ := io.ReadAll(resp.Body)
		return resp.StatusCode, string(b)
	}
	code, body := get("/metrics")
	assert.Equal(t, http.StatusOK, code)
	assert.Contains(t, body, `brokkr_vm_phase{phase="running",vm="web"} 1`)
	code, _ = get("/v1/status")
	assert.Equal(t, http.StatusNotFound, code, "the API stays on the root-only socket")
	resp, err := http.Post("http://"+ln.Addr().String()+"/v1/vms/web/stop", "", nil)
	require.NoError(t, err)
	resp.Body.Close()
	assert.Equal(t, http.StatusNotFound, resp.StatusCode)
}
