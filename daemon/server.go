package daemon

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"os"
	"path/filepath"
	"time"

	"github.com/brokkr/brokkr/daemon/api"
	"github.com/brokkr/brokkr/daemon/config"
	"github.com/brokkr/brokkr/supervisor"
)

// SocketName is the API socket's name under runDir.
const SocketName = "brokkr.sock"

// maxBody caps request bodies at the largest config (a desired state at
// the most exposures a host holds); anything bigger is a mistake or an
// attack, refused before it is read into memory.
const maxBody = config.MaxConfigBytes

// Handler is the API: GET /v1/status, POST /v1/apply[?dryRun=1],
// PUT|DELETE /v1/exposures/{name} (exposures.go),
// POST /v1/vms/{name}/start|stop|restart, GET /v1/vms/{name}/console,
// GET /metrics.
func (d *Daemon) Handler() http.Handler {
	mux := http.NewServeMux()
	mux.HandleFunc("GET /v1/status", func(w http.ResponseWriter, r *http.Request) {
		st := d.Status()
		b := api.CurrentBuild()
		st.Daemon = &b
		writeJSON(w, http.StatusOK, st)
	})
	mux.HandleFunc("POST /v1/apply", d.handleApply)
	mux.HandleFunc("PUT /v1/exposures/{name}", d.handlePutExposure)
	mux.HandleFunc("DELETE /v1/exposures/{name}", d.handleDeleteExposure)
	mux.HandleFunc("POST /v1/vms/{name}/{action}", d.handleVMAction)
	mux.HandleFunc("GET /v1/vms/{name}/console", d.handleConsole)
	mux.Handle("GET /metrics", d.m.handler())
	return mux
}

func writeJSON(w http.ResponseWriter, code int, v any) {
	w.Header().Set("Content-Type", "application/json")
	w.WriteHeader(code)
	// Compact: indenting re-walks the whole buffer, and at 1,000 exposures
	// it made a status answer several times dearer (BenchmarkStatusRequest);
	// the CLI indents what it prints, and jq does for curl.
	_ = json.NewEncoder(w).Encode(v)
}

func writeError(w http.ResponseWriter, code int, msg string, fields []string) {
	writeJSON(w, code, api.Error{Error: msg, Errors: fields})
}

// readBody reads a request's body, at most maxBody; false when it has
// answered the request with the error.
func readBody(w http.ResponseWriter, r *http.Request) ([]byte, bool) {
	body, err := io.ReadAll(http.MaxBytesReader(w, r.Body, maxBody))
	if err != nil {
		var mbe *http.MaxBytesError
		if errors.As(err, &mbe) {
			writeError(w, http.StatusRequestEntityTooLarge, fmt.Sprintf("config is larger than %d bytes", maxBody), nil)
			return nil, false
		}
		writeError(w, http.StatusBadRequest, "reading the request: "+err.Error(), nil)
		return nil, false
	}
	return body, true
}

// parseConfig is config.Decode; tests watch it.
var parseConfig = config.Decode

func (d *Daemon) handleApply(w http.ResponseWriter, r *http.Request) {
	if d.opts.Source != nil {
		writeError(w, http.StatusConflict, ErrRemoteSource{d.opts.Source.Report()}.Error(), nil)
		return
	}
	body, ok := readBody(w, r)
	if !ok {
		return
	}
	dry := false
	switch r.URL.Query().Get("dryRun") {
	case "", "0", "false":
	case "1", "true":
		dry = true
	default:
		writeError(w, http.StatusBadRequest, fmt.Sprintf("dryRun: %q is not 1, true, 0 or false", r.URL.Query().Get("dryRun")), nil)
		return
	}
	// Decode only: Apply validates (config.Compile), once.
	d.parseGate.Lock()
	cfg, err := parseConfig(body)
	d.parseGate.Unlock()
	if err == nil {
		var plan api.Plan
		plan, err = d.Apply(cfg, dry)
		if err == nil {
			if !dry {
				d.noteAPIApply(body)
			}
			writeJSON(w, http.StatusOK, plan)
			return
		}
	}
	var ce config.Errors
	if errors.As(err, &ce) {
		fields := make([]string, len(ce))
		for i, e := range ce {
			fields[i] = e.Error()
		}
		writeError(w, http.StatusUnprocessableEntity, "config rejected; nothing was changed", fields)
		return
	}
	if errors.Is(err, ErrBusy) {
		writeError(w, http.StatusServiceUnavailable, err.Error(), nil)
		return
	}
	writeError(w, http.StatusInternalServerError, err.Error(), nil)
}

func (d *Daemon) handleVMAction(w http.ResponseWriter, r *http.Request) {
	name, action := r.PathValue("name"), r.PathValue("action")
	var err error
	switch action {
	case "start":
		err = d.SetPower(name, supervisor.PowerRunning)
	case "stop":
		err = d.SetPower(name, supervisor.PowerStopped)
	case "restart":
		err = d.Restart(name)
	case "suspend", "resume":
		err = d.suspendAction(name, action)
	default:
		writeError(w, http.StatusNotFound, fmt.Sprintf("no such VM action %q (start, stop, restart, suspend, resume)", action), nil)
		return
	}
	switch {
	case err == nil:
		writeJSON(w, http.StatusOK, map[string]string{"vm": name, "action": action})
	case errors.Is(err, ErrNoSuchVM):
		writeError(w, http.StatusNotFound, err.Error(), nil)
	case errors.Is(err, ErrStopped):
		writeError(w, http.StatusConflict, err.Error(), nil)
	default:
		writeError(w, http.StatusInternalServerError, err.Error(), nil)
	}
}

// handleConsole streams stateDir/vms/<name>/console.log; with ?follow=1 it
// keeps sending what the guest writes until the caller goes away.
func (d *Daemon) handleConsole(w http.ResponseWriter, r *http.Request) {
	name := r.PathValue("name")
	known := false
	for _, v := range d.Desired().VMs {
		known = known || v.Name == name
	}
	if !known {
		writeError(w, http.StatusNotFound, fmt.Sprintf("%v: %q", ErrNoSuchVM, name), nil)
		return
	}
	follow := r.URL.Query().Get("follow") == "1" || r.URL.Query().Get("follow") == "true"
	path := filepath.Join(d.host.StateDir, "vms", name, "console.log")
	f, err := os.Open(path)
	if err != nil && !(follow && errors.Is(err, os.ErrNotExist)) {
		writeError(w, http.StatusNotFound, fmt.Sprintf("no console log for %q yet (%v)", name, err), nil)
		return
	}
	w.Header().Set("Content-Type", "text/plain; charset=utf-8")
	w.Header().Set("X-Content-Type-Options", "nosniff")
	w.WriteHeader(http.StatusOK)
	flusher, _ := w.(http.Flusher)
	var off int64
	buf := make([]byte, 32<<10)
	for {
		if f != nil {
			// A log rotated (renamed away, a new file in its place) or
			// truncated under us: finish the old file, then start again at
			// the top of the current one.
			cur, err1 := os.Stat(path)
			old, err2 := f.Stat()
			if err1 == nil && err2 == nil && (!os.SameFile(cur, old) || cur.Size() < off) {
				if os.SameFile(cur, old) {
					off = 0 // truncated in place
				} else if !copyFrom(w, f, off, buf) {
					f.Close()
					return
				} else {
					f.Close()
					f, off = nil, 0
				}
			}
		}
		if f == nil {
			if f, err = os.Open(path); err != nil {
				f = nil
			}
		}
		if f != nil {
			n, ok := copyFromN(w, f, off, buf)
			off += n
			if !ok {
				f.Close()
				return
			}
		}
		if flusher != nil {
			flusher.Flush()
		}
		if !follow {
			if f != nil {
				f.Close()
			}
			return
		}
		select {
		case <-r.Context().Done():
			if f != nil {
				f.Close()
			}
			return
		case <-time.After(200 * time.Millisecond):
		}
	}
}

// copyFromN writes f's content from off to w; ok is false when the
// caller has gone away.
func copyFromN(w io.Writer, f *os.File, off int64, buf []byte) (n int64, ok bool) {
	for {
		k, err := f.ReadAt(buf, off+n)
		if k > 0 {
			if _, werr := w.Write(buf[:k]); werr != nil {
				return n, false
			}
			n += int64(k)
		}
		if err != nil {
			return n, true
		}
	}
}

func copyFrom(w io.Writer, f *os.File, off int64, buf []byte) bool {
	_, ok := copyFromN(w, f, off, buf)
	return ok
}

// MetricsHandler serves GET /metrics alone, for metrics.listen: a TCP
// listener a scraper can reach must not carry the API, which can start VMs
// and publish ports.
func (d *Daemon) MetricsHandler() http.Handler {
	mux := http.NewServeMux()
	mux.Handle("GET /metrics", d.m.handler())
	return mux
}

// ServeMetrics serves MetricsHandler on ln (metrics.listen) until ctx ends.
func (d *Daemon) ServeMetrics(ctx context.Context, ln net.Listener) error {
	return serveUntil(ctx, ln, d.MetricsHandler())
}

// Serve listens on runDir/brokkr.sock (mode 0600: the API can start VMs and
// publish ports, so it is root's alone) until ctx ends.
func (d *Daemon) Serve(ctx context.Context, ln net.Listener) error {
	return serveUntil(ctx, ln, d.Handler())
}

func serveUntil(ctx context.Context, ln net.Listener, h http.Handler) error {
	srv := &http.Server{
		Handler:           h,
		ReadHeaderTimeout: 10 * time.Second,
		MaxHeaderBytes:    64 << 10,
	}
	errc := make(chan error, 1)
	go func() { errc <- srv.Serve(ln) }()
	select {
	case err := <-errc:
		return err
	case <-ctx.Done():
		sctx, cancel := context.WithTimeout(context.Background(), 2*time.Second)
		defer cancel()
		if err := srv.Shutdown(sctx); err != nil {
			srv.Close() // console followers do not end on their own
		}
		<-errc
		return nil
	}
}

// Listen makes runDir and the socket. A socket file left by a dead daemon is
// replaced; one that answers belongs to a live daemon and is an error.
func Listen(runDir string) (net.Listener, error) {
	if err := os.MkdirAll(runDir, 0o700); err != nil {
		return nil, fmt.Errorf("runDir: %w", err)
	}
	path := filepath.Join(runDir, SocketName)
	if c, err := net.DialTimeout("unix", path, time.Second); err == nil {
		c.Close()
		return nil, fmt.Errorf("%s: another brokkrd is already serving there", path)
	}
	_ = os.Remove(path)
	ln, err := net.Listen("unix", path)
	if err != nil {
		return nil, fmt.Errorf("listening on %s: %w", path, err)
	}
	if err := os.Chmod(path, 0o600); err != nil {
		ln.Close()
		return nil, fmt.Errorf("%s: %w", path, err)
	}
	return ln, nil
}
