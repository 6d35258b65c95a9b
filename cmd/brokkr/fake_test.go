package main

import (
	"encoding/json"
	"io"
	"net"
	"net/http"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"testing"

	"github.com/brokkr/brokkr/daemon/api"
	"github.com/stretchr/testify/require"
)

// fakeDaemon answers the API on a unix socket with a status the test sets,
// and records the VM actions it was sent: the CLI's own decisions (exit
// codes, waiting, completion) are tested against it; the real daemon's
// handlers have their tests in package daemon.
type fakeDaemon struct {
	sock    string
	mu      sync.Mutex
	st      api.Status
	actions []string
	// onAction, when set, changes the status after an action (a VM that
	// stops once asked).
	onAction func(st *api.Status, name, action string)
	// exposures records PUT and DELETE /v1/exposures/{name} ("PUT name
	// body"); onExposure, when set, answers them (code, body), else they
	// succeed with the plan of an added or removed exposure.
	exposures  []string
	onExposure func(method, name string) (int, any)
}

func newFakeDaemon(t *testing.T, st api.Status) *fakeDaemon {
	t.Helper()
	f := &fakeDaemon{sock: filepath.Join(shortTemp(t), "d.sock"), st: st}
	ln, err := net.Listen("unix", f.sock)
	require.NoError(t, err)
	mux := http.NewServeMux()
	mux.HandleFunc("GET /v1/status", func(w http.ResponseWriter, _ *http.Request) {
		f.mu.Lock()
		defer f.mu.Unlock()
		_ = json.NewEncoder(w).Encode(f.st)
	})
	mux.HandleFunc("POST /v1/vms/{name}/{action}", func(w http.ResponseWriter, r *http.Request) {
		f.mu.Lock()
		defer f.mu.Unlock()
		name, action := r.PathValue("name"), r.PathValue("action")
		known := false
		for _, v := range f.st.VMs {
			known = known || v.Name == name
		}
		if !known {
			w.WriteHeader(http.StatusNotFound)
			_ = json.NewEncoder(w).Encode(api.Error{Error: "no such VM: " + name})
			return
		}
		f.actions = append(f.actions, name+" "+action)
		if f.onAction != nil {
			f.onAction(&f.st, name, action)
		}
		_ = json.NewEncoder(w).Encode(map[string]string{"vm": name, "action": action})
	})
	mux.HandleFunc("POST /v1/apply", func(w http.ResponseWriter, r *http.Request) {
		_ = json.NewEncoder(w).Encode(api.Plan{Applied: true, VMs: api.Changes{Added: []string{"web"}}})
	})
	for _, method := range []string{"PUT", "DELETE"} {
		mux.HandleFunc(method+" /v1/exposures/{name}", func(w http.ResponseWriter, r *http.Request) {
			body, _ := io.ReadAll(r.Body)
			name := r.PathValue("name")
			f.mu.Lock()
			f.exposures = append(f.exposures, strings.TrimSpace(method+" "+name+" "+string(body)))
			answer := f.onExposure
			f.mu.Unlock()
			if answer != nil {
				code, v := answer(method, name)
				w.WriteHeader(code)
				_ = json.NewEncoder(w).Encode(v)
				return
			}
			p := api.Plan{Applied: true, Exposures: api.Changes{Added: []string{}, Changed: []string{}, Removed: []string{}}}
			if method == "PUT" {
				p.Exposures.Added = []string{name}
			} else {
				p.Exposures.Removed = []string{name}
			}
			_ = json.NewEncoder(w).Encode(p)
		})
	}
	srv := &http.Server{Handler: mux}
	go func() { _ = srv.Serve(ln) }()
	t.Cleanup(func() { srv.Close() })
	return f
}

func (f *fakeDaemon) set(change func(st *api.Status)) {
	f.mu.Lock()
	defer f.mu.Unlock()
	change(&f.st)
}

func (f *fakeDaemon) answerExposures(fn func(method, name string) (int, any)) {
	f.mu.Lock()
	defer f.mu.Unlock()
	f.onExposure = fn
}

func (f *fakeDaemon) exposureRequests() []string {
	f.mu.Lock()
	defer f.mu.Unlock()
	return append([]string(nil), f.exposures...)
}

func (f *fakeDaemon) sent() []string {
	f.mu.Lock()
	defer f.mu.Unlock()
	return append([]string(nil), f.actions...)
}

// shortTemp is a directory with a path short enough for a unix socket
// (t.TempDir() under a long test name can pass the 108-byte sun_path).
func shortTemp(t *testing.T) string {
	t.Helper()
	dir, err := os.MkdirTemp("", "brk")
	require.NoError(t, err)
	t.Cleanup(func() { os.RemoveAll(dir) })
	return dir
}
