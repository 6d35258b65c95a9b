package config

import (
	"fmt"
	"net"
	"net/netip"
	"path/filepath"
	"regexp"
	"strconv"
	"strings"

	"github.com/brokkr/brokkr/internal/spec"
)

var (
	vmNameRE       = regexp.MustCompile(`^[a-z0-9-]{1,32}$`)
	exposureNameRE = regexp.MustCompile(`^[A-Za-z0-9][A-Za-z0-9._-]*$`)
	bridgeRE       = regexp.MustCompile(`^[A-Za-z0-9][A-Za-z0-9_-]{0,14}$`)
	sha256RE       = regexp.MustCompile(`^[0-9a-f]{64}$`)
	sizeRE         = regexp.MustCompile(`^([0-9]+)([KMGT]?)(i?B)?$`)
)

// Validate checks the whole config (defaults applied) and returns every
// problem, in file order. An empty result means valid.
func (c *Config) Validate() Errors {
	_, errs := Compile(c)
	return errs
}

// Compile is the one validation of desired state: it checks the whole
// config (defaults applied) and returns every problem, in file order, or
// the typed model the engines run from. It runs where desired state enters:
// Load and Parse (a config file, desired.json), the daemon's Apply (the API,
// a fleet document) and SetPower; nothing downstream checks again what it
// checked.
func Compile(c *Config) (*spec.Desired, Errors) {
	var errs Errors
	m := &spec.Desired{Network: spec.Network{Bridge: c.Network.Bridge, MTU: *c.Network.MTU,
		Masquerade: *c.Network.Masquerade, DHCP: *c.Network.DHCP, IsolateGuests: c.Network.IsolateGuests},
		VMs: make([]spec.VM, 0, len(c.VMs)), Exposures: make([]spec.Exposure, 0, len(c.Exposures))}
	add := func(path, format string, a ...any) {
		errs = append(errs, FieldError{Path: path, Msg: fmt.Sprintf(format, a...)})
	}

	for _, d := range []struct{ path, v string }{{"stateDir", c.StateDir}, {"runDir", c.RunDir}, {"bpfDir", c.BPFDir}} {
		if !filepath.IsAbs(d.v) {
			add(d.path, "%q is not an absolute path", d.v)
		}
	}
	if strings.Contains(filepath.Base(c.BPFDir), ".") {
		add("bpfDir", "%q: bpffs names may not contain '.'", c.BPFDir)
	}
	// sun_path is 108 bytes; leave room for per-VM sockets below runDir.
	if len(c.RunDir) > 60 {
		add("runDir", "%q is longer than 60 bytes (unix socket paths below it must fit in 108)", c.RunDir)
	}

	if l := c.Metrics.Listen; l != "" {
		host, port, err := net.SplitHostPort(l)
		pn, perr := strconv.Atoi(port)
		switch {
		case err != nil:
			add("metrics.listen", "%q is not host:port (like 127.0.0.1:9464)", l)
		case perr != nil || pn < 1 || pn > 65535:
			add("metrics.listen", "%q: the port must be 1..65535", l)
		case host != "":
			if a, err := netip.ParseAddr(host); err != nil || a.Zone() != "" {
				add("metrics.listen", "%q: the host must be an IP address (or empty for every address)", l)
			}
		}
	}

	n := c.Network
	if !bridgeRE.MatchString(n.Bridge) {
		add("network.bridge", "%q is not a valid interface name (1-15 of A-Z a-z 0-9 _ -)", n.Bridge)
	}
	cidr, err := netip.ParsePrefix(n.CIDR)
	switch {
	case err != nil:
		add("network.cidr", "%q is not an address with a prefix (like 10.213.0.1/24)", n.CIDR)
	case !cidr.Addr().Is4():
		add("network.cidr", "%q: only IPv4 guest networks are supported", n.CIDR)
	case cidr.Bits() > 29 || cidr.Bits() < 8:
		add("network.cidr", "%q: the prefix must be between /8 and /29", n.CIDR)
	case cidr.Addr() == cidr.Masked().Addr():
		add("network.cidr", "%q is the network address; give the bridge's own address (like 10.213.0.1/24)", n.CIDR)
	case cidr.Addr() == broadcast(cidr):
		add("network.cidr", "%s is the broadcast address", cidr)
	case cidr.Addr().IsLoopback() || cidr.Addr().IsMulticast():
		add("network.cidr", "%s is not a unicast address", cidr)
	default:
		m.Network.CIDR = cidr
	}
	if *n.MTU < minMTU || *n.MTU > maxMTU {
		add("network.mtu", "%d is out of range (%d..%d)", *n.MTU, minMTU, maxMTU)
	}

	h := c.Hypervisor
	if h.Kind != HypervisorCHV && h.Kind != HypervisorQEMU {
		add("hypervisor.kind", "%q is not one of cloud-hypervisor, qemu", h.Kind)
	}
	if h.Path != "" && !filepath.IsAbs(h.Path) {
		add("hypervisor.path", "%q is not an absolute path", h.Path)
	}
	if m := *h.MaxConcurrentCreates; m < 0 || m > maxConcurrentCreatesUp {
		add("hypervisor.maxConcurrentCreates", "%d is out of range (0..%d; 0 = unlimited)", m, maxConcurrentCreatesUp)
	}

	vms := map[string]int{}
	for i, v := range c.VMs {
		p := fmt.Sprintf("vms[%d]", i)
		switch {
		case v.Name == "":
			add(p+".name", "is required")
		case !vmNameRE.MatchString(v.Name):
			add(p+".name", "%q must be 1-32 of a-z 0-9 -", v.Name)
		default:
			if j, dup := vms[v.Name]; dup {
				add(p+".name", "%q is already the name of vms[%d]", v.Name, j)
			} else {
				vms[v.Name] = i
			}
		}
		mv := spec.VM{Name: v.Name, CPUs: *v.CPUs, Kernel: spec.Source{Location: v.Kernel, SHA256: v.KernelSHA256},
			Cmdline: v.Cmdline, Power: spec.Power(v.Power), Restart: spec.Restart(v.Restart)}
		if *v.CPUs < 1 || *v.CPUs > 256 {
			add(p+".cpus", "%d is out of range (1..256)", *v.CPUs)
		}
		if mem, err := ParseSize(v.Memory); err != nil {
			add(p+".memory", "%q is not a size (like 256M or 2G)", v.Memory)
		} else if mem < 16<<20 || mem%(1<<20) != 0 {
			add(p+".memory", "%q must be a whole number of MiB, at least 16M", v.Memory)
		} else {
			mv.MemoryMiB = int(mem >> 20)
		}
		if v.Kernel == "" {
			add(p+".kernel", "is required")
		} else {
			checkSource(add, p+".kernel", v.Kernel, p+".kernelSha256", v.KernelSHA256)
		}
		if v.Initramfs != "" {
			mv.Initramfs = &spec.Source{Location: v.Initramfs, SHA256: v.InitramfsSHA256}
			checkSource(add, p+".initramfs", v.Initramfs, p+".initramfsSha256", v.InitramfsSHA256)
		} else if v.InitramfsSHA256 != "" {
			add(p+".initramfsSha256", "is set but initramfs is not")
		}
		if strings.ContainsAny(v.Cmdline, "\n\x00") {
			add(p+".cmdline", "%q contains a newline or NUL", v.Cmdline)
		}
		if v.Disk != nil {
			if v.Disk.Source == "" {
				add(p+".disk.source", "is required")
			} else {
				checkSource(add, p+".disk.source", v.Disk.Source, p+".disk.sha256", v.Disk.SHA256)
			}
			mv.Disk = &spec.Disk{Source: spec.Source{Location: v.Disk.Source, SHA256: v.Disk.SHA256}}
			if v.Disk.Size != "" {
				if size, err := ParseSize(v.Disk.Size); err != nil {
					add(p+".disk.size", "%q is not a size (like 2G)", v.Disk.Size)
				} else {
					mv.Disk.Size = size
				}
			}
		}
		compileSuspend(add, p, v, &mv)
		if mv.Restart != spec.RestartAlways && mv.Restart != spec.RestartOnFailure && mv.Restart != spec.RestartNever {
			add(p+".restart", "%q is not one of always, on-failure, never", v.Restart)
		}
		m.VMs = append(m.VMs, mv)
	}

	names := map[string]int{}
	// Host binds by (protocol, port), in file order: an overlap is only
	// possible within one such list, so the check stays linear in the number
	// of exposures and names the first clash in the file.
	type portKey struct {
		proto string
		port  int
	}
	type bind struct {
		addr netip.Addr
		i    int
	}
	binds := map[portKey][]bind{}
	for i, e := range c.Exposures {
		p := fmt.Sprintf("exposures[%d]", i)
		me := spec.Exposure{Name: e.Name, Target: spec.Target{VM: e.VM}, Proto: spec.Proto(e.Protocol),
			HostPort: uint16(e.HostPort), GuestPort: uint16(e.GuestPort), Mode: spec.Mode(e.Mode), MaxConns: *e.MaxConns}
		switch {
		case e.Name == "":
			add(p+".name", "is required")
		case len(e.Name) > MaxExposureNameLen:
			add(p+".name", "%q is longer than %d bytes", e.Name, MaxExposureNameLen)
		case !exposureNameRE.MatchString(e.Name):
			add(p+".name", "%q must start with a letter or digit and hold only A-Z a-z 0-9 . _ -", e.Name)
		default:
			if j, dup := names[e.Name]; dup {
				add(p+".name", "%q is already the name of exposures[%d]", e.Name, j)
			} else {
				names[e.Name] = i
			}
		}
		switch {
		case e.VM == "" && e.Target == "":
			add(p, "one of vm or target is required")
		case e.VM != "" && e.Target != "":
			add(p, "vm %q and target %q are both set; give exactly one", e.VM, e.Target)
		case e.VM != "":
			if _, ok := vms[e.VM]; !ok {
				add(p+".vm", "%q is not a VM in vms", e.VM)
			}
		default:
			t, err := netip.ParseAddr(e.Target)
			switch {
			case err != nil || t.Zone() != "":
				add(p+".target", "%q is not an IP address", e.Target)
			case cidr.IsValid() && !cidr.Masked().Contains(t):
				add(p+".target", "%q is not inside network.cidr %s", e.Target, n.CIDR)
			case cidr.IsValid() && (t == cidr.Addr() || t == cidr.Masked().Addr() || t == broadcast(cidr)):
				add(p+".target", "%q is the bridge, network or broadcast address of network.cidr", e.Target)
			default:
				me.Target.Addr = t
			}
		}
		if me.Proto != spec.TCP && me.Proto != spec.UDP {
			add(p+".protocol", "%q is not one of tcp, udp", e.Protocol)
		}
		if e.GuestPort < 1 || e.GuestPort > 65535 {
			add(p+".guestPort", "%d is out of range (1..65535)", e.GuestPort)
		}
		portOK := e.HostPort >= 1 && e.HostPort <= 65535
		if !portOK {
			add(p+".hostPort", "%d is out of range (1..65535)", e.HostPort)
		}
		ha, err := netip.ParseAddr(e.HostAddress)
		if err != nil || ha.Zone() != "" {
			add(p+".hostAddress", "%q is not an IP address", e.HostAddress)
		} else if ha.IsMulticast() {
			add(p+".hostAddress", "%q is a multicast address", e.HostAddress)
		} else {
			me.HostAddr = ha
		}
		if me.Mode != spec.ModeAuto && me.Mode != spec.ModeNAT && me.Mode != spec.ModeProxy {
			add(p+".mode", "%q is not one of auto, nat, proxy", e.Mode)
		} else if me.Mode == spec.ModeNAT && err == nil && ha.IsLoopback() {
			add(p+".mode", "nat cannot publish on loopback %s (brokkr never sets route_localnet); use proxy or auto", e.HostAddress)
		} else if me.HostAddr.IsValid() && me.UsesKernel() && !me.HostAddr.Is4() {
			// The kernel path publishes IPv4 only: the guests have no IPv6.
			add(p+".hostAddress", "%s is not IPv4 (guests are IPv4-only)", me.HostAddr)
		}
		if *e.MaxConns < 0 {
			add(p+".maxConns", "%d is negative (0 = unlimited)", *e.MaxConns)
		} else if *e.MaxConns > spec.MaxConnsLimit {
			add(p+".maxConns", "%d is outside 0 (unlimited)..%d", *e.MaxConns, spec.MaxConnsLimit)
		}
		if err == nil && portOK && (e.Protocol == "tcp" || e.Protocol == "udp") {
			ha = ha.Unmap()
			// auto on 0.0.0.0 also listens on ::1 for IPv6 loopback callers.
			claims := []netip.Addr{ha}
			if me.Mode == spec.ModeAuto && ha == netip.IPv4Unspecified() {
				claims = append(claims, netip.IPv6Loopback())
			}
			k := portKey{e.Protocol, e.HostPort}
		check:
			for _, a := range claims {
				for _, other := range binds[k] {
					if addrsOverlap(other.addr, a) {
						add(p+".hostPort", "%d/%s on %s overlaps exposures[%d] (%s/%s on %s)", e.HostPort, e.Protocol, e.HostAddress,
							other.i, strconv.Itoa(k.port), k.proto, c.Exposures[other.i].HostAddress)
						break check
					}
				}
			}
			for _, a := range claims {
				binds[k] = append(binds[k], bind{a, i})
			}
		}
		m.Exposures = append(m.Exposures, me)
	}
	if errs = append(errs, c.Fleet.validate()...); len(errs) > 0 {
		return nil, errs
	}
	return m, nil
}

// addrsOverlap: the same address, or either is the unspecified address of
// the same family (0.0.0.0 takes every IPv4 address, :: every address).
func addrsOverlap(a, b netip.Addr) bool {
	if a == b {
		return true
	}
	if a.IsUnspecified() && (b.Is4() == a.Is4() || a.Is6()) {
		return true
	}
	if b.IsUnspecified() && (a.Is4() == b.Is4() || b.Is6()) {
		return true
	}
	return false
}

func broadcast(p netip.Prefix) netip.Addr {
	a := p.Masked().Addr().As4()
	host := uint32(1)<<(32-p.Bits()) - 1
	v := uint32(a[0])<<24 | uint32(a[1])<<16 | uint32(a[2])<<8 | uint32(a[3])
	v |= host
	return netip.AddrFrom4([4]byte{byte(v >> 24), byte(v >> 16), byte(v >> 8), byte(v)})
}

func isURL(s string) bool {
	return strings.HasPrefix(s, "http://") || strings.HasPrefix(s, "https://")
}

func checkSource(add func(string, string, ...any), path, loc, shaPath, sha string) {
	switch {
	case isURL(loc):
		if sha == "" {
			add(shaPath, "is required when %s is a URL", path[strings.LastIndex(path, ".")+1:])
		}
	case filepath.IsAbs(loc):
	default:
		add(path, "%q is neither an absolute path nor an http(s) URL", loc)
	}
	if sha != "" && !sha256RE.MatchString(sha) {
		add(shaPath, "%q is not a sha256 (64 lower-case hex digits)", sha)
	}
}

// ParseSize reads a size like 256M, 2G, 1048576, 512Ki or 1GiB (binary
// units) into bytes.
func ParseSize(s string) (int64, error) {
	m := sizeRE.FindStringSubmatch(s)
	if m == nil {
		return 0, fmt.Errorf("%q is not a size", s)
	}
	if m[3] != "" && m[2] == "" && m[3] != "B" {
		return 0, fmt.Errorf("%q is not a size", s)
	}
	n, err := strconv.ParseInt(m[1], 10, 64)
	if err != nil {
		return 0, fmt.Errorf("%q is not a size", s)
	}
	shift := map[string]uint{"": 0, "K": 10, "M": 20, "G": 30, "T": 40}[m[2]]
	if n > (1<<62)>>shift {
		return 0, fmt.Errorf("%q is too large", s)
	}
	return n << shift, nil
}
