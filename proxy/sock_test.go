package proxy

import (
	"net"
	"net/netip"
	"testing"
	"time"
	"unsafe"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	"golang.org/x/sys/unix"
)

// The socket addresses the raw dial and accept use read back as they were
// written, port in network order; a v4-mapped address is dialled as IPv4,
// and a link-local one keeps its link (the zone) as the scope id.
func TestSockaddrRoundTrip(t *testing.T) {
	for _, s := range []string{"10.1.2.3:8080", "[fd00::7]:443", "[::1]:1"} {
		var sa sockaddr
		ap := netip.MustParseAddrPort(s)
		sa.set(ap)
		assert.Equal(t, ap, sa.addrPort(), s)
	}
	var sa sockaddr
	sa.set(netip.MustParseAddrPort("[::ffff:10.0.0.1]:80"))
	assert.EqualValues(t, unix.AF_INET, sa.raw.Addr.Family)
	assert.Equal(t, netip.MustParseAddrPort("10.0.0.1:80"), sa.addrPort())
	assert.EqualValues(t, unix.SizeofSockaddrInet4, sa.len)

	lo, err := net.InterfaceByName("lo")
	require.NoError(t, err)
	sa.set(netip.MustParseAddrPort("[fe80::1%lo]:22"))
	assert.EqualValues(t, lo.Index, (*unix.RawSockaddrInet6)(unsafe.Pointer(&sa.raw)).Scope_id)
	sa.set(netip.MustParseAddrPort("[fe80::1%7]:22"))
	assert.EqualValues(t, 7, (*unix.RawSockaddrInet6)(unsafe.Pointer(&sa.raw)).Scope_id)
}

// A rawListener takes a TCP listener's socket over (the TCPListener is
// closed, the port stays bound), accepts callers with their addresses,
// hands out working duplicates, and Close ends a wait in accept.
func TestRawListenerTakesTheSocketOver(t *testing.T) {
	for _, network := range []string{"tcp4", "tcp6"} {
		t.Run(network, func(t *testing.T) {
			host := "127.0.0.1:0"
			if network == "tcp6" {
				host = "[::1]:0"
			}
			tl, err := net.Listen(network, host)
			require.NoError(t, err)
			l, err := newRawListener(tl.(*net.TCPListener))
			require.NoError(t, err)
			defer l.Close()
			_, err = tl.Accept()
			require.ErrorIs(t, err, net.ErrClosed, "the TCPListener was closed")
			addr := l.Addr().String()
			assert.Equal(t, tl.Addr().String(), addr)

			c, err := net.Dial(network, addr)
			require.NoError(t, err)
			defer c.Close()
			f, remote, err := l.accept()
			require.NoError(t, err)
			defer f.Close()
			assert.Equal(t, c.LocalAddr().(*net.TCPAddr).AddrPort(), remote)
			assert.Equal(t, l.addr.AddrPort(), sockLocalAddr(f))

			// Accept (net.Listener) on a duplicate handed out for a hand-over.
			df, err := l.File()
			require.NoError(t, err)
			dl, err := net.FileListener(df)
			df.Close()
			require.NoError(t, err)
			defer dl.Close()
			c2, err := net.Dial(network, addr)
			require.NoError(t, err)
			defer c2.Close()
			a2, err := l.Accept()
			require.NoError(t, err)
			defer a2.Close()
			assert.Equal(t, c2.LocalAddr().String(), a2.RemoteAddr().String())

			done := make(chan error, 1)
			go func() { _, _, err := l.accept(); done <- err }()
			time.Sleep(20 * time.Millisecond)
			require.NoError(t, l.Close())
			select {
			case err := <-done:
				assert.Error(t, err)
			case <-time.After(5 * time.Second):
				t.Fatal("Close did not end a wait in accept")
			}
		})
	}
}
