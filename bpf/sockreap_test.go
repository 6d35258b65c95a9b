package bpf

import (
	"net"
	"syscall"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

func requireReaper(t *testing.T, lb *SockLB) {
	t.Helper()
	if lb.StaleReason() != "" {
		t.Skipf("this kernel cannot close sockets from BPF (bpf_sock_destroy, Linux 6.5): %s", lb.StaleReason())
	}
}

// A host-local caller's connected UDP socket follows its exposure: when the
// exposure moves to another guest or goes, CloseStale closes it (it is
// disconnected: a send without an address fails with EDESTADDRREQ, the next
// receive with ECONNABORTED; its place is given back), so it cannot go
// on sending to the old guest (cilium/cilium#12859). A socket whose
// exposure still sends it to the same guest, and a socket the socket path
// never translated, are left alone. (Fails with the stale() test in
// sockreap.c's UDP iterator made always true: the unchanged socket is
// closed too; and with CloseStale's iterator run removed: nothing closes.)
func TestAConnectedUDPSocketOfAMovedOrRemovedExposureIsClosed(t *testing.T) {
	tp := newSockTopo(t, ProtoUDP, 0)
	lb := tp.load(t)
	defer lb.Close()
	requireReaper(t, lb)
	g1 := SockTarget{Guest: guest("10.213.0.11:7000"), Slot: tp.slot.Index()}
	require.NoError(t, lb.SetTarget(anyHost, ProtoUDP, 8080, g1))

	udp := func(addr string) *net.UDPConn {
		c, err := dial(t, tp.host, "udp4", addr)
		require.NoError(t, err)
		t.Cleanup(func() { c.Close() })
		roundTrip(t, c, []byte("ping"))
		return c.(*net.UDPConn)
	}
	a := udp("127.0.0.1:8080")
	direct := udp("10.213.0.11:7000") // to the guest itself: not the socket path's
	require.EqualValues(t, 1, tp.slot.Read().Active)

	// The same guest again (a cap change, say): nothing to close.
	require.NoError(t, lb.SetTarget(anyHost, ProtoUDP, 8080, g1))
	n, err := lb.CloseStale()
	require.NoError(t, err)
	assert.Zero(t, n, "a socket whose exposure still sends it there is left alone")
	roundTrip(t, a, []byte("same"))

	// Moved to g2: the socket is closed and its place given back.
	require.NoError(t, lb.SetTarget(anyHost, ProtoUDP, 8080, SockTarget{Guest: guest("10.213.0.12:7000"), Slot: tp.slot.Index()}))
	n, err = lb.CloseStale()
	require.NoError(t, err)
	assert.Equal(t, 1, n)
	require.NoError(t, a.SetDeadline(time.Now().Add(time.Second)))
	_, err = a.Read(make([]byte, 10))
	require.ErrorIs(t, err, syscall.ECONNABORTED, "the moved exposure's socket is told at its next call")
	assert.EqualValues(t, 0, tp.slot.Read().Active, "its place given back")
	roundTrip(t, direct, []byte("mine")) // untouched
	b := udp("127.0.0.1:8080")           // a new caller reaches the new guest
	assert.EqualValues(t, 1, tp.slot.Read().Active)

	// Gone: the same.
	require.NoError(t, lb.DeleteTarget(anyHost, ProtoUDP, 8080))
	n, err = lb.CloseStale()
	require.NoError(t, err)
	assert.Equal(t, 1, n)
	require.NoError(t, b.SetDeadline(time.Now().Add(time.Second)))
	_, err = b.Write([]byte("x"))
	require.ErrorIs(t, err, syscall.EDESTADDRREQ, "disconnected: a send without an address goes nowhere")
	_, err = b.Read(make([]byte, 10))
	require.ErrorIs(t, err, syscall.ECONNABORTED, "and the next receive says why")
	assert.EqualValues(t, 0, tp.slot.Read().Active)
	c := tp.slot.Read()
	assert.EqualValues(t, 2, c.Accepted)
	assert.EqualValues(t, 4+4+4, c.BytesIn, "every datagram counted once")
}

// A host-local caller's TCP connection through a moved or removed exposure
// is reset, as the nat path's conntrack flush ends a nat caller's: its
// place is given back and its bytes counted; one whose exposure still
// sends it to the same guest goes on. (Fails with the TCP iterator's
// stale() made always false: the moved exposure's connection goes on.)
func TestATCPConnectionOfAMovedExposureIsReset(t *testing.T) {
	tp := newSockTopo(t, ProtoTCP, 0)
	lb := tp.load(t)
	defer lb.Close()
	requireReaper(t, lb)
	g1 := SockTarget{Guest: guest("10.213.0.11:7000"), Slot: tp.slot.Index()}
	require.NoError(t, lb.SetTarget(anyHost, ProtoTCP, 8080, g1))
	c, err := dial(t, tp.host, "tcp4", "127.0.0.1:8080")
	require.NoError(t, err)
	defer c.Close()
	roundTrip(t, c, []byte("hello"))

	require.NoError(t, lb.SetTarget(anyHost, ProtoTCP, 8080, g1))
	n, err := lb.CloseStale()
	require.NoError(t, err)
	assert.Zero(t, n)
	roundTrip(t, c, []byte("still"))

	require.NoError(t, lb.SetTarget(anyHost, ProtoTCP, 8080, SockTarget{Guest: guest("10.213.0.12:7000"), Slot: tp.slot.Index()}))
	n, err = lb.CloseStale()
	require.NoError(t, err)
	assert.Equal(t, 1, n)
	require.NoError(t, c.SetDeadline(time.Now().Add(time.Second)))
	_, err = c.Read(make([]byte, 10))
	require.ErrorIs(t, err, syscall.ECONNABORTED, "the connection to the old guest is ended")
	eventually(t, "its place given back and its bytes counted", func() bool {
		s := tp.slot.Read()
		return s.Active == 0 && s.BytesIn == 10 && s.BytesOut == 10
	})
}
