package netplane

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"net"
	"net/netip"
	"path/filepath"
	"sort"
	"strings"
	"sync"

	"github.com/vishvananda/netlink"

	"github.com/brokkr/brokkr/bpf"
	"github.com/brokkr/brokkr/internal/nlsafe"
	"github.com/brokkr/brokkr/netplane/dhcp"
	"github.com/brokkr/brokkr/netplane/ipam"
	"github.com/brokkr/brokkr/netplane/link"
	"github.com/brokkr/brokkr/netplane/nft"
	"github.com/brokkr/brokkr/netplane/radv"
)

// How a Plane decides (the reasons are next to the code):
//   - Ownership: links carry an ifalias "brokkr:bridge" / "brokkr:tap:<vm>"
//     (package link); only those are ever changed or deleted.
//   - Addresses: ipam leases are per VM and persisted; a VM's MAC is
//     persisted with its address. Exposure targets are reserved.
//   - "Leased" means the guest took its DHCP lease, or the bridge's
//     neighbour table shows its MAC at its address (a guest booted with
//     the kernel's ip= parameter, or one whose lease predates this process).
//   - An exposure's DNAT is installed as soon as its guest has an assigned
//     address; State stays "pending" until the guest is seen with it, so a
//     daemon restart never interrupts traffic while it waits to hear back.
//   - IPv6 (network.cidr6): router advertisements of the /64, guests form
//     their addresses from their MACs (SLAAC, ipam.SLAAC), so the address
//     is known before the guest boots; "seen" means the guest answered a
//     neighbour solicitation for it from its MAC (package radv). Where the
//     bridge has no IPv6 (disabled on the host, MTU below 1280) guests get
//     IPv4 only and Report.Warnings says why.
//   - DNS is not served: replies carry no DNS option.
//   - Counters: the nft table's absolute values are added to the
//     exposure_stats_v2 slot as differences since the last read (see
//     counters.go); the first read after start is a baseline.

// DefaultMTU is the bridge MTU when Network.MTU is 0.
const DefaultMTU = 1500

// Options configures a Plane.
type Options struct {
	NetNS    string     // path of the netns to manage ("" = the caller's current netns)
	StateDir string     // IPAM leases persisted here (stateDir/netplane/)
	Stats    *bpf.Store // counters of the kernel path go into the same slots
	Logger   *slog.Logger
	// OnLease, if set, is called when a guest takes its DHCP lease, or is
	// first seen at its IPv6 address, so the daemon can converge at once
	// instead of at the next tick. It runs on the DHCP server's or the
	// advertiser's goroutine: it must return at once (a non-blocking send
	// on a channel) and must never call Converge, Close or Teardown itself,
	// which wait for that goroutine.
	OnLease func(vm string, addr netip.Addr)
	// Overflow, if set, carries the connections the cap's slow path admits
	// (a capped TCP exposure whose kernel set was full when the caller
	// arrived, see netplane/nft): the daemon hands them to the proxy's
	// splice code. nil: the network plane splices them itself.
	Overflow func(exposure string, client, guest *net.TCPConn)
}

// Plane converges the guest network of one namespace: bridge, taps, IPAM,
// DHCP, and the nftables table, and feeds the kernel counters into the
// shared exposure_stats_v2 slots.
//
// Why it is this large (17 fields, 28 methods over plane.go, exposures.go,
// capbackend.go and validate.go): it is the one owner of a namespace's
// pieces, and a pass must see them under one lock (mu) so that a lease, its
// tap, its DHCP binding and its exposures' elements never disagree. Each
// piece's own logic lives in its package (link, ipam, dhcp, radv, nft);
// what is left here is the order of a pass and who may change what.
type Plane struct {
	opts  Options
	log   *slog.Logger
	links *link.Manager
	pool  *ipam.Pool

	mu        sync.Mutex // one Converge/Teardown/Close at a time
	table     *nft.Table // opened by the first pass that reaches it
	dhcp      *dhcp.Server
	dhcpIfIdx int
	radv      *radv.Server // nil: IPv6 off, or the bridge not ready for it yet
	radvIfIdx int
	slots     slotFeeds  // the published exposures' counter slots
	caps      capBackend // chosen by the first pass that finds the bridge
	made      madeLinks  // what earlier passes of this process made: a loss is drift
	facts     *passFacts // what the last full pass learned (nil before one)
	closed    bool
	ownStats  bool // Stats was made here (in memory) and is closed with the Plane

	macs macIndex // guest MAC → VM, for OnLease (its own lock: the DHCP server's goroutine reads it)
}

// madeLinks is what earlier passes of this process made: one missing now
// was removed behind brokkr's back, and its re-making is reported as drift.
type madeLinks struct {
	bridge      bool
	taps        map[string]bool
	forwarding  bool
	forwarding6 bool
}

// macIndex maps guest MACs to their VMs.
type macIndex struct {
	mu sync.Mutex
	vm map[string]string
}

// New opens the managed namespace and the leases file. It changes nothing
// in the kernel; the first Converge does.
func New(opts Options) (*Plane, error) {
	ownStats := opts.Stats == nil
	if opts.StateDir == "" {
		return nil, errors.New("netplane: StateDir is required (leases are persisted there)")
	}
	log := opts.Logger
	if log == nil {
		log = slog.New(slog.DiscardHandler)
	}
	if opts.Stats == nil {
		opts.Stats = bpf.NewInMemory("netplane: no store given")
	}
	pool, err := ipam.Open(filepath.Join(opts.StateDir, "netplane"))
	if err != nil {
		return nil, fmt.Errorf("netplane: %w", err)
	}
	links, err := link.New(opts.NetNS)
	if err != nil {
		return nil, fmt.Errorf("netplane: %w", err)
	}
	return &Plane{
		opts: opts, log: log, links: links, pool: pool, ownStats: ownStats,
		slots: slotFeeds{store: opts.Stats, log: log, feeds: map[string]*slotFeed{}},
		made:  madeLinks{taps: map[string]bool{}}, macs: macIndex{vm: map[string]string{}},
	}, nil
}

// Validate checks d (valid on its own: config.Compile) against what
// netplane derives from it and against the namespace (foreign links and
// subnets). Every error names its field. Nothing is applied.
func (p *Plane) Validate(d Desired) []error {
	links, err := p.links.Links()
	if err != nil {
		return []error{fmt.Errorf("network: reading links: %w", err)}
	}
	return p.validate(withDefaults(d), links)
}

// ValidateExposures is Validate's check of d's exposures alone (explicit
// targets against the addresses IPAM gave out), for a change of exposures
// that leaves the network and the guests as the last pass found them: no
// link or address dump, so a change costs what it is, not what the host
// has.
func (p *Plane) ValidateExposures(d Desired) []error {
	guests := make(map[string]bool, len(d.Guests))
	for _, g := range d.Guests {
		guests[g.Name] = true
	}
	return validateTargets(d.Exposures, p.assigned(), guests)
}

// assigned is each VM's address as IPAM gave it out.
func (p *Plane) assigned() map[string]netip.Addr {
	leases := p.pool.Leases()
	out := make(map[string]netip.Addr, len(leases))
	for vm, l := range leases {
		out[vm] = l.Addr
	}
	return out
}

func (p *Plane) validate(d Desired, links []netlink.Link) []error {
	return append(validateDerived(d, p.assigned()), p.validateAgainstKernel(d, links)...)
}

func withDefaults(d Desired) Desired {
	if d.Network.MTU == 0 {
		d.Network.MTU = DefaultMTU
	}
	return d
}

// Converge makes the namespace match d and reports. It is level-triggered:
// every pass compares with what the kernel has and repairs what drifted.
// When d does not validate, nothing is applied and Report.Err says why.
func (p *Plane) Converge(ctx context.Context, d Desired) Report {
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.closed {
		return Report{Err: errors.New("netplane: closed")}
	}
	d = withDefaults(d)
	// One link dump serves validation and the removal of stale links: both
	// only look at links that existed before this pass.
	links, err := p.links.Links()
	if err != nil {
		return Report{Err: fmt.Errorf("netplane: reading links: %w", err)}
	}
	if errs := p.validate(d, links); len(errs) > 0 {
		return Report{Err: fmt.Errorf("netplane: invalid network spec, nothing applied: %w", errors.Join(errs...))}
	}
	var rep Report
	n := d.Network

	created, repaired, err := p.links.EnsureBridge(link.BridgeSpec{Name: n.Bridge, Addr: n.CIDR, Addr6: n.CIDR6, MTU: n.MTU})
	rep.Repaired = append(rep.Repaired, repaired...)
	if created && p.made.bridge {
		rep.Repaired = append(rep.Repaired, fmt.Sprintf("bridge %s was missing", n.Bridge))
	}
	if err != nil {
		rep.Err = fmt.Errorf("netplane: network.bridge: %w", err)
		return rep
	}
	p.made.bridge = true
	// The guests' /64, where the bridge can carry IPv6.
	prefix6 := n.CIDR6
	if prefix6.IsValid() {
		if on, err := p.links.IPv6Enabled(n.Bridge); err != nil {
			rep.Err = fmt.Errorf("netplane: network.cidr6: %w", err)
			return rep
		} else if !on {
			rep.Warnings = append(rep.Warnings, fmt.Sprintf("network.cidr6: bridge %s has no IPv6 (disabled on this host, or an MTU below 1280): guests get IPv4 only", n.Bridge))
			prefix6 = netip.Prefix{}
		}
	}
	if changed, err := p.links.EnableForwarding(); err != nil {
		rep.Err = fmt.Errorf("netplane: %w", err)
		return rep
	} else if changed && p.made.forwarding {
		rep.Repaired = append(rep.Repaired, "net.ipv4.ip_forward was 0")
	}
	p.made.forwarding = true
	if err := ctx.Err(); err != nil {
		rep.Err = err
		return rep
	}

	// Addresses: explicit exposure targets are never leased.
	var vms []string
	for _, g := range d.Guests {
		vms = append(vms, g.Name)
	}
	var reserved []netip.Addr
	for _, e := range d.Exposures {
		if !e.Target.IsVM() && e.Target.Addr.IsValid() {
			reserved = append(reserved, e.Target.Addr)
		}
	}
	leases, noAddr, err := p.pool.Reconcile(ipam.Request{Bridge: n.CIDR, VMs: vms, Reserved: reserved, MAC: link.GuestMAC})
	if err != nil {
		rep.Err = fmt.Errorf("netplane: guest addresses: %w", err)
		return rep
	}

	// The taps of VMs no longer desired go first, so a new VM whose tap
	// name a departed one held gets it in the same pass; then the taps.
	if err := p.removeStaleLinks(d, links); err != nil {
		p.log.Warn("netplane: removing links of departed guests", "err", err)
	}
	guestErr := map[string]string{}
	for vm, err := range noAddr {
		guestErr[vm] = err.Error()
	}
	var specs []link.TapSpec
	for _, g := range d.Guests {
		if l, ok := leases[g.Name]; ok {
			specs = append(specs, link.TapSpec{
				VM: g.Name, Name: link.TapName(g.Name), GuestMAC: l.MAC, MultiQueue: g.MultiQueue, Bridge: n.Bridge, MTU: n.MTU,
			})
		}
	}
	for i, r := range p.links.EnsureTaps(specs) {
		s := specs[i]
		rep.Repaired = append(rep.Repaired, r.Repaired...)
		if r.Created && p.made.taps[s.Name] {
			rep.Repaired = append(rep.Repaired, fmt.Sprintf("tap %s was missing", s.Name))
		}
		if r.Err != nil {
			guestErr[s.VM] = r.Err.Error()
			continue
		}
		p.made.taps[s.Name] = true
	}

	// DHCP, and which guests hold an address.
	p.setMACs(leases)
	if err := p.convergeDHCP(n, leases); err != nil {
		rep.Err = fmt.Errorf("netplane: network.dhcp: %w", err)
	}
	if err := p.convergeRadv(n, prefix6, leases); err != nil {
		rep.Err = errors.Join(rep.Err, fmt.Errorf("netplane: network.cidr6: %w", err))
	}
	if err := p.links.PinNeighbours(n.Bridge, sleepers(d.Guests, leases, prefix6)); err != nil {
		rep.Warnings = append(rep.Warnings, fmt.Sprintf("suspended guests' callers may not wake them: %v", err))
	}
	hasAddr := p.guestsWithAddress(n.Bridge, leases)
	var seen6 map[string]netip.Addr
	if p.radv != nil {
		seen6 = p.radv.Seen()
	}

	for _, g := range d.Guests {
		st := GuestStatus{Name: g.Name, Tap: link.TapName(g.Name), Error: guestErr[g.Name]}
		if l, ok := leases[g.Name]; ok {
			st.MAC, st.Address, st.Leased = l.MAC, l.Addr, hasAddr[g.Name]
			if st.Address6 = ipam.SLAAC(prefix6, l.MAC); st.Address6.IsValid() {
				st.Seen6 = seen6[l.MAC.String()] == st.Address6
			}
		}
		rep.Guests = append(rep.Guests, st)
	}

	p.facts = &passFacts{network: n, prefix6: prefix6, leases: leases, hasAddr: hasAddr, guestErr: guestErr, guests: map[string]bool{}}
	for _, g := range d.Guests {
		p.facts.guests[g.Name] = true
	}
	rep.Exposures, rep.Repaired = p.convergeExposures(d, rep.Repaired)
	if len(d.Exposures) > 0 {
		rep.Warnings = append(rep.Warnings, p.capWarnings()...)
	}
	return rep
}

// sleepers is where the asleep guests' addresses are: each of their
// addresses (IPv4, and IPv6 on the /64) at their MAC.
func sleepers(guests []Guest, leases map[string]ipam.Lease, prefix6 netip.Prefix) map[netip.Addr]net.HardwareAddr {
	pins := map[netip.Addr]net.HardwareAddr{}
	for _, g := range guests {
		l, ok := leases[g.Name]
		if !g.Asleep || !ok {
			continue
		}
		if l.Addr.IsValid() {
			pins[l.Addr] = l.MAC
		}
		if a := ipam.SLAAC(prefix6, l.MAC); a.IsValid() {
			pins[a] = l.MAC
		}
	}
	return pins
}

// removeStaleLinks deletes brokkr's taps whose VM is no longer desired (or
// whose name no longer matches its VM) and brokkr's bridges other than the
// configured one (a renamed bridge). Foreign links are never listed here.
func (p *Plane) removeStaleLinks(d Desired, links []netlink.Link) error {
	want := map[string]bool{}
	for _, g := range d.Guests {
		want[link.TapName(g.Name)] = true
	}
	taps := link.OwnedTapsIn(links)
	var errs []error
	for tap, vm := range taps {
		if want[tap] && link.TapName(vm) == tap {
			continue
		}
		if err := p.links.DeleteTap(tap); err != nil {
			errs = append(errs, err)
			continue
		}
		delete(p.made.taps, tap)
		p.log.Info("netplane: removed tap of departed guest", "tap", tap, "vm", vm)
	}
	for _, l := range links {
		if l.Attrs().Alias == link.AliasPrefix+"bridge" && l.Attrs().Name != d.Network.Bridge {
			errs = append(errs, p.links.DeleteBridge(l.Attrs().Name))
		}
	}
	return errors.Join(errs...)
}

func (p *Plane) setMACs(leases map[string]ipam.Lease) {
	p.macs.mu.Lock()
	defer p.macs.mu.Unlock()
	p.macs.vm = map[string]string{}
	for vm, l := range leases {
		p.macs.vm[l.MAC.String()] = vm
	}
}

func (p *Plane) onLease(mac net.HardwareAddr, addr netip.Addr) {
	p.macs.mu.Lock()
	vm, ok := p.macs.vm[mac.String()]
	p.macs.mu.Unlock()
	p.log.Info("netplane: guest took its lease", "vm", vm, "mac", mac.String(), "addr", addr)
	if ok && p.opts.OnLease != nil {
		p.opts.OnLease(vm, addr)
	}
}

func (p *Plane) onSeen6(mac net.HardwareAddr, addr netip.Addr) {
	p.macs.mu.Lock()
	vm, ok := p.macs.vm[mac.String()]
	p.macs.mu.Unlock()
	p.log.Info("netplane: guest answers at its IPv6 address", "vm", vm, "mac", mac.String(), "addr", addr)
	if ok && p.opts.OnLease != nil {
		p.opts.OnLease(vm, addr)
	}
}

// convergeDHCP keeps one server running on the bridge while Network.DHCP is
// set. It is restarted when its settings change or the bridge was re-made
// (a socket bound to a device follows the old ifindex, not the name).
func (p *Plane) convergeDHCP(n Network, leases map[string]ipam.Lease) error {
	if !n.DHCP {
		p.stopDHCP()
		return nil
	}
	br, err := nlsafe.LinkByName(p.links.Handle(), n.Bridge)
	if err != nil {
		return err
	}
	cfg := dhcp.Config{Interface: n.Bridge, Server: n.CIDR, MTU: n.MTU}
	if p.dhcp != nil {
		cur := p.dhcp.Config()
		if cur.Interface != cfg.Interface || cur.Server != cfg.Server || cur.MTU != cfg.MTU || p.dhcpIfIdx != br.Attrs().Index {
			p.stopDHCP()
		}
	}
	if p.dhcp == nil {
		s, err := dhcp.Start(p.opts.NetNS, cfg, p.log, p.onLease)
		if err != nil {
			return err
		}
		p.dhcp, p.dhcpIfIdx = s, br.Attrs().Index
	}
	var bs []dhcp.Binding
	for _, l := range leases {
		bs = append(bs, dhcp.Binding{MAC: l.MAC, Addr: l.Addr})
	}
	p.dhcp.SetBindings(bs)
	return nil
}

// convergeRadv keeps one advertiser on the bridge while the guests have a
// /64 (prefix6 valid). It is restarted when its settings change or the
// bridge was re-made; a prefix that changed or went is withdrawn first, so
// guests stop using it. Until the bridge has a usable link-local address
// (a port with carrier) there is nothing to start, and no error.
func (p *Plane) convergeRadv(n Network, prefix6 netip.Prefix, leases map[string]ipam.Lease) error {
	if !prefix6.IsValid() {
		p.stopRadv(true)
		return nil
	}
	br, err := nlsafe.LinkByName(p.links.Handle(), n.Bridge)
	if err != nil {
		return err
	}
	cfg := radv.Config{Interface: n.Bridge, Prefix: prefix6, MTU: n.MTU, DefaultRouter: p.made.forwarding6}
	if p.radv != nil {
		if cur := p.radv.Config(); cur != cfg || p.radvIfIdx != br.Attrs().Index {
			p.stopRadv(cur.Prefix.Masked() != prefix6.Masked())
		}
	}
	if p.radv == nil {
		s, err := radv.Start(p.opts.NetNS, cfg, p.log, p.onSeen6)
		if errors.Is(err, radv.ErrNotReady) {
			return nil
		}
		if err != nil {
			return err
		}
		p.radv, p.radvIfIdx = s, br.Attrs().Index
	}
	bs := make([]radv.Binding, 0, len(leases))
	for _, l := range leases {
		bs = append(bs, radv.Binding{MAC: l.MAC, Addr: ipam.SLAAC(prefix6, l.MAC)})
	}
	p.radv.SetBindings(bs)
	return nil
}

// stopRadv stops the advertiser, withdrawing its prefix from the guests
// when asked to.
func (p *Plane) stopRadv(withdraw bool) {
	if p.radv == nil {
		return
	}
	if withdraw {
		_ = p.radv.Withdraw()
	} else {
		_ = p.radv.Close()
	}
	p.radv = nil
}

func (p *Plane) stopDHCP() {
	if p.dhcp != nil {
		_ = p.dhcp.Close()
		p.dhcp = nil
	}
}

// guestsWithAddress: a guest has its address when it took the DHCP lease,
// or when the bridge's neighbour table shows its MAC at its assigned address
// (a guest configured statically, e.g. with ip= on the kernel command line,
// or one whose lease predates this daemon).
func (p *Plane) guestsWithAddress(bridge string, leases map[string]ipam.Lease) map[string]bool {
	out := map[string]bool{}
	var leased map[string]netip.Addr
	if p.dhcp != nil {
		leased = p.dhcp.Leased()
	}
	byMAC := map[string]string{}
	for vm, l := range leases {
		byMAC[l.MAC.String()] = vm
		if a, ok := leased[l.MAC.String()]; ok && a == l.Addr {
			out[vm] = true
		}
	}
	br, err := nlsafe.LinkByName(p.links.Handle(), bridge)
	if err != nil {
		return out
	}
	neighs, err := nlsafe.NeighList(p.links.Handle(), br.Attrs().Index, netlink.FAMILY_V4)
	if err != nil {
		p.log.Warn("netplane: reading neighbours", "err", err)
		return out
	}
	for _, nb := range neighs {
		if nb.State&(netlink.NUD_FAILED|netlink.NUD_INCOMPLETE) != 0 || nb.HardwareAddr == nil {
			continue
		}
		vm, ok := byMAC[nb.HardwareAddr.String()]
		if !ok {
			continue
		}
		if a, ok := netip.AddrFromSlice(nb.IP.To4()); ok && a == leases[vm].Addr {
			out[vm] = true
		}
	}
	return out
}

// Close stops the DHCP server and the advertiser and releases the counter slots (their values
// stay). Links, addresses and the nft table stay in the kernel.
func (p *Plane) Close() error {
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.closed {
		return nil
	}
	p.closed = true
	p.stopDHCP()
	p.stopRadv(false) // VMs outlive the daemon, and keep their addresses
	p.slots.close()
	var err error
	if p.table != nil {
		err = p.table.Close()
	}
	if p.caps != nil {
		err = errors.Join(err, p.caps.close())
		p.caps = nil
	}
	p.links.Close()
	if p.ownStats {
		_ = p.opts.Stats.Close()
	}
	return err
}

// Teardown removes exactly what brokkr made in the namespace: the nft
// table, every link carrying brokkr's alias (taps, bridges). Foreign links
// stay. Leases stay on disk, so a later start gives the same addresses.
func (p *Plane) Teardown() error {
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.closed {
		return errors.New("netplane: closed")
	}
	p.stopDHCP()
	p.stopRadv(true)
	var errs []error
	if err := p.openTable(); err != nil {
		errs = append(errs, err)
	}
	if p.table != nil {
		if err := p.table.Delete(); err != nil {
			errs = append(errs, fmt.Errorf("deleting nft table: %w", err))
		}
	}
	if p.caps != nil {
		errs = append(errs, p.caps.remove())
		p.caps = nil // the next pass chooses again
	}
	taps, err := p.links.OwnedTaps()
	if err != nil {
		return errors.Join(append(errs, err)...)
	}
	names := make([]string, 0, len(taps))
	for t := range taps {
		names = append(names, t)
	}
	sort.Strings(names)
	for _, t := range names {
		errs = append(errs, p.links.DeleteTap(t))
	}
	links, err := p.links.Links()
	if err != nil {
		return errors.Join(append(errs, err)...)
	}
	for _, l := range links {
		if strings.HasPrefix(l.Attrs().Alias, link.AliasPrefix+"bridge") {
			errs = append(errs, p.links.DeleteBridge(l.Attrs().Name))
		}
	}
	p.made.bridge, p.made.taps = false, map[string]bool{}
	return errors.Join(errs...)
}
