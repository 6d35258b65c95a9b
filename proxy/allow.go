package proxy

import (
	"net"
	"net/netip"
	"slices"
)

// allowList is an exposure's allowFrom as the accept path checks it: the
// prefixes by length, so a check is one map lookup per distinct length
// (a handful in practice), not a scan of every prefix.
type allowList struct {
	src  []netip.Prefix // as given, to tell a change
	lens []int          // distinct lengths, IPv4 ones as 0..32 and IPv6 as 1000+0..128
	set  map[netip.Prefix]struct{}
}

// newAllowList is nil (everyone) for an empty list.
func newAllowList(ps []netip.Prefix) *allowList {
	if len(ps) == 0 {
		return nil
	}
	a := &allowList{src: slices.Clone(ps), set: make(map[netip.Prefix]struct{}, len(ps))}
	seen := map[int]bool{}
	for _, p := range ps {
		p = p.Masked()
		a.set[p] = struct{}{}
		l := p.Bits()
		if p.Addr().Is6() {
			l += 1000
		}
		if !seen[l] {
			seen[l] = true
			a.lens = append(a.lens, l)
		}
	}
	slices.Sort(a.lens)
	return a
}

// same reports whether the list is ps.
func (a *allowList) same(ps []netip.Prefix) bool {
	if a == nil {
		return len(ps) == 0
	}
	return slices.Equal(a.src, ps)
}

// allows reports whether a caller from src may connect.
func (a *allowList) allows(src netip.Addr) bool {
	if a == nil {
		return true
	}
	src = src.Unmap().WithZone("")
	six := src.Is6()
	for _, l := range a.lens {
		if (l >= 1000) != six {
			continue
		}
		if six {
			l -= 1000
		}
		p, err := src.Prefix(l)
		if err != nil {
			continue
		}
		if _, ok := a.set[p]; ok {
			return true
		}
	}
	return false
}

// hostLocal reports whether a caller is the host's own process: from
// loopback, or from the very address it dialled. allowFrom does not
// restrict those (README, "allowFrom"): they reach the guest over the
// bridge anyway.
func hostLocal(remote, local netip.Addr) bool {
	remote, local = remote.Unmap(), local.Unmap()
	return remote.IsLoopback() || remote == local
}

// addrOf is the IP of a net.Addr of a TCP or UDP socket.
func addrOf(a net.Addr) netip.Addr {
	switch a := a.(type) {
	case *net.TCPAddr:
		ip, _ := netip.AddrFromSlice(a.IP)
		return ip
	case *net.UDPAddr:
		ip, _ := netip.AddrFromSlice(a.IP)
		return ip
	}
	return netip.Addr{}
}
