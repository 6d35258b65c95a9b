package bpf

import (
	"errors"
	"fmt"
	"net/netip"
	"slices"
)

// allowFrom on the nat path (natpath.c, "allowFrom"): the prefixes of each
// restricted exposure are elements of one LPM trie keyed by (counter slot,
// source address), and allow_restricted_v2 says per slot that the exposure is
// restricted at all. Both carry the slot's generation, so what a deleted
// exposure left behind neither restricts nor admits for the slot's next
// owner. Invariant kept across crashes: a slot is flagged restricted only
// while its prefixes are in the trie (written before the flag, deleted
// after it is cleared).

type allowSlot struct {
	gen     uint32
	set     map[netip.Prefix]bool
	flagged bool           // allow_restricted_v2 holds gen+1, written by this process
	last    []netip.Prefix // the list last written in full, to skip a pass with no change cheaply
}

func allowKeyOf(slot uint32, p netip.Prefix) natpathAllowKey {
	k := natpathAllowKey{Slot: slot}
	a := p.Addr()
	bits := p.Bits()
	if a.Is4() {
		bits += 96
	}
	k.Prefixlen = uint32(32 + bits)
	k.Addr = a.As16() // an IPv4 address in its v4-mapped form
	return k
}

func prefixOf(k natpathAllowKey) (netip.Prefix, bool) {
	bits := int(k.Prefixlen) - 32
	if bits < 0 || bits > 128 {
		return netip.Prefix{}, false
	}
	a := netip.AddrFrom16(k.Addr)
	if a.Is4In6() && bits >= 96 {
		return netip.PrefixFrom(a.Unmap(), bits-96), true
	}
	return netip.PrefixFrom(a, bits), true
}

// readAllow learns what the trie holds (once per process: a restarted
// daemon finds what the last one wrote).
func (n *NatPath) readAllow() error {
	if n.allow != nil {
		return nil
	}
	allow := map[uint32]*allowSlot{}
	var k natpathAllowKey
	var gen uint32
	it := n.objs.AllowFrom.Iterate()
	for it.Next(&k, &gen) {
		p, ok := prefixOf(k)
		if !ok {
			continue
		}
		a := allow[k.Slot]
		if a == nil {
			a = &allowSlot{gen: gen, set: map[netip.Prefix]bool{}}
			allow[k.Slot] = a
		}
		if gen != a.gen {
			a.gen = ^uint32(0) // mixed: every element is written again
		}
		a.set[p] = true
	}
	if err := it.Err(); err != nil {
		return fmt.Errorf("nat path: reading allow_from: %w", err)
	}
	n.allow = allow
	return nil
}

// ErrAllowNotLoaded: the programs that serve are an earlier binary's, which
// know nothing of allowFrom.
var ErrAllowNotLoaded = errors.New("allowFrom needs this binary's nat-path programs")

// SetAllow makes the exposure at slot (of generation gen) restricted to
// prefixes, or unrestricted when there are none. Only what changed is
// written.
func (n *NatPath) SetAllow(slot int, gen uint32, prefixes []netip.Prefix) error {
	if n.objs == nil {
		if len(prefixes) == 0 {
			return nil
		}
		return fmt.Errorf("%w (%s)", ErrAllowNotLoaded, n.adopted)
	}
	if err := n.readAllow(); err != nil {
		return err
	}
	s := uint32(slot)
	cur := n.allow[s]
	if len(prefixes) == 0 {
		if cur == nil {
			return nil
		}
		return n.clearAllow(s)
	}
	if cur == nil {
		cur = &allowSlot{gen: gen, set: map[netip.Prefix]bool{}}
		n.allow[s] = cur
	}
	if cur.gen == gen && cur.flagged && slices.Equal(cur.last, prefixes) {
		return nil // the common pass: nothing changed, nothing allocated
	}
	want := make(map[netip.Prefix]bool, len(prefixes))
	same := cur.gen == gen && cur.flagged
	for _, p := range prefixes {
		want[p] = true
		same = same && cur.set[p]
	}
	if same && len(want) == len(cur.set) {
		cur.last = slices.Clone(prefixes)
		return nil
	}
	stale := cur.gen != gen
	for p := range want {
		if cur.set[p] && !stale {
			continue
		}
		if err := n.objs.AllowFrom.Put(allowKeyOf(s, p), gen); err != nil {
			return fmt.Errorf("nat path: allow_from %s: %w", p, err)
		}
		cur.set[p] = true
	}
	if cur.gen != gen || !cur.flagged {
		cur.gen = gen
		if err := n.objs.AllowRestrictedV2.Put(s, gen+1); err != nil {
			return fmt.Errorf("nat path: allow_restricted_v2: %w", err)
		}
		cur.flagged = true
	}
	for p := range cur.set {
		if want[p] {
			continue
		}
		if err := n.objs.AllowFrom.Delete(allowKeyOf(s, p)); err != nil {
			return fmt.Errorf("nat path: allow_from %s: %w", p, err)
		}
		delete(cur.set, p)
	}
	cur.last = slices.Clone(prefixes)
	return nil
}

func (n *NatPath) clearAllow(s uint32) error {
	if err := n.objs.AllowRestrictedV2.Put(s, uint32(0)); err != nil {
		return fmt.Errorf("nat path: allow_restricted_v2: %w", err)
	}
	cur := n.allow[s]
	for p := range cur.set {
		if err := n.objs.AllowFrom.Delete(allowKeyOf(s, p)); err != nil {
			return fmt.Errorf("nat path: allow_from %s: %w", p, err)
		}
		delete(cur.set, p)
	}
	delete(n.allow, s)
	return nil
}

// PruneAllow unrestricts every slot keep rejects (exposures deleted, their
// slots freed).
func (n *NatPath) PruneAllow(keep func(slot int) bool) error {
	if n.objs == nil {
		return nil
	}
	if err := n.readAllow(); err != nil {
		return err
	}
	var errs []error
	for s := range n.allow {
		if !keep(int(s)) {
			errs = append(errs, n.clearAllow(s))
		}
	}
	return errors.Join(errs...)
}
