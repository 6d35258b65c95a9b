package proxy

import (
	"io"
	"net"
	"sync/atomic"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

// tcpPair returns both ends of one loopback TCP connection.
func tcpPair(t *testing.T) (dialed, accepted *net.TCPConn) {
	t.Helper()
	ln, err := net.ListenTCP("tcp4", &net.TCPAddr{IP: net.IPv4(127, 0, 0, 1)})
	require.NoError(t, err)
	defer ln.Close()
	d, err := net.DialTCP("tcp4", nil, ln.Addr().(*net.TCPAddr))
	require.NoError(t, err)
	a, err := ln.AcceptTCP()
	require.NoError(t, err)
	return d, a
}

// Carry splices a connection handed over by the network plane's cap slow
// path: bytes both ways, each direction half-closed at its end, and the
// slot of no exposure touched (the plane counts these through conntrack).
func TestCarrySplicesHandedOverConnection(t *testing.T) {
	m := NewManager(func(string) string { return "" }, nil)
	defer m.StopAll()
	caller, client := tcpPair(t)
	defer caller.Close()
	guest, guestSide := tcpPair(t)
	defer guestSide.Close()
	go func() {
		// The guest echoes until EOF, then says bye and closes.
		b, _ := io.ReadAll(guestSide)
		_, _ = guestSide.Write(append(b, []byte(" bye")...))
		guestSide.Close()
	}()
	m.Carry("web", client, guest)
	_, err := caller.Write([]byte("hello"))
	require.NoError(t, err)
	require.NoError(t, caller.CloseWrite()) // half-close reaches the guest
	_ = caller.SetReadDeadline(time.Now().Add(5 * time.Second))
	got, err := io.ReadAll(caller)
	require.NoError(t, err)
	assert.Equal(t, "hello bye", string(got))
	_, ok := m.stats.Lookup("web")
	assert.False(t, ok, "no slot attached for a carried connection")
}

// StopAll ends connections handed over by Carry, and a Carry after StopAll
// resets the caller.
func TestCarryEndedByStopAll(t *testing.T) {
	m := NewManager(func(string) string { return "" }, nil)
	caller, client := tcpPair(t)
	defer caller.Close()
	guest, guestSide := tcpPair(t)
	defer guestSide.Close()
	m.Carry("web", client, guest)
	m.StopAll()
	_ = caller.SetReadDeadline(time.Now().Add(5 * time.Second))
	_, err := caller.Read(make([]byte, 1))
	assert.Error(t, err, "the carried connection ended with StopAll")

	caller2, client2 := tcpPair(t)
	defer caller2.Close()
	guest2, guestSide2 := tcpPair(t)
	defer guestSide2.Close()
	m.Carry("web", client2, guest2)
	_ = caller2.SetReadDeadline(time.Now().Add(5 * time.Second))
	_, err = caller2.Read(make([]byte, 1))
	assert.Error(t, err, "reset: the manager is stopped")
}

// A process that cannot make a splice pipe (out of descriptors) still carries
// both directions, half-closes and counts, copying through memory instead.
func TestWithoutPipesBytesStillFlowAndCount(t *testing.T) {
	pipePool.mu.Lock()
	for _, p := range pipePool.free {
		p.queued = 1 // closed, not kept, by putPipe
		putPipe(p)
	}
	pipePool.free = nil
	pipePool.mu.Unlock()
	var made atomic.Int32
	newPipe = func() *pipe { made.Add(1); return nil }
	t.Cleanup(func() { newPipe = makePipe })

	caller, client := tcpPair(t)
	defer caller.Close()
	guest, guestSide := tcpPair(t)
	defer guestSide.Close()
	go func() {
		b, _ := io.ReadAll(guestSide)
		_, _ = guestSide.Write(append(b, []byte(" bye")...))
		guestSide.Close()
	}()
	var in, out atomic.Int64
	done := make(chan struct{})
	go func() {
		(&Manager{}).runPair(&pair{client: client, guest: guest}, func(n int64) { in.Add(n) }, func(n int64) { out.Add(n) })
		close(done)
	}()
	_, err := caller.Write([]byte("hello"))
	require.NoError(t, err)
	require.NoError(t, caller.CloseWrite())
	_ = caller.SetReadDeadline(time.Now().Add(5 * time.Second))
	got, err := io.ReadAll(caller)
	require.NoError(t, err)
	assert.Equal(t, "hello bye", string(got))
	<-done
	assert.Equal(t, int64(5), in.Load())
	assert.Equal(t, int64(9), out.Load())
	assert.Equal(t, int32(2), made.Load(), "one failed pipe per direction, then memory")
}
