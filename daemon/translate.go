package daemon

import (
	"fmt"
	"net"
	"net/netip"
	"slices"

	"github.com/brokkr/brokkr/internal/spec"
	"github.com/brokkr/brokkr/netplane"
	"github.com/brokkr/brokkr/proxy"
	"github.com/brokkr/brokkr/supervisor"
)

// The engines' inputs, made from the validated model (config.Compile): no
// string of the config is parsed again here.

func netDesired(m *spec.Desired) netplane.Desired {
	d := netplane.Desired{Network: m.Network, Exposures: m.KernelExposures()}
	for _, v := range m.VMs {
		d.Guests = append(d.Guests, netplane.Guest{Name: v.Name, MultiQueue: v.CPUs > 1})
	}
	return d
}

// withSleepers marks the guests of the VMs asleep (suspending, suspended
// or resuming) in nd: netplane pins their neighbour entries so that their
// callers' packets reach the bridge and wake them (netplane.Guest.Asleep).
func (d *Daemon) withSleepers(nd netplane.Desired) netplane.Desired {
	if d.opts.Wakes == nil {
		return nd
	}
	for i, g := range nd.Guests {
		nd.Guests[i].Asleep = d.opts.Wakes.Asleep(g.Name)
	}
	return nd
}

// natPathReporter is a network plane that says whether its nat exposures'
// caps are the shared slot's (netplane.Plane: why not, "" when they are or
// before its first pass chose).
type natPathReporter interface{ NatPathFallback() string }

// natFallback says why the kernel's nat path cannot carry what only its
// BPF programs do (one cap with the host-local paths, allowFrom), or "":
// the plane's own word once its first pass chose its cap backend (its
// programs may fail to load on a kernel that has every feature), else the
// prediction from the kernel's features that cmd/brokkrd made at start.
func (d *Daemon) natFallback() string {
	if n, ok := d.net.(natPathReporter); ok {
		if why := n.NatPathFallback(); why != "" {
			return why
		}
	}
	return d.opts.CappedAutoByProxy
}

// byProxy is m with its capped auto exposures that the kernel would carry
// carried wholly by the proxy (AllByProxy: on the host side and, beside
// 0.0.0.0, on ::1, as auto's loopback listeners), and their names; m
// itself is not changed. Used where the nat path's fallback runs: its cap is an nft
// set that the socket path's and the proxy's admissions (an atomic gauge
// in the exposure's slot) cannot see, so an auto exposure's outside and
// host-local callers would each have a cap of their own. The proxy admits
// every caller against the slot: one cap, exact, at the proxy's cost.
func byProxy(m *spec.Desired) (*spec.Desired, []string) {
	return toProxy(m, func(e spec.Exposure) bool { return e.Mode == spec.ModeAuto && e.MaxConns != 0 && e.UsesKernel() })
}

// restrictedByProxy is m with the exposures the kernel would carry that
// have an allowFrom made proxy exposures on the same host side, and their
// names. Used, like byProxy, where the nat path's fallback runs: allowFrom
// is enforced by the nat path's BPF programs, which do not load there, so
// the proxy (which checks it at accept) carries them rather than nobody.
func restrictedByProxy(m *spec.Desired) (*spec.Desired, []string) {
	return toProxy(m, func(e spec.Exposure) bool { return len(e.AllowFrom) != 0 && e.UsesKernel() })
}

// ipv6ByProxy is m with the auto exposures the kernel would carry that
// have IPv6 callers and a guest address of that family given those
// callers by the proxy, and their names. Used, like byProxy, where the nat
// path's fallback runs: it publishes IPv4 only (its cap sets are keyed by
// IPv4 connections), so an IPv6 caller of a default exposure (hostAddress
// "", both families) would go unanswered. One of both families keeps its
// IPv4 callers in the kernel (IPv6ByProxy: the proxy listens on ::); one of
// IPv6 alone is carried wholly by the proxy. Both count into the
// exposure's one slot. mode nat stays the kernel's alone, as asked.
func ipv6ByProxy(m *spec.Desired) (*spec.Desired, []string) {
	guest6 := func(e spec.Exposure) bool {
		if e.Target.IsVM() {
			return m.Network.CIDR6.IsValid()
		}
		return e.Target.Addr6.IsValid()
	}
	return moveExposures(m, func(e spec.Exposure) bool {
		_, v6 := e.HostFamilies()
		return e.Mode == spec.ModeAuto && v6 && e.UsesKernel() && guest6(e)
	}, func(e *spec.Exposure) {
		if e.HostAddr.IsValid() {
			e.AllByProxy = true
		} else {
			e.IPv6ByProxy = true
		}
	})
}

// fallbackMoves names the exposures onFallback gave the proxy, by why.
type fallbackMoves struct{ capped, restricted, ipv6 []string }

// warnings are the status lines that say what mv moved and why; fallback
// is why the nat path's programs do not run.
func (mv fallbackMoves) warnings(fallback string) []string {
	var out []string
	if len(mv.restricted) > 0 {
		out = append(out, fmt.Sprintf("exposures %v with allowFrom are carried by the proxy (the nat path's BPF programs enforce allowFrom and do not load here): %s", mv.restricted, fallback))
	}
	if len(mv.capped) > 0 {
		out = append(out, fmt.Sprintf("capped auto exposures %v are carried by the proxy for every caller, so that they keep one cap: %s", mv.capped, fallback))
	}
	if len(mv.ipv6) > 0 {
		out = append(out, fmt.Sprintf("the IPv6 callers of auto exposures %v are carried by the proxy (the kernel path publishes IPv4 only here): %s", fewNames(mv.ipv6), fallback))
	}
	return out
}

// onFallback is m as the engines carry it where the nat path's fallback
// runs: what only the BPF nat path carries as it should goes to the proxy
// (byProxy, restrictedByProxy, ipv6ByProxy); m itself is not changed.
func onFallback(m *spec.Desired) (*spec.Desired, fallbackMoves) {
	var mv fallbackMoves
	m, mv.capped = byProxy(m)
	m, mv.restricted = restrictedByProxy(m)
	m, mv.ipv6 = ipv6ByProxy(m)
	return m, mv
}

// toProxy is m with the exposures move picks carried by the proxy, and
// their names; m itself is not changed (cloned at the first one moved). An
// auto exposure stays auto, carried wholly by the proxy (AllByProxy keeps
// auto's listeners: the host side and ::1 beside 0.0.0.0); any other
// becomes a proxy exposure on its host side.
func toProxy(m *spec.Desired, move func(spec.Exposure) bool) (*spec.Desired, []string) {
	return moveExposures(m, move, func(e *spec.Exposure) {
		if e.Mode == spec.ModeAuto {
			e.AllByProxy = true
		} else {
			e.Mode = spec.ModeProxy
		}
	})
}

// moveExposures is m with set applied to the exposures move picks, and
// their names; m itself is not changed (cloned at the first one picked).
func moveExposures(m *spec.Desired, move func(spec.Exposure) bool, set func(*spec.Exposure)) (*spec.Desired, []string) {
	var moved []string
	var exps []spec.Exposure
	for i, e := range m.Exposures {
		if !move(e) {
			continue
		}
		if exps == nil {
			exps = slices.Clone(m.Exposures)
		}
		set(&exps[i])
		moved = append(moved, e.Name)
	}
	if exps == nil {
		return m, nil
	}
	out := *m
	out.Exposures = exps
	return &out, moved
}

func proxySpecs(m *spec.Desired, ipv6, sock bool) []proxy.Spec {
	var out []proxy.Spec
	for _, e := range m.Exposures {
		for _, addr := range e.ProxyBinds(ipv6, sock) {
			out = append(out, proxy.Specs(e, addr)...)
		}
	}
	return out
}

// guestFacts is what netplane told us about a VM's network.
type guestFacts struct {
	Tap      string
	MAC      net.HardwareAddr
	Address  netip.Addr
	Leased   bool
	Address6 netip.Addr // the zero Addr: IPv6 off
	Seen6    bool       // the guest answers at Address6
	Error    string
}

func vmSpecs(m *spec.Desired, facts map[string]guestFacts) []supervisor.VMSpec {
	out := make([]supervisor.VMSpec, 0, len(m.VMs))
	for _, v := range m.VMs {
		s := supervisor.VMSpec{
			Name:      v.Name,
			CPUs:      v.CPUs,
			MemoryMiB: v.MemoryMiB,
			Kernel:    v.Kernel,
			Initramfs: v.Initramfs,
			Cmdline:   v.Cmdline,
			Disk:      v.Disk,
			Power:     v.Power,
			Restart:   v.Restart,

			IdleSuspend: v.IdleSuspend,
		}
		if f, ok := facts[v.Name]; ok {
			s.Tap, s.MAC = f.Tap, f.MAC
			if !m.Network.DHCP && f.Address.IsValid() {
				s.IP = &spec.StaticIP{Addr: netip.PrefixFrom(f.Address, m.Network.CIDR.Bits()), Gateway: m.Network.CIDR.Addr()}
				if f.Address6.IsValid() {
					s.IP.Addr6 = netip.PrefixFrom(f.Address6, m.Network.CIDR6.Bits())
				}
			}
		}
		out = append(out, s)
	}
	return out
}

// HaveIPv6Loopback reports whether ::1 can be bound in this namespace (IPv6
// may be disabled; then auto exposures serve loopback callers on 127.0.0.1
// only).
func HaveIPv6Loopback() bool {
	ln, err := net.Listen("tcp6", "[::1]:0")
	if err != nil {
		return false
	}
	ln.Close()
	return true
}
