// Package compile is the pure half of brokkr's nftables tables: the desired
// state (Rules), the table spec built from it (Desired, one unit per
// exposure), the plan that turns one spec into another (MakePlan), and the
// spec printed in `nft -f` syntax (Render). It touches no kernel and needs
// no root: package nft applies what it builds and runs the cap around it.
//
// The tables are `table inet brokkr` (map-dispatched DNAT for exposures with
// an honest per-exposure connection cap, named counters, the remote-loopback
// guard, host isolation, hairpin and egress masquerade) and `table bridge
// brokkr` (anti-spoof per guest port and guest-to-guest isolation).
package compile

import (
	"fmt"
	"net"
	"net/netip"
	"strconv"

	"github.com/brokkr/brokkr/bpf/ctmark"
	"github.com/brokkr/brokkr/internal/spec"
)

// Rules is the whole desired state of brokkr's tables.
type Rules struct {
	Bridge string       // the guest bridge (host isolation, anti-spoof, hairpin)
	Subnet netip.Prefix // guest subnet: bridge address + prefix, e.g. 10.213.0.1/24
	// Subnet6 is the guests' /64 with the bridge's address in it; the zero
	// Prefix: IPv4 only (no IPv6 rule at all, and guests' IPv6 is dropped).
	Subnet6       netip.Prefix
	Masquerade    bool    // egress NAT for the subnet leaving through any other interface
	IsolateGuests bool    // drop guest-to-guest frames across the bridge
	DHCP          bool    // guests may reach udp/67 on the host
	DNS           bool    // guests may reach udp+tcp/53 on the host
	Guests        []Guest // ports under anti-spoof
	Exposures     []Exposure
	// Cap is the connection cap's part of the table (nil: MarksOnly).
	Cap Cap
}

// Cap is the connection cap's part of the inet table: what the backend
// that runs the cap needs there. The shapes are this package's (it builds
// and renders every expression); a backend picks one.
type Cap interface{ capShape() string }

// MarksOnly: the cap runs outside the table (the BPF nat path's programs
// read the marks): an exposure is its mark and its DNAT, nothing else.
type MarksOnly struct{}

// SetBasedCap: the set-based cap runs in the table (the fallback where the
// nat path's programs cannot load): per capped exposure a set of its open
// connections and the chain that admits into it, the FIN/RST bookkeeping,
// per-element counters of the targets, and the slow path's port map
// pointing at OverflowPort (its listener; 0: none).
type SetBasedCap struct{ OverflowPort uint16 }

func (MarksOnly) capShape() string   { return "marks" }
func (SetBasedCap) capShape() string { return "set" }

// setBased reports whether r's cap is the set-based one, and its settings.
func (r Rules) setBased() (SetBasedCap, bool) {
	if r.Cap == nil || r.Cap.capShape() != (SetBasedCap{}).capShape() {
		return SetBasedCap{}, false
	}
	return r.Cap.(SetBasedCap), true
}

// Guest is one bridge port that may only send frames from its own MAC and
// IPv4 address (plus the DHCP discover/request from 0.0.0.0), and with
// Rules.Subnet6 from its own IPv6 addresses: Addr6 and the link-local one of
// its MAC (plus duplicate address detection from ::).
type Guest struct {
	Name  string
	Tap   string // bridge port name (a tap, or a veth in tests)
	MAC   net.HardwareAddr
	Addr  netip.Addr // invalid = not leased yet: only DHCP and ARP probes pass
	Addr6 netip.Addr // its SLAAC address in Subnet6; invalid = none
}

// LinkLocal is the link-local address a NIC with mac forms (fe80::/64 and
// the modified EUI-64 of the MAC, RFC 4291 appendix A).
func LinkLocal(mac net.HardwareAddr) netip.Addr {
	a := [16]byte{0: 0xfe, 1: 0x80}
	copy(a[8:], []byte{mac[0] ^ 2, mac[1], mac[2], 0xff, 0xfe, mac[3], mac[4], mac[5]})
	return netip.AddrFrom16(a)
}

// ula is fc00::/7: the unique-local addresses, which egress masquerades
// (NAT66) like the IPv4 subnet; a global /64 is routed as it is.
var ula = netip.MustParsePrefix("fc00::/7")

// Exposure is one published port.
type Exposure struct {
	Name     string
	Protocol string // tcp | udp
	// HostAddr: the zero Addr is every local address of both families, an
	// unspecified one every local address of its family.
	HostAddr netip.Addr
	HostPort uint16
	// HostPortLast is the last port of a range of host ports (HostPort the
	// first; 0: one port): one element of the interval maps, one mark.
	HostPortLast uint16
	GuestAddr    netip.Addr // IPv4; the zero Addr: IPv4 callers are not published
	// GuestAddr6 is the guest's IPv6 address; the zero Addr: IPv6 callers
	// are not published (nor are they under the set-based cap).
	GuestAddr6 netip.Addr
	// GuestPort is where every host port goes, or with GuestPortLast (0:
	// none) the first port of a guest range as long as the host's: host
	// port HostPort+i to GuestPort+i. The same range keeps the port the
	// caller dialled (one element, exp-target-addr); a shifted one is an
	// element per port (exp-target-port).
	GuestPort     uint16
	GuestPortLast uint16
	MaxConns      int    // 0 = unlimited
	MarkID        uint32 // the ct mark id: the exposure's counter slot + 1, unique
}

// IsRange reports whether the exposure publishes a range of host ports.
func (e Exposure) IsRange() bool { return e.HostPortLast > e.HostPort }

// keepsPort reports whether each host port goes to the same guest port.
func (e Exposure) keepsPort() bool { return e.GuestPortLast != 0 && e.GuestPort == e.HostPort }

// ports is e's ports as the model has them, whose methods say what a port
// of a range maps to (one rule for every path).
func (e Exposure) ports() spec.Exposure {
	return spec.Exposure{HostPort: e.HostPort, HostPortLast: e.HostPortLast, GuestPort: e.GuestPort, GuestPortLast: e.GuestPortLast}
}

// GuestPortOf is the guest port a caller of host port hp (one of e's)
// reaches.
func (e Exposure) GuestPortOf(hp uint16) uint16 { return e.ports().GuestPortOf(hp) }

// HasPort reports whether host port hp is one of the exposure's.
func (e Exposure) HasPort(hp uint16) bool { return hp >= e.HostPort && hp <= e.ports().LastHostPort() }

// shifted reports whether each host port goes to a guest port of its own,
// another one.
func (e Exposure) shifted() bool { return e.GuestPortLast != 0 && e.GuestPort != e.HostPort }

// loopbackOnly: an exposure bound to 127.0.0.0/8 is the userspace proxy's
// alone (DNAT from loopback would need route_localnet, which brokkr never
// sets); it is valid and gets no rules here.
func (e Exposure) LoopbackOnly() bool { return e.HostAddr.IsValid() && e.HostAddr.IsLoopback() }

// wildcard reports whether the exposure answers on every local address.
func (e Exposure) Wildcard() bool { return !e.HostAddr.IsValid() || e.HostAddr.IsUnspecified() }

// families are the address families the table publishes e on: those of
// its host address that it has a guest address of (IPv6 not under the
// set-based cap).
func (e Exposure) families(setBased bool) (v4, v6 bool) {
	any := !e.HostAddr.IsValid()
	v4 = (any || e.HostAddr.Is4()) && e.GuestAddr.IsValid()
	v6 = (any || e.HostAddr.Is6()) && e.GuestAddr6.IsValid() && !setBased
	return v4, v6
}

// fieldErr names the field of Rules the builder cannot express. The
// desired state was validated where it entered (config.Compile); this only
// keeps the compiler total on input that did not.
func fieldErr(field, format string, a ...any) error {
	return fmt.Errorf("%s: %s", field, fmt.Sprintf(format, a...))
}

// validName: names usable inside nft object names (chains, sets, counters)
// that `nft` prints back and parses again: [a-zA-Z0-9][a-zA-Z0-9_.-]{0,63}.
func validName(s string) bool {
	if len(s) == 0 || len(s) > 64 {
		return false
	}
	for i := 0; i < len(s); i++ {
		c := s[i]
		alnum := c >= 'a' && c <= 'z' || c >= 'A' && c <= 'Z' || c >= '0' && c <= '9'
		if !alnum && (i == 0 || c != '_' && c != '.' && c != '-') {
			return false
		}
	}
	return true
}

// MaxConnsLimit bounds a cap; the set that enforces it is sized to it.
const MaxConnsLimit = 1 << 20

// buildable reports input the builder cannot turn into expressions.
func (r Rules) buildable() error {
	if len(r.Bridge) == 0 || len(r.Bridge) > 15 {
		return fieldErr("bridge", "%q is not an interface name", r.Bridge)
	}
	if !r.Subnet.IsValid() || !r.Subnet.Addr().Is4() {
		return fieldErr("subnet", "%q is not an IPv4 prefix", r.Subnet)
	}
	if r.Subnet6.IsValid() && (!r.Subnet6.Addr().Is6() || r.Subnet6.Addr().Is4In6()) {
		return fieldErr("subnet6", "%q is not an IPv6 prefix", r.Subnet6)
	}
	for i, g := range r.Guests {
		f := "guests[" + strconv.Itoa(i) + "]"
		switch {
		case g.Addr6.IsValid() && (!g.Addr6.Is6() || !r.Subnet6.Contains(g.Addr6)):
			return fieldErr(f+".addr6", "%s is not an IPv6 address in subnet6 %s", g.Addr6, r.Subnet6)
		case len(g.Tap) == 0 || len(g.Tap) > 15:
			return fieldErr(f+".tap", "%q is not an interface name", g.Tap)
		case len(g.MAC) != 6:
			return fieldErr(f+".mac", "%q is not a 6-byte MAC", g.MAC)
		case g.Addr.IsValid() && !g.Addr.Is4():
			return fieldErr(f+".addr", "%s is not an IPv4 address", g.Addr)
		}
	}
	return nil
}

// buildable reports an exposure the builder cannot express (a mark id of 0
// is never one).
func (e Exposure) buildable() error {
	id := e.MarkID
	if e.LoopbackOnly() {
		return nil
	}
	f := "exposures[" + e.Name + "]"
	switch {
	case !validName(e.Name):
		return fieldErr(f+".name", "%q is not a valid name", e.Name)
	case e.Protocol != "tcp" && e.Protocol != "udp":
		return fieldErr(f+".protocol", "%q must be tcp or udp", e.Protocol)
	case e.GuestAddr.IsValid() && !e.GuestAddr.Is4():
		return fieldErr(f+".guestAddr", "%q is not an IPv4 address", e.GuestAddr)
	case e.GuestAddr6.IsValid() && (!e.GuestAddr6.Is6() || e.GuestAddr6.Is4In6()):
		return fieldErr(f+".guestAddr6", "%q is not an IPv6 address", e.GuestAddr6)
	case !e.GuestAddr.IsValid() && !e.GuestAddr6.IsValid():
		return fieldErr(f+".guestAddr", "the exposure has no guest address")
	case e.HostAddr.Is4In6():
		return fieldErr(f+".hostAddr", "%s is an IPv4-mapped address", e.HostAddr)
	case e.HostAddr.Is4() && !e.GuestAddr.IsValid():
		return fieldErr(f+".hostAddr", "%s is IPv4 and the exposure has no IPv4 guest address", e.HostAddr)
	case e.HostAddr.Is6() && !e.GuestAddr6.IsValid():
		return fieldErr(f+".hostAddr", "%s is IPv6 and the exposure has no IPv6 guest address", e.HostAddr)
	case e.HostPortLast != 0 && e.HostPortLast <= e.HostPort:
		return fieldErr(f+".hostPortLast", "%d is not above hostPort %d", e.HostPortLast, e.HostPort)
	case e.GuestPortLast != 0 && (!e.IsRange() || int(e.GuestPortLast)-int(e.GuestPort) != int(e.HostPortLast)-int(e.HostPort)):
		return fieldErr(f+".guestPortLast", "%d: a guest range is as long as the host's range", e.GuestPortLast)
	case e.MaxConns < 0 || e.MaxConns > MaxConnsLimit:
		return fieldErr(f+".maxConns", "%d is outside 0..%d", e.MaxConns, MaxConnsLimit)
	case id == 0 || id > ctmark.IDMask:
		return fieldErr(f+".markID", "%d is not a mark id (1..%d)", id, ctmark.IDMask)
	}
	return nil
}
