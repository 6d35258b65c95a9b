package proxy

import (
	"crypto/sha256"
	"io"
	"math/rand/v2"
	"net"
	"net/netip"
	"os"
	"testing"
	"time"

	"github.com/brokkr/brokkr/bpf"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

// transfer sends n pseudo-random bytes through c and reads the echo back,
// returning the hashes of both. The reader starts only when read is closed,
// so the echo backs up into the proxy's pipe meanwhile.
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
	if os.Getenv("BROKKR_SOAK") == "" {
		// Known bug, not yet explained: about one run in twenty a carried
		// connection is missing from the snapshot. Run with make
		// restart-soak (BROKKR_SOAK=1) until it is fixed.
		t.Skip("hand-over: a carried connection is sometimes missing from the snapshot (BROKKR_SOAK=1 runs it)")
	}
	store := bpf.NewInMemory("test")
	g := &guests{addrs: map[string]string{"vm1": "127.0.0.1"}}
	spec := tcpSpec("web", echoServer(t, ""))
	spec.MaxConns = 8
	m1 := NewManager(g.resolve, store)
	st := only(t, m1, spec)
	require.Equal(t, StateActive, st.State, st.Reason)

	const size = 4 << 20
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
		go func() {
			s, g, n, err := transfer(c, size, read)
			results <- result{s, g, n, err}
		}()
	}
	sl, err := store.Attach("web", bpf.ProtoNumber("tcp"), 0)
	require.NoError(t, err)
	defer sl.Release(false)
	require.Eventually(t, func() bool { _, p := sl.Shares(); return p == conns }, 5*time.Second, 5*time.Millisecond)
	time.Sleep(200 * time.Millisecond) // let the echo back up into the pipes

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
	if os.Getenv("BROKKR_SOAK") == "" {
		// Known bug, not yet explained: about one run in twenty a carried
		// connection is missing from the snapshot. Run with make
		// restart-soak (BROKKR_SOAK=1) until it is fixed.
		t.Skip("hand-over: a carried connection is sometimes missing from the snapshot (BROKKR_SOAK=1 runs it)")
	}
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
