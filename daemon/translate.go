package daemon

import (
	"fmt"
	"net"
	"net/netip"
	"strings"

	"github.com/brokkr/brokkr/daemon/config"
	"github.com/brokkr/brokkr/netplane"
	"github.com/brokkr/brokkr/proxy"
	"github.com/brokkr/brokkr/supervisor"
)

// targetPrefix marks a proxy Spec.VM that is an explicit target address, not
// a VM name (VM names cannot contain ':').
const targetPrefix = "target:"

// usesKernel reports whether an exposure is carried by nftables DNAT. auto on
// a loopback address cannot be: brokkr never sets route_localnet.
func usesKernel(e config.Exposure) bool {
	switch e.Mode {
	case config.ModeNAT:
		return true
	case config.ModeAuto:
		a, err := netip.ParseAddr(e.HostAddress)
		return err == nil && !a.IsLoopback()
	}
	return false
}

// proxyBinds lists the addresses the userspace proxy binds for an exposure:
// proxy mode binds hostAddress; auto binds loopback (which DNAT cannot serve)
// when hostAddress covers it: 127.0.0.1, and ::1 when the host has IPv6
// loopback (ipv6). With the socket path (sock) auto binds nothing: it
// serves loopback callers.
func proxyBinds(e config.Exposure, ipv6, sock bool) []string {
	a, err := netip.ParseAddr(e.HostAddress)
	if err != nil {
		return nil
	}
	switch e.Mode {
	case config.ModeProxy:
		return []string{e.HostAddress}
	case config.ModeAuto:
		switch {
		case sock:
			return nil
		case a.IsLoopback():
			return []string{e.HostAddress}
		case a.IsUnspecified() && ipv6:
			return []string{"127.0.0.1", "::1"}
		case a.IsUnspecified():
			return []string{"127.0.0.1"}
		}
	}
	return nil
}

func netDesired(c *config.Config) netplane.Desired {
	cidr, _ := netip.ParsePrefix(c.Network.CIDR)
	d := netplane.Desired{Network: netplane.Network{
		Bridge:        c.Network.Bridge,
		CIDR:          cidr,
		MTU:           *c.Network.MTU,
		Masquerade:    *c.Network.Masquerade,
		DHCP:          *c.Network.DHCP,
		IsolateGuests: c.Network.IsolateGuests,
	}}
	for _, v := range c.VMs {
		d.Guests = append(d.Guests, netplane.Guest{Name: v.Name, MultiQueue: *v.CPUs > 1})
	}
	for _, e := range c.Exposures {
		if !usesKernel(e) {
			continue
		}
		ne := netplane.Exposure{
			Name:      e.Name,
			VM:        e.VM,
			Protocol:  e.Protocol,
			HostPort:  uint16(e.HostPort),
			GuestPort: uint16(e.GuestPort),
			MaxConns:  *e.MaxConns,
		}
		ne.HostAddress, _ = netip.ParseAddr(e.HostAddress)
		if e.Target != "" {
			ne.Target, _ = netip.ParseAddr(e.Target)
		}
		d.Exposures = append(d.Exposures, ne)
	}
	return d
}

func proxySpecs(c *config.Config, ipv6, sock bool) []proxy.Spec {
	var out []proxy.Spec
	for _, e := range c.Exposures {
		for _, addr := range proxyBinds(e, ipv6, sock) {
			vm := e.VM
			if e.Target != "" {
				vm = targetPrefix + e.Target
			}
			out = append(out, proxy.Spec{
				ID:          e.Name,
				VM:          vm,
				Protocol:    e.Protocol,
				HostAddress: addr,
				HostPort:    e.HostPort,
				GuestPort:   e.GuestPort,
				MaxConns:    *e.MaxConns,
			})
		}
	}
	return out
}

func source(loc, sha string) supervisor.Source { return supervisor.Source{Location: loc, SHA256: sha} }

// guestFacts is what netplane told us about a VM's network.
type guestFacts struct {
	Tap     string
	MAC     net.HardwareAddr
	Address netip.Addr
	Leased  bool
	Error   string
}

func vmSpecs(c *config.Config, facts map[string]guestFacts) []supervisor.VMSpec {
	cidr, _ := netip.ParsePrefix(c.Network.CIDR)
	out := make([]supervisor.VMSpec, 0, len(c.VMs))
	for _, v := range c.VMs {
		mem, _ := config.ParseSize(v.Memory)
		s := supervisor.VMSpec{
			Name:      v.Name,
			CPUs:      *v.CPUs,
			MemoryMiB: int(mem >> 20),
			Kernel:    source(v.Kernel, v.KernelSHA256),
			Cmdline:   v.Cmdline,
			Power:     v.Power,
			Restart:   v.Restart,
		}
		if v.Initramfs != "" {
			src := source(v.Initramfs, v.InitramfsSHA256)
			s.Initramfs = &src
		}
		if v.Disk != nil {
			size, _ := config.ParseSize(v.Disk.Size) // "" is 0: the image's own size
			s.Disk = &supervisor.Disk{Source: source(v.Disk.Source, v.Disk.SHA256), Size: size}
		}
		if f, ok := facts[v.Name]; ok {
			s.Tap, s.MAC = f.Tap, f.MAC
			if !*c.Network.DHCP && f.Address.IsValid() {
				s.IP = kernelIPParam(cidr, v.Name, f.Address)
			}
		}
		out = append(out, s)
	}
	return out
}

// kernelIPParam is the kernel parameter that gives a guest booted without
// DHCP its assigned address (Documentation/admin-guide/nfs/nfsroot.rst,
// "ip="): client, no server, the bridge as gateway, the subnet mask, the VM
// name as hostname, eth0, no autoconfiguration. Kernels without IP
// autoconfiguration leave it to the guest's init (the test guest reads it).
func kernelIPParam(bridge netip.Prefix, vm string, addr netip.Addr) string {
	mask := net.IP(net.CIDRMask(bridge.Bits(), 32)).String()
	return fmt.Sprintf("ip=%s::%s:%s:%s:eth0:off", addr, bridge.Addr(), mask, vm)
}

// resolveTarget handles the proxy Resolver's explicit-target form.
func resolveTarget(vm string) (string, bool) {
	if strings.HasPrefix(vm, targetPrefix) {
		return strings.TrimPrefix(vm, targetPrefix), true
	}
	return "", false
}

// ProxyPair carries the IPv6-loopback listeners on a second proxy.Manager.
// An auto exposure listens on 127.0.0.1 and ::1 under one name, and one
// Manager holds one listener per name; both Managers attach the exposure's
// counter slot by that name in the same Store, so the two listeners add
// into one entry and share nothing else.
type ProxyPair struct {
	Main, Loopback6 Proxy
}

// Converge hands ::1 specs to Loopback6 and the rest to Main.
func (p ProxyPair) Converge(specs []proxy.Spec) []proxy.Status {
	var main, v6 []proxy.Spec
	for _, s := range specs {
		if s.HostAddress == "::1" {
			v6 = append(v6, s)
		} else {
			main = append(main, s)
		}
	}
	return append(p.Main.Converge(main), p.Loopback6.Converge(v6)...)
}

// StopAll stops both.
func (p ProxyPair) StopAll() {
	p.Main.StopAll()
	p.Loopback6.StopAll()
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
