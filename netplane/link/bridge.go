package link

import (
	"fmt"
	"net/netip"

	"github.com/vishvananda/netlink"

	"github.com/brokkr/brokkr/internal/nlsafe"
)

// BridgeSpec is the bridge brokkr keeps: its name, its address with the
// subnet's prefix length (e.g. 10.213.0.1/24), its IPv6 address on the
// guests' /64 (the zero Prefix: none) and its MTU.
type BridgeSpec struct {
	Name  string
	Addr  netip.Prefix
	Addr6 netip.Prefix
	MTU   int
}

// EnsureBridge makes the bridge exist exactly as specified: created with
// brokkr's alias if missing, else its MTU, address and up state restored.
// Other IPv4 addresses on it are removed (an old CIDR), and so are IPv6
// addresses other than Addr6 and the link-local ones, where the bridge has
// IPv6 (IPv6Enabled; without it Addr6 is left out). It returns whether
// the bridge was created, and the drift it repaired on an existing bridge.
// A link of that name that brokkr did not make is an error and is left alone.
func (m *Manager) EnsureBridge(s BridgeSpec) (created bool, repaired []string, err error) {
	l, err := m.byName(s.Name)
	if err != nil {
		return false, nil, err
	}
	if l != nil && !(Owned(l) && l.Type() == "bridge") {
		return false, nil, fmt.Errorf("link %s %w", s.Name, ErrForeign)
	}
	if l == nil {
		br := &netlink.Bridge{LinkAttrs: netlink.LinkAttrs{
			Name: s.Name, MTU: s.MTU, HardwareAddr: bridgeMAC(s.Name),
		}}
		if err := m.h.LinkAdd(br); err != nil {
			return false, nil, fmt.Errorf("creating bridge %s: %w", s.Name, err)
		}
		if err := m.h.LinkSetAlias(br, bridgeAlias); err != nil {
			_ = m.h.LinkDel(br)
			return false, nil, fmt.Errorf("marking bridge %s: %w", s.Name, err)
		}
		created = true
		if l, err = m.byName(s.Name); err != nil || l == nil {
			return true, nil, fmt.Errorf("bridge %s vanished after creation: %v", s.Name, err)
		}
	}
	fix := func(what string) {
		if !created {
			repaired = append(repaired, fmt.Sprintf("bridge %s %s", s.Name, what))
		}
	}
	if s.MTU > 0 && l.Attrs().MTU != s.MTU {
		fix(fmt.Sprintf("had MTU %d, want %d", l.Attrs().MTU, s.MTU))
		if err := m.h.LinkSetMTU(l, s.MTU); err != nil {
			return created, repaired, fmt.Errorf("setting MTU of %s: %w", s.Name, err)
		}
	}
	addrs, err := nlsafe.AddrList(m.h, l, netlink.FAMILY_V4)
	if err != nil {
		return created, repaired, fmt.Errorf("addresses of %s: %w", s.Name, err)
	}
	have := false
	for _, a := range addrs {
		p, ok := prefixOf(a.IPNet)
		if ok && p == s.Addr {
			have = true
			continue
		}
		fix(fmt.Sprintf("had stray address %s", p))
		if err := m.h.AddrDel(l, &a); err != nil {
			return created, repaired, fmt.Errorf("removing %s from %s: %w", p, s.Name, err)
		}
	}
	if !have {
		fix(fmt.Sprintf("lost its address %s", s.Addr))
		if err := m.h.AddrAdd(l, &netlink.Addr{IPNet: ipNet(s.Addr)}); err != nil {
			return created, repaired, fmt.Errorf("adding %s to %s: %w", s.Addr, s.Name, err)
		}
	}
	if l.Attrs().Flags&netlinkUp == 0 {
		fix("was down")
		if err := m.h.LinkSetUp(l); err != nil {
			return created, repaired, fmt.Errorf("setting %s up: %w", s.Name, err)
		}
	}
	// After up: taking a link down removes its IPv6 addresses.
	if on, err := m.IPv6Enabled(s.Name); err != nil {
		return created, repaired, err
	} else if on {
		if err := m.ensureBridge6(l, s.Addr6, fix); err != nil {
			return created, repaired, err
		}
	}
	// A bridge's sysctls go with it: one re-made has the defaults again.
	return created, repaired, m.patientNeighbours(s.Name)
}

// DeleteBridge removes the bridge if brokkr made it; a missing bridge is
// fine, a foreign one is left alone and reported.
func (m *Manager) DeleteBridge(name string) error {
	l, err := m.byName(name)
	if err != nil || l == nil {
		return err
	}
	if !Owned(l) {
		return fmt.Errorf("not deleting %s: link %w", name, ErrForeign)
	}
	if err := m.h.LinkDel(l); err != nil && !nlsafe.IsNotFound(err) {
		return fmt.Errorf("deleting bridge %s: %w", name, err)
	}
	return nil
}
