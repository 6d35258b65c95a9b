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

// collector gathers every problem of one config, in file order.
type collector struct{ errs Errors }

func (c *collector) add(path, format string, a ...any) {
	c.errs = append(c.errs, FieldError{Path: path, Msg: fmt.Sprintf(format, a...)})
}

// Compile is the one validation of desired state: it checks the whole
// config (defaults applied) and returns every problem, in file order, or
// the typed model the engines run from. It runs where desired state enters:
// Load and Parse (a config file, desired.json), the daemon's Apply (the API,
// a fleet document) and SetPower; nothing downstream checks again what it
// checked.
//
// Each section is one step below; the exposures are checked one at a time
// against an index of what came before them (compileExposure), the same
// check an exposure added alone goes through.
func Compile(c *Config) (*spec.Desired, Errors) {
	var col collector
	compileDirs(c, &col)
	compileMetrics(c.Metrics, &col)
	network, cidr := compileNetwork(c.Network, &col)
	compileHypervisor(c.Hypervisor, &col)
	vms, vmIndex := compileVMs(c.VMs, &col)
	ix := newExposureIndex(cidr, c.Network.CIDR, network.CIDR6, vmIndex)
	exps := make([]spec.Exposure, 0, len(c.Exposures))
	for i, e := range c.Exposures {
		me := ix.check(fmt.Sprintf("exposures[%d]", i), e, &col)
		ix.insert(e, me, i)
		exps = append(exps, me)
	}
	compileCapacity(len(c.Exposures), &col)
	if errs := append(col.errs, c.Fleet.validate()...); len(errs) > 0 {
		return nil, errs
	}
	return &spec.Desired{Network: network, VMs: vms, Exposures: exps}, nil
}

// compileDirs checks the process-fixed directories.
func compileDirs(c *Config, col *collector) {
	for _, d := range []struct{ path, v string }{{"stateDir", c.StateDir}, {"runDir", c.RunDir}, {"bpfDir", c.BPFDir}} {
		if !filepath.IsAbs(d.v) {
			col.add(d.path, "%q is not an absolute path", d.v)
		}
	}
	if strings.Contains(filepath.Base(c.BPFDir), ".") {
		col.add("bpfDir", "%q: bpffs names may not contain '.'", c.BPFDir)
	}
	// sun_path is 108 bytes; leave room for per-VM sockets below runDir.
	if len(c.RunDir) > 60 {
		col.add("runDir", "%q is longer than 60 bytes (unix socket paths below it must fit in 108)", c.RunDir)
	}
}

// compileMetrics checks metrics.listen: an IP literal and a port.
func compileMetrics(m Metrics, col *collector) {
	l := m.Listen
	if l == "" {
		return
	}
	host, port, err := net.SplitHostPort(l)
	pn, perr := strconv.Atoi(port)
	switch {
	case err != nil:
		col.add("metrics.listen", "%q is not host:port (like 127.0.0.1:9464)", l)
	case perr != nil || pn < 1 || pn > 65535:
		col.add("metrics.listen", "%q: the port must be 1..65535", l)
	case host != "":
		if a, err := netip.ParseAddr(host); err != nil || a.Zone() != "" {
			col.add("metrics.listen", "%q: the host must be an IP address (or empty for every address)", l)
		}
	}
}

// compileNetwork checks the network section; the model's CIDR stays the
// zero Prefix when network.cidr is invalid. cidr is network.cidr as parsed
// (valid or not, if it parses): exposure targets are checked against it.
func compileNetwork(n Network, col *collector) (out spec.Network, cidr netip.Prefix) {
	out = spec.Network{Bridge: n.Bridge, MTU: *n.MTU, Masquerade: *n.Masquerade, DHCP: *n.DHCP, IsolateGuests: n.IsolateGuests}
	if !bridgeRE.MatchString(n.Bridge) {
		col.add("network.bridge", "%q is not a valid interface name (1-15 of A-Z a-z 0-9 _ -)", n.Bridge)
	}
	cidr, err := netip.ParsePrefix(n.CIDR)
	switch {
	case err != nil:
		col.add("network.cidr", "%q is not an address with a prefix (like 10.213.0.1/24)", n.CIDR)
	case !cidr.Addr().Is4():
		col.add("network.cidr", "%q: only IPv4 guest networks are supported", n.CIDR)
	case cidr.Bits() > 29 || cidr.Bits() < 8:
		col.add("network.cidr", "%q: the prefix must be between /8 and /29", n.CIDR)
	case cidr.Addr() == cidr.Masked().Addr():
		col.add("network.cidr", "%q is the network address; give the bridge's own address (like 10.213.0.1/24)", n.CIDR)
	case cidr.Addr() == broadcast(cidr):
		col.add("network.cidr", "%s is the broadcast address", cidr)
	case cidr.Addr().IsLoopback() || cidr.Addr().IsMulticast():
		col.add("network.cidr", "%s is not a unicast address", cidr)
	default:
		out.CIDR = cidr
	}
	if p6, ferr := compileCIDR6(*n.CIDR6); ferr != nil {
		col.errs = append(col.errs, *ferr)
	} else {
		out.CIDR6 = p6
	}
	if *n.MTU < minMTU || *n.MTU > maxMTU {
		col.add("network.mtu", "%d is out of range (%d..%d)", *n.MTU, minMTU, maxMTU)
	}
	return out, cidr
}

// compileHypervisor checks the hypervisor section (no part of the model:
// it is fixed for the process).
func compileHypervisor(h Hypervisor, col *collector) {
	if h.Kind != HypervisorCHV && h.Kind != HypervisorQEMU {
		col.add("hypervisor.kind", "%q is not one of cloud-hypervisor, qemu", h.Kind)
	}
	if h.Path != "" && !filepath.IsAbs(h.Path) {
		col.add("hypervisor.path", "%q is not an absolute path", h.Path)
	}
	if m := *h.MaxConcurrentCreates; m < 0 || m > maxConcurrentCreatesUp {
		col.add("hypervisor.maxConcurrentCreates", "%d is out of range (0..%d; 0 = unlimited)", m, maxConcurrentCreatesUp)
	}
}

// compileVMs checks every VM and returns the model's VMs and the index of
// each valid, unique name.
func compileVMs(vms []VM, col *collector) ([]spec.VM, map[string]int) {
	out := make([]spec.VM, 0, len(vms))
	index := map[string]int{}
	for i, v := range vms {
		p := fmt.Sprintf("vms[%d]", i)
		switch {
		case v.Name == "":
			col.add(p+".name", "is required")
		case !vmNameRE.MatchString(v.Name):
			col.add(p+".name", "%q must be 1-32 of a-z 0-9 -", v.Name)
		default:
			if j, dup := index[v.Name]; dup {
				col.add(p+".name", "%q is already the name of vms[%d]", v.Name, j)
			} else {
				index[v.Name] = i
			}
		}
		out = append(out, compileVM(p, v, col))
	}
	return out, index
}

// compileVM checks one VM's fields (its name's uniqueness is compileVMs').
func compileVM(p string, v VM, col *collector) spec.VM {
	mv := spec.VM{Name: v.Name, CPUs: *v.CPUs, Kernel: spec.Source{Location: v.Kernel, SHA256: v.KernelSHA256},
		Cmdline: v.Cmdline, Power: spec.Power(v.Power), Restart: spec.Restart(v.Restart)}
	if *v.CPUs < 1 || *v.CPUs > 256 {
		col.add(p+".cpus", "%d is out of range (1..256)", *v.CPUs)
	}
	if mem, err := ParseSize(v.Memory); err != nil {
		col.add(p+".memory", "%q is not a size (like 256M or 2G)", v.Memory)
	} else if mem < 16<<20 || mem%(1<<20) != 0 {
		col.add(p+".memory", "%q must be a whole number of MiB, at least 16M", v.Memory)
	} else {
		mv.MemoryMiB = int(mem >> 20)
	}
	if v.Kernel == "" {
		col.add(p+".kernel", "is required")
	} else {
		checkSource(col.add, p+".kernel", v.Kernel, p+".kernelSha256", v.KernelSHA256)
	}
	if v.Initramfs != "" {
		mv.Initramfs = &spec.Source{Location: v.Initramfs, SHA256: v.InitramfsSHA256}
		checkSource(col.add, p+".initramfs", v.Initramfs, p+".initramfsSha256", v.InitramfsSHA256)
	} else if v.InitramfsSHA256 != "" {
		col.add(p+".initramfsSha256", "is set but initramfs is not")
	}
	if strings.ContainsAny(v.Cmdline, "\n\x00") {
		col.add(p+".cmdline", "%q contains a newline or NUL", v.Cmdline)
	}
	if v.Disk != nil {
		if v.Disk.Source == "" {
			col.add(p+".disk.source", "is required")
		} else {
			checkSource(col.add, p+".disk.source", v.Disk.Source, p+".disk.sha256", v.Disk.SHA256)
		}
		mv.Disk = &spec.Disk{Source: spec.Source{Location: v.Disk.Source, SHA256: v.Disk.SHA256}}
		if v.Disk.Size != "" {
			if size, err := ParseSize(v.Disk.Size); err != nil {
				col.add(p+".disk.size", "%q is not a size (like 2G)", v.Disk.Size)
			} else {
				mv.Disk.Size = size
			}
		}
	}
	compileSuspend(col.add, p, v, &mv)
	if mv.Restart != spec.RestartAlways && mv.Restart != spec.RestartOnFailure && mv.Restart != spec.RestartNever {
		col.add(p+".restart", "%q is not one of always, on-failure, never", v.Restart)
	}
	return mv
}

// compileCapacity refuses more exposures than this host can count: each
// needs a counter slot of its own (spec.MaxExposures), and an exposure
// without one would be accepted and then never served.
func compileCapacity(n int, col *collector) {
	if n > spec.MaxExposures {
		col.add("exposures", "%d exposures, more than the %d this host can hold (one counter slot each in exposure_stats_v2); nothing was applied",
			n, spec.MaxExposures)
	}
}

// addrsOverlap: the same address, or either is the unspecified address of
// the same family (0.0.0.0 takes every IPv4 address, :: every address).
func addrsOverlap(a, b netip.Addr) bool {
	if a == b {
		return true
	}
	// An unspecified address covers its own family: brokkr binds :: with
	// IPV6_V6ONLY ("" claims both unspecified addresses).
	return (a.IsUnspecified() || b.IsUnspecified()) && a.Is4() == b.Is4()
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
