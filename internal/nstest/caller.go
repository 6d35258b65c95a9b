package nstest

import (
	"bufio"
	"fmt"
	"io"
	"net"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	"golang.org/x/sys/unix"
)

const callerEnv = "BRK_NSTEST_CALLER"

// CallerMain makes the test binary a caller process (see StartCaller) when
// it was started as one; a TestMain calls it first.
func CallerMain() {
	if os.Getenv(callerEnv) != "" {
		os.Exit(callerMain())
	}
}

// callerMain makes and holds TCP connections on command, one command a
// line on stdin, one answer a line on stdout:
//
//	hold ADDR    dial, echo "hold", keep the connection: "ok N" (its index)
//	probe ADDR   dial and echo "probe": "accepted", or "refused WHY"
//	echo N MSG   echo MSG on held connection N: "ok"
//	close N      close held connection N (a FIN) and wait for the peer's: "ok"
//	udp ADDR     a connected UDP socket, one datagram echoed: "ok N"
//	uecho N MSG  echo MSG on UDP socket N: "ok", or "err" and why
//
// It runs where a test cannot run a goroutine: in a cgroup of its own
// (cgroup membership is per process), such as the child cgroup a socket
// path is attached to.
func callerMain() int {
	var held []net.Conn
	var udp []*net.UDPConn
	in := bufio.NewScanner(os.Stdin)
	for in.Scan() {
		f := strings.Fields(in.Text())
		if len(f) < 2 {
			fmt.Println("err bad command")
			continue
		}
		switch f[0] {
		case "hold":
			c, err := DialEcho(f[1], "hold")
			if err != nil {
				fmt.Println("err", err)
				continue
			}
			held = append(held, c)
			fmt.Println("ok", len(held)-1)
		case "probe":
			c, err := DialEcho(f[1], "probe")
			if err != nil {
				fmt.Println("refused", err)
				continue
			}
			c.Close()
			fmt.Println("accepted")
		case "udp":
			c, err := net.Dial("udp", f[1])
			if err == nil {
				if err = udpEcho(c.(*net.UDPConn), "udp"); err != nil {
					c.Close()
				}
			}
			if err != nil {
				fmt.Println("err", err)
				continue
			}
			udp = append(udp, c.(*net.UDPConn))
			fmt.Println("ok", len(udp)-1)
		case "uecho":
			i, err := strconv.Atoi(f[1])
			if err != nil || i < 0 || i >= len(udp) || len(f) != 3 {
				fmt.Println("err no socket", f[1])
				continue
			}
			if err := udpEcho(udp[i], f[2]); err != nil {
				fmt.Println("err", err)
				continue
			}
			fmt.Println("ok")
		case "echo", "close":
			i, err := strconv.Atoi(f[1])
			if err != nil || i < 0 || i >= len(held) || held[i] == nil {
				fmt.Println("err no connection", f[1])
				continue
			}
			if f[0] == "echo" && len(f) == 3 {
				err = EchoOn(held[i], f[2])
			} else {
				err = CloseBoth(held[i])
				held[i] = nil
			}
			if err != nil {
				fmt.Println("err", err)
				continue
			}
			fmt.Println("ok")
		default:
			fmt.Println("err unknown command", f[0])
		}
	}
	return 0
}

// udpEcho sends msg on a connected UDP socket and reads the echo: the
// receive's error when there is none.
func udpEcho(c *net.UDPConn, msg string) error {
	_ = c.SetDeadline(time.Now().Add(3 * time.Second))
	defer c.SetDeadline(time.Time{})
	if _, err := c.Write([]byte(msg)); err != nil {
		// A disconnected socket cannot send; the pending error says why.
		if _, rerr := c.Read(make([]byte, 1)); rerr != nil {
			return rerr
		}
		return err
	}
	buf := make([]byte, len(msg)+1)
	n, err := c.Read(buf)
	if err != nil {
		return err
	}
	if string(buf[:n]) != msg {
		return fmt.Errorf("udp echo: got %q", buf[:n])
	}
	return nil
}

// DialEcho connects and echoes msg once: a connection carried end to end.
func DialEcho(addr, msg string) (net.Conn, error) {
	c, err := net.DialTimeout("tcp", addr, 3*time.Second)
	if err != nil {
		return nil, err
	}
	if err := EchoOn(c, msg); err != nil {
		c.Close()
		return nil, err
	}
	return c, nil
}

// EchoOn sends msg on c and checks that it comes back.
func EchoOn(c net.Conn, msg string) error {
	_ = c.SetDeadline(time.Now().Add(5 * time.Second))
	defer c.SetDeadline(time.Time{})
	if _, err := io.WriteString(c, msg); err != nil {
		return err
	}
	buf := make([]byte, len(msg))
	if _, err := io.ReadFull(c, buf); err != nil {
		return err
	}
	if string(buf) != msg {
		return fmt.Errorf("echo: got %q", buf)
	}
	return nil
}

// CloseBoth half-closes c and waits for the peer's FIN, so the
// connection's place is given back on both sides before it returns.
func CloseBoth(c net.Conn) error {
	defer c.Close()
	_ = c.SetDeadline(time.Now().Add(5 * time.Second))
	if err := c.(*net.TCPConn).CloseWrite(); err != nil {
		return err
	}
	_, err := io.Copy(io.Discard, c)
	return err
}

// Caller drives a caller process.
type Caller struct {
	t   testing.TB
	in  io.WriteCloser
	out *bufio.Scanner
}

// StartCaller runs the test binary as a caller process in ns, inside
// cgroup; it ends with the test. The package's TestMain must call
// CallerMain.
func StartCaller(t testing.TB, ns *NS, cgroup string) *Caller {
	t.Helper()
	cg, err := os.Open(cgroup)
	if err != nil {
		t.Fatal(err)
	}
	defer cg.Close()
	cmd := ns.Command(os.Args[0])
	cmd.Env = append(os.Environ(), callerEnv+"=1")
	cmd.SysProcAttr = &syscall.SysProcAttr{UseCgroupFD: true, CgroupFD: int(cg.Fd())}
	in, err := cmd.StdinPipe()
	if err != nil {
		t.Fatal(err)
	}
	out, err := cmd.StdoutPipe()
	if err != nil {
		t.Fatal(err)
	}
	cmd.Stderr = os.Stderr
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { in.Close(); _ = cmd.Wait() })
	return &Caller{t: t, in: in, out: bufio.NewScanner(out)}
}

func (c *Caller) do(cmd string) string {
	c.t.Helper()
	if _, err := fmt.Fprintln(c.in, cmd); err != nil {
		c.t.Fatalf("caller: %v", err)
	}
	if !c.out.Scan() {
		c.t.Fatalf("the caller process ended: %v", c.out.Err())
	}
	return c.out.Text()
}

// Hold makes a connection to addr that is carried end to end and keeps it.
func (c *Caller) Hold(addr string) Held {
	c.t.Helper()
	ans := c.do("hold " + addr)
	n, ok := strings.CutPrefix(ans, "ok ")
	if !ok {
		c.t.Fatalf("hold %s: %s", addr, ans)
	}
	return Held{c: c, idx: n}
}

// Probe calls addr once: refused is true when the connection was not
// carried, and why says how ("connect: connection refused").
func (c *Caller) Probe(addr string) (refused bool, why string) {
	c.t.Helper()
	ans := c.do("probe " + addr)
	if ans == "accepted" {
		return false, ""
	}
	why, ok := strings.CutPrefix(ans, "refused ")
	if !ok {
		c.t.Fatalf("probe %s: %s", addr, ans)
	}
	return true, why
}

// UDP makes a connected UDP socket to addr that carried one datagram
// both ways, and returns its index for UDPEcho.
func (c *Caller) UDP(addr string) string {
	c.t.Helper()
	ans := c.do("udp " + addr)
	n, ok := strings.CutPrefix(ans, "ok ")
	if !ok {
		c.t.Fatalf("udp %s: %s", addr, ans)
	}
	return n
}

// UDPEcho sends msg on UDP socket i and waits for the echo: "" when it
// came back, else the error.
func (c *Caller) UDPEcho(i, msg string) string {
	c.t.Helper()
	ans := c.do("uecho " + i + " " + msg)
	if ans == "ok" {
		return ""
	}
	return strings.TrimPrefix(ans, "err ")
}

// Held is a held connection: in this process (Conn) or in a caller's.
type Held struct {
	Conn net.Conn
	c    *Caller
	idx  string
}

// Echo sends msg on the connection and checks that it comes back.
func (h Held) Echo(t testing.TB, msg string) {
	t.Helper()
	if h.Conn != nil {
		if err := EchoOn(h.Conn, msg); err != nil {
			t.Fatalf("echo on a held connection: %v", err)
		}
		return
	}
	if ans := h.c.do("echo " + h.idx + " " + msg); ans != "ok" {
		t.Fatalf("echo on a held connection: %s", ans)
	}
}

// Close closes the connection both ways (see CloseBoth).
func (h Held) Close(t testing.TB) {
	t.Helper()
	if h.Conn != nil {
		if err := CloseBoth(h.Conn); err != nil {
			t.Fatalf("close: %v", err)
		}
		return
	}
	if ans := h.c.do("close " + h.idx); ans != "ok" {
		t.Fatalf("close: %s", ans)
	}
}

// ChildCgroup makes a cgroup v2 child of the test's own under the host's
// cgroup2 hierarchy (/sys/fs/cgroup/unified on a hybrid host, else
// /sys/fs/cgroup), for cgroup BPF programs that must never attach to the
// root; processes left in it are killed and it is removed at cleanup.
func ChildCgroup(t testing.TB) string {
	t.Helper()
	root := ""
	for _, p := range []string{"/sys/fs/cgroup/unified", "/sys/fs/cgroup"} {
		var st unix.Statfs_t
		if unix.Statfs(p, &st) == nil && st.Type == unix.CGROUP2_SUPER_MAGIC {
			root = p
			break
		}
	}
	if root == "" {
		t.Skip("no cgroup v2 hierarchy mounted")
	}
	dir := filepath.Join(root, Name(t, "cg"))
	_ = os.Remove(dir) // a leftover of a killed run
	if err := os.Mkdir(dir, 0o755); err != nil {
		t.Fatalf("cgroup %s: %v", dir, err)
	}
	t.Cleanup(func() {
		for i := 0; i < 50; i++ {
			b, _ := os.ReadFile(filepath.Join(dir, "cgroup.procs"))
			pids := strings.Fields(string(b))
			if len(pids) == 0 {
				break
			}
			for _, p := range pids {
				if pid, err := strconv.Atoi(p); err == nil {
					_ = syscall.Kill(pid, syscall.SIGKILL)
				}
			}
			time.Sleep(20 * time.Millisecond)
		}
		if err := os.Remove(dir); err != nil {
			t.Errorf("removing cgroup %s: %v", dir, err)
		}
	})
	return dir
}
