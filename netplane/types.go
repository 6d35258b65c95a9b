// Package netplane owns the host side of the guest network: the bridge, one
// tap per VM, guest addressing (IPAM + DHCP), and the nftables table
// `inet brokkr` that publishes guest ports (map-dispatched DNAT with caps,
// counters, guards), masquerade, isolation and conntrack hygiene.
package netplane

import (
	"net"
	"net/netip"

	"github.com/brokkr/brokkr/bpf"
	"github.com/brokkr/brokkr/internal/spec"
)

// Network is the guest network, validated (config.Compile).
type Network = spec.Network

// Guest is a VM that needs a tap and an address.
type Guest struct {
	Name       string
	MultiQueue bool // create the tap with IFF_MULTI_QUEUE
	// Asleep: the VM is suspending, suspended or resuming. Its neighbour
	// entries are pinned to its MAC (link.PinNeighbours), so its callers'
	// packets reach the bridge, and wake it, though it answers no ARP.
	Asleep bool
}

// Exposure is one published port, validated (config.Compile).
type Exposure = spec.Exposure

// Desired is everything netplane converges to in one call.
type Desired struct {
	Network   Network
	Guests    []Guest
	Exposures []Exposure // only those that use the kernel path (mode nat or auto)
}

// GuestStatus is what the rest of the daemon needs to know about a guest's
// network: its tap, MAC, assigned address, and whether it has taken a lease.
type GuestStatus struct {
	Name    string
	Tap     string
	MAC     net.HardwareAddr
	Address netip.Addr // assigned by IPAM (stable); valid even before the lease
	Leased  bool       // the guest has asked for and taken its DHCP lease
	// Address6 is the guest's IPv6 address, formed from its MAC in the /64
	// (SLAAC); the zero Addr where the guests have no IPv6.
	Address6 netip.Addr
	Seen6    bool // the guest answered neighbour discovery at Address6
	Error    string
}

// ExposureStatus is one exposure's row.
type ExposureStatus struct {
	Name     string
	State    spec.ExposureState
	Reason   string
	Counters bpf.Counters
}

// Report is the result of one Converge.
type Report struct {
	Guests    []GuestStatus
	Exposures []ExposureStatus
	Repaired  []string // drift found and repaired on this pass ("tap brk-web was missing")
	Err       error    // a failure of the whole pass (the network section itself)
	Warnings  []string // conditions an operator should know of (the nat path's fallback)
}
