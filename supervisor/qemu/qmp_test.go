package qemu

import (
	"context"
	"net"
	"os"
	"path/filepath"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	"golang.org/x/sys/unix"
)

// listenBacklog0 listens on a unix socket with the smallest backlog, as
// QEMU's QMP server effectively has, and never accepts by itself.
func listenBacklog0(t *testing.T, path string) int {
	fd, err := unix.Socket(unix.AF_UNIX, unix.SOCK_STREAM|unix.SOCK_CLOEXEC, 0)
	require.NoError(t, err)
	t.Cleanup(func() { unix.Close(fd) })
	require.NoError(t, unix.Bind(fd, &unix.SockaddrUnix{Name: path}))
	require.NoError(t, unix.Listen(fd, 0))
	return fd
}

// A full backlog (EAGAIN) is waited out, and the peer is identified by
// SO_PEERCRED.
func TestSocketPeerPIDWaitsOutFullBacklog(t *testing.T) {
	sock := filepath.Join(t.TempDir(), "qmp.sock")
	lfd := listenBacklog0(t, sock)
	var pending []net.Conn
	full := false
	for i := 0; i < 4 && !full; i++ { // fill the queue until the kernel says EAGAIN
		c, err := net.Dial("unix", sock)
		if err != nil {
			require.ErrorIs(t, err, unix.EAGAIN)
			full = true
			continue
		}
		pending = append(pending, c)
	}
	require.True(t, full, "the backlog never filled")
	defer func() {
		for _, c := range pending {
			c.Close()
		}
	}()
	go func() {
		time.Sleep(100 * time.Millisecond)
		for range pending {
			if nfd, _, err := unix.Accept(lfd); err == nil {
				unix.Close(nfd)
			}
		}
	}()
	ctx, cancel := context.WithTimeout(t.Context(), 5*time.Second)
	defer cancel()
	pid, err := socketPeerPID(ctx, sock)
	require.NoError(t, err)
	assert.Equal(t, os.Getpid(), pid)
	assert.True(t, socketInUse(sock))
}

func TestSocketInUse(t *testing.T) {
	dir := t.TempDir()
	assert.False(t, socketInUse(filepath.Join(dir, "absent.sock")))
	stale := filepath.Join(dir, "stale.sock")
	ln, err := net.Listen("unix", stale)
	require.NoError(t, err)
	ln.(*net.UnixListener).SetUnlinkOnClose(false)
	ln.Close()
	assert.False(t, socketInUse(stale), "a socket file nobody listens on is stale")
}
