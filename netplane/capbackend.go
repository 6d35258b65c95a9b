package netplane

import (
	"fmt"
	"log/slog"
	"net"
	"net/netip"
	"path/filepath"

	"github.com/vishvananda/netlink"

	"github.com/brokkr/brokkr/bpf"
	"github.com/brokkr/brokkr/internal/nlsafe"
	"github.com/brokkr/brokkr/netplane/nft"
)

// capBackend runs the per-exposure connection cap, the release of its
// places and the kernel path's counters, for the exposures nft publishes.
// One is chosen once per Plane, by the first pass that finds the bridge
// (chooseCap): the BPF nat path (bpf.NatPath: the programs admit, release
// and count in the kernel, reading the ct mark nft sets), or, where its
// programs cannot load, the set-based cap in the nft table itself (package
// nft's SetCap: cap sets, a conntrack-event watcher, a slow-path listener).
// A kernel that has neither BPF netfilter programs nor the set-based cap's
// needs gets a backend of its own behind the same seam. The slot each
// exposure counts into is the daemon's to attach; the backend only runs
// the cap on it.
type capBackend interface {
	// tableCap is the backend's part of the nft table.
	tableCap() nft.Cap
	// follow keeps the backend on the network's bridge and subnet (the
	// bridge made anew, the subnet changed).
	follow(n Network)
	// beside runs what the backend needs beside the table, once it is open.
	beside(t *nft.Table) error
	// feed brings the kernel path's counts of the published exposures into
	// their slots (nothing to do where the programs write the slots).
	feed(feeds map[string]*slotFeed)
	// allow restricts the exposure counting into slot to callers from
	// prefixes (none: everyone) before it is published; an error when the
	// backend cannot (the exposure is then not published: never open to
	// everyone by mistake).
	allow(slot *bpf.Slot, prefixes []netip.Prefix) error
	// pruneAllow lifts the restrictions of slots keep rejects.
	pruneAllow(keep func(slot int) bool)
	// warning is what status says of the backend ("" for nothing).
	warning() string
	// fallback says why nat exposures' caps are not the shared slot's (the
	// set-based cap), "" when they are.
	fallback() string
	// ipv6 says why the backend cannot carry IPv6 callers ("" when it
	// does): the table then publishes IPv4 only, since an IPv6 connection
	// the cap does not see would be neither capped nor counted.
	ipv6() string
	close() error
	// remove takes away what outlives the daemon (a teardown).
	remove() error
}

// chooseCap picks the backend the first time the bridge exists: the nat
// path when its programs load, else the set-based cap, with why in the
// warning.
func (p *Plane) chooseCap(n Network) {
	if p.caps != nil {
		p.caps.follow(n)
		return
	}
	np, err := loadNatPath(p.opts, p.links.Handle(), n, p.log)
	if err != nil {
		reason := "nat path: fallback (" + err.Error() + "): the cap and counters of nat exposures are nft sets fed by conntrack events"
		p.log.Warn("netplane: " + reason)
		p.caps = &setCapBackend{reason: reason, carrier: p.opts.Overflow, log: p.log}
		return
	}
	if np.np.Hooks() == "tc" {
		p.log.Info("netplane: nat path: tc programs on the bridge (docs/ARCHITECTURE.md, \"The nat path on kernels before 6.4\")")
	}
	if why := np.np.Adopted(); why != "" {
		// The earlier binary's programs read the marks this table sets:
		// the warning says this binary's did not load.
		p.log.Warn("netplane: nat path: this binary's programs did not load: " + why)
	}
	p.caps = np
}

// natPathBackend is the BPF nat path: the nft table carries only marks and
// DNAT.
type natPathBackend struct {
	opts    Options
	h       *netlink.Handle // the managed namespace's links
	log     *slog.Logger
	np      *bpf.NatPath
	bridge  int          // the ifindex the reflector is on
	guests  netip.Prefix // the subnet the programs know
	guests6 netip.Prefix // and the IPv6 one
}

func loadNatPath(opts Options, h *netlink.Handle, n Network, log *slog.Logger) (*natPathBackend, error) {
	b := &natPathBackend{opts: opts, h: h, log: log}
	if err := b.load(n); err != nil {
		return nil, err
	}
	return b, nil
}

// load loads (or adopts) the programs for n's bridge and subnet.
func (b *natPathBackend) load(n Network) error {
	br, err := nlsafe.LinkByName(b.h, n.Bridge)
	if err != nil {
		return fmt.Errorf("bridge %s: %w", n.Bridge, err)
	}
	if !b.opts.Stats.Pinned() {
		return fmt.Errorf("the counter map is not pinned: %s", b.opts.Stats.Reason())
	}
	idx := br.Attrs().Index
	np, err := bpf.LoadNatPath(bpf.NatPathConfig{
		PinDir: filepath.Dir(b.opts.Stats.Path()), Bridge: idx, Guests: n.CIDR.Masked(), Guests6: n.CIDR6.Masked(),
		InNS: func(fn func() error) error { return nlsafe.Do(b.opts.NetNS, fn) },
	})
	if err != nil {
		return err
	}
	if b.np != nil {
		_ = b.np.Close()
	}
	b.np, b.bridge, b.guests, b.guests6 = np, idx, n.CIDR.Masked(), n.CIDR6.Masked()
	return nil
}

func (b *natPathBackend) tableCap() nft.Cap { return nft.MarksOnly{} }

func (b *natPathBackend) follow(n Network) {
	br, err := nlsafe.LinkByName(b.h, n.Bridge)
	if err == nil && br.Attrs().Index == b.bridge && n.CIDR.Masked() == b.guests && n.CIDR6.Masked() == b.guests6 {
		return
	}
	// The bridge was made anew or the subnet changed: load again, which
	// adopts what still fits and re-attaches the rest.
	if err := b.load(n); err != nil {
		b.log.Warn("netplane: re-attaching the nat path", "err", err)
	}
}

func (b *natPathBackend) beside(*nft.Table) error { return nil }

// allow writes the prefixes into the programs' trie (docs/ARCHITECTURE.md,
// "allowFrom").
func (b *natPathBackend) allow(slot *bpf.Slot, prefixes []netip.Prefix) error {
	return b.np.SetAllow(slot.Index(), slot.Gen(), prefixes)
}

func (b *natPathBackend) pruneAllow(keep func(int) bool) {
	if err := b.np.PruneAllow(keep); err != nil {
		b.log.Warn("netplane: nat path: pruning allowFrom", "err", err)
	}
}

func (b *natPathBackend) feed(map[string]*slotFeed) {}

// warning says when the programs serving are an earlier binary's (this
// binary's did not load; see bpf.NatPath.Adopted).
func (b *natPathBackend) warning() string {
	if why := b.np.Adopted(); why != "" {
		return "nat path: this binary's programs did not load: " + why
	}
	return ""
}
func (b *natPathBackend) fallback() string { return "" } // adopted programs too: they admit against the slot
func (b *natPathBackend) ipv6() string {
	if !b.np.IPv6() {
		return "no nat-path program runs at the IPv6 hooks (an earlier brokkrd's, kept, had none)"
	}
	return ""
}
func (b *natPathBackend) close() error  { return b.np.Close() }
func (b *natPathBackend) remove() error { return b.np.Remove() }

// setCapBackend is the set-based cap: nft's cap sets, fed by conntrack
// events, with the slow path's connections handed to carrier.
type setCapBackend struct {
	reason  string
	carrier func(exposure string, client, guest *net.TCPConn)
	log     *slog.Logger
	sc      *nft.SetCap
}

func (b *setCapBackend) tableCap() nft.Cap { return nft.SetBasedCap{} }
func (b *setCapBackend) follow(Network)    {}

func (b *setCapBackend) beside(t *nft.Table) error {
	if b.sc != nil {
		return nil
	}
	var opts []nft.SetCapOption
	if b.carrier != nil {
		opts = append(opts, nft.WithOverflow(b.carrier))
	}
	sc, err := nft.StartSetCap(t, opts...)
	if err != nil {
		return fmt.Errorf("the set-based cap: %w", err)
	}
	b.sc = sc
	return nil
}

// feed adds the kernel counters to the slots. A counter read asks the
// kernel for brokkr's conntrack entries: the caller skips it when nothing
// is published.
func (b *setCapBackend) feed(feeds map[string]*slotFeed) {
	if b.sc == nil {
		return
	}
	counters, err := b.sc.Counters()
	if err != nil {
		b.log.Warn("netplane: reading nft counters", "err", err)
		return
	}
	for name, c := range counters {
		if f := feeds[name]; f != nil {
			f.feed(c)
		}
	}
}

// allow: the set-based cap has no allowFrom (the daemon carries restricted
// exposures by the proxy where it knows the nat path cannot load; anything
// else is not published).
func (b *setCapBackend) allow(_ *bpf.Slot, prefixes []netip.Prefix) error {
	if len(prefixes) == 0 {
		return nil
	}
	return fmt.Errorf("allowFrom needs the BPF nat path, which is not in use: %s", b.reason)
}

func (b *setCapBackend) pruneAllow(func(int) bool) {}

func (b *setCapBackend) warning() string  { return b.reason }
func (b *setCapBackend) fallback() string { return b.reason }
func (b *setCapBackend) ipv6() string {
	return "the nat path's fallback (nft sets keyed by IPv4 connections) carries IPv4 only"
}

func (b *setCapBackend) close() error {
	if b.sc != nil {
		return b.sc.Close()
	}
	return nil
}

func (b *setCapBackend) remove() error { return b.close() }

// NatPathReason says why the BPF nat path is not in use ("" when it is, or
// before the first pass chose).
func (p *Plane) NatPathReason() string {
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.caps == nil {
		return ""
	}
	return p.caps.warning()
}

// NatPathFallback says why nat exposures' caps are the fallback's nft sets,
// not the shared slot's ("" when they are the slot's, adopted programs of
// an earlier binary included, or before the first pass chose).
func (p *Plane) NatPathFallback() string {
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.caps == nil {
		return ""
	}
	return p.caps.fallback()
}
