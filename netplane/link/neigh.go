package link

import (
	"errors"
	"fmt"
	"net"
	"net/netip"

	"github.com/vishvananda/netlink"
	"golang.org/x/sys/unix"

	"github.com/brokkr/brokkr/internal/nlsafe"
)

// PinNeighbours makes the host's neighbour entries on brokkr's bridge for
// the addresses of pins permanent, each at its MAC, and takes away every
// other permanent entry there (the bridge is brokkr's: a permanent entry on
// it is one a former pass pinned, for a VM awake again or gone).
//
// Why: a suspended guest answers no ARP or neighbour solicitation. A
// caller's packets would wait in the neighbour entry, before the bridge,
// and never reach the bridge's tc hooks, where the nat path asks for the
// VM's wake on kernels before 6.4 (docs/ARCHITECTURE.md, "The nat path on
// kernels before 6.4"). Pinned, they go out to the sleeping guest's port
// and wake it, as at the netfilter hooks; the guest resumes with the same
// MAC, so the entry stays right until the pass after the resume removes it.
//
// With no sleeper, as on most passes, and none at the last call either,
// it does nothing: no neighbour dump every pass for nothing.
func (m *Manager) PinNeighbours(bridge string, pins map[netip.Addr]net.HardwareAddr) (err error) {
	if len(pins) == 0 && m.nonePinned {
		return nil
	}
	defer func() { m.nonePinned = err == nil && len(pins) == 0 }()
	br, err := m.byName(bridge)
	if err != nil || br == nil {
		return err
	}
	idx := br.Attrs().Index
	have := map[netip.Addr]string{}
	var errs []error
	for _, fam := range []int{netlink.FAMILY_V4, netlink.FAMILY_V6} {
		ns, err := nlsafe.NeighList(m.h, idx, fam)
		if err != nil {
			return fmt.Errorf("listing the neighbours of %s: %w", bridge, err)
		}
		for _, n := range ns {
			if n.State&netlink.NUD_PERMANENT == 0 {
				continue
			}
			a, ok := netip.AddrFromSlice(n.IP)
			if !ok {
				continue
			}
			a = a.Unmap()
			if mac, want := pins[a]; want && mac.String() == n.HardwareAddr.String() {
				have[a] = mac.String()
				continue
			}
			if err := m.h.NeighDel(&n); err != nil && !errors.Is(err, unix.ENOENT) {
				errs = append(errs, fmt.Errorf("unpinning %s on %s: %w", a, bridge, err))
			}
		}
	}
	for a, mac := range pins {
		if _, ok := have[a]; ok {
			continue
		}
		fam := netlink.FAMILY_V4
		if a.Is6() {
			fam = netlink.FAMILY_V6
		}
		n := &netlink.Neigh{LinkIndex: idx, Family: fam, State: netlink.NUD_PERMANENT, IP: net.IP(a.AsSlice()), HardwareAddr: mac}
		if err := m.h.NeighSet(n); err != nil {
			errs = append(errs, fmt.Errorf("pinning %s at %s on %s: %w", a, mac, bridge, err))
		}
	}
	return errors.Join(errs...)
}
