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
	"errors"
	"fmt"
	"net"
	"net/netip"
	"regexp"
	"strconv"
)

// Rules is the whole desired state of brokkr's tables.
type Rules struct {
	Bridge        string       // the guest bridge (host isolation, anti-spoof, hairpin)
	Subnet        netip.Prefix // guest subnet: bridge address + prefix, e.g. 10.213.0.1/24
	Gateway       netip.Addr   // the bridge's own address
	Masquerade    bool         // egress NAT for the subnet leaving through any other interface
	IsolateGuests bool         // drop guest-to-guest frames across the bridge
	DHCP          bool         // guests may reach udp/67 on the host
	DNS           bool         // guests may reach udp+tcp/53 on the host
	Guests        []Guest      // ports under anti-spoof
	Exposures     []Exposure
	// KernelCap: the cap, its release and the counters are the BPF nat
	// path's (bpf.NatPath); exposures carry only their mark and DNAT, and
	// each Exposure's MarkID is its counter slot's.
	KernelCap bool
}

// Guest is one bridge port that may only send frames from its own MAC and
// IPv4 address (plus the DHCP discover/request from 0.0.0.0).
type Guest struct {
	Name string
	Tap  string // bridge port name (a tap, or a veth in tests)
	MAC  net.HardwareAddr
	Addr netip.Addr // invalid = not leased yet: only DHCP and ARP probes pass
}

// Exposure is one published port.
type Exposure struct {
	Name      string
	Protocol  string     // tcp | udp
	HostAddr  netip.Addr // unspecified (0.0.0.0) or invalid = every local address
	HostPort  uint16
	GuestAddr netip.Addr
	GuestPort uint16
	MaxConns  int    // 0 = unlimited
	MarkID    uint32 // with Rules.KernelCap: the ct mark id (counter slot + 1)
}

// loopbackOnly: an exposure bound to 127.0.0.0/8 is the userspace proxy's
// alone (DNAT from loopback would need route_localnet, which brokkr never
// sets); it is valid and gets no rules here.
func (e Exposure) LoopbackOnly() bool { return e.HostAddr.IsValid() && e.HostAddr.IsLoopback() }

// wildcard reports whether the exposure answers on every local address.
func (e Exposure) Wildcard() bool { return !e.HostAddr.IsValid() || e.HostAddr.IsUnspecified() }

// FieldError names the field of Rules that is wrong.
type FieldError struct {
	Field string // e.g. exposures[web-http].hostPort
	Msg   string
}

func (e *FieldError) Error() string { return e.Field + ": " + e.Msg }

// nameRE keeps names usable inside nft object names (chains, sets, counters)
// that `nft` prints back and parses again.
var nameRE = regexp.MustCompile(`^[a-zA-Z0-9][a-zA-Z0-9_.-]{0,63}$`)

// validName is nameRE.MatchString without the regexp machinery.
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

// ifnameRE: Linux interface names (IFNAMSIZ-1 bytes, no '/', no spaces).
var ifnameRE = regexp.MustCompile(`^[a-zA-Z0-9_.-]{1,15}$`)

// MaxConnsLimit bounds a cap; the set that enforces it is sized to it.
const MaxConnsLimit = 1 << 20

// Validate checks r as a whole and returns every problem, each naming its
// field. nft.Table.Converge applies nothing when Validate fails.
func (r Rules) Validate() []error {
	var errs []error
	bad := func(field, format string, a ...any) {
		errs = append(errs, &FieldError{Field: field, Msg: fmt.Sprintf(format, a...)})
	}
	if !ifnameRE.MatchString(r.Bridge) {
		bad("bridge", "%q is not a valid interface name (1-15 of [a-zA-Z0-9_.-])", r.Bridge)
	}
	subnetOK := r.Subnet.IsValid() && r.Subnet.Addr().Is4() && r.Subnet.Bits() > 0 && r.Subnet.Bits() < 31
	if !subnetOK {
		bad("subnet", "%q must be an IPv4 prefix between /1 and /30", r.Subnet)
	}
	if !r.Gateway.Is4() {
		bad("gateway", "%q must be an IPv4 address", r.Gateway)
	} else if subnetOK && !r.Subnet.Masked().Contains(r.Gateway) {
		bad("gateway", "%s is outside subnet %s", r.Gateway, r.Subnet)
	}
	seenTap := map[string]string{}
	seenGuest := map[string]bool{}
	for i, g := range r.Guests {
		f := fmt.Sprintf("guests[%d]", i)
		if g.Name != "" {
			f = fmt.Sprintf("guests[%s]", g.Name)
		}
		if !nameRE.MatchString(g.Name) {
			bad(f+".name", "%q must match %s", g.Name, nameRE)
		} else if seenGuest[g.Name] {
			bad(f+".name", "duplicate guest name")
		}
		seenGuest[g.Name] = true
		if !ifnameRE.MatchString(g.Tap) {
			bad(f+".tap", "%q is not a valid interface name", g.Tap)
		} else if other, ok := seenTap[g.Tap]; ok {
			bad(f+".tap", "%q is also the tap of guest %s", g.Tap, other)
		} else if g.Tap == r.Bridge {
			bad(f+".tap", "%q is the bridge itself", g.Tap)
		}
		seenTap[g.Tap] = g.Name
		if len(g.MAC) != 6 || g.MAC[0]&1 == 1 {
			bad(f+".mac", "%q must be a unicast 6-byte MAC", g.MAC)
		}
		if g.Addr.IsValid() && (!g.Addr.Is4() || (subnetOK && !r.Subnet.Masked().Contains(g.Addr))) {
			bad(f+".addr", "%s must be an IPv4 address inside %s", g.Addr, r.Subnet)
		}
	}
	seenExp := make(map[string]bool, len(r.Exposures))
	type bind struct {
		addr  netip.Addr
		proto string
		port  uint16
	}
	binds := make(map[bind]string, len(r.Exposures))
	for i, e := range r.Exposures {
		// This loop runs over every exposure on every Converge: the field
		// name is built only for an error, names are checked without a
		// regexp (10,000 Sprintf and matches were ~5 ms of it).
		bad := func(field, format string, a ...any) {
			f := "exposures[" + strconv.Itoa(i) + "]"
			if e.Name != "" {
				f = "exposures[" + e.Name + "]"
			}
			bad(f+field, format, a...)
		}
		f := ""
		if !validName(e.Name) {
			bad(f+".name", "%q must match %s", e.Name, nameRE)
		} else if seenExp[e.Name] {
			bad(f+".name", "duplicate exposure name")
		}
		seenExp[e.Name] = true
		if e.Protocol != "tcp" && e.Protocol != "udp" {
			bad(f+".protocol", "%q must be tcp or udp", e.Protocol)
		}
		if e.HostPort == 0 {
			bad(f+".hostPort", "must be 1..65535")
		}
		if e.GuestPort == 0 {
			bad(f+".guestPort", "must be 1..65535")
		}
		if e.HostAddr.IsValid() {
			switch {
			case !e.HostAddr.Is4():
				bad(f+".hostAddr", "%s: only IPv4 host addresses are published by the kernel path", e.HostAddr)
			}
		}
		if !e.GuestAddr.Is4() || e.GuestAddr.IsUnspecified() || e.GuestAddr.IsLoopback() {
			bad(f+".guestAddr", "%q must be a routable IPv4 address", e.GuestAddr)
		}
		if r.KernelCap && (e.MarkID == 0 || e.MarkID > MarkIDMask) {
			bad(f+".markID", "%d must be a counter slot + 1 (1 .. %d)", e.MarkID, MarkIDMask)
		}
		if e.MaxConns < 0 || e.MaxConns > MaxConnsLimit {
			bad(f+".maxConns", "%d must be 0 (unlimited) .. %d", e.MaxConns, MaxConnsLimit)
		}
		a := e.HostAddr
		if e.Wildcard() {
			a = netip.IPv4Unspecified()
		}
		k := bind{a, e.Protocol, e.HostPort}
		if other, ok := binds[k]; ok {
			bad(f+".hostPort", "%s %s:%d is already published by exposure %s", e.Protocol, a, e.HostPort, other)
		}
		binds[k] = e.Name
	}
	// A wildcard binding and a specific one on the same port would both
	// match; the specific one wins (looked up first), which is what a socket
	// bind would do too, so that is allowed.
	return errs
}

// ValidationError joins the errors of Validate into one error.
func ValidationError(errs []error) error {
	if len(errs) == 0 {
		return nil
	}
	return fmt.Errorf("invalid rules: %w", errors.Join(errs...))
}

// buildable reports input the builder cannot turn into expressions. Validate
// already refuses all of it; this keeps the compiler total on input that did
// not pass through Validate.
func (r Rules) buildable() error {
	if len(r.Bridge) == 0 || len(r.Bridge) > 15 {
		return &FieldError{Field: "bridge", Msg: fmt.Sprintf("%q is not an interface name", r.Bridge)}
	}
	if !r.Subnet.IsValid() || !r.Subnet.Addr().Is4() {
		return &FieldError{Field: "subnet", Msg: fmt.Sprintf("%q is not an IPv4 prefix", r.Subnet)}
	}
	for i, g := range r.Guests {
		f := "guests[" + strconv.Itoa(i) + "]"
		switch {
		case len(g.Tap) == 0 || len(g.Tap) > 15:
			return &FieldError{Field: f + ".tap", Msg: fmt.Sprintf("%q is not an interface name", g.Tap)}
		case len(g.MAC) != 6:
			return &FieldError{Field: f + ".mac", Msg: fmt.Sprintf("%q is not a 6-byte MAC", g.MAC)}
		case g.Addr.IsValid() && !g.Addr.Is4():
			return &FieldError{Field: f + ".addr", Msg: fmt.Sprintf("%s is not an IPv4 address", g.Addr)}
		}
	}
	return nil
}

// buildable reports an exposure the builder cannot express (id is its mark
// id; 0 is never one).
func (e Exposure) buildable(kernelCap bool, id uint32) error {
	if e.LoopbackOnly() {
		return nil
	}
	f := "exposures[" + e.Name + "]"
	switch {
	case !validName(e.Name):
		return &FieldError{Field: f + ".name", Msg: fmt.Sprintf("%q is not a valid name", e.Name)}
	case e.Protocol != "tcp" && e.Protocol != "udp":
		return &FieldError{Field: f + ".protocol", Msg: fmt.Sprintf("%q must be tcp or udp", e.Protocol)}
	case !e.GuestAddr.Is4():
		return &FieldError{Field: f + ".guestAddr", Msg: fmt.Sprintf("%q is not an IPv4 address", e.GuestAddr)}
	case !e.Wildcard() && !e.HostAddr.Is4():
		return &FieldError{Field: f + ".hostAddr", Msg: fmt.Sprintf("%s is not an IPv4 address", e.HostAddr)}
	case e.MaxConns < 0 || e.MaxConns > MaxConnsLimit:
		return &FieldError{Field: f + ".maxConns", Msg: fmt.Sprintf("%d is outside 0..%d", e.MaxConns, MaxConnsLimit)}
	case id == 0 || id > MarkIDMask:
		return &FieldError{Field: f + ".markID", Msg: fmt.Sprintf("%d is not a mark id (1..%d)", id, MarkIDMask)}
	}
	return nil
}
