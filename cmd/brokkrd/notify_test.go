package main

import (
	"context"
	"io"
	"log/slog"
	"net"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/brokkr/brokkr/daemon/api"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

type fakeLoop struct {
	first chan struct{}
	mu    sync.Mutex
	last  time.Time
	st    api.Status
}

func (f *fakeLoop) FirstPass() <-chan struct{} { return f.first }
func (f *fakeLoop) LastPass() time.Time {
	f.mu.Lock()
	defer f.mu.Unlock()
	return f.last
}
func (f *fakeLoop) Status() api.Status {
	f.mu.Lock()
	defer f.mu.Unlock()
	return f.st
}
func (f *fakeLoop) set(last time.Time, st func(*api.Status)) {
	f.mu.Lock()
	defer f.mu.Unlock()
	f.last = last
	if st != nil {
		st(&f.st)
	}
}

// notifySocket is a real unix datagram socket in place of systemd's.
func notifySocket(t *testing.T) *net.UnixConn {
	t.Helper()
	path := filepath.Join(shortTemp(t), "notify")
	c, err := net.ListenUnixgram("unixgram", &net.UnixAddr{Name: path, Net: "unixgram"})
	require.NoError(t, err)
	t.Cleanup(func() { c.Close() })
	t.Setenv("NOTIFY_SOCKET", path)
	return c
}

// recv reads datagrams until one contains want, or fails after d.
func recv(t *testing.T, c *net.UnixConn, want string, d time.Duration) []string {
	t.Helper()
	var got []string
	deadline := time.Now().Add(d)
	buf := make([]byte, 4096)
	for {
		require.NoError(t, c.SetReadDeadline(deadline))
		n, err := c.Read(buf)
		if err != nil {
			t.Fatalf("no %q within %s; got %q (%v)", want, d, got, err)
		}
		got = append(got, string(buf[:n]))
		if strings.Contains(string(buf[:n]), want) {
			return got
		}
	}
}

// silent reports whether nothing containing what arrives for d.
func silent(t *testing.T, c *net.UnixConn, what string, d time.Duration) bool {
	t.Helper()
	buf := make([]byte, 4096)
	require.NoError(t, c.SetReadDeadline(time.Now().Add(d)))
	for {
		n, err := c.Read(buf)
		if err != nil {
			return true
		}
		if strings.Contains(string(buf[:n]), what) {
			return false
		}
	}
}

func TestNotifyReadyStatusAndWatchdog(t *testing.T) {
	sock := notifySocket(t)
	t.Setenv("WATCHDOG_USEC", "300000") // 300 ms: pings every 100 ms
	t.Setenv("WATCHDOG_PID", "")
	loop := &fakeLoop{first: make(chan struct{}), st: api.Status{
		VMs:       []api.VM{{Name: "web", Phase: "starting"}},
		Exposures: []api.Exposure{{Name: "web-http", State: "pending"}},
	}}
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan struct{})
	go func() { notifySystemd(ctx, loop, slog.New(slog.NewTextHandler(io.Discard, nil))); close(done) }()
	defer func() { cancel(); <-done }()

	assert.True(t, silent(t, sock, "", 300*time.Millisecond), "nothing before the first pass: not ready")

	loop.set(time.Now(), nil)
	close(loop.first)
	got := recv(t, sock, "READY=1", 2*time.Second)
	assert.Equal(t, "READY=1\nSTATUS=0/1 VMs running, 0/1 exposures active", got[len(got)-1])

	recv(t, sock, "WATCHDOG=1", time.Second)
	loop.set(time.Now(), func(st *api.Status) { st.VMs[0].Phase, st.Exposures[0].State = "running", "failed" })
	recv(t, sock, "STATUS=1/1 VMs running, 0/1 exposures active; 0 VMs and 1 exposures failed", 2*time.Second)

	// A loop that stops finishing passes stops the pings.
	loop.set(time.Now().Add(-time.Hour), nil)
	time.Sleep(150 * time.Millisecond)           // a ping already in flight
	silent(t, sock, "\x00", 20*time.Millisecond) // drain what was queued before
	assert.True(t, silent(t, sock, "WATCHDOG=1", 500*time.Millisecond), "no pings for a stuck loop")
	loop.set(time.Now(), nil)
	recv(t, sock, "WATCHDOG=1", time.Second)
}

func TestNoNotifySocketIsQuiet(t *testing.T) {
	t.Setenv("NOTIFY_SOCKET", "")
	loop := &fakeLoop{first: make(chan struct{})}
	close(loop.first)
	ctx, cancel := context.WithTimeout(context.Background(), 200*time.Millisecond)
	defer cancel()
	notifySystemd(ctx, loop, slog.New(slog.NewTextHandler(io.Discard, nil))) // returns at ctx's end, sends nowhere
}

func shortTemp(t *testing.T) string {
	t.Helper()
	dir, err := os.MkdirTemp("", "brkd")
	require.NoError(t, err)
	t.Cleanup(func() { os.RemoveAll(dir) })
	return dir
}
