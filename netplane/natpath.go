package netplane

import (
	"fmt"
	"path/filepath"

	"github.com/brokkr/brokkr/bpf"
	"github.com/brokkr/brokkr/internal/nlsafe"
	"github.com/brokkr/brokkr/netplane/nft"
)

// ensureNatPath loads (or adopts) the BPF nat path once the bridge exists:
// the cap, its release and the counters of nat exposures then live in the
// kernel, and the nft table carries only marks and DNAT. When the programs
// cannot load (no pinned store, an older kernel) it records why and the
// table keeps the set-based cap fed by conntrack events (docs/ARCHITECTURE.md,
// "The nat path").
func (p *Plane) ensureNatPath(n Network) {
	if p.natReason != "" && p.nat == nil {
		return // decided once per process: the table's mode follows it
	}
	br, err := nlsafe.LinkByName(p.links.Handle(), n.Bridge)
	if err != nil {
		p.noNatPath(fmt.Sprintf("bridge %s: %v", n.Bridge, err))
		return
	}
	idx := br.Attrs().Index
	if p.nat != nil && p.natBridge == idx && p.natGuests == n.CIDR.Masked() {
		return
	}
	// First load, or the bridge was made anew or the subnet changed: load
	// again, which adopts what still fits and re-attaches the rest.
	if !p.opts.Stats.Pinned() {
		p.noNatPath("the counter map is not pinned: " + p.opts.Stats.Reason())
		return
	}
	np, err := bpf.LoadNatPath(bpf.NatPathConfig{
		PinDir: filepath.Dir(p.opts.Stats.Path()), Bridge: idx, Guests: n.CIDR.Masked(),
		InNS: func(fn func() error) error { return nlsafe.Do(p.opts.NetNS, fn) },
	})
	if err != nil {
		if p.nat != nil {
			p.log.Warn("netplane: re-attaching the nat path", "err", err)
			return
		}
		p.noNatPath(err.Error())
		return
	}
	if p.nat != nil {
		_ = p.nat.Close()
	}
	p.nat, p.natBridge, p.natGuests, p.natReason = np, idx, n.CIDR.Masked(), ""
	if why := np.Adopted(); why != "" {
		// The earlier binary's programs read the marks this table sets
		// (the kernel cap's): the warning says this binary's did not load.
		p.natReason = "nat path: this binary's programs did not load: " + why
		p.log.Warn("netplane: " + p.natReason)
	}
}

func (p *Plane) noNatPath(reason string) {
	p.natReason = "nat path: fallback (" + reason + "): the cap and counters of nat exposures are nft sets fed by conntrack events"
	p.log.Warn("netplane: " + p.natReason)
}

// NatPathReason says why the BPF nat path is not in use, or why it runs an
// earlier binary's programs ("" when it runs this binary's).
func (p *Plane) NatPathReason() string {
	p.mu.Lock()
	defer p.mu.Unlock()
	return p.natReason
}

// kernelCap reports whether the nat path runs the caps.
func (p *Plane) kernelCap() bool { return p.nat != nil }

func (p *Plane) natOptions() []nft.Option {
	if p.kernelCap() {
		return []nft.Option{nft.WithoutCapWatcher()}
	}
	return nil
}
