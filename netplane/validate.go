package netplane

import (
	"fmt"
	"net/netip"
	"regexp"

	"github.com/vishvananda/netlink"

	"github.com/brokkr/brokkr/bpf"
	"github.com/brokkr/brokkr/netplane/link"
	"github.com/brokkr/brokkr/netplane/nft"
)

// nameRE is what a guest or exposure name may be: it becomes part of nft
// object names, which `nft` must print back and parse again (netplane/nft
// checks the same).
var nameRE = regexp.MustCompile(`^[a-zA-Z0-9][a-zA-Z0-9_.-]{0,63}$`)

// ifnameRE is the bridge names the nft table accepts (a subset of what the
// kernel allows).
var ifnameRE = regexp.MustCompile(`^[a-zA-Z0-9_.-]{1,15}$`)

// fieldError is an error that names the offending field.
type fieldError struct {
	Field string
	Msg   string
}

func (e *fieldError) Error() string { return e.Field + ": " + e.Msg }

func ferr(field, format string, args ...any) error {
	return &fieldError{Field: field, Msg: fmt.Sprintf(format, args...)}
}

// validateNetwork checks the network section alone.
func validateNetwork(n Network) []error {
	var errs []error
	if err := link.ValidName(n.Bridge); err != nil {
		errs = append(errs, ferr("network.bridge", "%v", err))
	} else if !ifnameRE.MatchString(n.Bridge) {
		errs = append(errs, ferr("network.bridge", "%q must match %s", n.Bridge, ifnameRE))
	}
	c := n.CIDR
	switch {
	case !c.IsValid():
		errs = append(errs, ferr("network.cidr", "%q is not a CIDR", c.String()))
	case !c.Addr().Is4() || c.Addr().Is4In6():
		errs = append(errs, ferr("network.cidr", "%s is not IPv4", c))
	case c.Bits() < 1:
		errs = append(errs, ferr("network.cidr", "%s is not a subnet (/0)", c))
	case c.Bits() > 30:
		errs = append(errs, ferr("network.cidr", "%s leaves no address for a guest (prefix longer than /30)", c))
	case c.Addr() == c.Masked().Addr():
		errs = append(errs, ferr("network.cidr", "%s is the network address; give the bridge's address, e.g. %s", c, nextAddr(c)))
	case c.Addr() == broadcast(c):
		errs = append(errs, ferr("network.cidr", "%s is the broadcast address", c))
	case c.Addr().IsLoopback() || c.Addr().IsMulticast() || c.Addr().IsUnspecified():
		errs = append(errs, ferr("network.cidr", "%s is not a unicast address", c))
	}
	if n.MTU != 0 && (n.MTU < 68 || n.MTU > 65535) {
		errs = append(errs, ferr("network.mtu", "%d is outside 68..65535", n.MTU))
	}
	return errs
}

func nextAddr(p netip.Prefix) netip.Prefix { return netip.PrefixFrom(p.Addr().Next(), p.Bits()) }

func broadcast(p netip.Prefix) netip.Addr {
	b := p.Masked().Addr().As4()
	host := uint32(1)<<(32-p.Bits()) - 1
	for i := 0; i < 4; i++ {
		b[3-i] |= byte(host >> (8 * i))
	}
	return netip.AddrFrom4(b)
}

// validateSpec checks everything that needs no kernel: network, guests and
// exposures, and their relations. assigned maps VM → its current address
// (explicit targets may not take one).
func validateSpec(d Desired, assigned map[string]netip.Addr) []error {
	errs := validateNetwork(d.Network)
	netOK := len(errs) == 0
	guests := map[string]bool{}
	taps := map[string]string{d.Network.Bridge: "the bridge"}
	for i, g := range d.Guests {
		f := fmt.Sprintf("guests[%d].name", i)
		switch {
		case g.Name == "":
			errs = append(errs, ferr(f, "is empty"))
			continue
		case guests[g.Name]:
			errs = append(errs, ferr(f, "%q appears twice", g.Name))
			continue
		case !nameRE.MatchString(g.Name):
			errs = append(errs, ferr(f, "%q must match %s", g.Name, nameRE))
			continue
		}
		guests[g.Name] = true
		tap := link.TapName(g.Name)
		if other, ok := taps[tap]; ok {
			errs = append(errs, ferr(f, "tap name %q of guest %q clashes with %s", tap, g.Name, other))
			continue
		}
		taps[tap] = fmt.Sprintf("the tap of guest %q", g.Name)
	}
	type hostKey struct {
		addr  netip.Addr
		proto string
		port  uint16
	}
	names := map[string]bool{}
	hosts := map[hostKey]string{}
	for i, e := range d.Exposures {
		f := func(field string) string { return fmt.Sprintf("exposures[%d].%s", i, field) }
		if err := bpf.ValidName(e.Name); err != nil {
			errs = append(errs, ferr(f("name"), "%v", err))
		} else if !nameRE.MatchString(e.Name) {
			errs = append(errs, ferr(f("name"), "%q must match %s", e.Name, nameRE))
		} else if names[e.Name] {
			errs = append(errs, ferr(f("name"), "%q appears twice", e.Name))
		}
		names[e.Name] = true
		if e.Protocol != "tcp" && e.Protocol != "udp" {
			errs = append(errs, ferr(f("protocol"), "%q is not tcp or udp", e.Protocol))
		}
		if e.HostPort == 0 {
			errs = append(errs, ferr(f("hostPort"), "must be 1..65535"))
		}
		if e.GuestPort == 0 {
			errs = append(errs, ferr(f("guestPort"), "must be 1..65535"))
		}
		if e.MaxConns < 0 || e.MaxConns > nft.MaxConnsLimit {
			errs = append(errs, ferr(f("maxConns"), "%d is outside 0 (unlimited)..%d", e.MaxConns, nft.MaxConnsLimit))
		}
		ha := e.HostAddress
		if !ha.IsValid() {
			ha = netip.IPv4Unspecified()
		}
		switch {
		case !ha.Is4():
			errs = append(errs, ferr(f("hostAddress"), "%s is not IPv4 (guests are IPv4-only)", ha))
		case ha.IsLoopback():
			errs = append(errs, ferr(f("hostAddress"), "%s is loopback: loopback callers are served by the proxy, never by DNAT", ha))
		}
		// Unique per (host address, protocol, port). 0.0.0.0 and a specific
		// address on the same port may coexist: the specific one wins, as
		// with socket binds (the nft table looks it up first).
		k := hostKey{ha, e.Protocol, e.HostPort}
		if other, ok := hosts[k]; ok {
			errs = append(errs, ferr(f("hostPort"), "%s %s:%d is already published by exposure %q", e.Protocol, ha, e.HostPort, other))
		} else {
			hosts[k] = e.Name
		}
		switch {
		case e.VM != "" && e.Target.IsValid():
			errs = append(errs, ferr(f("target"), "give either vm or target, not both"))
		case e.VM == "" && !e.Target.IsValid():
			errs = append(errs, ferr(f("vm"), "give the vm whose port is published, or a target address"))
		case e.VM != "" && !guests[e.VM]:
			errs = append(errs, ferr(f("vm"), "%q is not a guest on this network", e.VM))
		case e.Target.IsValid():
			t := e.Target
			switch {
			case !netOK:
			case !d.Network.CIDR.Masked().Contains(t):
				errs = append(errs, ferr(f("target"), "%s is outside the bridge subnet %s", t, d.Network.CIDR.Masked()))
			case t == d.Network.CIDR.Addr():
				errs = append(errs, ferr(f("target"), "%s is the bridge's own address", t))
			case t == d.Network.CIDR.Masked().Addr() || t == broadcast(d.Network.CIDR):
				errs = append(errs, ferr(f("target"), "%s is the subnet's network or broadcast address", t))
			default:
				for vm, a := range assigned {
					if a == t && guests[vm] {
						errs = append(errs, ferr(f("target"), "%s is assigned to guest %q", t, vm))
					}
				}
			}
		}
	}
	return errs
}

// validateAgainstKernel checks the spec against the namespace: the bridge
// name and tap names must not belong to links brokkr did not make, and the
// subnet must not overlap one on such a link.
func (p *Plane) validateAgainstKernel(d Desired, links []netlink.Link) []error {
	var errs []error
	foreign := map[string]bool{}
	for _, l := range links {
		if !link.Owned(l) {
			foreign[l.Attrs().Name] = true
		}
	}
	if foreign[d.Network.Bridge] {
		errs = append(errs, ferr("network.bridge", "link %q exists and was not created by brokkr", d.Network.Bridge))
	}
	for i, g := range d.Guests {
		if tap := link.TapName(g.Name); foreign[tap] {
			errs = append(errs, ferr(fmt.Sprintf("guests[%d].name", i), "tap name %q of guest %q clashes with an existing link brokkr did not create", tap, g.Name))
		}
	}
	prefixes, err := p.links.ForeignPrefixesIn(links)
	if err != nil {
		return append(errs, fmt.Errorf("network: reading addresses: %w", err))
	}
	subnet := d.Network.CIDR.Masked()
	for _, fp := range prefixes {
		if fp.Prefix.Masked().Overlaps(subnet) {
			errs = append(errs, ferr("network.cidr", "%s overlaps %s on %s", subnet, fp.Prefix, fp.Link))
		}
	}
	return errs
}

// nftPreflight runs the nft package's own validation on the rules this
// spec will become, before anything is applied, so a rule the table would
// refuse can never leave the links half-built. Guest addresses are not
// known yet; a VM's exposure uses the bridge address as a stand-in target
// (the checks on it are only "a routable IPv4 address").
func nftPreflight(d Desired) []error {
	n := d.Network
	r := nft.Rules{Bridge: n.Bridge, Subnet: n.CIDR.Masked(), Gateway: n.CIDR.Addr(),
		Masquerade: n.Masquerade, IsolateGuests: n.IsolateGuests, DHCP: n.DHCP}
	for _, g := range d.Guests {
		r.Guests = append(r.Guests, nft.Guest{Name: g.Name, Tap: link.TapName(g.Name), MAC: link.GuestMAC(g.Name, 0)})
	}
	for _, e := range d.Exposures {
		target := e.Target
		if e.VM != "" {
			target = n.CIDR.Addr()
		}
		r.Exposures = append(r.Exposures, nft.Exposure{Name: e.Name, Protocol: e.Protocol, HostAddr: e.HostAddress,
			HostPort: e.HostPort, GuestAddr: target, GuestPort: e.GuestPort, MaxConns: e.MaxConns})
	}
	var errs []error
	for _, err := range r.Validate() {
		errs = append(errs, fmt.Errorf("nft rules: %w", err))
	}
	return errs
}
