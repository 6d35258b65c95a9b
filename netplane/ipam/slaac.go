package ipam

import (
	"net"
	"net/netip"
)

// SLAAC is the IPv6 address a guest with mac forms in the /64 prefix by
// stateless autoconfiguration (RFC 4862) with the modified EUI-64 interface
// identifier (RFC 4291 appendix A: the MAC with ff:fe in its middle and the
// universal/local bit flipped), the kernel's default (addr_gen_mode 0). It
// needs no lease: the guest's MAC is persisted, so the address is as stable
// as the MAC. The zero Addr for a prefix that is not an IPv6 /64 or a MAC
// that is not 6 bytes.
func SLAAC(prefix netip.Prefix, mac net.HardwareAddr) netip.Addr {
	if !prefix.Addr().Is6() || prefix.Addr().Is4In6() || prefix.Bits() != 64 || len(mac) != 6 {
		return netip.Addr{}
	}
	a := prefix.Masked().Addr().As16()
	a[8], a[9], a[10] = mac[0]^0x02, mac[1], mac[2]
	a[11], a[12] = 0xff, 0xfe
	a[13], a[14], a[15] = mac[3], mac[4], mac[5]
	return netip.AddrFrom16(a)
}
