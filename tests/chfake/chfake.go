// Package chfake is a contract fake of cloud-hypervisor's REST API, used
// because cloud-hypervisor cannot be installed on the build machines. It
// serves the endpoints brokkr uses on a unix socket, checks every request
// (path, method, body) and every answer it gives against the OpenAPI file
// cloud-hypervisor publishes, and can be told to misbehave: crash after
// boot, hang on boot, ignore the power button, refuse endpoints, ignore
// SIGTERM. The program in cmd/chfake runs it as a real process so process
// supervision (Setsid, pidfd, kill -9, stale sockets, adoption) is real.
//
// Snapshots are real files: vm.snapshot writes config.json, state.json and
// memory-ranges (as many bytes as the guest has memory, so a full disk
// fails it as it fails cloud-hypervisor) into the destination directory,
// and vm.restore reads them back into a new process, which keeps the
// guest's boot id: the serial console says "restored boot <id>" where a
// fresh guest says "booting".
package chfake

import (
	"bytes"
	"context"
	"crypto/rand"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"net/url"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"time"

	"github.com/getkin/kin-openapi/openapi3"
	"github.com/getkin/kin-openapi/openapi3filter"
	"github.com/getkin/kin-openapi/routers"
	"github.com/getkin/kin-openapi/routers/legacy"
)

// Behaviour says how the fake misbehaves. The zero value is a well-behaved
// cloud-hypervisor whose guest powers off (and the process exits 0) when
// the power button is pressed.
type Behaviour struct {
	HangBoot          bool            // vm.boot never answers
	CrashAfter        time.Duration   // >0: the process exits 1 this long after boot
	IgnorePowerButton bool            // the guest ignores ACPI power button
	DropPresses       int             // the guest (still booting) drops this many presses first
	Refuse            map[string]bool // endpoint names ("vm.create") answered 500
	IgnoreSIGTERM     bool            // only SIGKILL ends the process
	ConsoleBytes      int             // serial output written after boot, besides the banner
}

// BehaviourFromEnv reads CHFAKE_HANG_BOOT=1, CHFAKE_CRASH_AFTER=<duration>,
// CHFAKE_IGNORE_POWER_BUTTON=1, CHFAKE_DROP_PRESSES=<n>, CHFAKE_REFUSE=<endpoint,...>,
// CHFAKE_IGNORE_SIGTERM=1, CHFAKE_CONSOLE_BYTES=<n>.
func BehaviourFromEnv() (Behaviour, error) {
	var b Behaviour
	b.HangBoot = os.Getenv("CHFAKE_HANG_BOOT") == "1"
	b.IgnorePowerButton = os.Getenv("CHFAKE_IGNORE_POWER_BUTTON") == "1"
	b.IgnoreSIGTERM = os.Getenv("CHFAKE_IGNORE_SIGTERM") == "1"
	if v := os.Getenv("CHFAKE_DROP_PRESSES"); v != "" {
		n, err := strconv.Atoi(v)
		if err != nil || n < 0 {
			return b, fmt.Errorf("CHFAKE_DROP_PRESSES: %q is not a count", v)
		}
		b.DropPresses = n
	}
	if v := os.Getenv("CHFAKE_CRASH_AFTER"); v != "" {
		d, err := time.ParseDuration(v)
		if err != nil {
			return b, fmt.Errorf("CHFAKE_CRASH_AFTER: %w", err)
		}
		b.CrashAfter = d
	}
	if v := os.Getenv("CHFAKE_CONSOLE_BYTES"); v != "" {
		n, err := strconv.Atoi(v)
		if err != nil {
			return b, fmt.Errorf("CHFAKE_CONSOLE_BYTES: %w", err)
		}
		b.ConsoleBytes = n
	}
	if v := os.Getenv("CHFAKE_REFUSE"); v != "" {
		b.Refuse = map[string]bool{}
		for _, e := range strings.Split(v, ",") {
			b.Refuse[strings.TrimSpace(e)] = true
		}
	}
	return b, nil
}

// LoadSpec loads and validates cloud-hypervisor's OpenAPI file.
func LoadSpec(path string) (*openapi3.T, error) {
	doc, err := openapi3.NewLoader().LoadFromFile(path)
	if err != nil {
		return nil, fmt.Errorf("load %s: %w", path, err)
	}
	if err := doc.Validate(context.Background()); err != nil {
		return nil, fmt.Errorf("validate %s: %w", path, err)
	}
	return doc, nil
}

// FindSpec looks for shared/reference/cloud-hypervisor.yaml beside dir or
// any of its parents (CI checks the repo out with shared/ beside it).
func FindSpec(dir string) (string, error) {
	if p := os.Getenv("CHFAKE_SCHEMA"); p != "" {
		return p, nil
	}
	for d := dir; ; d = filepath.Dir(d) {
		p := filepath.Join(d, "shared", "reference", "cloud-hypervisor.yaml")
		if _, err := os.Stat(p); err == nil {
			return p, nil
		}
		if filepath.Dir(d) == d {
			return "", fmt.Errorf("shared/reference/cloud-hypervisor.yaml not found beside %s or its parents", dir)
		}
	}
}

// Build compiles the fake's program (tests/chfake/cmd/chfake) into dir and
// returns its path.
func Build(dir string) (string, error) {
	bin := filepath.Join(dir, "chfake")
	out, err := exec.Command("go", "build", "-o", bin, "github.com/brokkr/brokkr/tests/chfake/cmd/chfake").CombinedOutput()
	if err != nil {
		return "", fmt.Errorf("build chfake: %v\n%s", err, out)
	}
	return bin, nil
}

// ForTests is what a test package that drives the fake needs before its
// tests run: the OpenAPI file found from the working directory and the fake
// built into a temporary directory, which cleanup removes. Without the
// OpenAPI file skip says why (the tests skip) and nothing is built.
func ForTests() (bin, spec, skip string, cleanup func(), err error) {
	cleanup = func() {}
	wd, _ := os.Getwd()
	if spec, err = FindSpec(wd); err != nil {
		return "", "", err.Error(), cleanup, nil
	}
	dir, err := os.MkdirTemp("", "chfake-bin")
	if err != nil {
		return "", "", "", cleanup, err
	}
	cleanup = func() { os.RemoveAll(dir) }
	if bin, err = Build(dir); err != nil {
		return "", "", "", cleanup, err
	}
	return bin, spec, "", cleanup, nil
}

// WriteLauncher writes an executable "cloud-hypervisor" at path that runs
// the fake bin against the OpenAPI file spec, with env (NAME=value) set:
// the backends start it with cloud-hypervisor's own arguments.
func WriteLauncher(path, bin, spec string, env ...string) error {
	script := "#!/bin/sh\nexport CHFAKE_SCHEMA=" + spec
	for _, e := range env {
		script += " " + e
	}
	script += "\nexec " + bin + " \"$@\"\n"
	return os.WriteFile(path, []byte(script), 0o755)
}

// Server is the fake VMM.
type Server struct {
	router routers.Router
	b      Behaviour
	pid    int
	// Exit is called when the real cloud-hypervisor would exit (vmm.shutdown,
	// guest poweroff, crash). The program passes os.Exit.
	exit func(code int)
	log  io.Writer

	mu      sync.Mutex
	state   string // "", Created, Running, Paused, Shutdown
	presses int    // vm.power-button calls while Running
	config  json.RawMessage
	guest   guestState
	closers []io.Closer
}

// guestState is what a snapshot carries besides the config: the fake
// guest's identity, which survives a snapshot and restore and is new on
// every boot.
type guestState struct {
	BootID    string `json:"boot_id"`
	Snapshots int    `json:"snapshots"` // snapshots this guest went through
}

// New makes a fake over a loaded spec. log receives one line per request:
// "METHOD /api/v1/endpoint STATUS" followed by the request body, if any.
func New(doc *openapi3.T, b Behaviour, exit func(int), log io.Writer) (*Server, error) {
	r, err := legacy.NewRouter(doc)
	if err != nil {
		return nil, err
	}
	if log == nil {
		log = io.Discard
	}
	return &Server{router: r, b: b, pid: os.Getpid(), exit: exit, log: log}, nil
}

// Close releases the serial socket.
func (s *Server) Close() {
	s.mu.Lock()
	defer s.mu.Unlock()
	for _, c := range s.closers {
		c.Close()
	}
	s.closers = nil
}

// recorder buffers an answer so it can be checked against the spec before
// it is sent.
type recorder struct {
	hdr    http.Header
	status int
	body   bytes.Buffer
}

func (r *recorder) Header() http.Header         { return r.hdr }
func (r *recorder) WriteHeader(code int)        { r.status = code }
func (r *recorder) Write(p []byte) (int, error) { return r.body.Write(p) }

func (s *Server) ServeHTTP(w http.ResponseWriter, r *http.Request) {
	body, _ := io.ReadAll(r.Body)
	// Requests arrive over a unix socket with a relative URL; the spec's
	// server is http://localhost/api/v1.
	u := &url.URL{Scheme: "http", Host: "localhost", Path: r.URL.Path}
	req := r.Clone(r.Context())
	req.URL, req.Host = u, "localhost"
	req.Body = io.NopCloser(bytes.NewReader(body))
	rec := &recorder{hdr: http.Header{}, status: http.StatusOK}
	logged := false
	logLine := func() {
		if !logged {
			logged = true
			fmt.Fprintf(s.log, "%s %s %d %s\n", r.Method, r.URL.Path, rec.status, bytes.TrimSpace(body))
		}
	}
	defer logLine()

	route, params, err := s.router.FindRoute(req)
	if err != nil {
		status := http.StatusNotFound
		if errors.Is(err, routers.ErrMethodNotAllowed) || strings.Contains(err.Error(), routers.ErrMethodNotAllowed.Error()) {
			status = http.StatusMethodNotAllowed
		}
		rec.status = status
		logLine()
		http.Error(w, "chfake: "+err.Error(), status)
		return
	}
	in := &openapi3filter.RequestValidationInput{Request: req, PathParams: params, Route: route,
		Options: &openapi3filter.Options{AuthenticationFunc: openapi3filter.NoopAuthenticationFunc}}
	if err := openapi3filter.ValidateRequest(r.Context(), in); err != nil {
		rec.status = http.StatusBadRequest
		logLine()
		http.Error(w, "chfake: request violates the OpenAPI schema: "+err.Error(), http.StatusBadRequest)
		return
	}
	endpoint := strings.TrimPrefix(r.URL.Path, "/api/v1/")
	var after func()
	if s.b.Refuse[endpoint] {
		rec.status = http.StatusInternalServerError
		rec.body.WriteString("chfake: refused " + endpoint)
	} else {
		after = s.handle(r.Context(), endpoint, body, rec)
		if r.Context().Err() != nil {
			return // a hung call the client gave up on
		}
	}
	if rec.status < 300 {
		// Our answers must be what the real VMM's could be.
		in.Request.Body = io.NopCloser(bytes.NewReader(body))
		vin := &openapi3filter.ResponseValidationInput{RequestValidationInput: in, Status: rec.status, Header: rec.hdr}
		vin.SetBodyBytes(rec.body.Bytes())
		if err := openapi3filter.ValidateResponse(r.Context(), vin); err != nil {
			rec.status = http.StatusInternalServerError
			rec.body.Reset()
			rec.body.WriteString("chfake bug: answer violates the OpenAPI schema: " + err.Error())
		}
	}
	// Logged before answering: the client sends its next request only
	// after this answer, so the log keeps the order of the calls.
	logLine()
	for k, v := range rec.hdr {
		w.Header()[k] = v
	}
	w.WriteHeader(rec.status)
	w.Write(rec.body.Bytes())
	if f, ok := w.(http.Flusher); ok {
		f.Flush()
	}
	if after != nil {
		after()
	}
}

func writeJSON(rec *recorder, v any) {
	rec.hdr.Set("Content-Type", "application/json")
	rec.status = http.StatusOK
	_ = json.NewEncoder(&rec.body).Encode(v)
}

// handle answers one valid request; the returned func runs after the
// answer is sent (for exits that follow an answer).
func (s *Server) handle(ctx context.Context, endpoint string, body []byte, rec *recorder) func() {
	s.mu.Lock()
	defer s.mu.Unlock()
	switch endpoint {
	case "vmm.ping":
		writeJSON(rec, map[string]any{"version": "v51.1-chfake", "build_version": "chfake", "pid": s.pid, "features": []string{"kvm"}})
	case "vmm.shutdown":
		rec.status = http.StatusNoContent
		return func() { s.exit(0) }
	case "vm.create":
		if s.state != "" {
			rec.status = http.StatusInternalServerError
			rec.body.WriteString("VM already created")
			return nil
		}
		s.config, s.state = append(json.RawMessage(nil), body...), "Created"
		rec.status = http.StatusNoContent
	case "vm.info":
		if s.state == "" {
			rec.status = http.StatusNotFound
			return nil
		}
		writeJSON(rec, map[string]any{"config": s.config, "state": s.state, "memory_actual_size": 0})
	case "vm.boot":
		if s.state == "" {
			rec.status = http.StatusNotFound
			return nil
		}
		if s.b.HangBoot {
			s.mu.Unlock()
			<-ctx.Done()
			s.mu.Lock()
			return nil
		}
		s.guest = guestState{BootID: newBootID()}
		if err := s.boot("booting"); err != nil {
			rec.status = http.StatusInternalServerError
			rec.body.WriteString(err.Error())
			return nil
		}
		s.state = "Running"
		rec.status = http.StatusNoContent
	case "vm.power-button":
		switch s.state {
		case "":
			rec.status = http.StatusNotFound
		case "Running":
			rec.status = http.StatusNoContent
			s.presses++
			if !s.b.IgnorePowerButton && s.presses > s.b.DropPresses {
				// The guest powers off; cloud-hypervisor exits with it.
				return func() { time.AfterFunc(50*time.Millisecond, func() { s.exit(0) }) }
			}
		default:
			rec.status = http.StatusMethodNotAllowed
		}
	case "vm.shutdown":
		switch s.state {
		case "":
			rec.status = http.StatusNotFound
		case "Running", "Paused":
			s.state = "Shutdown"
			rec.status = http.StatusNoContent
		default:
			rec.status = http.StatusMethodNotAllowed
		}
	case "vm.pause":
		switch s.state {
		case "":
			rec.status = http.StatusNotFound
		case "Running":
			s.state, rec.status = "Paused", http.StatusNoContent
		default:
			rec.status = http.StatusMethodNotAllowed
		}
	case "vm.resume":
		switch s.state {
		case "":
			rec.status = http.StatusNotFound
		case "Paused":
			s.state, rec.status = "Running", http.StatusNoContent
		default:
			rec.status = http.StatusMethodNotAllowed
		}
	case "vm.snapshot":
		switch s.state {
		case "":
			rec.status = http.StatusNotFound
		case "Paused":
			if err := s.snapshot(body); err != nil {
				rec.status = http.StatusInternalServerError
				rec.body.WriteString("Error snapshotting VM: " + err.Error())
				return nil
			}
			rec.status = http.StatusNoContent
		default:
			// cloud-hypervisor snapshots only a paused VM.
			rec.status = http.StatusMethodNotAllowed
		}
	case "vm.restore":
		if s.state != "" {
			rec.status = http.StatusNotFound // "already created"
			return nil
		}
		resume, err := s.restore(body)
		if err != nil {
			rec.status = http.StatusBadRequest
			rec.body.WriteString("Error restoring VM: " + err.Error())
			return nil
		}
		s.state = "Paused"
		if resume {
			s.state = "Running"
		}
		rec.status = http.StatusNoContent
	case "vm.counters":
		if s.state == "" {
			writeJSON(rec, map[string]any{})
			return nil
		}
		writeJSON(rec, map[string]map[string]int64{
			"_net0":  {"rx_bytes": 0, "rx_frames": 0, "tx_bytes": 0, "tx_frames": 0},
			"_disk0": {"read_bytes": 0, "write_bytes": 0, "read_ops": 0, "write_ops": 0},
		})
	default:
		rec.status = http.StatusInternalServerError
		rec.body.WriteString("chfake: " + endpoint + " is not implemented")
	}
	return nil
}

// boot starts the guest's side effects: the serial socket and the crash
// timer. how is "booting" or "restored". s.mu is held.
func (s *Server) boot(how string) error {
	var cfg struct {
		Payload struct{ Kernel, Cmdline string }
		Serial  struct {
			Mode, File, Socket string
		}
	}
	if err := json.Unmarshal(s.config, &cfg); err != nil {
		return err
	}
	banner := fmt.Sprintf("chfake: booting %s with %q (boot %s)\n", cfg.Payload.Kernel, cfg.Payload.Cmdline, s.guest.BootID)
	if how == "restored" {
		banner = fmt.Sprintf("chfake: restored boot %s (snapshot %d)\n", s.guest.BootID, s.guest.Snapshots)
	}
	out := append([]byte(banner), bytes.Repeat([]byte("console filler line .........................\n"), s.b.ConsoleBytes/46+1)[:s.b.ConsoleBytes]...)
	switch cfg.Serial.Mode {
	case "Socket":
		l, err := net.Listen("unix", cfg.Serial.Socket)
		if err != nil {
			return fmt.Errorf("serial socket: %w", err)
		}
		s.closers = append(s.closers, l)
		go func() {
			// Like cloud-hypervisor: one client at a time; output while
			// nobody is connected is dropped.
			for {
				c, err := l.Accept()
				if err != nil {
					return
				}
				c.Write(out)
				go func() { io.Copy(io.Discard, c); c.Close() }()
			}
		}()
	case "File":
		if err := os.WriteFile(cfg.Serial.File, out, 0o600); err != nil {
			return err
		}
	}
	if s.b.CrashAfter > 0 {
		time.AfterFunc(s.b.CrashAfter, func() { s.exit(1) })
	}
	return nil
}

// Files of a snapshot directory, as cloud-hypervisor names them.
const (
	snapConfig = "config.json"
	snapState  = "state.json"
	snapMemory = "memory-ranges"
)

func newBootID() string {
	b := make([]byte, 8)
	_, _ = rand.Read(b)
	return hex.EncodeToString(b)
}

// fileURLDir is the directory a file:// URL of a snapshot names.
func fileURLDir(raw string) (string, error) {
	u, err := url.Parse(raw)
	if err != nil || u.Scheme != "file" || u.Path == "" {
		return "", fmt.Errorf("%q is not a file:// URL", raw)
	}
	return u.Path, nil
}

// snapshot writes the paused guest into the directory the body names:
// config, state, and its memory (memory.size bytes). s.mu is held.
func (s *Server) snapshot(body []byte) error {
	var req struct {
		DestinationURL string `json:"destination_url"`
	}
	if err := json.Unmarshal(body, &req); err != nil {
		return err
	}
	dir, err := fileURLDir(req.DestinationURL)
	if err != nil {
		return err
	}
	if fi, err := os.Stat(dir); err != nil || !fi.IsDir() {
		return fmt.Errorf("destination %s is not a directory", dir)
	}
	var cfg struct {
		Memory struct{ Size int64 }
	}
	if err := json.Unmarshal(s.config, &cfg); err != nil {
		return err
	}
	st := s.guest
	st.Snapshots++
	stb, _ := json.Marshal(st)
	if err := os.WriteFile(filepath.Join(dir, snapConfig), s.config, 0o600); err != nil {
		return err
	}
	if err := os.WriteFile(filepath.Join(dir, snapState), stb, 0o600); err != nil {
		return err
	}
	if err := writeMemory(filepath.Join(dir, snapMemory), cfg.Memory.Size); err != nil {
		return err
	}
	s.guest = st
	return nil
}

// writeMemory writes size bytes of non-zero data (a sparse file would not
// fill a disk) and syncs them.
func writeMemory(path string, size int64) error {
	f, err := os.OpenFile(path, os.O_WRONLY|os.O_CREATE|os.O_TRUNC, 0o600)
	if err != nil {
		return err
	}
	chunk := bytes.Repeat([]byte("guest memory page "), 1<<16/18+1)[:1<<16]
	for left := size; left > 0; left -= int64(len(chunk)) {
		if _, err := f.Write(chunk[:min(int64(len(chunk)), left)]); err != nil {
			f.Close()
			return err
		}
	}
	if err := f.Sync(); err != nil {
		f.Close()
		return err
	}
	return f.Close()
}

// restore loads a snapshot directory into this (fresh) VMM. It refuses a
// snapshot whose files are missing, corrupt or whose memory is short, as
// cloud-hypervisor does. s.mu is held.
func (s *Server) restore(body []byte) (resume bool, err error) {
	var req struct {
		SourceURL string `json:"source_url"`
		Resume    bool   `json:"resume"`
	}
	if err := json.Unmarshal(body, &req); err != nil {
		return false, err
	}
	dir, err := fileURLDir(req.SourceURL)
	if err != nil {
		return false, err
	}
	cfgb, err := os.ReadFile(filepath.Join(dir, snapConfig))
	if err != nil {
		return false, err
	}
	var cfg struct {
		Memory struct{ Size int64 }
	}
	if err := json.Unmarshal(cfgb, &cfg); err != nil {
		return false, fmt.Errorf("%s: %w", snapConfig, err)
	}
	stb, err := os.ReadFile(filepath.Join(dir, snapState))
	if err != nil {
		return false, err
	}
	var st guestState
	if err := json.Unmarshal(stb, &st); err != nil || st.BootID == "" {
		return false, fmt.Errorf("%s: corrupt (%v)", snapState, err)
	}
	fi, err := os.Stat(filepath.Join(dir, snapMemory))
	if err != nil {
		return false, err
	}
	if fi.Size() != cfg.Memory.Size {
		return false, fmt.Errorf("%s: %d bytes, the guest has %d", snapMemory, fi.Size(), cfg.Memory.Size)
	}
	s.config, s.guest = cfgb, st
	if err := s.boot("restored"); err != nil {
		return false, err
	}
	return req.Resume, nil
}
