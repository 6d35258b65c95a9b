package daemon

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"log/slog"
	"net/http"
	"net/http/httptest"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/brokkr/brokkr/bpf"
	"github.com/brokkr/brokkr/daemon/api"
	"github.com/brokkr/brokkr/daemon/config"
	"github.com/brokkr/brokkr/netplane"
)

// updNet is recNet that also takes single exposures (as netplane.Plane
// does) and records each update as "set a,b -c".
type updNet struct {
	*recNet
	mu      sync.Mutex
	updates []string
	// Which of the network plane's checks ran.
	validated, validatedExposures atomic.Int32
}

func (n *updNet) Validate(d netplane.Desired) []error {
	n.validated.Add(1)
	return n.recNet.Validate(d)
}

func (n *updNet) ValidateExposures(netplane.Desired) []error {
	n.validatedExposures.Add(1)
	return n.invalid
}

func (n *updNet) UpdateExposures(_ context.Context, set []netplane.Exposure, remove []string) netplane.Report {
	var names []string
	for _, e := range set {
		names = append(names, e.Name+"/"+string(e.Mode))
	}
	n.mu.Lock()
	n.updates = append(n.updates, fmt.Sprintf("set %s -%s", strings.Join(names, ","), strings.Join(remove, ",")))
	n.mu.Unlock()
	return netplane.Report{}
}

func (n *updNet) got() []string {
	n.mu.Lock()
	defer n.mu.Unlock()
	return append([]string(nil), n.updates...)
}

// newUpdRig is newRig whose network plane takes single exposures.
func newUpdRig(t *testing.T, yaml string, opts func(*Options)) (*rig, *updNet) {
	t.Helper()
	host, err := config.Parse([]byte(yaml))
	require.NoError(t, err)
	host.StateDir, host.RunDir = t.TempDir(), shortDir(t)
	c := &calls{}
	addrs := NewAddressBook()
	un := &updNet{recNet: &recNet{calls: c}}
	r := &rig{calls: c, sup: &recSup{calls: c}, net: un.recNet, px: &recProxy{calls: c, resolve: addrs.Resolve},
		store: bpf.NewInMemory("test"), host: host}
	o := Options{Host: host, Store: r.store, Supervisor: r.sup, Network: un, Proxy: r.px, Addresses: addrs,
		Logger: slog.New(slog.NewTextHandler(io.Discard, nil)), Timeout: 200 * time.Millisecond}
	if opts != nil {
		opts(&o)
	}
	d, err := New(o)
	require.NoError(t, err)
	r.d = d
	t.Cleanup(func() { _ = r.store.Close() })
	return r, un
}

func do(t *testing.T, h http.Handler, method, path, body string) *httptest.ResponseRecorder {
	t.Helper()
	w := httptest.NewRecorder()
	h.ServeHTTP(w, httptest.NewRequest(method, path, strings.NewReader(body)))
	return w
}

// persisted is what is on disk of the desired state: desired.json and
// the journal of changes after it.
func persisted(t *testing.T, r *rig) []byte {
	t.Helper()
	b := desiredFile(t, r)
	j, err := os.ReadFile(filepath.Join(r.host.StateDir, JournalFile))
	require.NoError(t, err)
	return append(b, j...)
}

func desiredFile(t *testing.T, r *rig) []byte {
	t.Helper()
	b, err := os.ReadFile(filepath.Join(r.host.StateDir, DesiredFile))
	require.NoError(t, err)
	return b
}

func exposureNamesOf(c *config.Config) []string {
	var out []string
	for _, e := range c.Exposures {
		out = append(out, e.Name)
	}
	return out
}

// PUT creates an exposure (the name from the URL when the body has none),
// then replaces it in place; both are persisted with the rest of the
// desired state (a daemon started again has them) and handed to the
// network plane at once, alone; a PUT of what is already so changes
// nothing. DELETE removes it, persisted and withdrawn from the kernel.
func TestPutAndDeleteOneExposure(t *testing.T) {
	r, un := newUpdRig(t, rigConfig, nil)
	r.d.Pass(context.Background())
	c := serve(t, r)
	ctx := context.Background()
	_, gen0 := r.d.Generations()

	plan, err := c.PutExposure(ctx, "db-extra", []byte(`{"vm": "db", "guestPort": 6432, "hostPort": 6432, "mode": "nat", "maxConns": 7}`))
	require.NoError(t, err)
	assert.True(t, plan.Applied)
	assert.Equal(t, []string{"db-extra"}, plan.Exposures.Added)
	assert.Empty(t, plan.Exposures.Changed)
	assert.Equal(t, []string{"web-auto", "web-nat", "web-proxy", "lo-auto", "ext", "db-extra"}, exposureNamesOf(r.d.Desired()))
	assert.Equal(t, []string{"set db-extra/nat -"}, un.got(), "the one exposure, to the kernel at once")
	desired, _ := r.d.Generations()
	assert.Greater(t, desired, gen0)

	// Replaced in place, in YAML; the defaults filled as in a file.
	plan, err = c.PutExposure(ctx, "web-nat", []byte("name: web-nat\nvm: web\nguestPort: 81\nhostPort: 8081\nmode: proxy\n"))
	require.NoError(t, err)
	assert.Equal(t, []string{"web-nat"}, plan.Exposures.Changed)
	assert.Empty(t, plan.Exposures.Added)
	got := r.d.Desired()
	assert.Equal(t, []string{"web-auto", "web-nat", "web-proxy", "lo-auto", "ext", "db-extra"}, exposureNamesOf(got), "in its place")
	assert.Equal(t, config.P(81), got.Exposures[1].GuestPort)
	assert.Equal(t, "tcp", got.Exposures[1].Protocol)
	assert.Equal(t, config.DefaultMaxConns, *got.Exposures[1].MaxConns)
	assert.Equal(t, "set db-extra/nat -", un.got()[0])
	assert.Equal(t, []string{"set  -web-nat"}, un.got()[1:], "now proxied: withdrawn from the kernel")

	// Again the same: nothing to do.
	before := persisted(t, r)
	plan, err = c.PutExposure(ctx, "web-nat", []byte("vm: web\nguestPort: 81\nhostPort: 8081\nmode: proxy\n"))
	require.NoError(t, err)
	assert.True(t, plan.Exposures.Empty())
	assert.Equal(t, before, persisted(t, r))
	assert.Len(t, un.got(), 2)

	// A daemon started again resumes from what was persisted.
	again := newRigWith(t, r.host)
	ag := again.d.Desired()
	assert.Equal(t, exposureNamesOf(got), exposureNamesOf(ag))
	assert.Equal(t, 7, *ag.Exposures[5].MaxConns)
	assert.Equal(t, "proxy", ag.Exposures[1].Mode)

	plan, err = c.DeleteExposure(ctx, "db-extra")
	require.NoError(t, err)
	assert.Equal(t, []string{"db-extra"}, plan.Exposures.Removed)
	assert.Equal(t, []string{"web-auto", "web-nat", "web-proxy", "lo-auto", "ext"}, exposureNamesOf(r.d.Desired()))
	assert.NotContains(t, exposureNamesOf(newRigWith(t, r.host).d.Desired()), "db-extra", "a daemon started again has it removed")
	assert.Equal(t, "set  -db-extra", un.got()[2])

	// A proxied exposure removed has nothing in the kernel to withdraw.
	_, err = c.DeleteExposure(ctx, "web-proxy")
	require.NoError(t, err)
	assert.Len(t, un.got(), 3)

	// The pass after carries the change to every engine.
	r.d.Pass(context.Background())
	specs, _ := r.px.specs()
	var proxied []string
	for _, s := range specs {
		proxied = append(proxied, s.Name+"@"+s.Listen.String())
	}
	assert.Contains(t, proxied, "web-nat@0.0.0.0")
	assert.NotContains(t, proxied, "web-proxy@0.0.0.0")
	st := r.d.Status()
	assert.Len(t, st.Exposures, 4)
}

// Deleting an exposure that is not there is a 404 naming it; nothing changes.
func TestDeleteOfAnUnknownExposureIs404(t *testing.T) {
	r, un := newUpdRig(t, rigConfig, nil)
	before := persisted(t, r)
	w := do(t, r.d.Handler(), "DELETE", "/v1/exposures/ghost", "")
	assert.Equal(t, http.StatusNotFound, w.Code)
	assert.Contains(t, w.Body.String(), `no such exposure: \"ghost\"`)
	assert.Equal(t, before, persisted(t, r))
	assert.Empty(t, un.got())
}

// A PUT that does not validate is refused as a whole with the fields named
// (the exposure's own without a path prefix), and nothing is persisted,
// swapped in or published.
func TestPutOfAnInvalidExposureNamesTheFieldAndChangesNothing(t *testing.T) {
	r, un := newUpdRig(t, rigConfig, nil)
	h := r.d.Handler()
	before := persisted(t, r)
	gen0, _ := r.d.Generations()
	for _, tc := range []struct {
		name, path, body string
		fields           []string
	}{
		{"a port out of range", "/v1/exposures/x", `{"vm": "web", "guestPort": 70000, "hostPort": 9000}`,
			[]string{"guestPort: 70000 is out of range (1..65535)"}},
		{"a VM that does not exist", "/v1/exposures/x", `{"vm": "nope", "guestPort": 80, "hostPort": 9000}`,
			[]string{`vm: "nope" is not a VM in vms`}},
		{"a misspelt key", "/v1/exposures/x", "vm: web\nguestPort: 80\nhostPort: 9000\nmaxconns: 3\n",
			[]string{`maxconns: unknown key "maxconns"`}},
		{"a wrong type", "/v1/exposures/x", "vm: web\nguestPort: eighty\nhostPort: 9000\n",
			[]string{`guestPort: "eighty" is not a port or a range of ports (8080, "30000-30099")`}},
		{"a name other than the URL's", "/v1/exposures/x", `{"name": "y", "vm": "web", "guestPort": 80, "hostPort": 9000}`,
			[]string{`name: "y" is not the name in the URL ("x")`}},
		{"a bad name in the URL", "/v1/exposures/-x", `{"vm": "web", "guestPort": 80, "hostPort": 9000}`,
			[]string{`name: "-x" must start with a letter or digit and hold only A-Z a-z 0-9 . _ -`}},
		{"neither vm nor target", "/v1/exposures/x", `{"guestPort": 80, "hostPort": 9000}`,
			[]string{"one of vm or target (or target6) is required"}},
		{"the host port of another exposure", "/v1/exposures/x", `{"target": "10.213.0.201", "guestPort": 80, "hostPort": 8081, "mode": "nat"}`,
			[]string{"hostPort: 8081/tcp on every address overlaps exposures[1] (8081/tcp on every address)"}},
		{"a replaced exposure onto another's port", "/v1/exposures/web-nat", `{"vm": "web", "guestPort": 80, "hostPort": 8082}`,
			[]string{"hostPort: 8082/tcp on every address overlaps exposures[2] (8082/tcp on 0.0.0.0)"}}, // reported at web-nat, not at web-proxy
		{"no body", "/v1/exposures/x", "",
			[]string{"no exposure given (one entry of exposures:, like {vm: web, guestPort: 80, hostPort: 8080})"}},
		{"a list", "/v1/exposures/x", "[1, 2]",
			[]string{"line 1: an exposure must be a mapping (name:, vm:, guestPort:, hostPort:, ...)"}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			w := do(t, h, "PUT", tc.path, tc.body)
			require.Equal(t, http.StatusUnprocessableEntity, w.Code, w.Body.String())
			var e api.Error
			require.NoError(t, json.Unmarshal(w.Body.Bytes(), &e))
			assert.Equal(t, "exposure rejected; nothing was changed", e.Error)
			assert.Equal(t, tc.fields, e.Errors)
		})
	}
	assert.Equal(t, before, persisted(t, r), "nothing persisted")
	gen, _ := r.d.Generations()
	assert.Equal(t, gen0, gen)
	assert.Len(t, r.d.Desired().Exposures, 5)
	assert.Equal(t, config.P(8081), r.d.Desired().Exposures[1].HostPort)
	assert.Empty(t, un.got(), "nothing published")
}

// The network plane's own checks refuse a PUT as they refuse an apply.
func TestPutIsRefusedByTheNetworkPlanesChecks(t *testing.T) {
	r, un := newUpdRig(t, rigConfig, nil)
	before := persisted(t, r)
	r.net.invalid = []error{fmt.Errorf("exposures[5].target: 10.213.0.10 is assigned to guest %q", "web")}
	w := do(t, r.d.Handler(), "PUT", "/v1/exposures/x", `{"target": "10.213.0.10", "guestPort": 80, "hostPort": 9000}`)
	assert.Equal(t, http.StatusUnprocessableEntity, w.Code)
	assert.Contains(t, w.Body.String(), "is assigned to guest")
	assert.Equal(t, before, persisted(t, r))
	assert.Empty(t, un.got())
	assert.NotZero(t, un.validatedExposures.Load(), "the exposure's own check refused it")

	// Accepted, a PUT runs the exposure's check alone: no link or address
	// dump of the whole network's (nor a wait for a pass in flight).
	r.net.invalid = nil
	un.validated.Store(0)
	w = do(t, r.d.Handler(), "PUT", "/v1/exposures/x", `{"target": "10.213.0.99", "guestPort": 80, "hostPort": 9000}`)
	require.Equal(t, http.StatusOK, w.Code, w.Body.String())
	assert.Zero(t, un.validated.Load(), "the whole network's check")
}

type fleetSource struct{}

func (fleetSource) Run(ctx context.Context, _ Target) { <-ctx.Done() }
func (fleetSource) Report() api.Source {
	return api.Source{Kind: "etcd", Node: "h1", State: "connected"}
}

// In fleet mode the document in etcd is the desired state: PUT and DELETE
// are refused as a local apply is (409, naming brokkr fleet apply), and
// nothing changes.
func TestPutAndDeleteAreRefusedInFleetMode(t *testing.T) {
	r, un := newUpdRig(t, rigConfig, func(o *Options) { o.Source = fleetSource{} })
	h := r.d.Handler()
	before := persisted(t, r)
	apply := do(t, h, "POST", "/v1/apply", "vms: []\n")
	require.Equal(t, http.StatusConflict, apply.Code)
	for _, req := range [][2]string{
		{"PUT", `{"vm": "web", "guestPort": 80, "hostPort": 9000}`},
		{"DELETE", ""},
	} {
		w := do(t, h, req[0], "/v1/exposures/web-nat", req[1])
		assert.Equal(t, http.StatusConflict, w.Code, req[0])
		assert.Equal(t, apply.Body.String(), w.Body.String(), "%s: refused as apply is", req[0])
		assert.Contains(t, w.Body.String(), "brokkr fleet apply --node h1")
	}
	_, err := r.d.PutExposure(config.Exposure{Name: "x"})
	assert.ErrorAs(t, err, new(ErrRemoteSource), "the method refuses too, not only the handler")
	_, err = r.d.DeleteExposure("web-nat")
	assert.ErrorAs(t, err, new(ErrRemoteSource))
	assert.Equal(t, before, persisted(t, r))
	assert.Len(t, r.d.Desired().Exposures, 5)
	assert.Empty(t, un.got())
}

// A PUT reaches the kernel before any pass runs: a caller is served by the
// exposure just added, and no longer by the one just removed, with only
// the first pass before them (which the network needs to be known); on the
// nat path (counters pinned, as brokkrd runs) and on its fallback.
func TestAnExposurePutIsServedBeforeThePass(t *testing.T) {
	for _, pinned := range []bool{true, false} {
		t.Run(map[bool]string{true: "pinned", false: "in memory"}[pinned], func(t *testing.T) {
			d, echo := kernelRig(t, 1, "", pinned)
			require.Error(t, echo("10.99.0.1:8082"), "not published yet")

			h := d.Handler()
			w := do(t, h, "PUT", "/v1/exposures/b", `{"target": "10.213.0.250", "guestPort": 80, "hostPort": 8082, "mode": "nat"}`)
			require.Equal(t, http.StatusOK, w.Code, w.Body.String())
			assert.NoError(t, echo("10.99.0.1:8082"), "served with no pass since the PUT")

			w = do(t, h, "DELETE", "/v1/exposures/e-0", "")
			require.Equal(t, http.StatusOK, w.Code, w.Body.String())
			assert.Error(t, echo("10.99.0.1:20001"), "withdrawn with no pass since the DELETE")

			// The pass after finds the kernel already so.
			d.Pass(context.Background())
			st := d.Status()
			require.Len(t, st.Exposures, 1)
			assert.Equal(t, "b", st.Exposures[0].Name)
			assert.Equal(t, "active", st.Exposures[0].State, st.Exposures[0].Reason)
			assert.NoError(t, echo("10.99.0.1:8082"))
		})
	}
}

// desired.json is laid out as json.MarshalIndent lays it out, byte for
// byte (the faster layout is no change of format), strings holding what
// the layout looks for included.
func TestDesiredFileIsIndentedAsBefore(t *testing.T) {
	r := newRig(t, strings.Replace(rigConfig, "    kernel: /k\n    cpus: 2", "    kernel: /k\n    cmdline: 'a=\"{[,:]}\" b=\\\\ {}[]'\n    cpus: 2", 1))
	require.NoError(t, r.d.SetPower("db", "stopped"))
	want, err := json.MarshalIndent(r.d.Desired(), "", "  ")
	require.NoError(t, err)
	assert.Equal(t, string(want)+"\n", string(desiredFile(t, r)))
	assert.Contains(t, string(want), `"cmdline": "a=\"{[,:]}\" b=\\\\ {}[]"`)
	for _, v := range []any{map[string]any{}, []any{}, map[string]any{"a": []any{}, "b": map[string]any{}, "c": []any{map[string]any{}, 1, "x\\\""}}} {
		compact, err := json.Marshal(v)
		require.NoError(t, err)
		want, err := json.MarshalIndent(v, "", "  ")
		require.NoError(t, err)
		assert.Equal(t, string(want), string(indented(compact)))
	}
}

// Changes from many clients at once are each persisted before they are
// acknowledged: every acknowledged exposure (and every acknowledged
// removal) is in the desired state as a restart would read it
// (desired.json and the journal) when its answer comes, with the journal
// compacted many times on the way, and a daemon started again has exactly
// the acknowledged state.
func TestConcurrentPutsAreEachPersisted(t *testing.T) {
	r, _ := newUpdRig(t, rigConfig, nil)
	r.d.journal.maxRecords = 7 // compacted every few changes, under the clients
	h := r.d.Handler()
	restartSees := func() map[string]bool {
		// As a restart would read it; read again if a compaction ran in
		// between (desired.json read before it, the journal after).
		var l loadedState
		for {
			b := desiredFile(t, r)
			var err error
			l, err = loadDesired(r.host.StateDir)
			require.NoError(t, err)
			if bytes.Equal(b, desiredFile(t, r)) {
				break
			}
		}
		names := map[string]bool{}
		for _, e := range l.c.Exposures {
			names[e.Name] = true
		}
		return names
	}
	var wg sync.WaitGroup
	for c := range 8 {
		wg.Go(func() {
			for i := range 12 {
				name := fmt.Sprintf("c%d-%d", c, i)
				w := do(t, h, "PUT", "/v1/exposures/"+name, fmt.Sprintf(`{"vm": "db", "guestPort": 80, "hostPort": %d, "mode": "nat"}`, 10000+100*c+i))
				if !assert.Equal(t, http.StatusOK, w.Code, w.Body.String()) {
					return
				}
				assert.True(t, restartSees()[name], "%s persisted before it is acknowledged", name)
				if i%3 == 0 {
					w := do(t, h, "DELETE", "/v1/exposures/"+name, "")
					if !assert.Equal(t, http.StatusOK, w.Code, w.Body.String()) {
						return
					}
					assert.False(t, restartSees()[name], "%s's removal persisted before it is acknowledged", name)
				}
			}
		})
	}
	wg.Wait()
	want := exposureNamesOf(r.d.Desired())
	assert.Len(t, want, 5+8*8)
	again := newRigWith(t, r.host)
	assert.Equal(t, want, exposureNamesOf(again.d.Desired()), "the acknowledged state, in its order")
}
