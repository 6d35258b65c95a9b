package netplane

import (
	"fmt"
	"net/netip"

	"github.com/vishvananda/netlink"

	"github.com/brokkr/brokkr/netplane/link"
)

// The desired state arrives validated (config.Compile); what is checked here
// is what only this package or the namespace knows: the tap names netplane
// derives, the addresses IPAM has given out, and the links, addresses and
// routes that brokkr did not make. Every error names its field.

// validateDerived checks what netplane derives from d: tap names (a long VM
// name is shortened, so two may meet, or meet the bridge) and explicit
// targets against the addresses IPAM has assigned (assigned maps VM → its
// current address).
func validateDerived(d Desired, assigned map[string]netip.Addr) []error {
	var errs []error
	guests := map[string]bool{}
	taps := map[string]string{d.Network.Bridge: "the bridge"}
	for i, g := range d.Guests {
		guests[g.Name] = true
		tap := link.TapName(g.Name)
		if other, ok := taps[tap]; ok {
			errs = append(errs, fmt.Errorf("guests[%d].name: tap name %q of guest %q clashes with %s", i, tap, g.Name, other))
			continue
		}
		taps[tap] = fmt.Sprintf("the tap of guest %q", g.Name)
	}
	return append(errs, validateTargets(d.Exposures, assigned, guests)...)
}

// validateTargets checks explicit targets against the addresses IPAM has
// assigned to desired guests.
func validateTargets(exps []Exposure, assigned map[string]netip.Addr, guests map[string]bool) []error {
	var errs []error
	for i, e := range exps {
		if e.Target.IsVM() {
			continue
		}
		for vm, a := range assigned {
			if a == e.Target.Addr && guests[vm] {
				errs = append(errs, fmt.Errorf("exposures[%d].target: %s is assigned to guest %q", i, a, vm))
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
		errs = append(errs, fmt.Errorf("network.bridge: link %q exists and was not created by brokkr", d.Network.Bridge))
	}
	for i, g := range d.Guests {
		if tap := link.TapName(g.Name); foreign[tap] {
			errs = append(errs, fmt.Errorf("guests[%d].name: tap name %q of guest %q clashes with an existing link brokkr did not create", i, tap, g.Name))
		}
	}
	prefixes, err := p.links.ForeignPrefixesIn(links)
	if err != nil {
		return append(errs, fmt.Errorf("network: reading addresses: %w", err))
	}
	subnet, subnet6 := d.Network.CIDR.Masked(), d.Network.CIDR6.Masked()
	for _, fp := range prefixes {
		if fp.Prefix.Masked().Overlaps(subnet) {
			errs = append(errs, fmt.Errorf("network.cidr: %s overlaps %s on %s", subnet, fp.Prefix, fp.Link))
		}
		if subnet6.IsValid() && fp.Prefix.Masked().Overlaps(subnet6) {
			errs = append(errs, fmt.Errorf("network.cidr6: %s overlaps %s on %s", subnet6, fp.Prefix, fp.Link))
		}
	}
	return errs
}
