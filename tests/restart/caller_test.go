package restart

import (
	"bufio"
	"fmt"
	"io"
	"net"
	"os"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
)

const callerEnv = "BRK_RESTART_CALLER"

// callerMain is a child process that makes and holds TCP connections on
// command, one command a line on stdin, one answer a line on stdout:
//
//	hold ADDR    dial, echo "hold", keep the connection: "ok N" (its index)
//	probe ADDR   dial and echo "probe": "accepted" or "refused"
//	echo N MSG   echo MSG on held connection N: "ok"
//	close N      close held connection N (a FIN) and wait for the guest's: "ok"
//
// It runs where a test cannot run a goroutine: in the child cgroup the
// socket path is attached to (cgroup membership is per process).
func callerMain() int {
	var held []net.Conn
	in := bufio.NewScanner(os.Stdin)
	for in.Scan() {
		f := strings.Fields(in.Text())
		if len(f) < 2 {
			fmt.Println("err bad command")
			continue
		}
		switch f[0] {
		case "hold":
			c, err := dialEcho(f[1], "hold")
			if err != nil {
				fmt.Println("err", err)
				continue
			}
			held = append(held, c)
			fmt.Println("ok", len(held)-1)
		case "probe":
			c, err := dialEcho(f[1], "probe")
			if err != nil {
				fmt.Println("refused")
				continue
			}
			c.Close()
			fmt.Println("accepted")
		case "echo", "close":
			i, err := strconv.Atoi(f[1])
			if err != nil || i < 0 || i >= len(held) || held[i] == nil {
				fmt.Println("err no connection", f[1])
				continue
			}
			if f[0] == "echo" && len(f) == 3 {
				err = echoOn(held[i], f[2])
			} else {
				err = closeBoth(held[i])
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

// dialEcho connects and echoes msg once: a connection carried end to end.
func dialEcho(addr, msg string) (net.Conn, error) {
	c, err := net.DialTimeout("tcp", addr, 3*time.Second)
	if err != nil {
		return nil, err
	}
	if err := echoOn(c, msg); err != nil {
		c.Close()
		return nil, err
	}
	return c, nil
}

func echoOn(c net.Conn, msg string) error {
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

// closeBoth half-closes and waits for the guest's FIN, so the connection's
// place is given back on both sides before the answer.
func closeBoth(c net.Conn) error {
	defer c.Close()
	_ = c.SetDeadline(time.Now().Add(5 * time.Second))
	if err := c.(*net.TCPConn).CloseWrite(); err != nil {
		return err
	}
	_, err := io.Copy(io.Discard, c)
	return err
}

// caller drives a callerMain process.
type caller struct {
	t   *testing.T
	in  io.WriteCloser
	out *bufio.Scanner
}

// startCaller runs callerMain in the host namespace, inside cgroup.
func (r *rig) startCaller(cgroup string) *caller {
	t := r.t
	cg, err := os.Open(cgroup)
	require.NoError(t, err)
	defer cg.Close()
	cmd := r.host.Command(os.Args[0])
	cmd.Env = append(os.Environ(), callerEnv+"=1")
	cmd.SysProcAttr = &syscall.SysProcAttr{UseCgroupFD: true, CgroupFD: int(cg.Fd())}
	in, err := cmd.StdinPipe()
	require.NoError(t, err)
	out, err := cmd.StdoutPipe()
	require.NoError(t, err)
	cmd.Stderr = os.Stderr
	require.NoError(t, cmd.Start())
	t.Cleanup(func() { in.Close(); _ = cmd.Wait() })
	return &caller{t: t, in: in, out: bufio.NewScanner(out)}
}

func (c *caller) do(cmd string) string {
	c.t.Helper()
	_, err := fmt.Fprintln(c.in, cmd)
	require.NoError(c.t, err)
	require.True(c.t, c.out.Scan(), "the caller process ended: %v", c.out.Err())
	return c.out.Text()
}

func (c *caller) hold(addr string) conn {
	c.t.Helper()
	ans := c.do("hold " + addr)
	n, ok := strings.CutPrefix(ans, "ok ")
	require.True(c.t, ok, "hold %s: %s", addr, ans)
	return conn{c: c, idx: n}
}

func (c *caller) probe(addr string) bool {
	c.t.Helper()
	ans := c.do("probe " + addr)
	require.Contains(c.t, []string{"accepted", "refused"}, ans)
	return ans == "refused"
}

// conn is a held connection: in this process (tcp) or in a caller's.
type conn struct {
	tcp net.Conn
	c   *caller
	idx string
}

func (h conn) echo(t *testing.T, msg string) {
	t.Helper()
	if h.tcp != nil {
		require.NoError(t, echoOn(h.tcp, msg))
		return
	}
	require.Equal(t, "ok", h.c.do("echo "+h.idx+" "+msg), "echo on a held connection")
}

func (h conn) close(t *testing.T) {
	t.Helper()
	if h.tcp != nil {
		require.NoError(t, closeBoth(h.tcp))
		return
	}
	require.Equal(t, "ok", h.c.do("close "+h.idx))
}

// holdIn and probeIn are hold and probe from a namespace of the test's own.
func (r *rig) holdIn(addr string) conn {
	r.t.Helper()
	var c net.Conn
	require.NoError(r.t, r.client.Do(func() (err error) { c, err = dialEcho(addr, "hold"); return err }), "hold %s", addr)
	r.t.Cleanup(func() { c.Close() })
	return conn{tcp: c}
}

func (r *rig) probeIn(addr string) bool {
	var c net.Conn
	err := r.client.Do(func() (err error) { c, err = dialEcho(addr, "probe"); return err })
	if err != nil {
		return true
	}
	c.Close()
	return false
}

// udpAsk sends msg on u once and waits for the guest's answer
// ("port:msg"): each datagram sent is one the counters must show.
func udpAsk(u *net.UDPConn, msg string) (string, error) {
	if _, err := u.Write([]byte(msg)); err != nil {
		return "", err
	}
	buf := make([]byte, 512)
	_ = u.SetReadDeadline(time.Now().Add(3 * time.Second))
	n, err := u.Read(buf)
	if err != nil {
		return "", err
	}
	return string(buf[:n]), nil
}
