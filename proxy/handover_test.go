package proxy

import (
	"crypto/sha256"
	"fmt"
	"io"
	"math/rand/v2"
	"net"
	"net/netip"
	"os"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/brokkr/brokkr/bpf"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

// transfer sends n pseudo-random bytes through c and reads the echo back,
// returning the hashes of both. The reader starts only when read is closed,
// so the echo backs up into the proxy's pipe meanwhile; the write side is
// closed only then too. Why: with the whole stream sent and half-closed,
// the socket buffers and the 1 MiB pipes can absorb all of it, both
// directions reach EOF and the connection ends before a freeze, and a
// test that counts frozen pairs finds one missing.
func transfer(c net.Conn, n int, read <-chan struct{}) (sent, got [32]byte, gotN int64, err error) {
	errc := make(chan error, 1)
	go func() {
		h := sha256.New()
		r := rand.New(rand.NewPCG(1, 2))
		buf := make([]byte, 64<<10)
		for left := n; left > 0; left -= len(buf) {
			b := buf[:min(len(buf), left)]
			for i := range b {
				b[i] = byte(r.Uint32())
			}
			h.Write(b)
			if _, err := c.Write(b); err != nil {
				errc <- err
				return
			}
		}
		copy(sent[:], h.Sum(nil))
		<-read
		errc <- c.(*net.TCPConn).CloseWrite()
	}()
	<-read
	h := sha256.New()
	gotN, err = io.Copy(h, c)
	copy(got[:], h.Sum(nil))
	if werr := <-errc; err == nil {
		err = werr
	}
	return sent, got, gotN, err
}

// A frozen Manager's listener and connections, bytes still sitting in its
// pipes included, carry on in a second Manager: the transfers arrive whole,
// a caller that connects during the hand-over is served, and the counters
// and the cap's proxy share are exact (nothing subtracted or added twice).
func TestFreezeHandsListenersAndConnectionsToAnotherManager(t *testing.T) {
	store := bpf.NewInMemory("test")
	g := &guests{addrs: map[string]string{"vm1": "127.0.0.1"}}
	spec := tcpSpec("web", echoServer(t, ""))
	spec.MaxConns = 8
	m1 := NewManager(g.resolve, store)
	st := only(t, m1, spec)
	require.Equal(t, StateActive, st.State, st.Reason)

	// More than the return path's buffers hold (the caller's small receive
	// buffer, the proxy's send buffer, at most 4 MiB): once the echo stalls,
	// each return direction waits in the middle of a pipeful.
	const size = 8 << 20
	const conns = 3
	read := make(chan struct{})
	type result struct {
		sent, got [32]byte
		n         int64
		err       error
	}
	results := make(chan result, conns)
	for i := 0; i < conns; i++ {
		c, err := net.Dial("tcp", st.BoundAddr)
		require.NoError(t, err)
		defer c.Close()
		require.NoError(t, c.(*net.TCPConn).SetReadBuffer(64<<10))
		go func() {
			s, g, n, err := transfer(c, size, read)
			results <- result{s, g, n, err}
		}()
	}
	sl, err := store.Attach("web", bpf.ProtoNumber("tcp"), 0)
	require.NoError(t, err)
	defer sl.Release(false)
	require.Eventually(t, func() bool { _, p := sl.Shares(); return p == conns }, 5*time.Second, 5*time.Millisecond)
	// Frozen once the echo stalls (no byte moved for 100 ms): the callers
	// do not read, so each return direction then waits in the middle of a
	// pipeful. A fixed pause was not enough on a loaded machine.
	var last uint64
	require.Eventually(t, func() bool {
		c := sl.Read()
		moved := c.BytesIn + c.BytesOut
		stalled := c.BytesOut > 0 && moved == last
		last = moved
		return stalled
	}, 20*time.Second, 100*time.Millisecond)

	snap := m1.Freeze()
	require.Len(t, snap.Pairs, conns)
	require.Len(t, snap.Listeners, 1)
	pending := 0
	for _, p := range snap.Pairs {
		pending += len(p.Pending[0]) + len(p.Pending[1])
	}
	assert.Positive(t, pending, "the callers do not read yet, so bytes wait in the pipes")
	_, p := sl.Shares()
	assert.EqualValues(t, conns, p, "frozen connections keep their places")
	m1.StopAll() // the old process exits: its copies close, the sockets live on
	_, p = sl.Shares()
	assert.EqualValues(t, conns, p, "StopAll of a frozen Manager gives back no handed-over place")

	m2 := NewManager(g.resolve, store, WithHold())
	defer m2.StopAll()
	m2.Inherit(snap.Listeners)
	m2.Adopt(snap.Pairs)
	st2 := only(t, m2, spec)
	require.Equal(t, st.BoundAddr, st2.BoundAddr, "the same socket, not a new bind")

	// A caller during the hand-over queues in the backlog.
	late, err := net.DialTimeout("tcp", st.BoundAddr, time.Second)
	require.NoError(t, err, "the listening socket stayed open through the hand-over")
	defer late.Close()
	m2.Resume()
	close(read)
	_, err = late.Write([]byte("late"))
	require.NoError(t, err)
	require.NoError(t, late.(*net.TCPConn).CloseWrite())
	b, err := io.ReadAll(late)
	require.NoError(t, err)
	assert.Equal(t, "late", string(b))

	for i := 0; i < conns; i++ {
		r := <-results
		require.NoError(t, r.err)
		assert.EqualValues(t, size, r.n)
		assert.Equal(t, r.sent, r.got, "the echo arrived intact")
	}
	require.Eventually(t, func() bool { _, p := sl.Shares(); return p == 0 }, 5*time.Second, 5*time.Millisecond)
	c := sl.Read()
	assert.EqualValues(t, conns+1, c.Accepted, "each connection counted accepted once")
	assert.EqualValues(t, conns*size+4, c.BytesIn)
	assert.EqualValues(t, conns*size+4, c.BytesOut)
	assert.Zero(t, c.Active)
}

// A hand-over that fails is undone in place: Thaw rebinds the same socket
// and the frozen connections carry on.
func TestThawResumesAfterAFailedHandOver(t *testing.T) {
	store := bpf.NewInMemory("test")
	g := &guests{addrs: map[string]string{"vm1": "127.0.0.1"}}
	spec := tcpSpec("web", echoServer(t, ""))
	m := NewManager(g.resolve, store)
	defer m.StopAll()
	st := only(t, m, spec)
	c, err := net.Dial("tcp", st.BoundAddr)
	require.NoError(t, err)
	defer c.Close()
	read := make(chan struct{})
	done := make(chan error, 1)
	var sent, got [32]byte
	go func() {
		var err error
		sent, got, _, err = transfer(c, 4<<20, read)
		done <- err
	}()
	// Frozen only once carried: a caller still in the backlog is simply
	// accepted after the thaw.
	sl, err := store.Attach("web", bpf.ProtoNumber("tcp"), 0)
	require.NoError(t, err)
	defer sl.Release(false)
	require.Eventually(t, func() bool { _, p := sl.Shares(); return p == 1 }, 5*time.Second, 5*time.Millisecond)
	snap := m.Freeze()
	require.Len(t, snap.Pairs, 1)
	assert.Nil(t, m.Converge([]Spec{spec}), "a frozen Manager binds nothing")
	m.Thaw(snap)
	st2 := only(t, m, spec)
	require.Equal(t, st.BoundAddr, st2.BoundAddr)
	close(read)
	require.NoError(t, <-done)
	assert.Equal(t, sent, got)
}

// Callers that connect while a freeze runs are each frozen into the snapshot
// (accepted, dialling the guest, or between the two) or still queued in the
// listener's backlog: after the hand-over every one is carried, none is
// reset, and each is counted accepted exactly once.
func TestFreezeWhileCallersArriveLosesNone(t *testing.T) {
	store := bpf.NewInMemory("test")
	g := &guests{addrs: map[string]string{"vm1": "127.0.0.1"}}
	spec := tcpSpec("web", echoServer(t, ""))
	m1 := NewManager(g.resolve, store)
	st := only(t, m1, spec)

	const callers, each = 6, 40
	var mu sync.Mutex
	var conns []net.Conn
	t.Cleanup(func() {
		for _, c := range conns {
			c.Close()
		}
	})
	dialErr := make(chan error, callers)
	var wg sync.WaitGroup
	for range callers {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for range each {
				c, err := net.DialTimeout("tcp", st.BoundAddr, 5*time.Second)
				if err != nil {
					dialErr <- err
					return
				}
				mu.Lock()
				conns = append(conns, c)
				mu.Unlock()
			}
		}()
	}
	// Freeze once some callers are carried and others are still arriving.
	require.Eventually(t, func() bool { mu.Lock(); defer mu.Unlock(); return len(conns) >= 10 }, 5*time.Second, time.Millisecond)
	snap := m1.Freeze()
	wg.Wait()
	close(dialErr)
	for err := range dialErr {
		require.NoError(t, err, "the listening socket stayed open through the freeze")
	}
	m1.StopAll()

	m2 := NewManager(g.resolve, store, WithHold())
	defer m2.StopAll()
	m2.Inherit(snap.Listeners)
	m2.Adopt(snap.Pairs)
	only(t, m2, spec)
	m2.Resume()
	deadline := time.Now().Add(10 * time.Second)
	for i, c := range conns {
		require.NoError(t, c.SetDeadline(deadline))
		msg := fmt.Sprintf("caller %d", i)
		_, err := c.Write([]byte(msg))
		require.NoError(t, err)
		b := make([]byte, len(msg))
		_, err = io.ReadFull(c, b)
		require.NoError(t, err, "caller %d of %d (%d frozen in the snapshot) is carried", i, len(conns), len(snap.Pairs))
		assert.Equal(t, msg, string(b))
	}
	sl, err := store.Attach("web", bpf.ProtoNumber("tcp"), 0)
	require.NoError(t, err)
	defer sl.Release(false)
	c := sl.Read()
	assert.EqualValues(t, len(conns), c.Accepted, "each caller counted accepted once")
	assert.Zero(t, c.Dropped+c.Refused)
	_, p := sl.Shares()
	assert.EqualValues(t, len(conns), p, "each open caller holds one place")
	for _, c := range conns {
		c.Close()
	}
	require.Eventually(t, func() bool { _, p := sl.Shares(); return p == 0 }, 5*time.Second, 5*time.Millisecond)
}

// A UDP exchange carries on across a hand-over: the exposure's socket and
// the client's flow (its socket to the guest, the client's address, the
// idle clock) go to the next Manager. A datagram sent during the freeze
// waits in the socket and is answered after it, through the same guest-side
// socket; the flow is counted once, keeps its place, and still ends when
// idle.
func TestFreezeHandsUDPFlowsToAnotherManager(t *testing.T) {
	store := bpf.NewInMemory("test")
	g := &guests{addrs: map[string]string{"vm1": "127.0.0.1"}}
	spec := udpSpec("dns", udpEcho(t))
	spec.UDPIdle = 2 * time.Second
	m1 := NewManager(g.resolve, store)
	st := only(t, m1, spec)
	require.Equal(t, StateActive, st.State, st.Reason)
	c := udpClient(t, "udp4", "127.0.0.1:0")
	r1, _ := ask(t, c, st.BoundAddr, "one", 5*time.Second)
	guestPort, _, ok := strings.Cut(r1, ":")
	require.True(t, ok, "reply %q", r1)

	snap := m1.Freeze()
	require.Len(t, snap.Listeners, 1)
	require.Len(t, snap.Pairs, 1)
	require.NotNil(t, snap.Pairs[0].Flow)
	to, err := netip.ParseAddrPort(st.BoundAddr)
	require.NoError(t, err)
	_, err = c.WriteToUDPAddrPort([]byte("two"), to)
	require.NoError(t, err)
	m1.StopAll()
	sl, err := store.Attach("dns", bpf.ProtoNumber("udp"), 0)
	require.NoError(t, err)
	defer sl.Release(false)
	_, p := sl.Shares()
	require.EqualValues(t, 1, p, "the frozen flow keeps its place")

	m2 := NewManager(g.resolve, store, WithHold())
	defer m2.StopAll()
	m2.Inherit(snap.Listeners)
	m2.Adopt(snap.Pairs)
	st2 := only(t, m2, spec)
	require.Equal(t, st.BoundAddr, st2.BoundAddr, "the same socket, not a new bind")
	// Held: the new manager answers nothing until Resume (a failed
	// hand-over must not leave two processes serving one socket).
	buf := make([]byte, 512)
	require.NoError(t, c.SetReadDeadline(time.Now().Add(200*time.Millisecond)))
	_, err = c.Read(buf)
	require.ErrorIs(t, err, os.ErrDeadlineExceeded, "answered before Resume")
	m2.Resume()
	require.NoError(t, c.SetReadDeadline(time.Now().Add(5*time.Second)))
	n, err := c.Read(buf)
	require.NoError(t, err, "the datagram sent during the freeze is answered")
	assert.Equal(t, guestPort+":two", string(buf[:n]), "through the flow's own guest socket")
	r3, _ := ask(t, c, st.BoundAddr, "three", 5*time.Second)
	assert.Equal(t, guestPort+":three", r3)

	// A datagram is counted right after it is sent on, so the answer can
	// arrive first.
	in, out := uint64(len("onetwothree")), uint64(len(r1)+len(guestPort)+len(":two")+len(r3))
	require.Eventually(t, func() bool { cs := sl.Read(); return cs.BytesIn == in && cs.BytesOut == out },
		5*time.Second, 5*time.Millisecond, "bytes counted once each way: %+v", sl.Read())
	assert.EqualValues(t, 1, sl.Read().Accepted, "one flow, counted once")
	_, p = sl.Shares()
	assert.EqualValues(t, 1, p)
	require.Eventually(t, func() bool { _, p := sl.Shares(); return p == 0 }, 5*time.Second, 20*time.Millisecond,
		"the adopted flow still ends when idle, giving its place back")
}

// The two loopback listeners of one exposure are two entries of one
// Manager's snapshot, named apart by their address, and the next Manager
// binds each from its own socket.
func TestFreezeHandsOverBothListenersOfOneName(t *testing.T) {
	probe, err := net.Listen("tcp6", "[::1]:0")
	if err != nil {
		t.Skipf("no IPv6 loopback here: %v", err)
	}
	probe.Close()
	store := bpf.NewInMemory("test")
	defer store.Close()
	g := &guests{addrs: map[string]string{"vm1": "127.0.0.1"}}
	v4 := tcpSpec("web", echoServer(t, "g:"))
	v6 := v4
	v6.Listen = netip.IPv6Loopback()
	m1 := NewManager(g.resolve, store)
	before := m1.Converge([]Spec{v4, v6})
	for _, s := range before {
		require.Equal(t, StateActive, s.State, s.Reason)
	}
	snap := m1.Freeze()
	m1.StopAll()
	require.Len(t, snap.Listeners, 2, "one listener per (name, address)")

	m2 := NewManager(g.resolve, store)
	defer m2.StopAll()
	m2.Inherit(snap.Listeners)
	after := m2.Converge([]Spec{v4, v6})
	assert.Empty(t, m2.DropUnclaimed(), "each inherited listener was claimed by its own address")
	for i, s := range after {
		require.Equal(t, StateActive, s.State, s.Reason)
		assert.Equal(t, before[i].BoundAddr, s.BoundAddr, "bound from the handed-over socket")
		assert.Equal(t, "g:hi", roundTrip(t, dial(t, s.BoundAddr), "g:", "hi"))
	}
}
