package e2e

import (
	"bytes"
	"net"
	"net/netip"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	"golang.org/x/sys/unix"

	"github.com/brokkr/brokkr/internal/kernelfeat"
)

// eui64 is the address a NIC with mac forms in prefix by SLAAC (RFC 4291
// appendix A), computed here on its own so the test checks brokkr's.
func eui64(prefix string, mac net.HardwareAddr) netip.Addr {
	a := netip.MustParsePrefix(prefix).Masked().Addr().As16()
	copy(a[8:], []byte{mac[0] ^ 2, mac[1], mac[2], 0xff, 0xfe, mac[3], mac[4], mac[5]})
	return netip.AddrFrom16(a)
}

// neighbourAdvert waits for the guest's answer to brokkr's neighbour
// solicitations, read off its tap (before the bridge): an ICMPv6 neighbour
// advertisement from mac for target. It proves the guest holds target.
func (e *env) neighbourAdvert(tap string, mac net.HardwareAddr, target netip.Addr, timeout time.Duration) bool {
	e.t.Helper()
	var fd int
	require.NoError(e.t, e.host.Do(func() error {
		ifi, err := net.InterfaceByName(tap)
		if err != nil {
			return err
		}
		// ETH_P_ALL (in network order): the bridge takes a port's frames
		// before any socket bound to one protocol would see them.
		const p = 0x0300
		if fd, err = unix.Socket(unix.AF_PACKET, unix.SOCK_RAW|unix.SOCK_CLOEXEC, int(p)); err != nil {
			return err
		}
		return unix.Bind(fd, &unix.SockaddrLinklayer{Protocol: p, Ifindex: ifi.Index})
	}))
	defer unix.Close(fd)
	tv := unix.Timeval{Usec: 200_000}
	require.NoError(e.t, unix.SetsockoptTimeval(fd, unix.SOL_SOCKET, unix.SO_RCVTIMEO, &tv))
	want := target.As16()
	buf := make([]byte, 2048)
	for deadline := time.Now().Add(timeout); time.Now().Before(deadline); {
		n, _, err := unix.Recvfrom(fd, buf, 0)
		if err != nil || n < 14+40+24 {
			continue
		}
		f := buf[:n]
		// Ethernet source, IPv6, next header ICMPv6, type 136, its target.
		if bytes.Equal(f[6:12], mac) && f[12] == 0x86 && f[13] == 0xdd && f[14+6] == 58 && f[14+40] == 136 && bytes.Equal(f[14+40+8:14+40+24], want[:]) {
			return true
		}
	}
	return false
}

// The real guest (Debian's kernel, the test guest's init unchanged) takes
// its IPv6 address from brokkr's router advertisements: status shows it as
// address6, the EUI-64 address of its MAC in the default ULA, and the guest
// answers neighbour discovery for exactly that address on its tap.
func TestTheGuestTakesItsIPv6AddressBySLAAC(t *testing.T) {
	e := sharedEnv(t)
	v := vm(e.status(), vmName)
	mac, err := net.ParseMAC(v.MAC)
	require.NoError(t, err)
	want := eui64("fd00:6272:6b72::/64", mac)
	assert.Equal(t, want.String(), v.Address6, "status shows the address the guest forms")
	out, _, code := e.brokkr("status")
	require.Equal(t, 0, code)
	assert.Contains(t, out, want.String(), "the status table too")
	assert.True(t, e.neighbourAdvert(v.Tap, mac, want, 90*time.Second),
		"the guest answers for %s from %s on %s", want, mac, v.Tap)
	assert.Contains(t, e.host.MustRun(t, "ip", "-6", "addr", "show", "dev", "brk-e2e0"), "fd00:6272:6b72::1/64 scope global")

	// Over the bridge the guest talks IPv6 from its own address: the host
	// (its router) reaches its HTTP service at that address (anti-spoof
	// lets its answers and its neighbour discovery pass).
	var body string
	require.Eventually(t, func() bool {
		body, err = httpGet(e.host, "["+want.String()+"]:8080")
		return err == nil && strings.Contains(body, "brokkr-guest")
	}, 30*time.Second, 500*time.Millisecond, "the guest's HTTP over IPv6 from the host: %v %q", err, body)
}

// An outside caller over IPv6 reaches the real guest through an exposure
// with no hostAddress (every address of both families): DNATed by the nat
// path to the guest's SLAAC address, the guest answering through the host
// it was advertised as its default router, and the caller's own address
// kept (the reply goes back to it, not to a masquerading host), counted in
// the exposure's one slot.
func TestAnIPv6CallerReachesTheGuestThroughAnExposureWithNoHostAddress(t *testing.T) {
	// Where the nat path's programs cannot load, the fallback publishes
	// IPv4 only (TestTheFallbackPublishesIPv4OnlyAndSaysSo).
	kernelfeat.Require(t, kernelfeat.NatPath...)
	e := sharedEnv(t)
	before, _ := exposure(e.status(), "web-nat")
	v := vm(e.status(), vmName)
	// The guest answers callers from beyond its /64 once the host's
	// advertisements named it the default router: until then a caller's
	// SYN would be admitted and never answered, holding a place of the cap
	// until conntrack forgets it (two minutes). Wait for that route with a
	// call routed through the host to the guest's own address (no
	// exposure, no cap).
	_, _ = e.client.Run("ip", "-6", "route", "add", "fd00:6272:6b72::/64", "via", hostIP6)
	require.Eventually(t, func() bool {
		c, err := dial(e.client, "["+v.Address6+"]:8080", time.Second)
		if err == nil {
			c.Close()
		}
		return err == nil
	}, 90*time.Second, 500*time.Millisecond, "the guest answers beyond its /64 (its default route is the host)")
	var body string
	var err error
	require.Eventually(t, func() bool {
		body, err = httpGet(e.client, "["+hostIP6+"]:8080")
		return err == nil && strings.Contains(body, "brokkr-guest")
	}, 30*time.Second, 500*time.Millisecond, "the guest's HTTP through [%s]:8080: %v %q", hostIP6, err, body)
	ct := e.host.MustRun(t, "conntrack", "-L", "-f", "ipv6", "-p", "tcp", "--orig-port-dst", "8080")
	assert.Contains(t, ct, "src="+clientIP6+" dst="+hostIP6, "the caller dialled the host's IPv6 address")
	assert.Contains(t, ct, "src="+v.Address6+" dst="+clientIP6+" sport=8080",
		"DNATed to the guest's IPv6 address, which answered the caller's own address")
	require.Eventually(t, func() bool {
		after, _ := exposure(e.status(), "web-nat")
		return after.Accepted > before.Accepted
	}, 10*time.Second, 200*time.Millisecond, "an IPv6 caller counts in the exposure's slot")
	for _, w := range e.status().Warnings {
		assert.NotContains(t, w, "IPv6 callers are not published", "the nat path carries IPv6")
	}
}

// Where the nat path's programs cannot load (Debian 12's 6.1) the
// fallback's nft sets are keyed by IPv4 connections: an exposure of both
// families is published for IPv4 callers only, and status says why.
func TestTheFallbackPublishesIPv4OnlyAndSaysSo(t *testing.T) {
	if kernelfeat.Running().Missing(kernelfeat.NatPath...) == nil {
		t.Skip("the nat path's programs load here: IPv6 callers are published")
	}
	e := sharedEnv(t)
	st := e.status()
	found := false
	for _, w := range st.Warnings {
		found = found || strings.Contains(w, "IPv6 callers are not published")
	}
	assert.True(t, found, "status says IPv6 callers are not published: %v", st.Warnings)
	x, _ := exposure(st, "web-nat")
	assert.Equal(t, "active", x.State, "an exposure of both families serves IPv4: %s", x.Reason)
}
