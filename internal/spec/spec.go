// Package spec is brokkr's desired state as the engines use it: typed,
// defaults filled in, and valid as a whole. Only daemon/config builds one
// (config.Compile, the single validation of a config file, an apply and a
// fleet document; docs/ARCHITECTURE.md, "Data flow"), so nothing downstream
// parses a string of it again or checks what Compile already checked; the
// engines check only facts of their environment.
package spec

import (
	"net/netip"
	"strconv"
	"time"
)

// Mode says which paths carry an exposure.
type Mode string

// Modes of an exposure.
const (
	ModeAuto  Mode = "auto"
	ModeNAT   Mode = "nat"
	ModeProxy Mode = "proxy"
)

// Proto is an exposure's transport protocol.
type Proto string

// Protocols an exposure may have.
const (
	TCP Proto = "tcp"
	UDP Proto = "udp"
)

// ProxyProtocol is the PROXY protocol header (HAProxy's format) the proxy
// writes to the guest before the first byte of each TCP connection it
// carries: the caller's address and the address it dialled. ProxyNone
// writes none.
type ProxyProtocol string

// PROXY protocol versions an exposure may ask for.
const (
	ProxyNone ProxyProtocol = ""
	ProxyV1   ProxyProtocol = "v1" // text: "PROXY TCP4 src dst sport dport\r\n"
	ProxyV2   ProxyProtocol = "v2" // binary, with the 12-byte signature
)

// Power is a VM's desired power.
type Power string

// Power values.
const (
	PowerRunning Power = "running"
	PowerStopped Power = "stopped"
	// PowerSuspended: the VM's memory state is on disk and no process runs
	// (docs/ARCHITECTURE.md, "Suspend and resume").
	PowerSuspended Power = "suspended"
)

// Restart is a VM's restart policy.
type Restart string

// Restart policies.
const (
	RestartAlways    Restart = "always"
	RestartOnFailure Restart = "on-failure"
	RestartNever     Restart = "never"
)

// Phase is where a VM is in its life (status "phase").
type Phase string

// Phases of a VM.
const (
	PhasePending  Phase = "pending"
	PhaseCreating Phase = "creating"
	PhaseStarting Phase = "starting"
	PhaseRunning  Phase = "running"
	PhaseStopping Phase = "stopping"
	PhaseStopped  Phase = "stopped"
	PhaseFailed   Phase = "failed"
	// Suspend and resume (docs/ARCHITECTURE.md, "Suspend and resume").
	PhaseSuspending Phase = "suspending"
	PhaseSuspended  Phase = "suspended"
	PhaseResuming   Phase = "resuming"
)

// ExposureState is an exposure's status "state", and the state each path
// (netplane, the socket path, the proxy) reports for its part of one.
type ExposureState string

// Exposure states, best first.
const (
	StateActive  ExposureState = "active"
	StatePending ExposureState = "pending"
	StateFailed  ExposureState = "failed"
)

// Rank orders states for merging the parts of one exposure: failed beats
// pending beats active.
func (s ExposureState) Rank() int {
	switch s {
	case StateActive:
		return 0
	case StatePending:
		return 1
	}
	return 2
}

// MaxConnsLimit is the largest cap an exposure may have: the nft set that
// enforces a cap in the kernel fallback is sized to it.
const MaxConnsLimit = 1 << 20

// Desired is the whole desired state. VMs and Exposures are in the
// config's order: index i is the config's vms[i] / exposures[i].
type Desired struct {
	Network   Network
	VMs       []VM
	Exposures []Exposure
}

// Network is the guest network.
type Network struct {
	Bridge string
	CIDR   netip.Prefix // the bridge's own address with the subnet's bits
	// CIDR6 is the bridge's IPv6 address with the guests' /64 (their
	// addresses come from it by SLAAC); the zero Prefix is IPv4 only.
	CIDR6         netip.Prefix
	MTU           int
	Masquerade    bool
	DHCP          bool
	IsolateGuests bool
}

// Source is a local path or an http(s) URL with the sha256 it must have.
type Source struct {
	Location string
	SHA256   string
}

// Disk is a VM's root disk.
type Disk struct {
	Source Source
	Size   int64 // bytes; 0 = the image's own size
}

// VM is one guest.
type VM struct {
	Name      string
	CPUs      int
	MemoryMiB int
	Kernel    Source
	Initramfs *Source
	Cmdline   string
	Disk      *Disk
	Power     Power
	Restart   Restart
	// IdleSuspend: suspended after this long with no connection open and
	// none accepted through its exposures, woken by the next caller; 0 =
	// never.
	IdleSuspend time.Duration
}

// Target is where an exposure sends callers: a VM brokkr runs (its leased
// address, and its SLAAC address where the guests have IPv6) or fixed
// addresses on the bridge's subnets, Addr and Addr6, either or both. A VM
// and a fixed address are never both set.
type Target struct {
	VM    string
	Addr  netip.Addr // IPv4; the zero Addr: none
	Addr6 netip.Addr // IPv6; the zero Addr: none
}

// IsVM reports whether the target is a VM (its address comes from a lease).
func (t Target) IsVM() bool { return t.VM != "" }

// String is the VM name or the addresses.
func (t Target) String() string {
	switch {
	case t.IsVM():
		return t.VM
	case !t.Addr6.IsValid():
		return t.Addr.String()
	case !t.Addr.IsValid():
		return t.Addr6.String()
	}
	return t.Addr.String() + "," + t.Addr6.String()
}

// Exposure is one published guest port.
type Exposure struct {
	Name   string
	Target Target
	Proto  Proto
	// HostAddr is where callers dial: the zero Addr is every host address
	// of both families (hostAddress ""), the unspecified address of a
	// family every address of that family, else one host address.
	HostAddr netip.Addr
	// HostPort is the host port, or the first of a range whose last is
	// HostPortLast (0: a single port). A range is one exposure: one slot,
	// one cap, one set of counters across every port of it.
	HostPort     uint16
	HostPortLast uint16
	// GuestPort is the guest port every host port goes to, or with
	// GuestPortLast (0: one guest port) the first of a range as long as
	// the host's, host port HostPort+i to GuestPort+i (GuestPortOf).
	GuestPort     uint16
	GuestPortLast uint16
	Mode          Mode
	MaxConns      int // 0 = unlimited
	// ProxyProtocol: a PROXY header to the guest on every connection the
	// proxy carries (TCP only; refused with nat). An auto exposure with one
	// is carried wholly by the proxy (UsesKernel, UsesSocketPath, ProxyBinds):
	// a guest that expects a header must get one on every connection.
	ProxyProtocol ProxyProtocol
	// AllowFrom are the only source prefixes whose callers are carried
	// (IPv4 and IPv6, masked: Compile refuses host bits); nil = everyone.
	// Callers from elsewhere are dropped before admission and counted as
	// denied. Host-local callers (the host's own processes) are not
	// restricted (README, "allowFrom").
	AllowFrom []netip.Prefix
	// AllByProxy is no key of the config: the daemon sets it on an auto
	// exposure the host's kernel cannot carry as it should (one cap with
	// the host-local paths, or allowFrom, where the nat path's programs do
	// not load): the proxy then carries every caller, on what auto listens
	// on (hostAddress, and ::1 beside 0.0.0.0).
	AllByProxy bool
	// IPv6ByProxy is no key of the config either: the daemon sets it on an
	// auto exposure of both families (hostAddress "") whose IPv6 callers
	// the host's kernel path cannot carry (the nat path's fallback
	// publishes IPv4 only): the kernel carries its IPv4 callers, the proxy
	// its IPv6 ones on ::.
	IPv6ByProxy bool
}

// MaxPortRange is the most ports one exposure's range may have: the
// socket path, the proxy and the held ports take one entry, listener or
// socket per port of it.
const MaxPortRange = 4096

// MaxSocketPathPorts is how many host ports the socket path translates at
// once, every exposure's together: one entry each (a range one per port)
// in its pinned sock_targets map, whose size it is.
const MaxSocketPathPorts = 65536

// IsRange reports whether the exposure publishes a range of host ports.
func (e Exposure) IsRange() bool { return e.HostPortLast > e.HostPort }

// LastHostPort is the last host port: HostPortLast for a range, else
// HostPort.
func (e Exposure) LastHostPort() uint16 {
	if e.IsRange() {
		return e.HostPortLast
	}
	return e.HostPort
}

// PortCount is how many host ports the exposure publishes.
func (e Exposure) PortCount() int { return int(e.LastHostPort()) - int(e.HostPort) + 1 }

// HostPorts lists the host ports, first to last.
func (e Exposure) HostPorts() []uint16 {
	out := make([]uint16, 0, e.PortCount())
	for p := int(e.HostPort); p <= int(e.LastHostPort()); p++ {
		out = append(out, uint16(p))
	}
	return out
}

// GuestRange reports whether each host port goes to a guest port of its
// own (a guest range), not all to GuestPort.
func (e Exposure) GuestRange() bool { return e.IsRange() && e.GuestPortLast > e.GuestPort }

// GuestPortOf is the guest port host port hp goes to (hp one of
// HostPorts).
func (e Exposure) GuestPortOf(hp uint16) uint16 {
	if e.GuestRange() {
		return e.GuestPort + (hp - e.HostPort)
	}
	return e.GuestPort
}

// SamePorts reports whether every host port goes to the same port on the
// guest (a single port or a range published as it is).
func (e Exposure) SamePorts() bool {
	return e.HostPort == e.GuestPort && (!e.IsRange() || e.GuestRange() && e.GuestPortLast == e.HostPortLast)
}

// PortText is a port or a range as the config writes it: "8080",
// "30000-30099".
func PortText(first, last uint16) string {
	if last > first {
		return strconv.Itoa(int(first)) + "-" + strconv.Itoa(int(last))
	}
	return strconv.Itoa(int(first))
}

// HostPortText is the host port or range ("30000-30099").
func (e Exposure) HostPortText() string { return PortText(e.HostPort, e.HostPortLast) }

// GuestPortText is the guest port or range.
func (e Exposure) GuestPortText() string {
	if e.GuestRange() {
		return PortText(e.GuestPort, e.GuestPortLast)
	}
	return PortText(e.GuestPort, 0)
}

// HostFamilies reports which address families the exposure's callers may
// dial it on.
func (e Exposure) HostFamilies() (v4, v6 bool) {
	if !e.HostAddr.IsValid() {
		return true, true
	}
	return e.HostAddr.Is4(), e.HostAddr.Is6()
}

// HostAddrs are the host addresses the exposure takes on its port, what its
// held sockets and the overlap checks cover: both unspecified addresses for
// "" (:: only where the host has IPv6), else hostAddress, and for auto on
// 0.0.0.0 also ::1 where the host has IPv6 loopback (its IPv6 loopback
// callers are served, by the socket path or auto's loopback listener).
func (e Exposure) HostAddrs(ipv6 bool) []netip.Addr {
	switch {
	case !e.HostAddr.IsValid() && ipv6:
		return []netip.Addr{netip.IPv4Unspecified(), netip.IPv6Unspecified()}
	case !e.HostAddr.IsValid():
		return []netip.Addr{netip.IPv4Unspecified()}
	case e.Mode == ModeAuto && e.HostAddr == netip.IPv4Unspecified() && ipv6:
		return []netip.Addr{e.HostAddr, netip.IPv6Loopback()}
	}
	return []netip.Addr{e.HostAddr}
}

// Wildcard reports whether the exposure answers on every host address of
// its families.
func (e Exposure) Wildcard() bool { return !e.HostAddr.IsValid() || e.HostAddr.IsUnspecified() }

// proxiedAuto: an auto exposure with a PROXY header, which only the proxy
// can write, or one the host's kernel cannot carry as it should
// (AllByProxy), so the proxy carries every caller of it.
func (e Exposure) proxiedAuto() bool {
	return e.Mode == ModeAuto && (e.ProxyProtocol != ProxyNone || e.AllByProxy)
}

// MaxAllowFrom bounds one exposure's allowFrom, and MaxAllowFromTotal all
// exposures' together: the nat path's LPM trie is sized to the total.
const (
	MaxAllowFrom      = 65536
	MaxAllowFromTotal = 1 << 20
)

// UsesKernel reports whether nftables DNAT (and the nat path) carries the
// exposure. auto on a loopback address cannot be: brokkr never sets
// route_localnet.
func (e Exposure) UsesKernel() bool {
	switch e.Mode {
	case ModeNAT:
		return true
	case ModeAuto:
		return !e.HostAddr.IsLoopback() && !e.proxiedAuto()
	}
	return false
}

// UsesSocketPath reports whether the socket path serves the exposure's
// host-local callers when it is attached: every auto exposure but one with
// a PROXY header (the socket path connects the caller straight to the
// guest, so no header could be written).
func (e Exposure) UsesSocketPath() bool { return e.Mode == ModeAuto && !e.proxiedAuto() }

// ProxyBinds lists the addresses the userspace proxy binds for the
// exposure (an IPv6 one with IPV6_V6ONLY): proxy mode binds hostAddress,
// both unspecified addresses for "" (:: only when the host has IPv6,
// ipv6); auto binds the loopback that DNAT cannot serve when hostAddress
// covers it: 127.0.0.1 for IPv4, and ::1 for IPv6 or beside 0.0.0.0 when
// the host has IPv6 loopback. With the socket path attached (sock) auto
// binds nothing: the socket path serves loopback callers. An auto exposure
// with a PROXY header binds what auto claims, socket path or not:
// hostAddress (both families for ""), and ::1 beside 0.0.0.0. One whose
// IPv6 callers the proxy carries (IPv6ByProxy) binds :: (and 127.0.0.1
// without the socket path).
func (e Exposure) ProxyBinds(ipv6, sock bool) []netip.Addr {
	a := e.HostAddr
	v4any, v6any := netip.IPv4Unspecified(), netip.IPv6Unspecified()
	lo4, lo6 := netip.AddrFrom4([4]byte{127, 0, 0, 1}), netip.IPv6Loopback()
	switch {
	case e.proxiedAuto() || e.Mode == ModeProxy:
		return e.HostAddrs(ipv6)
	case e.Mode == ModeAuto && e.IPv6ByProxy && !a.IsValid() && ipv6:
		// :: takes ::1's callers too.
		if sock {
			return []netip.Addr{v6any}
		}
		return []netip.Addr{lo4, v6any}
	case e.Mode == ModeAuto:
		switch {
		case sock:
			return nil
		case a.IsLoopback():
			return []netip.Addr{a}
		case a == v6any && ipv6:
			return []netip.Addr{lo6}
		case a == v6any:
			return nil
		case !a.IsValid() || a == v4any:
			if ipv6 {
				return []netip.Addr{lo4, lo6}
			}
			return []netip.Addr{lo4}
		}
	}
	return nil
}

// KernelExposures are the exposures nftables carries, in order.
func (d *Desired) KernelExposures() []Exposure {
	var out []Exposure
	for _, e := range d.Exposures {
		if e.UsesKernel() {
			out = append(out, e)
		}
	}
	return out
}

// VM returns the named VM.
func (d *Desired) VM(name string) (VM, bool) {
	for _, v := range d.VMs {
		if v.Name == name {
			return v, true
		}
	}
	return VM{}, false
}

// StaticIP is a guest's address on a network without DHCP: the address
// with the subnet's bits, and the gateway (the bridge); and its IPv6
// address with the /64 (the zero Prefix: none).
type StaticIP struct {
	Addr    netip.Prefix
	Gateway netip.Addr
	Addr6   netip.Prefix
}

// MaxExposures is how many exposures one host holds: each has a counter
// slot of its own in the pinned exposure_stats_v2 map (bpf.Slots), and a
// desired state with more is refused whole rather than half-served.
const MaxExposures = 1 << 17 // 131,072
