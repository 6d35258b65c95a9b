package config

import (
	"fmt"
	"net/netip"

	"github.com/brokkr/brokkr/internal/spec"
)

// exposureIndex is what one exposure is checked against: the network and
// the VMs of the desired state, and the names and host binds of the other
// exposures. Compile fills it one exposure at a time, in file order, so a
// clash names the earlier exposure.
type exposureIndex struct {
	cidr     netip.Prefix // the valid network.cidr, or the zero Prefix
	cidrText string       // network.cidr as written, for messages
	cidr6    netip.Prefix // the valid network.cidr6; the zero Prefix: IPv4 only
	vms      map[string]int
	names    map[string]int // name → position in the exposures list
	// binds are the host sides of single ports claimed, by (protocol,
	// port): an overlap is only possible within one such list, so a check
	// stays linear in the exposures on the same port, not in all of them.
	binds map[portKey][]hostBind
	// ranges are the host sides of port ranges, under every block of
	// rangeBlock ports they touch (a range of spec.MaxPortRange ports is in
	// a few): a check looks at the ranges of its own blocks only. A single
	// port is checked against the ranges of its block, a range against the
	// single ports of each of its ports.
	ranges map[portKey][]hostBind
	// allowTotal counts the allowFrom prefixes of the exposures so far.
	allowTotal int
	// sockPorts counts the host ports the socket path translates for the
	// exposures inserted (sockPortsOf).
	sockPorts int
}

type portKey struct {
	proto string
	port  int // a port, or in ranges a block (port / rangeBlock)
}

// rangeBlock is the width of the blocks the ranges are indexed by.
const rangeBlock = 1024

// hostBind is one claimed host address of an exposure, on its ports
// first..last.
type hostBind struct {
	addr        netip.Addr
	name        string
	pos         int
	first, last int
	addrText    string // hostAddress as written
	portText    string // hostPort as written
}

func newExposureIndex(cidr netip.Prefix, cidrText string, cidr6 netip.Prefix, vms map[string]int) *exposureIndex {
	return &exposureIndex{cidr: cidr, cidrText: cidrText, cidr6: cidr6, vms: vms, names: map[string]int{},
		binds: map[portKey][]hostBind{}, ranges: map[portKey][]hostBind{}}
}

// portSpan is p's ports, first..last, and whether p is a valid host or
// guest port: 1..65535, first ≤ last, at most spec.MaxPortRange of them.
func portSpan(p Port) (first, last int, ok bool) {
	first, last = p.First, p.Last
	if !p.IsRange() {
		last = first
	}
	ok = first >= 1 && last <= 65535 && first <= last && last-first < spec.MaxPortRange
	return first, last, ok
}

// checkPort reports what is wrong with hostPort or guestPort p (field f).
func checkPort(f string, p Port, col *collector) bool {
	first, last, ok := portSpan(p)
	switch {
	case ok:
	case !p.IsRange():
		col.add(f, "%d is out of range (1..65535)", p.First)
	case first < 1 || last > 65535:
		col.add(f, "%s is out of range (1..65535)", p.quoted())
	case first > last:
		col.add(f, "%s: the first port is above the last", p.quoted())
	default:
		col.add(f, "%s is %d ports, more than the %d a range may have", p.quoted(), last-first+1, spec.MaxPortRange)
	}
	return ok
}

// checkPorts checks hostPort and guestPort and sets the model's ports: a
// guest range is as long as the host range (the same ports, kept, or
// others: host port first+i to guest port first+i), or the guest port is
// one for every host port.
func checkPorts(p string, e Exposure, me *spec.Exposure, col *collector) {
	guestOK := checkPort(p+".guestPort", e.GuestPort, col)
	hostOK := checkPort(p+".hostPort", e.HostPort, col)
	hf, hl, _ := portSpan(e.HostPort)
	gf, gl, _ := portSpan(e.GuestPort)
	if hostOK {
		me.HostPort = uint16(hf)
		if hl > hf {
			me.HostPortLast = uint16(hl)
		}
	}
	if !guestOK {
		return
	}
	me.GuestPort = uint16(gf)
	if gl == gf || !hostOK {
		return
	}
	switch {
	case hl == hf:
		col.add(p+".guestPort", "%s is a range and hostPort %s is one port; give one guest port", e.GuestPort.quoted(), e.HostPort.quoted())
	case gl-gf != hl-hf:
		col.add(p+".guestPort", "%s is %d ports and hostPort %s is %d; give a range of the same length, or one port", e.GuestPort.quoted(), gl-gf+1, e.HostPort.quoted(), hl-hf+1)
	default:
		me.GuestPortLast = uint16(gl)
	}
}

// claims are the host addresses e takes on its port ("" both unspecified
// ones; auto on 0.0.0.0 also takes ::1 for IPv6 loopback callers); nil
// when e's host side is invalid.
func claims(e Exposure, me spec.Exposure) []netip.Addr {
	if _, _, ok := portSpan(e.HostPort); !ok || (!me.HostAddr.IsValid() && e.HostAddress != "") || (e.Protocol != "tcp" && e.Protocol != "udp") {
		return nil
	}
	return me.HostAddrs(true)
}

// check validates one exposure (path p, like "exposures[3]") against the
// index and returns its model. It does not insert it.
func (ix *exposureIndex) check(p string, e Exposure, col *collector) spec.Exposure {
	me := spec.Exposure{Name: e.Name, Target: spec.Target{VM: e.VM}, Proto: spec.Proto(e.Protocol),
		Mode: spec.Mode(e.Mode), MaxConns: *e.MaxConns}
	switch {
	case e.Name == "":
		col.add(p+".name", "is required")
	case len(e.Name) > MaxExposureNameLen:
		col.add(p+".name", "%q is longer than %d bytes", e.Name, MaxExposureNameLen)
	case !exposureNameRE.MatchString(e.Name):
		col.add(p+".name", "%q must start with a letter or digit and hold only A-Z a-z 0-9 . _ -", e.Name)
	default:
		if j, dup := ix.names[e.Name]; dup {
			col.add(p+".name", "%q is already the name of exposures[%d]", e.Name, j)
		}
	}
	ix.checkTarget(p, e, &me, col)
	if me.Proto != spec.TCP && me.Proto != spec.UDP {
		col.add(p+".protocol", "%q is not one of tcp, udp", e.Protocol)
	}
	checkPorts(p, e, &me, col)
	var ha netip.Addr // "": every host address of both families
	var err error
	if e.HostAddress != "" {
		ha, err = netip.ParseAddr(e.HostAddress)
	}
	if err != nil || ha.Zone() != "" {
		col.add(p+".hostAddress", "%q is not an IP address", e.HostAddress)
	} else if ha.IsMulticast() {
		col.add(p+".hostAddress", "%q is a multicast address", e.HostAddress)
	} else if ha.Is4In6() {
		col.add(p+".hostAddress", "%q is an IPv4-mapped IPv6 address; write it as IPv4", e.HostAddress)
	} else {
		me.HostAddr = ha
	}
	if me.Mode != spec.ModeAuto && me.Mode != spec.ModeNAT && me.Mode != spec.ModeProxy {
		col.add(p+".mode", "%q is not one of auto, nat, proxy", e.Mode)
	} else if me.Mode == spec.ModeNAT && err == nil && ha.IsLoopback() {
		col.add(p+".mode", "nat cannot publish on loopback %s (brokkr never sets route_localnet); use proxy or auto", e.HostAddress)
	} else if me.HostAddr.IsValid() && me.UsesKernel() {
		ix.checkFamilies(p, e, me, col)
	}
	// Set after the mode's checks: auto's address rules are auto's, with a
	// header or without (removing one must not make a config invalid).
	me.ProxyProtocol = checkProxyProtocol(p, e, me, col)
	if *e.MaxConns < 0 {
		col.add(p+".maxConns", "%d is negative (0 = unlimited)", *e.MaxConns)
	} else if *e.MaxConns > spec.MaxConnsLimit {
		col.add(p+".maxConns", "%d is outside 0 (unlimited)..%d", *e.MaxConns, spec.MaxConnsLimit)
	}
	me.AllowFrom = ix.checkAllowFrom(p, e, col)
	ix.checkBinds(p, e, me, col)
	if n := sockPortsOf(e, me); n > 0 && ix.sockPorts+n > spec.MaxSocketPathPorts {
		col.add(p+".hostPort", "%s: the socket path would translate %d host ports with it, more than the %d it holds (one per port of every auto exposure)",
			e.HostPort.quoted(), ix.sockPorts+n, spec.MaxSocketPathPorts)
	}
	return me
}

// sockPortsOf is how many host ports the socket path translates for e
// (one per port of an auto exposure it serves; 0 for one with ports that
// are not valid).
func sockPortsOf(e Exposure, me spec.Exposure) int {
	first, last, ok := portSpan(e.HostPort)
	if !ok || !me.UsesSocketPath() {
		return 0
	}
	return last - first + 1
}

// checkProxyProtocol checks proxyProtocol: a PROXY header is written by the
// proxy, on TCP; the kernel's nat path keeps the caller's address and
// writes no header, and a UDP datagram has no stream to put one in front of.
func checkProxyProtocol(p string, e Exposure, me spec.Exposure, col *collector) spec.ProxyProtocol {
	v := spec.ProxyProtocol(e.ProxyProtocol)
	switch {
	case v == spec.ProxyNone:
	case v != spec.ProxyV1 && v != spec.ProxyV2:
		col.add(p+".proxyProtocol", "%q is not one of \"\" (none), v1, v2", e.ProxyProtocol)
	case me.Mode == spec.ModeNAT:
		col.add(p+".proxyProtocol", "%s cannot be written on mode nat: the kernel path keeps the caller's address and writes no header; use mode proxy or auto (carried by the proxy)", v)
	case me.Proto == spec.UDP:
		col.add(p+".proxyProtocol", "%s is for TCP only: a UDP exposure carries no PROXY header", v)
	default:
		return v
	}
	return spec.ProxyNone
}

// checkAllowFrom parses allowFrom. A prefix with host bits set is refused,
// not masked: 10.1.2.3/16 may well be meant as the one address, and a
// firewall rule should say what it admits.
func (ix *exposureIndex) checkAllowFrom(p string, e Exposure, col *collector) []netip.Prefix {
	if len(e.AllowFrom) == 0 {
		return nil
	}
	if len(e.AllowFrom) > spec.MaxAllowFrom {
		col.add(p+".allowFrom", "%d prefixes, more than the %d an exposure may have", len(e.AllowFrom), spec.MaxAllowFrom)
		return nil
	}
	ix.allowTotal += len(e.AllowFrom)
	if ix.allowTotal > spec.MaxAllowFromTotal {
		col.add(p+".allowFrom", "the exposures' allowFrom lists hold %d prefixes up to here, more than the %d brokkr can carry", ix.allowTotal, spec.MaxAllowFromTotal)
		return nil
	}
	out := make([]netip.Prefix, 0, len(e.AllowFrom))
	for i, s := range e.AllowFrom {
		q := fmt.Sprintf("%s.allowFrom[%d]", p, i)
		pf, err := netip.ParsePrefix(s)
		switch {
		case err != nil:
			col.add(q, "%q is not a CIDR prefix (like 192.0.2.0/24 or 2001:db8::/32)", s)
		case pf.Addr().Is4In6():
			col.add(q, "%q is an IPv4-mapped IPv6 prefix; write it as IPv4", s)
		case pf != pf.Masked():
			col.add(q, "%q has host bits set; did you mean %s?", s, pf.Masked())
		default:
			out = append(out, pf)
		}
	}
	return out
}

// checkFamilies checks that the kernel path, which cannot translate
// between families, has a guest address of the family hostAddress names.
// ("" publishes each family the exposure has a guest address of.)
func (ix *exposureIndex) checkFamilies(p string, e Exposure, me spec.Exposure, col *collector) {
	a := me.HostAddr
	switch {
	case a.Is6() && e.VM != "" && !ix.cidr6.IsValid():
		col.add(p+".hostAddress", `%s is IPv6 and network.cidr6 is "" (the guests have no IPv6); use "" or an IPv4 address, or mode proxy`, e.HostAddress)
	case a.Is6() && e.VM == "" && e.Target6 == "":
		col.add(p+".hostAddress", "%s is IPv6 and the exposure has no target6; give target6, or mode proxy", e.HostAddress)
	case a.Is4() && e.VM == "" && e.Target == "" && e.Target6 != "":
		col.add(p+".hostAddress", "%s is IPv4 and the exposure has only target6; give target, or use \"\" or an IPv6 address", e.HostAddress)
	}
}

// checkTarget checks vm or target/target6 and sets me.Target's addresses.
func (ix *exposureIndex) checkTarget(p string, e Exposure, me *spec.Exposure, col *collector) {
	switch {
	case e.VM == "" && e.Target == "" && e.Target6 == "":
		col.add(p, "one of vm or target (or target6) is required")
	case e.VM != "" && (e.Target != "" || e.Target6 != ""):
		t := e.Target
		if t == "" {
			t = e.Target6
		}
		col.add(p, "vm %q and target %q are both set; give exactly one", e.VM, t)
	case e.VM != "":
		if _, ok := ix.vms[e.VM]; !ok {
			col.add(p+".vm", "%q is not a VM in vms", e.VM)
		}
	default:
		ix.checkTarget6(p, e, me, col)
		if e.Target == "" {
			return
		}
		t, err := netip.ParseAddr(e.Target)
		cidr := ix.cidr
		switch {
		case err != nil || t.Zone() != "":
			col.add(p+".target", "%q is not an IP address", e.Target)
		case cidr.IsValid() && !cidr.Masked().Contains(t):
			col.add(p+".target", "%q is not inside network.cidr %s", e.Target, ix.cidrText)
		case cidr.IsValid() && (t == cidr.Addr() || t == cidr.Masked().Addr() || t == broadcast(cidr)):
			col.add(p+".target", "%q is the bridge, network or broadcast address of network.cidr", e.Target)
		default:
			me.Target.Addr = t
		}
	}
}

// checkTarget6 checks target6: an IPv6 address in network.cidr6 that is
// not the bridge's nor the subnet-router anycast address.
func (ix *exposureIndex) checkTarget6(p string, e Exposure, me *spec.Exposure, col *collector) {
	if e.Target6 == "" {
		return
	}
	t, err := netip.ParseAddr(e.Target6)
	c := ix.cidr6
	switch {
	case err != nil || t.Zone() != "" || !t.Is6() || t.Is4In6():
		col.add(p+".target6", "%q is not an IPv6 address", e.Target6)
	case !c.IsValid():
		col.add(p+".target6", `%q: network.cidr6 is "" (no IPv6 on the bridge)`, e.Target6)
	case !c.Masked().Contains(t):
		col.add(p+".target6", "%q is not inside network.cidr6 %s", e.Target6, c)
	case t == c.Addr() || t == c.Masked().Addr():
		col.add(p+".target6", "%q is the bridge's or the subnet-router anycast address of network.cidr6", e.Target6)
	default:
		me.Target.Addr6 = t
	}
}

// checkBinds reports the first earlier exposure whose host side overlaps
// e's (same protocol, overlapping ports and addresses).
func (ix *exposureIndex) checkBinds(p string, e Exposure, me spec.Exposure, col *collector) {
	first, last, _ := portSpan(e.HostPort)
	for _, a := range claims(e, me) {
		if other, ok := ix.overlap(e.Protocol, first, last, a, e.Name); ok {
			col.add(p+".hostPort", "%s/%s on %s overlaps exposures[%d] (%s/%s on %s)", e.HostPort.quoted(), e.Protocol, shownAddr(e.HostAddress),
				other.pos, other.portText, e.Protocol, shownAddr(other.addrText))
			return
		}
	}
}

// overlap finds a claimed host side of another exposure than name on
// protocol proto, ports first..last, overlapping address a: among the
// single ports of each port of the span, then among the ranges of its
// blocks.
func (ix *exposureIndex) overlap(proto string, first, last int, a netip.Addr, name string) (hostBind, bool) {
	hit := func(b hostBind) bool {
		return b.name != name && b.first <= last && first <= b.last && addrsOverlap(b.addr, a)
	}
	for port := first; port <= last; port++ {
		for _, other := range ix.binds[portKey{proto, port}] {
			if hit(other) {
				return other, true
			}
		}
	}
	if len(ix.ranges) == 0 {
		return hostBind{}, false
	}
	for blk := first / rangeBlock; blk <= last/rangeBlock; blk++ {
		for _, other := range ix.ranges[portKey{proto, blk}] {
			if hit(other) {
				return other, true
			}
		}
	}
	return hostBind{}, false
}

// shownAddr is a hostAddress as a message names it.
func shownAddr(s string) string {
	if s == "" {
		return "every address"
	}
	return s
}

// insert records e (at position pos) as one of the desired exposures.
func (ix *exposureIndex) insert(e Exposure, me spec.Exposure, pos int) {
	if _, dup := ix.names[e.Name]; !dup && e.Name != "" {
		ix.names[e.Name] = pos
	}
	ix.sockPorts += sockPortsOf(e, me)
	first, last, _ := portSpan(e.HostPort)
	for _, a := range claims(e, me) {
		b := hostBind{addr: a, name: e.Name, pos: pos, first: first, last: last, addrText: e.HostAddress, portText: e.HostPort.quoted()}
		if first == last {
			k := portKey{e.Protocol, first}
			ix.binds[k] = append(ix.binds[k], b)
			continue
		}
		for blk := first / rangeBlock; blk <= last/rangeBlock; blk++ {
			k := portKey{e.Protocol, blk}
			ix.ranges[k] = append(ix.ranges[k], b)
		}
	}
}

// forget removes the binds of the named exposure, on protocol proto and
// host port hp.
func (ix *exposureIndex) forget(name, proto string, hp Port) {
	drop := func(m map[portKey][]hostBind, k portKey) {
		binds := m[k][:0:0]
		for _, b := range m[k] {
			if b.name != name {
				binds = append(binds, b)
			}
		}
		if len(binds) == 0 {
			delete(m, k)
		} else {
			m[k] = binds
		}
	}
	first, last, ok := portSpan(hp)
	switch {
	case !ok:
	case first == last:
		drop(ix.binds, portKey{proto, first})
	default:
		for blk := first / rangeBlock; blk <= last/rangeBlock; blk++ {
			drop(ix.ranges, portKey{proto, blk})
		}
	}
}
