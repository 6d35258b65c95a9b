package main

import (
	"encoding/json"
	"net"
	"net/http"
	"os"
	"path/filepath"
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
