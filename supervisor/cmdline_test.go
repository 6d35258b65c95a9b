package supervisor

import (
	"net/netip"
	"testing"

	"github.com/stretchr/testify/assert"

	"github.com/brokkr/brokkr/internal/spec"
)

// Without DHCP the guest's addresses go on its command line: the kernel's
// ip= for IPv4 and brokkr.ip6= for IPv6 (Linux has no kernel form of it).
func TestKernelIPParamCarriesBothAddresses(t *testing.T) {
	ip := &spec.StaticIP{Addr: netip.MustParsePrefix("10.213.0.10/24"), Gateway: netip.MustParseAddr("10.213.0.1")}
	assert.Equal(t, "ip=10.213.0.10::10.213.0.1:255.255.255.0:web:eth0:off", KernelIPParam(ip, "web"))
	ip.Addr6 = netip.MustParsePrefix("fd00:6272:6b72:0:5054:ff:fe00:1/64")
	assert.Equal(t, "ip=10.213.0.10::10.213.0.1:255.255.255.0:web:eth0:off brokkr.ip6=fd00:6272:6b72:0:5054:ff:fe00:1/64", KernelIPParam(ip, "web"))
	assert.Equal(t, "", KernelIPParam(nil, "web"))
}

// A changed IPv6 address alone restarts no VM (it reaches the command line
// at the next boot); a changed IPv4 address does, as before.
func TestOnlyTheIPv4AddressMakesAnotherMachine(t *testing.T) {
	v4 := spec.StaticIP{Addr: netip.MustParsePrefix("10.213.0.10/24"), Gateway: netip.MustParseAddr("10.213.0.1")}
	a := &VMSpec{Name: "web", IP: &v4}
	with6 := v4
	with6.Addr6 = netip.MustParsePrefix("fd00:6272:6b72:0:5054:ff:fe00:1/64")
	b := &VMSpec{Name: "web", IP: &with6}
	assert.False(t, specEqual(a, b), "the desired spec takes the new address")
	assert.True(t, sameMachine(a, b), "but the running VM is the same machine")
	other := v4
	other.Addr = netip.MustParsePrefix("10.213.0.11/24")
	assert.False(t, sameMachine(a, &VMSpec{Name: "web", IP: &other}))
	assert.Equal(t, with6, *b.IP, "the caller's spec is not changed")
}
