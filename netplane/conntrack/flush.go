package conntrack

import (
	"encoding/binary"
	"errors"
	"fmt"
	"net/netip"

	"github.com/mdlayher/netlink"
	ct "github.com/ti-mo/conntrack"
	"github.com/ti-mo/netfilter"
	"golang.org/x/sys/unix"
)

// HostSide is what a published port is on the host: protocol, host
// address (invalid = every address of both families, a family's
// unspecified address every address of that family) and host port, or
// the ports Port to PortLast of a range.
type HostSide struct {
	Proto    uint8
	Addr     netip.Addr
	Port     uint16
	PortLast uint16 // 0: the one port Port
}

// isRange reports whether h is a range of ports.
func (h HostSide) isRange() bool { return h.PortLast > h.Port }

func (h HostSide) anyAddr() bool { return !h.Addr.IsValid() || h.Addr.IsUnspecified() }

// families are the address families whose entries h names.
func (h HostSide) families() (v4, v6 bool) {
	if !h.Addr.IsValid() {
		return true, true
	}
	return h.Addr.Is4(), h.Addr.Is6()
}

func (h HostSide) matches(t tuple) bool {
	if p := t.dst.Port(); t.proto != h.Proto || p != h.Port && (!h.isRange() || p < h.Port || p > h.PortLast) {
		return false
	}
	if h.anyAddr() {
		v4, v6 := h.families()
		return (v4 && t.dst.Addr().Is4()) || (v6 && t.dst.Addr().Is6())
	}
	return t.dst.Addr() == h.Addr
}

// tuple is the part of an entry's original tuple a flush needs: enough to
// match a host side and to name the entry in a delete.
type tuple struct {
	proto    uint8
	src, dst netip.AddrPort
	zone     uint16
}

func (t tuple) flow() ct.Flow {
	var f ct.Flow
	f.TupleOrig.IP.SourceAddress = t.src.Addr()
	f.TupleOrig.IP.DestinationAddress = t.dst.Addr()
	f.TupleOrig.Proto.Protocol = t.proto
	f.TupleOrig.Proto.SourcePort = t.src.Port()
	f.TupleOrig.Proto.DestinationPort = t.dst.Port()
	f.Zone = t.zone
	// ti-mo/conntrack picks the request's family from both tuples; the
	// kernel deletes by the original one when it is given.
	f.TupleReply.IP.SourceAddress, f.TupleReply.IP.DestinationAddress = t.dst.Addr(), t.src.Addr()
	f.TupleReply.Proto.Protocol = t.proto
	f.TupleReply.Proto.SourcePort, f.TupleReply.Proto.DestinationPort = t.dst.Port(), t.src.Port()
	return f
}

// A dump walks the whole host-wide conntrack hash whatever it returns
// (13–17 ms here, 262,144 buckets), and then costs about 5 µs per entry it
// returns: the kernel writes every attribute of it and the socket carries
// them (BenchmarkDeleteHostSides*, BenchmarkDumpDecodeAll20000). So:
//   - a namespace with no entries (asked first, one small request) is not
//     walked at all;
//   - otherwise each host side gets its own kernel-filtered dump (CTA_FILTER,
//     Linux ≥ 5.8), which returns only the entries to delete, however many
//     others the namespace tracks;
//   - unless one walk per side would cost more than returning every entry
//     once (a first converge of many exposures on a quiet host): then all
//     sides share one dump, parsed only as far as each original tuple.
//
// entriesPerWalk is that break-even: how many returned entries cost about
// one walk here. It only picks between two correct ways (a variable so a
// test can take each way).
var entriesPerWalk = 2500

// DeleteHostSides deletes every entry whose original destination is one of
// sides, and returns how many entries it deleted per side.
func (c *Conn) DeleteHostSides(sides []HostSide) ([]int, error) {
	c.mu.Lock()
	defer c.mu.Unlock()
	counts := make([]int, len(sides))
	if len(sides) == 0 {
		return counts, nil
	}
	n, err := c.entries()
	if n == 0 || err != nil {
		return counts, err
	}
	walks, any6 := 0, false
	for _, h := range sides {
		v4, v6 := h.families()
		walks += b2i(v4) + b2i(v6)
		any6 = any6 || v6
	}
	if filtered(walks, n) {
		for i, h := range sides {
			v4, v6 := h.families()
			for _, f := range [...]struct {
				fam netfilter.ProtoFamily
				on  bool
			}{{netfilter.ProtoIPv4, v4}, {netfilter.ProtoIPv6, v6}} {
				if !f.on {
					continue
				}
				fam := f.fam
				req, err := filteredDump(h, fam)
				if err != nil {
					return counts, err
				}
				if err := c.deleteDumped(req, sides[i:i+1], counts[i:i+1]); err != nil {
					return counts, err
				}
			}
		}
		return counts, nil
	}
	fam := netfilter.ProtoIPv4
	if any6 {
		fam = netfilter.ProtoUnspec // every family, one walk
	}
	req, err := netfilter.MarshalNetlink(dumpHeader(fam), nil)
	if err != nil {
		return counts, err
	}
	return counts, c.deleteDumped(req, sides, counts)
}

func b2i(b bool) int {
	if b {
		return 1
	}
	return 0
}

// filtered says whether walks filtered dumps (one per host side and
// family) are cheaper than one full dump of a namespace holding entries
// entries.
func filtered(walks, entries int) bool {
	return (walks-1)*entriesPerWalk < entries
}

func dumpHeader(fam netfilter.ProtoFamily) netfilter.Header {
	return netfilter.Header{
		SubsystemID: netfilter.NFSubsysCTNetlink,
		MessageType: netfilter.MessageType(ipctnlMsgCtGet),
		Family:      fam,
		Flags:       netlink.Request | netlink.Dump,
	}
}

// ctnetlink constants (linux/netfilter/nfnetlink_conntrack.h) and the tuple
// filter flags, which the kernel defines in nf_internals.h (ABI since 5.8).
const (
	ipctnlMsgCtGet = 1

	ctaTupleOrig = 1
	ctaZone      = 18
	ctaFilter    = 25

	ctaTupleIP    = 1
	ctaTupleProto = 2
	ctaTupleZone  = 3

	ctaIPv4Src = 1
	ctaIPv4Dst = 2
	ctaIPv6Src = 3 // read from dumps only (see filteredDump)
	ctaIPv6Dst = 4

	ctaProtoNum     = 1
	ctaProtoSrcPort = 2
	ctaProtoDstPort = 3

	ctaFilterOrigFlags = 1

	filterIPDst        = 1 << 1
	filterProtoNum     = 1 << 3
	filterProtoDstPort = 1 << 5
)

// filteredDump asks the kernel for the entries of family fam whose
// original destination is h, and nothing else.
func filteredDump(h HostSide, fam netfilter.ProtoFamily) (netlink.Message, error) {
	proto := netfilter.Attribute{Type: ctaTupleProto, Nested: true, Children: []netfilter.Attribute{
		{Type: ctaProtoNum, Data: []byte{h.Proto}},
	}}
	flags := uint32(filterProtoNum)
	if !h.isRange() {
		// A range's ports are matched here (the filter takes one port).
		proto.Children = append(proto.Children, netfilter.Attribute{Type: ctaProtoDstPort, Data: binary.BigEndian.AppendUint16(nil, h.Port)})
		flags |= filterProtoDstPort
	}
	orig := netfilter.Attribute{Type: ctaTupleOrig, Nested: true}
	// An IPv6 address is matched here, not by the kernel: its IPv6
	// address filter is inverted (6.18 returns the entries to other
	// addresses and not those to the one asked for; seen in
	// TestDeleteHostSidesByFamily), so the IPv6 dump is filtered by
	// protocol and port only.
	if !h.anyAddr() && h.Addr.Is4() {
		a := h.Addr.As4()
		orig.Children = append(orig.Children, netfilter.Attribute{Type: ctaTupleIP, Nested: true,
			Children: []netfilter.Attribute{{Type: ctaIPv4Dst, Data: a[:]}}})
		flags |= filterIPDst
	}
	orig.Children = append(orig.Children, proto)
	filter := netfilter.Attribute{Type: ctaFilter, Nested: true, Children: []netfilter.Attribute{
		// The kernel reads the flags in host byte order (nla_get_u32).
		{Type: ctaFilterOrigFlags, Data: binary.NativeEndian.AppendUint32(nil, flags)},
	}}
	req, err := netfilter.MarshalNetlink(dumpHeader(fam), []netfilter.Attribute{orig, filter})
	if err != nil {
		return netlink.Message{}, fmt.Errorf("conntrack: filtered dump request: %w", err)
	}
	return req, nil
}

// deleteDumped runs the dump req and deletes every returned entry that
// matches one of sides, counting into counts (same order). Entries are
// matched here even after a kernel-filtered dump, so a kernel that ignores
// the filter (before 5.8) still deletes exactly the right ones.
func (c *Conn) deleteDumped(req netlink.Message, sides []HostSide, counts []int) error {
	msgs, err := c.nf.Query(req)
	if err != nil {
		return fmt.Errorf("conntrack: dump: %w", err)
	}
	byPort := make(map[[2]uint16][]int, len(sides))
	var ranges []int // the sides of ranges, matched against every entry
	for i, h := range sides {
		if h.isRange() {
			ranges = append(ranges, i)
			continue
		}
		k := [2]uint16{uint16(h.Proto), h.Port}
		byPort[k] = append(byPort[k], i)
	}
	for _, m := range msgs {
		t, ok := origTuple(m)
		if !ok {
			continue
		}
		i := -1
		for _, j := range byPort[[2]uint16{uint16(t.proto), t.dst.Port()}] {
			if sides[j].matches(t) {
				i = j
				break
			}
		}
		for _, j := range ranges {
			if i < 0 && sides[j].matches(t) {
				i = j
			}
		}
		if i < 0 {
			continue
		}
		if err := c.c.Delete(t.flow()); err != nil && !errors.Is(err, unix.ENOENT) { // ENOENT: ended meanwhile
			return fmt.Errorf("conntrack: delete: %w", err)
		}
		counts[i]++
	}
	return nil
}

// origTuple reads an entry's original tuple and zone from a dump
// message without decoding the rest; ok is false for anything else.
func origTuple(m netlink.Message) (t tuple, ok bool) {
	_, ad, err := netfilter.DecodeNetlink(m)
	if err != nil {
		return t, false
	}
	var p tupleParts
	for ad.Next() {
		switch ad.Type() {
		case ctaZone:
			t.zone = ad.Uint16()
		case ctaTupleOrig:
			ad.Nested(p.tuple)
		}
	}
	if ad.Err() != nil || !p.src.IsValid() || !p.dst.IsValid() {
		return t, false
	}
	if p.zone != 0 {
		t.zone = p.zone
	}
	t.proto = p.proto
	t.src, t.dst = netip.AddrPortFrom(p.src, p.sport), netip.AddrPortFrom(p.dst, p.dport)
	return t, true
}

// tupleParts collects the attributes of one CTA_TUPLE_* nest.
type tupleParts struct {
	src, dst     netip.Addr
	proto        uint8
	sport, dport uint16
	zone         uint16
}

func (p *tupleParts) tuple(ad *netlink.AttributeDecoder) error {
	for ad.Next() {
		switch ad.Type() {
		case ctaTupleIP:
			ad.Nested(p.ip)
		case ctaTupleProto:
			ad.Nested(p.l4)
		case ctaTupleZone:
			p.zone = ad.Uint16()
		}
	}
	return nil
}

func (p *tupleParts) ip(ad *netlink.AttributeDecoder) error {
	for ad.Next() {
		b := ad.Bytes()
		switch {
		case ad.Type() == ctaIPv4Src && len(b) == 4:
			p.src = netip.AddrFrom4([4]byte(b))
		case ad.Type() == ctaIPv4Dst && len(b) == 4:
			p.dst = netip.AddrFrom4([4]byte(b))
		case ad.Type() == ctaIPv6Src && len(b) == 16:
			p.src = netip.AddrFrom16([16]byte(b))
		case ad.Type() == ctaIPv6Dst && len(b) == 16:
			p.dst = netip.AddrFrom16([16]byte(b))
		}
	}
	return nil
}

func (p *tupleParts) l4(ad *netlink.AttributeDecoder) error {
	for ad.Next() {
		switch ad.Type() {
		case ctaProtoNum:
			p.proto = ad.Uint8()
		case ctaProtoSrcPort:
			p.sport = ad.Uint16()
		case ctaProtoDstPort:
			p.dport = ad.Uint16()
		}
	}
	return nil
}
