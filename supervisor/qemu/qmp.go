package qemu

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"net"
	"time"

	"github.com/digitalocean/go-qemu/qmp"
	"golang.org/x/sys/unix"
)

// qmpRun opens a QMP session on sock, runs the commands in order, and returns
// the last reply's "return" value. go-qemu's SocketMonitor has no deadlines,
// so the session runs in its own goroutine: when ctx ends first the caller
// gets ctx's error, and the goroutine disconnects as soon as qemu answers or
// its socket closes (a wedged qemu is killed by Stop's escalation).
func qmpRun(ctx context.Context, sock string, cmds ...string) (json.RawMessage, error) {
	type result struct {
		ret json.RawMessage
		err error
	}
	done := make(chan result, 1)
	go func() {
		ret, err := qmpSession(sock, cmds)
		done <- result{ret, err}
	}()
	select {
	case r := <-done:
		return r.ret, r.err
	case <-ctx.Done():
		return nil, fmt.Errorf("qmp %s: %w", sock, ctx.Err())
	}
}

func qmpSession(sock string, cmds []string) (json.RawMessage, error) {
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
	defer mon.Disconnect()
	var ret json.RawMessage
	for _, c := range cmds {
		raw, err := mon.Run([]byte(`{"execute":"` + c + `"}`))
		if err != nil {
			return nil, fmt.Errorf("qmp %s: %w", c, err)
		}
		var reply struct {
			Return json.RawMessage `json:"return"`
		}
		if err := json.Unmarshal(raw, &reply); err != nil {
			return nil, fmt.Errorf("qmp %s: reply %q: %w", c, raw, err)
		}
		ret = reply.Return
	}
	return ret, nil
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
