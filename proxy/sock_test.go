package proxy

import (
	"net"
	"net/netip"
	"testing"
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
