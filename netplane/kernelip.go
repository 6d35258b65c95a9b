package netplane

import (
	"fmt"
	"net"
	"net/netip"
)

// KernelIPParam is the kernel command-line parameter that gives a guest
// booted without DHCP its assigned address (Documentation/admin-guide/
// nfs/nfsroot.rst, "ip="): client, no server, the bridge as gateway, the
// subnet mask, the VM name as hostname, any device, no autoconfiguration.
// The plane then sees the guest in the bridge's neighbour table.
func KernelIPParam(n Network, vm string, addr netip.Addr) string {
	mask := net.IP(net.CIDRMask(n.CIDR.Bits(), 32)).String()
	return fmt.Sprintf("ip=%s::%s:%s:%s::off", addr, n.CIDR.Addr(), mask, vm)
}
