package proxy

import (
	"bufio"
	"errors"
	"fmt"
	"github.com/brokkr/brokkr/internal/spec"
	"io"
	"net"
	"net/netip"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	"golang.org/x/sys/unix"
)

// scriptedListener is a real listener whose Accept first returns the errors
// queued in errs, the way a real one fails only under load a test cannot
// stage, and records when each Accept was called.
type scriptedListener struct {
	net.Listener
	errs chan error

	mu    sync.Mutex
	calls []time.Time
}

func (l *scriptedListener) Accept() (net.Conn, error) {
	l.mu.Lock()
	l.calls = append(l.calls, time.Now())
	l.mu.Unlock()
	select {
	case err := <-l.errs:
		return nil, &net.OpError{Op: "accept", Net: "tcp", Err: os.NewSyscallError("accept4", err)}
	default:
	}
	return l.Listener.Accept()
}

func (l *scriptedListener) callTimes() []time.Time {
	l.mu.Lock()
	defer l.mu.Unlock()
	return append([]time.Time(nil), l.calls...)
}

func TestAcceptBackoffDoublesFrom5msUpTo1s(t *testing.T) {
	var got []time.Duration
	p := time.Duration(0)
	for i := 0; i < 10; i++ {
		p = nextPause(p)
		got = append(got, p)
	}
	ms := time.Millisecond
	assert.Equal(t, []time.Duration{5 * ms, 10 * ms, 20 * ms, 40 * ms, 80 * ms, 160 * ms, 320 * ms, 640 * ms, time.Second, time.Second}, got)
}

func TestADescriptorShortagePausesTheLoopKeepsThePortAndIsReported(t *testing.T) {
	m, _ := newManager(t)
	sl := &scriptedListener{errs: make(chan error, 8)}
	sl.errs <- syscall.EMFILE
	sl.errs <- syscall.ENFILE
	sl.errs <- syscall.EMFILE
	m.listenTCP = func(c checked) (net.Listener, error) {
		ln, err := listenTCP(c)
		sl.Listener = ln
		return sl, err
	}
	spec := tcpSpec("web", echoServer(t, "g:"))
	only(t, m, spec)

	// Three failed accepts, then the loop waits in a real accept.
	eventually(t, "the loop retries past the shortage", func() bool { return len(sl.callTimes()) >= 4 })
	calls := sl.callTimes()
	for i, want := range []time.Duration{5 * time.Millisecond, 10 * time.Millisecond, 20 * time.Millisecond} {
		assert.GreaterOrEqual(t, calls[i+1].Sub(calls[i]), want, "pause %d", i)
	}
	st := only(t, m, spec)
	assert.Equal(t, StateActive, st.State, "the port is still bound")
	assert.Contains(t, st.Reason, "out of descriptors")
	assert.Contains(t, st.Reason, "too many open files")
	assert.True(t, listenerOf(m, "web") == net.Listener(sl), "no rebind: the same listener")

	// An accept that works ends the shortage and its report.
	assert.Equal(t, "g:hi", roundTrip(t, dial(t, st.BoundAddr), "g:", "hi"))
	eventually(t, "the report clears", func() bool { return only(t, m, spec).Reason == "" })

	// Any other accept error is a broken listener: the loop gives it back.
	sl.errs <- errors.New("broken")
	dial(t, st.BoundAddr) // wakes the real accept; the next call takes the error
	eventually(t, "the loop dies and says why", func() bool {
		m.mu.Lock()
		defer m.mu.Unlock()
		return liveOf(m, "web").ln == nil && strings.Contains(liveOf(m, "web").reason, "accept: ")
	})
}

// A good accept ends the shortage's backoff: the next shortage starts again
// at 5 ms, not where the last one left off. Seven failures take the pause to
// 320 ms, so a loop that kept it would wait 640 ms after the next one.
func TestAGoodAcceptResetsTheBackoffTo5ms(t *testing.T) {
	m, _ := newManager(t)
	sl := &scriptedListener{errs: make(chan error, 8)}
	for range 7 {
		sl.errs <- syscall.EMFILE
	}
	m.listenTCP = func(c checked) (net.Listener, error) {
		ln, err := listenTCP(c)
		sl.Listener = ln
		return sl, err
	}
	st := only(t, m, tcpSpec("web", echoServer(t, "g:")))
	eventually(t, "the loop waits in a real accept after the shortage", func() bool { return len(sl.callTimes()) >= 8 })

	// Call 7 is parked in the real accept: the caller below ends it with a
	// good accept, and call 8 takes the next shortage.
	sl.errs <- syscall.EMFILE
	assert.Equal(t, "g:hi", roundTrip(t, dial(t, st.BoundAddr), "g:", "hi"))
	eventually(t, "the loop retries after the new shortage", func() bool { return len(sl.callTimes()) >= 10 })
	calls := sl.callTimes()
	pause := calls[9].Sub(calls[8])
	assert.GreaterOrEqual(t, pause, acceptPauseFloor)
	assert.Less(t, pause, 320*time.Millisecond, "the pause after a good accept is %s: the backoff was not reset", pause)
}

// ---- the shortage for real, and splice, in a child process ----

const childEnv = "BRK_PX_CHILD"

func runChild(role string) int {
	switch role {
	case "shortage":
		return childShortage()
	case "splice":
		return childSplice()
	case "callers":
		return childCallers()
	}
	fmt.Fprintf(os.Stderr, "unknown child role %q\n", role)
	return 2
}

// loopbackEcho serves an echo on loopback for a child; accept errors other
// than a closed listener (the child runs out of descriptors on purpose) are
// retried.
func loopbackEcho() (net.Listener, error) {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		return nil, err
	}
	go func() {
		for {
			c, err := ln.Accept()
			if errors.Is(err, net.ErrClosed) {
				return
			}
			if err != nil {
				time.Sleep(5 * time.Millisecond)
				continue
			}
			go func() { defer c.Close(); io.Copy(c, c) }()
		}
	}()
	return ln, nil
}

// childShortage runs a Manager with RLIMIT_NOFILE lowered to 64, spends every
// descriptor it has left, and answers the parent's commands on stdin:
// "status" converges and prints the exposure's state and reason, "release"
// gives the descriptors back, "quit" stops.
func childShortage() int {
	var lim unix.Rlimit
	if err := unix.Getrlimit(unix.RLIMIT_NOFILE, &lim); err != nil {
		fmt.Println("error", err)
		return 1
	}
	lim.Cur = 64
	if err := unix.Setrlimit(unix.RLIMIT_NOFILE, &lim); err != nil {
		fmt.Println("error", err)
		return 1
	}
	guest, err := loopbackEcho()
	if err != nil {
		fmt.Println("error", err)
		return 1
	}
	defer guest.Close()
	m := NewManager(func(string) string { return "127.0.0.1" }, nil)
	defer m.StopAll()
	specs := []Spec{{Exposure: spec.Exposure{Name: "web", Target: spec.Target{VM: "vm1"}, Proto: "tcp", GuestPort: uint16(guest.Addr().(*net.TCPAddr).Port)}, Listen: netip.MustParseAddr("127.0.0.1")}}
	fmt.Println("bound", m.Converge(specs)[0].BoundAddr)

	var spent []*os.File
	for {
		f, err := os.Open(os.DevNull)
		if err != nil {
			if !errors.Is(err, syscall.EMFILE) {
				fmt.Println("error", err)
				return 1
			}
			break
		}
		spent = append(spent, f)
	}
	fmt.Println("exhausted", len(spent))

	sc := bufio.NewScanner(os.Stdin)
	for sc.Scan() {
		switch sc.Text() {
		case "status":
			st := m.Converge(specs)[0]
			fmt.Printf("status %s|%s\n", st.State, st.Reason)
		case "release":
			for _, f := range spent {
				f.Close()
			}
			spent = nil
			fmt.Println("released")
		case "quit":
			return 0
		}
	}
	return 0
}

// childCallers serves an echo on loopback (printing "echo PORT") and, on
// "hold ADDR N", opens N connections to ADDR, checks an echo on each and
// holds them all ("held N") until stdin closes.
func childCallers() int {
	guest, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		fmt.Println("error", err)
		return 1
	}
	defer guest.Close()
	go func() {
		for {
			c, err := guest.Accept()
			if err != nil {
				return
			}
			// Through memory: io.Copy between two TCPConns would splice and
			// spend a pipe (two descriptors) per connection.
			go func() { defer c.Close(); io.Copy(struct{ io.Writer }{c}, c) }()
		}
	}()
	fmt.Println("echo", guest.Addr().(*net.TCPAddr).Port)
	var held []net.Conn
	defer func() {
		for _, c := range held {
			c.Close()
		}
	}()
	sc := bufio.NewScanner(os.Stdin)
	for sc.Scan() {
		var addr string
		var n int
		if _, err := fmt.Sscanf(sc.Text(), "hold %s %d", &addr, &n); err != nil {
			fmt.Println("error", err)
			return 1
		}
		for i := 0; i < n; i++ {
			c, err := net.DialTimeout("tcp", addr, 5*time.Second)
			if err == nil {
				_ = c.SetDeadline(time.Now().Add(5 * time.Second))
				buf := make([]byte, 4)
				if _, err = c.Write([]byte("ping")); err == nil {
					_, err = io.ReadFull(c, buf)
				}
				if err == nil && string(buf) != "ping" {
					err = fmt.Errorf("echo %q", buf)
				}
			}
			if err != nil {
				fmt.Println("error connection", i, err)
				return 1
			}
			held = append(held, c)
		}
		fmt.Println("held", len(held))
	}
	return 0
}

// child starts this test binary in a role and returns a line reader on its
// stdout and a writer on its stdin. The child is killed if the test ends
// first.
func child(t *testing.T, role string) (lines <-chan string, stdin io.WriteCloser) {
	t.Helper()
	cmd := exec.Command(os.Args[0], "-test.run=^$")
	cmd.Env = append(os.Environ(), childEnv+"="+role)
	cmd.Stderr = os.Stderr
	stdin, err := cmd.StdinPipe()
	require.NoError(t, err)
	out, err := cmd.StdoutPipe()
	require.NoError(t, err)
	require.NoError(t, cmd.Start())
	ch := make(chan string, 64)
	done := make(chan struct{})
	go func() {
		defer close(done)
		defer close(ch)
		sc := bufio.NewScanner(out)
		for sc.Scan() {
			ch <- sc.Text()
		}
	}()
	t.Cleanup(func() {
		stdin.Close()
		timer := time.AfterFunc(5*time.Second, func() { cmd.Process.Kill() })
		<-done
		cmd.Wait()
		timer.Stop()
	})
	return ch, stdin
}

func expectLine(t *testing.T, lines <-chan string, prefix string) string {
	t.Helper()
	select {
	case l, ok := <-lines:
		require.True(t, ok, "child exited before printing %q", prefix)
		require.True(t, strings.HasPrefix(l, prefix), "want %q..., child said %q", prefix, l)
		return strings.TrimPrefix(l, prefix)
	case <-time.After(10 * time.Second):
		t.Fatalf("child did not print %q", prefix)
	}
	return ""
}

func TestARealDescriptorShortageKeepsThePortBoundReportsItAndRecovers(t *testing.T) {
	if testing.Short() {
		t.Skip("starts a child process")
	}
	lines, stdin := child(t, "shortage")
	addr := expectLine(t, lines, "bound ")
	expectLine(t, lines, "exhausted ")

	// The kernel completes the handshake into the backlog; the child's
	// accept then fails with EMFILE.
	first := dial(t, addr)
	var status string
	eventually(t, "the child reports the shortage", func() bool {
		fmt.Fprintln(stdin, "status")
		status = expectLine(t, lines, "status ")
		return strings.Contains(status, "out of descriptors")
	})
	assert.True(t, strings.HasPrefix(status, "active|"), "still active: %s", status)
	assert.Contains(t, status, "too many open files")
	second := dial(t, addr) // the port is still bound and listening
	require.NoError(t, second.Close())

	fmt.Fprintln(stdin, "release")
	expectLine(t, lines, "released")
	assert.Equal(t, "back", roundTrip(t, first, "", "back"), "the waiting caller is carried once descriptors return")
	eventually(t, "the report clears", func() bool {
		fmt.Fprintln(stdin, "status")
		return expectLine(t, lines, "status ") == "active|"
	})
	fmt.Fprintln(stdin, "quit")
}

// childSplice pushes 8 MiB through a Manager in both directions with plain
// reads and writes at both ends, so the only splice(2) calls in this process
// are the proxy's.
func childSplice() int {
	const size = 8 << 20
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		fmt.Println("error", err)
		return 1
	}
	defer ln.Close()
	go func() {
		c, err := ln.Accept()
		if err != nil {
			return
		}
		defer c.Close()
		buf := make([]byte, 64<<10)
		total := 0
		for {
			n, err := c.Read(buf)
			total += n
			if err != nil {
				break
			}
		}
		chunk := make([]byte, 64<<10)
		for sent := 0; sent < total; sent += len(chunk) {
			if _, err := c.Write(chunk); err != nil {
				return
			}
		}
	}()
	m := NewManager(func(string) string { return "127.0.0.1" }, nil)
	defer m.StopAll()
	st := m.Converge([]Spec{{Exposure: spec.Exposure{Name: "bulk", Target: spec.Target{VM: "vm1"}, Proto: "tcp", GuestPort: uint16(ln.Addr().(*net.TCPAddr).Port)}, Listen: netip.MustParseAddr("127.0.0.1")}})[0]
	c, err := net.Dial("tcp", st.BoundAddr)
	if err != nil {
		fmt.Println("error", err)
		return 1
	}
	defer c.Close()
	buf := make([]byte, 64<<10)
	for sent := 0; sent < size; sent += len(buf) {
		if _, err := c.Write(buf); err != nil {
			fmt.Println("error", err)
			return 1
		}
	}
	c.(*net.TCPConn).CloseWrite()
	back := 0
	for {
		n, err := c.Read(buf)
		back += n
		if err != nil {
			break
		}
	}
	fmt.Println("moved", size, back)
	return 0
}

func TestCarriedBytesGoThroughSplice(t *testing.T) {
	if testing.Short() {
		t.Skip("starts a child process under strace")
	}
	strace, err := exec.LookPath("strace")
	if err != nil {
		t.Skip("strace not installed (scripts/deps.sh installs it)")
	}
	trace := filepath.Join(t.TempDir(), "trace")
	cmd := exec.Command(strace, "-f", "-qq", "-e", "trace=splice", "-o", trace, os.Args[0], "-test.run=^$")
	cmd.Env = append(os.Environ(), childEnv+"=splice")
	out, err := cmd.CombinedOutput()
	require.NoError(t, err, "%s", out)
	require.Contains(t, string(out), "moved 8388608 8388608")

	data, err := os.ReadFile(trace)
	require.NoError(t, err)
	ret := regexp.MustCompile(`(?:splice\(|<\.\.\. splice resumed>).*\) = (\d+)`)
	calls, moved := 0, 0
	for _, l := range strings.Split(string(data), "\n") {
		if mm := ret.FindStringSubmatch(l); mm != nil {
			n, _ := strconv.Atoi(mm[1])
			calls++
			moved += n
		}
	}
	// Each byte is spliced twice (socket to pipe, pipe to socket) in each of
	// the two directions: 4 x 8 MiB. strace now and then garbles a line of a
	// call that a signal interrupted, so allow 5% for what it fails to print.
	t.Logf("%d splice calls moved %d bytes", calls, moved)
	assert.GreaterOrEqual(t, moved, 4*8<<20*95/100, "the proxy's copies went through splice(2)")
}
