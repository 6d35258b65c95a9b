package proxy

import (
	"fmt"
	"io"
	"net"
	"strings"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	"golang.org/x/sys/unix"
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
	// More than a small buffer's worth each way: the directions move to
	// splice (copyHalf), find no pipe and copy through memory.
	msg := strings.Repeat("hello", chunkSize)
	_, err := caller.Write([]byte(msg))
	require.NoError(t, err)
	require.NoError(t, caller.CloseWrite())
	_ = caller.SetReadDeadline(time.Now().Add(5 * time.Second))
	got, err := io.ReadAll(caller)
	require.NoError(t, err)
	assert.Equal(t, msg+" bye", string(got))
	<-done
	assert.Equal(t, int64(len(msg)), in.Load())
	assert.Equal(t, int64(len(msg)+4), out.Load())
	assert.Equal(t, int32(2), made.Load(), "one failed pipe per direction, then memory")
}

// withPipeCount drains the pipe pool and counts the pipes made from now on.
func withPipeCount(t *testing.T) *atomic.Int32 {
	pipePool.mu.Lock()
	for _, p := range pipePool.free {
		p.queued = 1 // closed, not kept, by putPipe
		putPipe(p)
	}
	pipePool.free = nil
	pipePool.mu.Unlock()
	var made atomic.Int32
	newPipe = func() *pipe { made.Add(1); return makePipe() }
	t.Cleanup(func() { newPipe = makePipe })
	return &made
}

// A short exchange is copied through the small buffer and takes no splice
// pipe; a read that fills the buffer moves its direction to splice.
func TestSmallChunksAreCopiedAndBulkIsSpliced(t *testing.T) {
	made := withPipeCount(t)
	exchange := func(msg string) string {
		caller, client := tcpPair(t)
		defer caller.Close()
		guest, guestSide := tcpPair(t)
		defer guestSide.Close()
		go func() {
			b, _ := io.ReadAll(guestSide)
			_, _ = guestSide.Write(b)
			guestSide.Close()
		}()
		done := make(chan struct{})
		go func() {
			(&Manager{}).runPair(&pair{client: client, guest: guest}, func(int64) {}, func(int64) {})
			close(done)
		}()
		_, err := caller.Write([]byte(msg))
		require.NoError(t, err)
		require.NoError(t, caller.CloseWrite())
		_ = caller.SetReadDeadline(time.Now().Add(5 * time.Second))
		got, err := io.ReadAll(caller)
		require.NoError(t, err)
		<-done
		return string(got)
	}
	assert.Equal(t, "hi", exchange("hi"))
	assert.Zero(t, made.Load(), "a short exchange took a splice pipe")
	big := strings.Repeat("x", 4*chunkSize)
	assert.Equal(t, big, exchange(big))
	assert.Positive(t, made.Load(), "bulk was not spliced")
}

// A freeze while a direction waits to write the small buffer on keeps its
// unwritten bytes: the stream arrives whole, in order, from what reached
// the caller, what the pair saved and what the guest's socket still holds.
func TestAFreezeKeepsTheSmallBuffersUnsentBytes(t *testing.T) {
	made := withPipeCount(t)
	// The smallest buffers on the way to the caller, who does not read
	// yet (its receive buffer set before connect, so the window is small
	// from the start): the proxy's send stalls after a few KiB, in the
	// middle of the one message the guest sends (less than the small
	// buffer, so the direction stays on it).
	ln, err := net.ListenTCP("tcp4", &net.TCPAddr{IP: net.IPv4(127, 0, 0, 1)})
	require.NoError(t, err)
	d := net.Dialer{Control: func(_, _ string, rc syscall.RawConn) error {
		return rc.Control(func(fd uintptr) { _ = unix.SetsockoptInt(int(fd), unix.SOL_SOCKET, unix.SO_RCVBUF, 1024) })
	}}
	cc, err := d.Dial("tcp4", ln.Addr().String())
	require.NoError(t, err)
	caller := cc.(*net.TCPConn)
	defer caller.Close()
	client, err := ln.AcceptTCP()
	ln.Close()
	require.NoError(t, err)
	require.NoError(t, client.SetWriteBuffer(1024))
	guest, guestSide := tcpPair(t)
	defer guestSide.Close()
	var stream []byte
	for i := 0; len(stream) < chunkSize-1000; i++ {
		stream = fmt.Appendf(stream, "%08d", i)
	}
	wrote := make(chan struct{})
	go func() {
		defer close(wrote)
		_, _ = guestSide.Write(stream)
	}()
	p := &pair{client: client, guest: guest}
	var out atomic.Int64
	frozen := make(chan bool)
	go func() { frozen <- (&Manager{}).runPair(p, func(int64) {}, func(n int64) { out.Add(n) }) }()
	// The proxy read the whole message (nothing left queued on its guest
	// socket) and could not send all of it on (its caller socket's send
	// queue stays full).
	<-wrote
	queued := func(c *net.TCPConn, req uint) (n int) {
		require.NoError(t, control(c, func(fd int) (err error) { n, err = unix.IoctlGetInt(fd, req); return err }))
		return n
	}
	require.Eventually(t, func() bool {
		return queued(guest, unix.SIOCINQ) == 0 && queued(client, unix.SIOCOUTQ) > 0
	}, 10*time.Second, 10*time.Millisecond)
	time.Sleep(50 * time.Millisecond)
	p.freeze()
	require.True(t, <-frozen)
	guestSide.Close()
	assert.NotEmpty(t, p.pending[1], "the small buffer's unsent bytes were kept (%d of %d counted)", out.Load(), len(stream))
	assert.Zero(t, made.Load(), "the direction was to stay on the small buffer")

	// What was counted reaches the caller (from the socket's send queue).
	_ = caller.SetReadDeadline(time.Now().Add(5 * time.Second))
	got := make([]byte, out.Load())
	_, err = io.ReadFull(caller, got)
	require.NoError(t, err)
	_ = caller.SetReadDeadline(time.Now().Add(50 * time.Millisecond))
	n, _ := caller.Read(make([]byte, 1))
	assert.Zero(t, n, "more reached the caller than was counted")
	got = append(got, p.pending[1]...)
	_ = guest.SetReadDeadline(time.Time{})
	rest, err := io.ReadAll(guest)
	require.NoError(t, err)
	got = append(got, rest...)
	require.Equal(t, len(stream), len(got), "nothing lost or doubled")
	assert.True(t, string(stream) == string(got), "the stream in order")
	assert.Greater(t, len(got), len(p.pending[1]))
}

// Many small messages back and forth on one connection, each waiting for
// the other side's answer: every one is carried at once through the small
// buffer (a lost wake-up would stall this until the deadline).
func TestManySmallExchangesOnOneConnection(t *testing.T) {
	m, _ := newManager(t)
	st := only(t, m, tcpSpec("web", echoServer(t, "")))
	c := dial(t, st.BoundAddr)
	defer c.Close()
	require.NoError(t, c.SetDeadline(time.Now().Add(20*time.Second)))
	buf := make([]byte, 64)
	for i := range 2000 {
		msg := fmt.Sprintf("m%d", i)
		_, err := c.Write([]byte(msg))
		require.NoError(t, err)
		_, err = io.ReadFull(c, buf[:len(msg)])
		require.NoError(t, err, "exchange %d", i)
		require.Equal(t, msg, string(buf[:len(msg)]))
	}
	require.NoError(t, c.CloseWrite())
	n, err := c.Read(buf)
	assert.Zero(t, n)
	assert.ErrorIs(t, err, io.EOF)
}
