package qemu

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"net"
	"os"
	"time"

	"github.com/digitalocean/go-qemu/qmp"
	"golang.org/x/sys/unix"
)

// qmpRun opens a QMP session on sock, runs the commands (without
// arguments) in order, and returns the last reply's "return" value.
func qmpRun(ctx context.Context, sock string, cmds ...string) (json.RawMessage, error) {
	var ret json.RawMessage
	err := qmpWith(ctx, sock, func(m *monitor) error {
		for _, c := range cmds {
			var err error
			if ret, err = m.run(c, nil); err != nil {
				return err
			}
		}
		return nil
	})
	return ret, err
}

// qmpWith opens a QMP session on sock and runs fn in it. go-qemu's
// SocketMonitor has no deadlines, so the session runs in its own
// goroutine: when ctx ends first the caller gets ctx's error, and the
// goroutine disconnects as soon as qemu answers or its socket closes (a
// wedged qemu is killed by Stop's escalation).
func qmpWith(ctx context.Context, sock string, fn func(*monitor) error) error {
	done := make(chan error, 1)
	go func() {
		mon, err := qmpConnect(sock)
		if err == nil {
			err = fn(&monitor{mon: mon})
			_ = mon.Disconnect()
		}
		done <- err
	}()
	select {
	case err := <-done:
		return err
	case <-ctx.Done():
		return fmt.Errorf("qmp %s: %w", sock, ctx.Err())
	}
}

func qmpConnect(sock string) (*qmp.SocketMonitor, error) {
	// QEMU accepts one QMP client at a time from a short listen backlog; a
	// connect while the backlog is full fails with EAGAIN. Retry briefly.
	var mon *qmp.SocketMonitor
	var err error
	for end := time.Now().Add(3 * time.Second); ; {
		mon, err = qmp.NewSocketMonitor("unix", sock, 2*time.Second)
		if err == nil || !errors.Is(err, unix.EAGAIN) || time.Now().After(end) {
			break
		}
		time.Sleep(20 * time.Millisecond)
	}
	if err != nil {
		return nil, fmt.Errorf("qmp dial %s: %w", sock, err)
	}
	if err := mon.Connect(); err != nil {
		_ = mon.Disconnect()
		return nil, fmt.Errorf("qmp handshake %s: %w", sock, err)
	}
	return mon, nil
}

// monitor runs commands in one QMP session.
type monitor struct{ mon *qmp.SocketMonitor }

// run executes cmd with args (nil: none) and returns its "return" value.
func (m *monitor) run(cmd string, args any) (json.RawMessage, error) {
	return m.runWithFile(cmd, args, nil)
}

// runWithFile is run with f passed to qemu in the same message
// (SCM_RIGHTS), as getfd takes it. A file descriptor passed so belongs to
// this session: the command that uses it must run in the same session.
func (m *monitor) runWithFile(cmd string, args any, f *os.File) (json.RawMessage, error) {
	req := map[string]any{"execute": cmd}
	if args != nil {
		req["arguments"] = args
	}
	b, err := json.Marshal(req)
	if err != nil {
		return nil, fmt.Errorf("qmp %s: %w", cmd, err)
	}
	var raw []byte
	if f != nil {
		raw, err = m.mon.RunWithFile(b, f)
	} else {
		raw, err = m.mon.Run(b)
	}
	if err != nil {
		return nil, fmt.Errorf("qmp %s: %w", cmd, err)
	}
	var reply struct {
		Return json.RawMessage `json:"return"`
	}
	if err := json.Unmarshal(raw, &reply); err != nil {
		return nil, fmt.Errorf("qmp %s: reply %q: %w", cmd, raw, err)
	}
	return reply.Return, nil
}

// qmpStatus is query-status's "status" (running, paused, shutdown,
// internal-error, guest-panicked, ...).
func qmpStatus(ctx context.Context, sock string) (string, error) {
	ret, err := qmpRun(ctx, sock, "query-status")
	if err != nil {
		return "", err
	}
	var st struct {
		Status string `json:"status"`
	}
	if err := json.Unmarshal(ret, &st); err != nil || st.Status == "" {
		return "", fmt.Errorf("qmp query-status: unexpected reply %s", ret)
	}
	return st.Status, nil
}

// socketPeerPID connects to a unix socket and returns the pid of the process
// that accepted (SO_PEERCRED): proof of who serves it. QEMU serves one QMP
// client at a time; the connection is closed at once without a handshake.
func socketPeerPID(ctx context.Context, sock string) (int, error) {
	var d net.Dialer
	var c net.Conn
	var err error
	for {
		c, err = d.DialContext(ctx, "unix", sock)
		if err == nil || !errors.Is(err, unix.EAGAIN) || ctx.Err() != nil {
			break
		}
		time.Sleep(20 * time.Millisecond) // backlog full, see qmpSession
	}
	if err != nil {
		return 0, err
	}
	defer c.Close()
	raw, err := c.(*net.UnixConn).SyscallConn()
	if err != nil {
		return 0, err
	}
	var cred *unix.Ucred
	var serr error
	if err := raw.Control(func(fd uintptr) {
		cred, serr = unix.GetsockoptUcred(int(fd), unix.SOL_SOCKET, unix.SO_PEERCRED)
	}); err != nil {
		return 0, err
	}
	if serr != nil {
		return 0, serr
	}
	return int(cred.Pid), nil
}

// socketInUse reports whether some process accepts connections on sock. A
// file nobody listens on (ECONNREFUSED) is a stale socket from a dead qemu.
func socketInUse(sock string) bool {
	c, err := net.DialTimeout("unix", sock, time.Second)
	if err == nil {
		c.Close()
		return true
	}
	return !errors.Is(err, unix.ECONNREFUSED) && !errors.Is(err, unix.ENOENT)
}
