package ipam

import (
	"net"
	"net/netip"
	"testing"

	"github.com/stretchr/testify/assert"
)

// The kernel's own EUI-64 addresses, as `ip -6 addr` shows them for these
// MACs on a /64 (RFC 4291 appendix A): ff:fe in the middle, the U/L bit
// flipped.
func TestSLAACIsTheModifiedEUI64Address(t *testing.T) {
	p := netip.MustParsePrefix("fd00:6272:6b72::1/64")
	for mac, want := range map[string]string{
		"52:54:00:8c:7d:82": "fd00:6272:6b72:0:5054:ff:fe8c:7d82",
		"02:00:00:00:00:01": "fd00:6272:6b72::ff:fe00:1",
		"00:16:3e:aa:bb:cc": "fd00:6272:6b72:0:216:3eff:feaa:bbcc",
	} {
		m, _ := net.ParseMAC(mac)
		assert.Equal(t, netip.MustParseAddr(want), SLAAC(p, m), mac)
	}
	m, _ := net.ParseMAC("52:54:00:8c:7d:82")
	assert.False(t, SLAAC(netip.MustParsePrefix("fd00::1/48"), m).IsValid(), "SLAAC needs a /64")
	assert.False(t, SLAAC(netip.MustParsePrefix("10.0.0.1/24"), m).IsValid())
	assert.False(t, SLAAC(netip.Prefix{}, m).IsValid(), "IPv6 off")
	assert.False(t, SLAAC(p, net.HardwareAddr{1, 2, 3}).IsValid())
}
