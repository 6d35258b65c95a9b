package main

import (
	"bufio"
	"context"
	"encoding/binary"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"sync"
	"time"

	"github.com/brokkr/brokkr/proxy"
	"golang.org/x/sys/unix"
)

// The hand-over (docs/ARCHITECTURE.md, "Restart and upgrade"). The running
// daemon starts the next binary itself, as its child, so under systemd the
// new process is in the unit's cgroup; it passes everything over a
// socketpair with SCM_RIGHTS: the runDir lock (the same open file, so the
// flock is shared, never released), the API and upgrade listeners, and the
// proxy's frozen listeners and connection pairs with their in-flight bytes.
// The new process converges once with its proxy held, says "ready", and
// serves only after the old one answered "commit"; until then the old one
// can take everything back (Thaw) and go on serving.

const (
	handoverEnv   = "BROKKR_HANDOVER_FD"
	upgradeSocket = "brokkrd.upgrade"
	maxFdsPerMsg  = 250 // below the kernel's SCM_MAX_FD (253)
)

// readyTimeout bounds the new process's start, from its launch (sending it
// the state included) to its first pass. A variable so the hand-over tests
// can watch a late process miss it without waiting a minute.
var readyTimeout = 60 * time.Second

type handState struct {
	Lock, API, Upgrade, Metrics int // descriptor indexes; -1 none
	Managers                    map[string]handManager
	Holds                       map[string]int // the held host ports (hold.Set.Files)
}

type handManager struct {
	Listeners map[string]int
	Pairs     []handPair
}

type handPair struct {
	ID            string
	HostPort      uint16
	Client, Guest int // Client -1 for a UDP flow
	Pending       [2][]byte
	Done          [2]bool
	Flow          *proxy.FrozenFlow `json:",omitempty"`
}

// inherited is what a new process got from the old one.
type inherited struct {
	conn                  *net.UnixConn
	lock                  *os.File
	api, upgrade, metrics net.Listener
	snaps                 map[string]*proxy.Snapshot
	holds                 map[string]*os.File
}

func (h *inherited) kept() map[string]uint64 {
	k := map[string]uint64{}
	for _, s := range h.snaps {
		s.KeptActive(k)
	}
	return k
}

// writeFrame sends fds and a payload: an 8-byte header (count, length)
// carrying the descriptors, then the payload.
func writeFrame(c *net.UnixConn, fds []int, payload []byte) error {
	var hdr [8]byte
	binary.LittleEndian.PutUint32(hdr[:4], uint32(len(fds)))
	binary.LittleEndian.PutUint32(hdr[4:], uint32(len(payload)))
	var oob []byte
	if len(fds) > 0 {
		oob = unix.UnixRights(fds...)
	}
	if _, _, err := c.WriteMsgUnix(hdr[:], oob, nil); err != nil {
		return err
	}
	_, err := c.Write(payload)
	return err
}

func readFrame(c *net.UnixConn) ([]*os.File, []byte, error) {
	var hdr [8]byte
	oob := make([]byte, unix.CmsgSpace(maxFdsPerMsg*4))
	n, oobn, _, _, err := c.ReadMsgUnix(hdr[:], oob)
	if err != nil {
		return nil, nil, err
	}
	var files []*os.File
	if oobn > 0 {
		msgs, err := unix.ParseSocketControlMessage(oob[:oobn])
		if err != nil {
			return nil, nil, err
		}
		for _, m := range msgs {
			fds, err := unix.ParseUnixRights(&m)
			if err != nil {
				continue
			}
			for _, fd := range fds {
				unix.CloseOnExec(fd)
				files = append(files, os.NewFile(uintptr(fd), "handover"))
			}
		}
	}
	if n < len(hdr) {
		if _, err := io.ReadFull(c, hdr[n:]); err != nil {
			return files, nil, err
		}
	}
	if want := binary.LittleEndian.Uint32(hdr[:4]); int(want) != len(files) {
		return files, nil, fmt.Errorf("hand-over: %d descriptors announced, %d received", want, len(files))
	}
	payload := make([]byte, binary.LittleEndian.Uint32(hdr[4:]))
	_, err = io.ReadFull(c, payload)
	return files, payload, err
}

// rawFds returns the descriptor numbers of files for SCM_RIGHTS without
// os.File.Fd, which switches a socket duplicated by net's File to blocking
// mode. That mode belongs to the socket, not the descriptor: the process's
// own listener would then block in accept(2), where Close cannot wake it,
// and its next Close (a freeze, a shutdown) would hang until a caller came.
// The numbers stay valid while the caller keeps files open.
func rawFds(files []*os.File) ([]int, error) {
	fds := make([]int, len(files))
	for i, f := range files {
		rc, err := f.SyscallConn()
		if err != nil {
			return nil, err
		}
		if err := rc.Control(func(fd uintptr) { fds[i] = int(fd) }); err != nil {
			return nil, err
		}
	}
	return fds, nil
}

// sendState sends the descriptors in frames of at most maxFdsPerMsg, then
// the state that refers to them by index.
func sendState(c *net.UnixConn, files []*os.File, st handState) error {
	fds, err := rawFds(files)
	if err != nil {
		return err
	}
	for len(fds) > 0 {
		n := min(len(fds), maxFdsPerMsg)
		if err := writeFrame(c, fds[:n], nil); err != nil {
			return err
		}
		fds = fds[n:]
	}
	b, err := json.Marshal(st)
	if err != nil {
		return err
	}
	return writeFrame(c, nil, b)
}

// receiveHandover reads the old process's state from the descriptor named
// by BROKKR_HANDOVER_FD.
func receiveHandover() (*inherited, error) {
	n, err := strconv.Atoi(os.Getenv(handoverEnv))
	if err != nil {
		return nil, fmt.Errorf("%s: %w", handoverEnv, err)
	}
	os.Unsetenv(handoverEnv)
	f := os.NewFile(uintptr(n), "handover")
	fc, err := net.FileConn(f)
	f.Close()
	if err != nil {
		return nil, fmt.Errorf("hand-over socket: %w", err)
	}
	conn := fc.(*net.UnixConn)
	var files []*os.File
	var payload []byte
	for len(payload) == 0 {
		fs, p, err := readFrame(conn)
		files = append(files, fs...)
		if err != nil {
			conn.Close()
			return nil, fmt.Errorf("hand-over: %w", err)
		}
		payload = p
	}
	var st handState
	if err := json.Unmarshal(payload, &st); err != nil {
		conn.Close()
		return nil, fmt.Errorf("hand-over state: %w", err)
	}
	at := func(i int) *os.File {
		if i < 0 || i >= len(files) {
			return nil
		}
		return files[i]
	}
	listener := func(i int) net.Listener {
		f := at(i)
		if f == nil {
			return nil
		}
		defer f.Close()
		ln, err := net.FileListener(f)
		if err != nil {
			return nil
		}
		if ul, ok := ln.(*net.UnixListener); ok {
			ul.SetUnlinkOnClose(false) // the path is the daemon's, not this process's
		}
		return ln
	}
	h := &inherited{conn: conn, lock: at(st.Lock), api: listener(st.API), upgrade: listener(st.Upgrade),
		metrics: listener(st.Metrics), snaps: map[string]*proxy.Snapshot{}, holds: map[string]*os.File{}}
	for k, i := range st.Holds {
		if f := at(i); f != nil {
			h.holds[k] = f
		}
	}
	if h.lock == nil || h.api == nil {
		conn.Close()
		return nil, errors.New("hand-over: no runDir lock or API socket in the state")
	}
	for name, hm := range st.Managers {
		s := &proxy.Snapshot{Listeners: map[string]*os.File{}}
		for ln, i := range hm.Listeners {
			if f := at(i); f != nil {
				s.Listeners[ln] = f
			}
		}
		for _, p := range hm.Pairs {
			c, g := at(p.Client), at(p.Guest)
			if g == nil || (c == nil) != (p.Flow != nil) {
				continue
			}
			s.Pairs = append(s.Pairs, proxy.FrozenPair{ID: p.ID, HostPort: p.HostPort, Client: c, Guest: g,
				Pending: p.Pending, Done: p.Done, Flow: p.Flow})
		}
		h.snaps[name] = s
	}
	return h, nil
}

// confirm is the new process's side after its first pass: "ready", then
// wait for "commit". An old process that vanished without an answer left
// nobody serving, so that counts as a commit too.
func (h *inherited) confirm() error {
	defer h.conn.Close()
	if err := writeFrame(h.conn, nil, []byte("ready")); err != nil {
		return fmt.Errorf("hand-over: telling the old process: %w", err)
	}
	_, p, err := readFrame(h.conn)
	switch {
	case err != nil && errors.Is(err, io.EOF):
		return nil
	case err != nil:
		return fmt.Errorf("hand-over: %w", err)
	case string(p) != "commit":
		return fmt.Errorf("hand-over: the old process answered %q", p)
	}
	return nil
}

// listenerFile duplicates a listener's descriptor; a unix listener stops
// unlinking its path on close, since the next process serves on it.
func listenerFile(ln net.Listener) (*os.File, error) {
	switch l := ln.(type) {
	case *net.UnixListener:
		l.SetUnlinkOnClose(false)
		return l.File()
	case *net.TCPListener:
		return l.File()
	}
	return nil, fmt.Errorf("cannot hand over a %T", ln)
}

// upgradeReq is a request to hand over to exe (args as its flags).
type upgradeReq struct {
	Exe   string
	Args  []string
	reply chan upgradeReply
}

type upgradeReply struct {
	PID   int
	Error string
}

// handOver runs the old process's side. On success the new process serves
// and this one must exit without closing what it handed over; on error it
// serves again (the proxy thawed, the loop restarted by the caller).
func (s *system) handOver(req upgradeReq, apiLn, upLn, metricsLn net.Listener, log *slog.Logger) (int, error) {
	snaps := map[string]*proxy.Snapshot{"main": s.px.Freeze()}
	thaw := func() { s.px.Thaw(snaps["main"]) }
	fds, err := unix.Socketpair(unix.AF_UNIX, unix.SOCK_STREAM|unix.SOCK_CLOEXEC, 0)
	if err != nil {
		thaw()
		return 0, err
	}
	mine, theirs := os.NewFile(uintptr(fds[0]), "handover"), os.NewFile(uintptr(fds[1]), "handover")
	fc, err := net.FileConn(mine)
	mine.Close()
	if err != nil {
		theirs.Close()
		thaw()
		return 0, err
	}
	conn := fc.(*net.UnixConn)
	defer conn.Close()

	// files is what is sent; dups are the listener duplicates made for it,
	// closed whatever happens. The snapshot's files are closed only once the
	// new process committed: after a failure Thaw owns them again.
	var files, dups []*os.File
	committed := false
	defer func() {
		for _, f := range dups {
			f.Close()
		}
		if committed {
			for _, sn := range snaps {
				sn.Close()
			}
		}
	}()
	add := func(f *os.File) int { files = append(files, f); return len(files) - 1 }
	st := handState{Lock: add(s.lock), API: -1, Upgrade: -1, Metrics: -1, Managers: map[string]handManager{}, Holds: map[string]int{}}
	held, err := s.holds.Files()
	if err != nil {
		theirs.Close()
		thaw()
		return 0, err
	}
	for k, f := range held {
		dups = append(dups, f)
		st.Holds[k] = add(f)
	}
	for _, l := range []struct {
		ln  net.Listener
		idx *int
	}{{apiLn, &st.API}, {upLn, &st.Upgrade}, {metricsLn, &st.Metrics}} {
		if l.ln == nil {
			continue
		}
		f, err := listenerFile(l.ln)
		if err != nil {
			theirs.Close()
			thaw()
			return 0, err
		}
		dups = append(dups, f)
		*l.idx = add(f)
	}
	for name, sn := range snaps {
		hm := handManager{Listeners: map[string]int{}}
		for ln, f := range sn.Listeners {
			hm.Listeners[ln] = len(files)
			files = append(files, f)
		}
		for _, p := range sn.Pairs {
			hp := handPair{ID: p.ID, HostPort: p.HostPort, Client: -1, Pending: p.Pending, Done: p.Done, Flow: p.Flow}
			if p.Client != nil {
				hp.Client = add(p.Client)
			}
			hp.Guest = add(p.Guest)
			hm.Pairs = append(hm.Pairs, hp)
		}
		st.Managers[name] = hm
	}

	cmd := exec.Command(req.Exe, req.Args...)
	cmd.ExtraFiles = []*os.File{theirs}
	cmd.Env = append(os.Environ(), handoverEnv+"=3")
	cmd.Stdout, cmd.Stderr = os.Stdout, os.Stderr
	err = cmd.Start()
	theirs.Close()
	if err != nil {
		thaw()
		return 0, fmt.Errorf("starting %s: %w", req.Exe, err)
	}
	exited := make(chan error, 1)
	go func() { exited <- cmd.Wait() }()
	talked := make(chan struct{}) // the sender below is done with files
	fail := func(err error) (int, error) {
		_ = cmd.Process.Kill()
		<-exited
		conn.Close()
		<-talked // before Thaw takes the snapshot's files back
		thaw()
		return 0, err
	}
	// Sending and the wait for "ready" share one deadline: a state larger
	// than the socket's buffer (in-flight bytes travel in it) blocks the
	// send until the new process reads, and one that never reads must not
	// keep this process frozen for good.
	_ = conn.SetDeadline(time.Now().Add(readyTimeout))
	ready := make(chan error, 1)
	go func() {
		defer close(talked)
		if err := sendState(conn, files, st); err != nil {
			ready <- fmt.Errorf("sending the state: %w", err)
			return
		}
		_, p, err := readFrame(conn)
		if err == nil && string(p) != "ready" {
			err = fmt.Errorf("answered %q", p)
		}
		ready <- err
	}()
	select {
	case err := <-ready:
		if err != nil {
			if errors.Is(err, os.ErrDeadlineExceeded) {
				// Alive by definition: no wait for an exit, the listeners
				// are frozen meanwhile.
				return fail(fmt.Errorf("the new process did not get ready: no answer within %s: %w", readyTimeout, err))
			}
			// A process that hung up has usually exited: say how.
			select {
			case e := <-exited:
				exited <- e
				return fail(fmt.Errorf("the new process exited before it was ready (%v): %w", e, err))
			case <-time.After(200 * time.Millisecond):
			}
			return fail(fmt.Errorf("the new process did not get ready: %w", err))
		}
	case err := <-exited:
		exited <- err
		return fail(fmt.Errorf("the new process exited before it was ready: %v", err))
	}
	_ = conn.SetDeadline(time.Time{})
	// From here on the new process is the daemon: systemd is told first,
	// so its notifications (sent only after commit) come from the main PID.
	notify(log, fmt.Sprintf("MAINPID=%d", cmd.Process.Pid))
	if err := writeFrame(conn, nil, []byte("commit")); err != nil {
		notify(log, fmt.Sprintf("MAINPID=%d", os.Getpid())) // still the daemon
		return fail(fmt.Errorf("committing: %w", err))
	}
	committed = true
	return cmd.Process.Pid, nil
}

// listenUpgrade opens runDir/brokkrd.upgrade, where `brokkrd --upgrade`
// asks the running daemon to hand over.
func listenUpgrade(runDir string) (net.Listener, error) {
	path := filepath.Join(runDir, upgradeSocket)
	_ = os.Remove(path)
	ln, err := net.Listen("unix", path)
	if err != nil {
		return nil, err
	}
	return ln, os.Chmod(path, 0o600)
}

// serveUpgrades passes each request on the upgrade socket to reqs and
// writes back the reply. It ends when ln is closed, once every request
// taken has its reply written: a process that handed over exits right
// after this returns, and the reply it had not yet written left
// `brokkrd --upgrade` with "no answer" (EOF) although the new process
// served (seen in CI). A request nobody took by then is dropped.
func serveUpgrades(ln net.Listener, reqs chan<- upgradeReq) {
	var conns sync.WaitGroup
	closed, cancel := context.WithCancel(context.Background())
	defer conns.Wait()
	defer cancel()
	for {
		c, err := ln.Accept()
		if err != nil {
			return
		}
		conns.Add(1)
		go func() {
			defer conns.Done()
			defer c.Close()
			// A client still sending its request when the socket closes
			// is cut off: it must not hold up a shutdown.
			cutOff := context.AfterFunc(closed, func() { _ = c.SetReadDeadline(time.Unix(1, 0)) })
			var r upgradeReq
			err := json.NewDecoder(bufio.NewReader(c)).Decode(&r)
			if !cutOff() || err != nil {
				return
			}
			r.reply = make(chan upgradeReply, 1)
			select {
			case reqs <- r:
			case <-closed.Done():
				return
			}
			_ = json.NewEncoder(c).Encode(<-r.reply)
		}()
	}
}

// upgrade is `brokkrd --upgrade`: this binary asks the running daemon to
// hand over to it (started with args), and reports the outcome.
func upgrade(o options, args []string, stdout, stderr io.Writer) int {
	_, cfg, err := loadConfig(o.config)
	if err != nil {
		fmt.Fprintf(stderr, "brokkrd: %v\n", err)
		return 1
	}
	exe, err := os.Executable()
	if err != nil {
		fmt.Fprintf(stderr, "brokkrd: %v\n", err)
		return 2
	}
	c, err := net.DialTimeout("unix", filepath.Join(cfg.RunDir, upgradeSocket), 5*time.Second)
	if err != nil {
		fmt.Fprintf(stderr, "brokkrd --upgrade: no running brokkrd to hand over from: %v\n", err)
		return 2
	}
	defer c.Close()
	_ = c.SetDeadline(time.Now().Add(readyTimeout + 30*time.Second))
	if err := json.NewEncoder(c).Encode(upgradeReq{Exe: exe, Args: args}); err != nil {
		fmt.Fprintf(stderr, "brokkrd --upgrade: %v\n", err)
		return 2
	}
	var r upgradeReply
	if err := json.NewDecoder(c).Decode(&r); err != nil {
		fmt.Fprintf(stderr, "brokkrd --upgrade: no answer from the running brokkrd: %v\n", err)
		return 2
	}
	if r.Error != "" {
		fmt.Fprintf(stderr, "brokkrd --upgrade: failed, the running brokkrd goes on serving: %s\n", r.Error)
		return 2
	}
	fmt.Fprintf(stdout, "brokkrd --upgrade: pid %d serves now\n", r.PID)
	return 0
}
