package netplane

import (
	"context"
	"errors"
	"fmt"
	"net/netip"

	"github.com/brokkr/brokkr/bpf/ctmark"
	"github.com/brokkr/brokkr/internal/spec"
	"github.com/brokkr/brokkr/netplane/ipam"
	"github.com/brokkr/brokkr/netplane/link"
	"github.com/brokkr/brokkr/netplane/nft"
)

// passFacts are what the last full pass learned that an exposure's rules
// and row depend on: an exposure changed on its own (UpdateExposures) is
// published against them, without the pass being run again.
type passFacts struct {
	network  Network
	prefix6  netip.Prefix // the guests' /64 where the bridge carries IPv6; zero: none
	leases   map[string]ipam.Lease
	hasAddr  map[string]bool
	guestErr map[string]string
	guests   map[string]bool // the desired guests
}

// convergeExposures builds the table's rules, applies them, feeds the
// counters into the slots and reports one row per exposure.
func (p *Plane) convergeExposures(d Desired, repaired []string) ([]ExposureStatus, []string) {
	f := p.facts
	n := d.Network
	rules := nft.Rules{
		Bridge: n.Bridge, Subnet: n.CIDR.Masked(), Subnet6: f.prefix6,
		Masquerade: n.Masquerade, IsolateGuests: n.IsolateGuests, DHCP: n.DHCP,
	}
	// Anti-spoof admits each tap's assigned address from the start, not
	// only after the DHCP ACK: a guest configured with ip= must be able to
	// ARP and talk before anyone has seen it, and the assigned address is
	// the only one it could ever lease.
	for _, g := range d.Guests {
		if l, ok := f.leases[g.Name]; ok && f.guestErr[g.Name] == "" {
			rules.Guests = append(rules.Guests, nft.Guest{Name: g.Name, Tap: link.TapName(g.Name), MAC: l.MAC, Addr: l.Addr,
				Addr6: ipam.SLAAC(f.prefix6, l.MAC)})
		}
	}
	p.chooseCap(n)
	rules.Cap = p.caps.tableCap()
	repaired = append(repaired, p.forward6(f.prefix6)...)
	p.slots.attachAll(d.Exposures)
	status := make([]ExposureStatus, len(d.Exposures))
	rules.Exposures = make([]nft.Exposure, 0, len(d.Exposures))
	for i, e := range d.Exposures {
		x, st, ok := p.kernelExposure(e, f)
		status[i] = st
		if ok {
			rules.Exposures = append(rules.Exposures, x)
		}
	}

	tableErr := p.withTable(func(t *nft.Table) (nft.Result, error) { return t.Converge(rules) }, &repaired)
	if tableErr == nil && len(rules.Exposures) > 0 {
		p.caps.feed(p.slots.feeds)
	}
	if tableErr == nil {
		live := make(map[int]bool, len(p.slots.feeds))
		for _, f := range p.slots.feeds {
			live[f.slot.Index()] = true
		}
		p.caps.pruneAllow(func(slot int) bool { return live[slot] })
	}
	for i, e := range d.Exposures {
		p.finishRow(&status[i], e.Name, tableErr)
	}
	return status, repaired
}

// UpdateExposures creates or replaces the exposures of set and deletes the
// exposures named in remove, against what the last Converge learned of the
// network (leases, taps): the network and every other exposure stay as they
// are. It costs O(len(set)+len(remove)) however many exposures there are,
// and the Report holds a row for each exposure of set, in order, and
// nothing else (no guests). set comes from the validated desired state,
// like Converge's. Before a first Converge it applies nothing.
func (p *Plane) UpdateExposures(ctx context.Context, set []Exposure, remove []string) Report {
	p.mu.Lock()
	defer p.mu.Unlock()
	switch {
	case p.closed:
		return Report{Err: errors.New("netplane: closed")}
	case p.facts == nil || p.table == nil:
		return Report{Err: errors.New("netplane: no full pass yet: the network is not known")}
	}
	if err := ctx.Err(); err != nil {
		return Report{Err: err}
	}
	f := p.facts
	if errs := validateTargets(set, p.assigned(), f.guests); len(errs) > 0 {
		return Report{Err: fmt.Errorf("netplane: invalid exposures, nothing applied: %w", errors.Join(errs...))}
	}
	gone := map[string]bool{}
	for _, n := range remove {
		gone[n] = true
	}
	rows := make([]ExposureStatus, len(set))
	publish := make([]nft.Exposure, 0, len(set))
	unpublish := append([]string(nil), remove...)
	for i, e := range set {
		if gone[e.Name] {
			return Report{Err: fmt.Errorf("netplane: exposure %s is both set and removed, nothing applied", e.Name)}
		}
		p.slots.attach(e)
		x, st, ok := p.kernelExposure(e, f)
		rows[i] = st
		if ok {
			publish = append(publish, x)
		} else {
			// Failed: it has no element (an earlier version of it goes).
			unpublish = append(unpublish, e.Name)
		}
	}
	var rep Report
	// A removed exposure with no connection open has no conntrack entry to
	// flush: the BPF nat path's gauge counts every flow it admitted until
	// it ends (the set-based cap's, fed by events, is not relied on).
	_, exact := p.caps.(*natPathBackend)
	idle := func(name string) bool {
		f := p.slots.feeds[name]
		return exact && gone[name] && f != nil && f.slot.Read().Active == 0
	}
	tableErr := p.withTable(func(t *nft.Table) (nft.Result, error) { return t.Update(publish, unpublish, idle) }, &rep.Repaired)
	if tableErr == nil {
		for _, n := range remove {
			if f := p.slots.feeds[n]; f != nil {
				if err := p.caps.allow(f.slot, nil); err != nil {
					p.log.Warn("netplane: lifting allowFrom", "exposure", n, "err", err)
				}
			}
			p.slots.release(n)
		}
	}
	for i, e := range set {
		p.finishRow(&rows[i], e.Name, tableErr)
	}
	rep.Exposures = rows
	if len(set) > 0 {
		rep.Warnings = append(rep.Warnings, p.capWarnings()...)
	}
	return rep
}

// kernelExposure is how the table publishes e given the last pass's facts,
// and e's row: ok is false when e cannot be published (then it has no
// element in the table).
func (p *Plane) kernelExposure(e Exposure, f *passFacts) (nft.Exposure, ExposureStatus, bool) {
	st := ExposureStatus{Name: e.Name, State: spec.StateActive}
	target, target6 := e.Target.Addr, e.Target.Addr6
	if vm := e.Target.VM; vm != "" {
		l, ok := f.leases[vm]
		switch {
		case !ok:
			st.State, st.Reason = spec.StateFailed, fmt.Sprintf("guest %s has no address: %s", vm, f.guestErr[vm])
			return nft.Exposure{}, st, false
		case f.guestErr[vm] != "":
			st.State, st.Reason = spec.StateFailed, fmt.Sprintf("guest %s: %s", vm, f.guestErr[vm])
			return nft.Exposure{}, st, false
		case !f.hasAddr[vm]:
			// The rule is installed anyway: the address is fixed, and
			// after a daemon restart a guest may hold its lease long
			// before we hear from it again.
			st.State, st.Reason = spec.StatePending, fmt.Sprintf("guest %s has not taken its address %s yet", vm, l.Addr)
		}
		target = l.Addr
		if f.prefix6.IsValid() {
			target6 = ipam.SLAAC(f.prefix6, l.MAC)
		}
	}
	// IPv6 callers only where the cap backend sees their connections: an
	// exposure of IPv6 alone fails, one of both families serves IPv4 (the
	// plane's warning says why).
	if why := p.caps.ipv6(); why != "" || !f.prefix6.IsValid() {
		if why == "" {
			why = "the bridge has no IPv6"
		}
		if e.HostAddr.Is6() || !target.IsValid() {
			st.State, st.Reason = spec.StateFailed, "ipv6: "+why
			return nft.Exposure{}, st, false
		}
		target6 = netip.Addr{}
	}
	x := nft.Exposure{
		Name: e.Name, Protocol: string(e.Proto), HostAddr: e.HostAddr, HostPort: e.HostPort, HostPortLast: e.HostPortLast,
		GuestPort: e.GuestPort, GuestPortLast: e.GuestPortLast, GuestAddr: target, GuestAddr6: target6, MaxConns: e.MaxConns,
	}
	// The mark is the counter slot: the nat path's programs write it, the
	// set-based cap's watcher reads it.
	feed := p.slots.feeds[e.Name]
	if feed == nil {
		st.State, st.Reason = spec.StateFailed, "no counter slot"
		return nft.Exposure{}, st, false
	}
	x.MarkID = ctmark.ID(feed.slot.Index())
	// allowFrom is in force before the exposure is published.
	if err := p.caps.allow(feed.slot, e.AllowFrom); err != nil {
		st.State, st.Reason = spec.StateFailed, err.Error()
		return nft.Exposure{}, st, false
	}
	return x, st, true
}

// forward6 turns IPv6 forwarding on where IPv6 callers are published (the
// bridge has IPv6 and the cap backend carries it), and reports a repair.
func (p *Plane) forward6(prefix6 netip.Prefix) []string {
	if !prefix6.IsValid() || p.caps.ipv6() != "" {
		return nil
	}
	changed, err := p.links.EnableForwarding6()
	if err != nil {
		p.log.Warn("netplane: IPv6 callers of published ports cannot be forwarded", "err", err)
		return nil
	}
	var out []string
	if len(changed) > 0 {
		p.log.Info("netplane: IPv6 forwarding on, for IPv6 callers of published ports", "set", changed)
		if p.made.forwarding6 {
			out = append(out, "net.ipv6.conf.all.forwarding was 0")
		}
	}
	p.made.forwarding6 = true
	return out
}

// capWarnings are what status says of the cap backend while exposures are
// published: its own warning, and that IPv6 callers are not published
// where the guests have IPv6 and the backend cannot carry it.
func (p *Plane) capWarnings() []string {
	var out []string
	if w := p.caps.warning(); w != "" {
		out = append(out, w)
	}
	if why := p.caps.ipv6(); why != "" && p.facts != nil && p.facts.prefix6.IsValid() {
		out = append(out, "nat path: IPv6 callers are not published ("+why+"); IPv6 exposures on the kernel path fail, those of both families serve IPv4")
	}
	return out
}

// finishRow fails a row the table could not take and fills its counters.
func (p *Plane) finishRow(st *ExposureStatus, name string, tableErr error) {
	if tableErr != nil && st.State != spec.StateFailed {
		st.State, st.Reason = spec.StateFailed, tableErr.Error()
	}
	if f := p.slots.feeds[name]; f != nil {
		st.Counters = f.slot.Read()
	} else if c, ok := p.opts.Stats.Lookup(name); ok {
		st.Counters = c
	}
}

// openTable opens the nft table (the first pass that reaches it does).
func (p *Plane) openTable() error {
	if p.table != nil {
		return nil
	}
	t, err := nft.Open(p.opts.NetNS, nft.WithLogger(p.log))
	if err != nil {
		return fmt.Errorf("opening nftables table: %w", err)
	}
	p.table = t
	return nil
}

// withTable runs one Converge or Update of the table, with the cap
// backend beside it, and reports its repairs.
func (p *Plane) withTable(fn func(*nft.Table) (nft.Result, error), repaired *[]string) error {
	if err := p.openTable(); err != nil {
		return err
	}
	if err := p.caps.beside(p.table); err != nil {
		return err
	}
	res, err := fn(p.table)
	for _, d := range res.Repaired {
		*repaired = append(*repaired, "nft "+d.String())
	}
	if res.Replaced != nil {
		p.log.Warn("netplane: nft incremental update failed; tables replaced whole", "err", res.Replaced)
	}
	if err != nil {
		return fmt.Errorf("nftables: %w", err)
	}
	return nil
}
