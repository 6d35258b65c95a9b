package config

import (
	"fmt"
	"net/netip"
)

// compileCIDR6 checks network.cidr6: "" turns IPv6 off (the zero Prefix);
// anything else is the bridge's own IPv6 address on the guests' /64. It
// returns the prefix, or the field's error.
func compileCIDR6(v string) (netip.Prefix, *FieldError) {
	const path = "network.cidr6"
	bad := func(format string, a ...any) (netip.Prefix, *FieldError) {
		return netip.Prefix{}, &FieldError{Path: path, Msg: fmt.Sprintf(format, a...)}
	}
	if v == "" {
		return netip.Prefix{}, nil
	}
	p, err := netip.ParsePrefix(v)
	if err != nil {
		return bad(`%q is not an IPv6 address with a prefix (like %s), or "" for IPv4 only`, v, DefaultCIDR6)
	}
	a := p.Addr()
	host := a.As16()
	switch {
	case !a.Is6() || a.Is4In6():
		return bad("%q is not an IPv6 address", v)
	case p.Bits() != 64:
		// SLAAC forms a guest's address from a /64 and its MAC.
		return bad("%q: the prefix must be /64 (guests form their addresses from it)", v)
	case a.IsLinkLocalUnicast():
		return bad("%s is link-local; give a unique-local or global address (like %s)", p, DefaultCIDR6)
	case a.IsMulticast() || a.IsLoopback() || a.IsUnspecified():
		return bad("%s is not a unicast address", p)
	case a == p.Masked().Addr():
		return bad("%q is the subnet-router anycast address; give the bridge's own address (like %s)", v, DefaultCIDR6)
	case host[11] == 0xff && host[12] == 0xfe:
		// Every guest's address has ff:fe there (its MAC, EUI-64).
		return bad("%s has the form of a guest's address (ff:fe in the middle of its host part); pick another, like ::1", p)
	}
	return p, nil
}
