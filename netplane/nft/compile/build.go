package compile

import (
	"encoding/binary"
	"maps"
	"net/netip"
	"slices"
	"sort"

	"github.com/brokkr/brokkr/bpf/ctmark"
	"github.com/google/nftables"
	"github.com/google/nftables/binaryutil"
	"github.com/google/nftables/expr"
	"golang.org/x/sys/unix"
)

// Connection marks: package ctmark's layout. The id bits identify the
// exposure that DNATed the connection, and the owner bit is set on every
// connection brokkr marks, so a counter read asks the kernel for brokkr's
// entries only (a mark filter) instead of every flow the host tracks. The
// two high bits record, for the set-based cap, that a FIN was seen in the
// original and in the reply direction (a RST sets both).

// connMark is the ct mark a connection of exposure id gets.
func connMark(id uint32) []byte { return binaryutil.NativeEndian.PutUint32(id | ctmark.Owned) }

// The table is data: an exposure is elements of a few maps, looked up by
// rules that never change.
//
//	dispatch: ct mark set <addr . proto . port> map @exp-addr goto publish
//	          ct mark set <proto . port> map @exp-any goto publish
//	publish:  [set-based cap: ct mark vmap @exp-cap]
//	          meta l4proto tcp|udp dnat ip to ct mark map @exp-target
//
// The connection's mark (its exposure's counter slot + 1, with the owner
// bit) is looked up by where it was dialled, and the guest by the mark, so
// adding, changing or removing an exposure is element updates only: no
// chain is made or deleted, and the kernel does not validate a jump graph
// that grows with the exposures. Only the set-based cap (the fallback where
// the BPF nat path cannot load) keeps a chain per capped exposure, because
// its admission adds to a set of the exposure's own.

// Names of the fixed objects of table inet brokkr.
const (
	chainPrerouting   = "prerouting"       // nat prerouting: DNAT dispatch
	chainOutput       = "output"           // nat output: DNAT dispatch for host-local callers
	chainPostrouting  = "postrouting"      // nat postrouting: hairpin + egress masquerade
	chainDispatch     = "dispatch"         // the mark, by where the caller dialled
	chainPublish      = "publish"          // the guest, by the mark
	chainDispatch6    = "dispatch6"        // IPv6: the mark, by where the caller dialled
	chainPublish6     = "publish6"         // IPv6: the guest, by the mark
	chainGuard        = "guard"            // raw prerouting: drop remote packets to 127/8
	chainInput        = "input"            // filter input: host isolation
	chainFromGuests   = "from-guests"      // what a guest may send to the host itself
	chainClosePre     = "close-pre"        // FIN/RST bookkeeping for the set-based cap (prerouting)
	chainCloseOut     = "close-out"        // the same for host-local callers (output)
	chainClose        = "close"            // the bookkeeping itself
	chainBytesFwd     = "bytes-forward"    // set-based cap: bytes of forwarded packets, by mark and direction
	chainBytesIn      = "bytes-input"      // the same for packets to the host (host-local callers' replies, the slow path)
	chainBytesOut     = "bytes-output"     // the same for packets from the host
	MapExpBytesOrig   = "exp-bytes-orig"   // set-based cap: mark, its element counting caller -> guest bytes
	MapExpBytesReply  = "exp-bytes-reply"  // set-based cap: mark, its element counting guest -> caller bytes
	MapExpAddr        = "exp-addr"         // ip daddr . l4proto . dport : mark
	MapExpAny         = "exp-any"          // l4proto . dport : mark
	MapExpTarget      = "exp-target"       // mark : guest address . guest port
	MapExpAddr6       = "exp-addr6"        // ip6 daddr . l4proto . dport : mark
	MapExpAny6        = "exp-any6"         // l4proto . dport : mark, IPv6 callers
	MapExpTarget6     = "exp-target6"      // mark : guest IPv6 address . guest port
	MapExpAddrRange   = "exp-addr-range"   // ip daddr . l4proto . dport range : mark (interval)
	MapExpAnyRange    = "exp-any-range"    // l4proto . dport range : mark (interval)
	MapExpAddr6Range  = "exp-addr6-range"  // ip6 daddr . l4proto . dport range : mark (interval)
	MapExpAny6Range   = "exp-any6-range"   // l4proto . dport range : mark, IPv6 callers (interval)
	MapExpTargetAddr  = "exp-target-addr"  // mark : guest address (a range's port kept)
	MapExpTargetAddr6 = "exp-target-addr6" // mark : guest IPv6 address (a range's port kept)
	MapExpTargetPort  = "exp-target-port"  // mark . dport : guest address . port (a shifted range, one per port)
	MapExpTargetPort6 = "exp-target-port6" // mark . dport : guest IPv6 address . port
	MapExpCap         = "exp-cap"          // set-based cap: mark : goto cap-NAME
	SetCappedTCP      = "capped-tcp"       // set-based cap: mark ids of capped TCP exposures
	MapOverflow       = "overflow"         // l4proto : port of the cap's slow-path listener
	setGuestPorts     = "guest-ports"      // bridge table: ports under anti-spoof
	setGuestAddrs     = "guest-addrs"      // bridge table: port . mac . ipv4
	setGuestMACs      = "guest-macs"       // bridge table: port . mac
	setGuestAddrs6    = "guest-addrs6"     // bridge table: port . mac . ipv6 (SLAAC and link-local)
	chainBrPre        = "prerouting"       // bridge table: anti-spoof dispatch
	chainAntiSpoof    = "anti-spoof"       // bridge table: what a guest port may send
	chainNDTargets    = "nd-targets"       // bridge table: the addresses a guest's neighbour advertisements may name
	chainBrForward    = "forward"          // bridge table: guest isolation
)

// IntervalSet reports whether set is one of the interval maps, whose
// elements' keys are the first key followed by the last (SetSpec.Interval).
func IntervalSet(set string) bool {
	switch set {
	case MapExpAddrRange, MapExpAnyRange, MapExpAddr6Range, MapExpAny6Range:
		return true
	}
	return false
}

// Per-exposure object names (the set-based cap's, for capped exposures).
func CapChain(name string) string       { return "cap-" + name }
func ConnsSet(name string) string       { return "conns-" + name }
func RefusedCounter(name string) string { return name + "-refused" }

// buildFixed computes both tables without the exposures: everything that
// does not depend on them, with the shared maps their units fill declared
// empty. Input no table can express is an error naming the field.
func buildFixed(r Rules) (inet, bridge *TableSpec, err error) {
	if err := r.buildable(); err != nil {
		return nil, nil, err
	}
	inet = NewTableSpec(nftables.TableFamilyINet)
	fam := nftables.TableFamilyINet
	subnet := r.Subnet.Masked()

	// Remote loopback guard: never let a packet from outside reach 127/8.
	inet.addChain(&ChainSpec{Name: chainGuard, Hook: &HookSpec{nftables.ChainTypeFilter, *nftables.ChainHookPrerouting, -300},
		Rules: guardRules(r)})

	// DNAT dispatch: only for local destinations, never for 127/8.
	entry := func(comment string) RuleSpec {
		return rule(fam, comment, append(append(ipDaddrNotIn(netip.MustParsePrefix("127.0.0.0/8")), fibDaddrLocal()...),
			&expr.Verdict{Kind: expr.VerdictJump, Chain: chainDispatch})...)
	}
	inet.addChain(&ChainSpec{Name: chainPrerouting, Hook: &HookSpec{nftables.ChainTypeNAT, *nftables.ChainHookPrerouting, -100},
		Rules: []RuleSpec{entry("published ports")}})
	inet.addChain(&ChainSpec{Name: chainOutput, Hook: &HookSpec{nftables.ChainTypeNAT, *nftables.ChainHookOutput, -100},
		Rules: []RuleSpec{entry("published ports, host-local callers")}})
	toPublish := &expr.Verdict{Kind: expr.VerdictGoto, Chain: chainPublish}
	setCap, setBased := r.setBased()
	dispatch := []RuleSpec{
		rule(fam, "exposures bound to one address", append(append(loadAddrProtoPort(), markFrom(MapExpAddr)...), toPublish)...),
		rule(fam, "exposures bound to every local address", append(append(loadProtoPort(), markFrom(MapExpAny)...), toPublish)...),
	}
	// Port ranges: interval maps beside the exact ones (a set's flags
	// cannot change in place), looked up after them.
	dispatch = append(dispatch,
		rule(fam, "port ranges bound to one address", append(append(loadAddrProtoPort(), markFrom(MapExpAddrRange)...), toPublish)...),
		rule(fam, "port ranges on every local address", append(append(loadProtoPort(), markFrom(MapExpAnyRange)...), toPublish)...))
	inet.addChain(&ChainSpec{Name: chainDispatch, Rules: dispatch})
	var publish []RuleSpec
	if setBased {
		publish = append(publish, rule(fam, "capped exposures: the set-based cap",
			&expr.Ct{Register: 1, Key: expr.CtKeyMARK}, lookupVmap(MapExpCap)))
	}
	// A DNAT rule names its protocol (the port it rewrites is the
	// transport header's): each target is a TCP and a UDP rule, each with
	// expressions of its own.
	perProto := func(comment string, dnat func() []expr.Any) []RuleSpec {
		return []RuleSpec{rule(fam, comment, append(l4proto(unix.IPPROTO_TCP), dnat()...)...),
			rule(fam, comment, append(l4proto(unix.IPPROTO_UDP), dnat()...)...)}
	}
	publish = append(publish, perProto("to the guest", dnatToTarget)...)
	// A range whose guest ports are its own: the address only (a mark has
	// an element in exp-target or in exp-target-addr).
	publish = append(publish, perProto("to the guest, the port kept", func() []expr.Any { return dnatToAddr(MapExpTargetAddr, unix.NFPROTO_IPV4) })...)
	publish = append(publish, perProto("to the guest, by the port dialled", func() []expr.Any { return dnatByPort(MapExpTargetPort, unix.NFPROTO_IPV4) })...)
	inet.addChain(&ChainSpec{Name: chainPublish, Rules: publish})
	if !setBased {
		// IPv6 callers: the same marks, one slot and one cap per exposure
		// whatever the family (the nat path's programs run on both). The
		// set-based cap's sets are keyed by IPv4 tuples: it publishes
		// IPv4 only.
		entry6 := func(comment string) RuleSpec {
			return rule(fam, comment, append(append(ip6Prefix(24, netip.MustParsePrefix("::1/128"), expr.CmpOpNeq), fibDaddrLocal()...),
				&expr.Verdict{Kind: expr.VerdictJump, Chain: chainDispatch6})...)
		}
		pre, out := inet.Chains[chainPrerouting], inet.Chains[chainOutput]
		pre.Rules = append(pre.Rules, entry6("published ports, ipv6"))
		out.Rules = append(out.Rules, entry6("published ports, ipv6 host-local callers"))
		toPublish6 := &expr.Verdict{Kind: expr.VerdictGoto, Chain: chainPublish6}
		inet.addChain(&ChainSpec{Name: chainDispatch6, Rules: []RuleSpec{
			rule(fam, "exposures bound to one ipv6 address", append(append(loadAddr6ProtoPort(), markFrom(MapExpAddr6)...), toPublish6)...),
			rule(fam, "exposures bound to every local ipv6 address", append(append(loadProtoPort(), markFrom(MapExpAny6)...), toPublish6)...),
			rule(fam, "port ranges bound to one ipv6 address", append(append(loadAddr6ProtoPort(), markFrom(MapExpAddr6Range)...), toPublish6)...),
			rule(fam, "port ranges on every local ipv6 address", append(append(loadProtoPort(), markFrom(MapExpAny6Range)...), toPublish6)...),
		}})
		publish6 := perProto("to the guest", dnat6ToTarget)
		publish6 = append(publish6, perProto("to the guest, the port kept", func() []expr.Any { return dnatToAddr(MapExpTargetAddr6, unix.NFPROTO_IPV6) })...)
		publish6 = append(publish6, perProto("to the guest, by the port dialled", func() []expr.Any { return dnatByPort(MapExpTargetPort6, unix.NFPROTO_IPV6) })...)
		inet.addChain(&ChainSpec{Name: chainPublish6, Rules: publish6})
	}
	addSharedMaps(inet, setBased)
	if setBased {
		desiredSetCap(inet, setCap.OverflowPort)
	}

	// Masquerade: hairpin (a guest reaching a published port through the
	// host) and egress.
	post := []RuleSpec{rule(fam, "hairpin", append(append(append(ctStatusDNAT(), ifname(unix.NFT_META_OIFNAME, r.Bridge, expr.CmpOpEq)...),
		ipSaddrIn(subnet)...), &expr.Masq{})...)}
	if r.Subnet6.IsValid() && !setBased {
		post = append(post, rule(fam, "hairpin ipv6", append(append(append(ctStatusDNAT(), ifname(unix.NFT_META_OIFNAME, r.Bridge, expr.CmpOpEq)...),
			ip6SaddrIn(r.Subnet6.Masked())...), &expr.Masq{})...))
	}
	if r.Masquerade {
		post = append(post, rule(fam, "egress", append(append(ipSaddrIn(subnet), ifname(unix.NFT_META_OIFNAME, r.Bridge, expr.CmpOpNeq)...), &expr.Masq{})...))
		if r.Subnet6.IsValid() && ula.Contains(r.Subnet6.Addr()) {
			// A unique-local /64 is not routed beyond the host: NAT66.
			post = append(post, rule(fam, "egress ipv6", append(append(ip6SaddrIn(r.Subnet6.Masked()), ifname(unix.NFT_META_OIFNAME, r.Bridge, expr.CmpOpNeq)...), &expr.Masq{})...))
		}
	}
	inet.addChain(&ChainSpec{Name: chainPostrouting, Hook: &HookSpec{nftables.ChainTypeNAT, *nftables.ChainHookPostrouting, 100}, Rules: post})

	// Host isolation: a guest reaches the host itself only for DHCP, DNS
	// and replies.
	inet.addChain(&ChainSpec{Name: chainInput, Hook: &HookSpec{nftables.ChainTypeFilter, *nftables.ChainHookInput, 0},
		Rules: []RuleSpec{rule(fam, "from guests", append(ifname(unix.NFT_META_IIFNAME, r.Bridge, expr.CmpOpEq),
			&expr.Verdict{Kind: expr.VerdictJump, Chain: chainFromGuests})...)}})
	fg := []RuleSpec{rule(fam, "replies", append(ctStateAny(expr.CtStateBitESTABLISHED|expr.CtStateBitRELATED), accept())...)}
	if r.DHCP {
		fg = append(fg, rule(fam, "dhcp", append(l4Dport(unix.IPPROTO_UDP, 67), accept())...))
	}
	if r.DNS {
		fg = append(fg, rule(fam, "dns", append(l4Dport(unix.IPPROTO_UDP, 53), accept())...),
			rule(fam, "dns", append(l4Dport(unix.IPPROTO_TCP, 53), accept())...))
	}
	if setBased {
		// A guest calling a published port whose cap is full in the kernel is
		// redirected to the slow-path listener on the host (only brokkr's
		// redirect makes a connection to the host DNATed).
		fg = append(fg, rule(fam, "redirected to the cap slow path", append(append(l4proto(unix.IPPROTO_TCP), ctStatusDNAT()...), accept())...))
	}
	if r.Subnet6.IsValid() {
		// IPv6 needs neighbour discovery with the host (the router); the
		// guests' addresses come from its advertisements, asked for by
		// their solicitations.
		fg = append(fg, rule(fam, "router solicitation", append(icmp6Type(133), accept())...),
			rule(fam, "neighbour solicitation", append(icmp6Type(135), accept())...),
			rule(fam, "neighbour advertisement", append(icmp6Type(136), accept())...))
	}
	fg = append(fg, rule(fam, "nothing else reaches the host", drop()))
	inet.addChain(&ChainSpec{Name: chainFromGuests, Rules: fg})

	return inet, desiredBridge(r), nil
}

// desiredSetCap adds the fixed objects of the set-based cap (the fallback
// when the BPF nat path cannot load): the slow path's port map and the
// FIN/RST bookkeeping.
func desiredSetCap(inet *TableSpec, overflowPort uint16) {
	fam := inet.Family
	// The cap's slow path: one element, the listener's port, so a new port
	// (a restart that could not get the old one) is one element, not every
	// capped chain.
	ov := &SetSpec{Name: MapOverflow, Key: nftables.TypeInetProto, Data: nftables.TypeInetService, IsMap: true,
		Comment: "cap slow path: listener port", Elems: map[string]ElemSpec{}}
	if overflowPort != 0 {
		k := []byte{unix.IPPROTO_TCP}
		ov.Elems[string(k)] = ElemSpec{Key: k, Val: binaryutil.BigEndian.PutUint16(overflowPort), Comment: "cap slow path"}
	}
	inet.addSet(ov)

	// Cap bookkeeping: FIN/RST of a connection of a capped TCP exposure
	// sets its mark's close bits; once closed, the watcher frees its place.
	// Only FIN/RST packets get past the first comparison, so established
	// traffic pays one load and compare.
	closeRule := rule(fam, "cap: closing connections",
		append(append(tcpFlagsAny(0x01|0x04), ctMarkMasked(ctmark.IDMask)...),
			&expr.Lookup{SourceRegister: 1, SetName: SetCappedTCP}, &expr.Verdict{Kind: expr.VerdictJump, Chain: chainClose})...)
	inet.addChain(&ChainSpec{Name: chainClosePre, Hook: &HookSpec{nftables.ChainTypeFilter, *nftables.ChainHookPrerouting, -150},
		Rules: []RuleSpec{closeRule}})
	inet.addChain(&ChainSpec{Name: chainCloseOut, Hook: &HookSpec{nftables.ChainTypeFilter, *nftables.ChainHookOutput, -150},
		Rules: []RuleSpec{closeRule}})
	setBits := func(bits uint32) []expr.Any {
		return []expr.Any{&expr.Ct{Register: 1, Key: expr.CtKeyMARK},
			&expr.Bitwise{SourceRegister: 1, DestRegister: 1, Len: 4,
				Mask: binaryutil.NativeEndian.PutUint32(^bits), Xor: binaryutil.NativeEndian.PutUint32(bits)},
			&expr.Ct{Register: 1, Key: expr.CtKeyMARK, SourceRegister: true}}
	}
	inet.addChain(&ChainSpec{Name: chainClose, Rules: []RuleSpec{
		rule(fam, "reset", append(tcpFlagsAny(0x04), setBits(ctmark.Closed)...)...),
		rule(fam, "fin from caller", append(ctDirection(0), setBits(ctmark.FINOrig)...)...),
		rule(fam, "fin from guest", append(ctDirection(1), setBits(ctmark.FINRepl)...)...),
	}})

	// Bytes per direction: every packet of a connection with an
	// exposure's mark bumps the counter of the exposure's element, once
	// (a packet is forwarded, or delivered to or sent by the host).
	// Absolute in the kernel, they outlive the daemon as the accepted
	// counters do; what conntrack accounting gave (live entries and the
	// ended ones the daemon saw) lost what ended while none ran. After the
	// nat hooks, so a connection's first packet carries its mark.
	byDir := func(comment string, dir byte, set string) RuleSpec {
		return rule(fam, comment, append(append(ctDirection(dir), ctMarkMasked(ctmark.IDMask|ctmark.Owned)...),
			&expr.Lookup{SourceRegister: 1, SetName: set})...)
	}
	for _, c := range []struct {
		name string
		hook *nftables.ChainHook
	}{{chainBytesFwd, nftables.ChainHookForward}, {chainBytesIn, nftables.ChainHookInput}, {chainBytesOut, nftables.ChainHookOutput}} {
		inet.addChain(&ChainSpec{Name: c.name, Hook: &HookSpec{nftables.ChainTypeFilter, *c.hook, 10}, Rules: []RuleSpec{
			byDir("bytes caller to guest", 0, MapExpBytesOrig), byDir("bytes guest to caller", 1, MapExpBytesReply)}})
	}
}

// Key and data types of the exposure maps (built once).
var (
	expAddrKey  = nftables.MustConcatSetType(nftables.TypeIPAddr, nftables.TypeInetProto, nftables.TypeInetService)
	expAnyKey   = nftables.MustConcatSetType(nftables.TypeInetProto, nftables.TypeInetService)
	targetData  = nftables.MustConcatSetType(nftables.TypeIPAddr, nftables.TypeInetService)
	expAddr6Key = nftables.MustConcatSetType(nftables.TypeIP6Addr, nftables.TypeInetProto, nftables.TypeInetService)
	target6Data = nftables.MustConcatSetType(nftables.TypeIP6Addr, nftables.TypeInetService)
	markPortKey = nftables.MustConcatSetType(nftables.TypeMark, nftables.TypeInetService)
)

// addSharedMaps adds the maps every exposure has elements in. With the
// set-based cap the targets count each exposure's admitted connections
// (their element's counter), and capped exposures are found by mark.
func addSharedMaps(inet *TableSpec, setBased bool) {
	// IPv6 is the BPF nat path's alone (the set-based cap's sets are keyed
	// by IPv4 connections); a target's element counts the set-based cap's
	// accepted.
	for _, m := range []struct {
		name      string
		key, data nftables.SetDatatype
		interval  bool
		counter   bool
		v6        bool
		comment   string
	}{
		{MapExpAddr, expAddrKey, nftables.TypeMark, false, false, false, "exposures bound to one address: their mark"},
		{MapExpAny, expAnyKey, nftables.TypeMark, false, false, false, "exposures bound to every local address: their mark"},
		{MapExpTarget, nftables.TypeMark, targetData, false, setBased, false, "each exposure's guest, by its mark"},
		{MapExpAddrRange, expAddrKey, nftables.TypeMark, true, false, false, "port ranges bound to one address: their mark"},
		{MapExpAnyRange, expAnyKey, nftables.TypeMark, true, false, false, "port ranges on every local address: their mark"},
		{MapExpTargetAddr, nftables.TypeMark, nftables.TypeIPAddr, false, setBased, false, "each port range's guest, by its mark: the port kept"},
		{MapExpTargetPort, markPortKey, targetData, false, setBased, false, "each shifted port range's guest port, by its mark and the port dialled"},
		{MapExpAddr6, expAddr6Key, nftables.TypeMark, false, false, true, "exposures bound to one ipv6 address: their mark"},
		{MapExpAny6, expAnyKey, nftables.TypeMark, false, false, true, "exposures bound to every local ipv6 address: their mark"},
		{MapExpTarget6, nftables.TypeMark, target6Data, false, false, true, "each exposure's guest ipv6 address, by its mark"},
		{MapExpAddr6Range, expAddr6Key, nftables.TypeMark, true, false, true, "port ranges bound to one ipv6 address: their mark"},
		{MapExpAny6Range, expAnyKey, nftables.TypeMark, true, false, true, "port ranges on every local ipv6 address: their mark"},
		{MapExpTargetAddr6, nftables.TypeMark, nftables.TypeIP6Addr, false, false, true, "each port range's guest ipv6 address, by its mark: the port kept"},
		{MapExpTargetPort6, markPortKey, target6Data, false, false, true, "each shifted port range's guest ipv6 address and port, by its mark and the port dialled"},
	} {
		if m.v6 && setBased {
			continue
		}
		inet.addSet(&SetSpec{Name: m.name, Key: m.key, Data: m.data, IsMap: true, Interval: m.interval, Counter: m.counter,
			PerExposure: true, Comment: m.comment, Elems: map[string]ElemSpec{}})
	}
	if !setBased {
		return
	}
	inet.addSet(&SetSpec{Name: MapExpCap, Key: nftables.TypeMark, Data: nftables.TypeVerdict, IsMap: true, PerExposure: true,
		Comment: "capped exposures: their cap, by mark", Elems: map[string]ElemSpec{}})
	inet.addSet(&SetSpec{Name: SetCappedTCP, Key: nftables.TypeMark, PerExposure: true,
		Comment: "capped tcp exposures by mark id", Elems: map[string]ElemSpec{}})
	inet.addSet(&SetSpec{Name: MapExpBytesOrig, Key: nftables.TypeMark, Counter: true, PerExposure: true,
		Comment: "each exposure's bytes caller to guest, by its mark", Elems: map[string]ElemSpec{}})
	inet.addSet(&SetSpec{Name: MapExpBytesReply, Key: nftables.TypeMark, Counter: true, PerExposure: true,
		Comment: "each exposure's bytes guest to caller, by its mark", Elems: map[string]ElemSpec{}})
}

// unit is one exposure's part of the inet table: its elements in the
// shared maps, and the objects of its own (nil when it has none). It is
// built for a first apply of 100,000 exposures at once: two allocations
// for the common case (the unit, and one buffer all its keys and values
// are slices of).
type unit struct {
	elems []unitElem
	own   *TableSpec
	arr   [4]unitElem
}

type unitElem struct {
	set string
	e   ElemSpec
}

// unitOf builds one exposure's unit. It depends on the exposure alone (and
// the cap's mode), so a unit is built again whenever it is needed instead
// of being kept.
func unitOf(e Exposure, setBased bool) (*unit, error) {
	if e.LoopbackOnly() {
		return &unit{}, nil
	}
	if err := e.buildable(); err != nil {
		return nil, err
	}
	u := &unit{}
	u.elems = u.arr[:0]
	add := func(set string, el ElemSpec) {
		el.Comment, el.Owner = e.Name, e.Name
		u.elems = append(u.elems, unitElem{set, el})
	}
	proto := ProtoNum(e.Protocol)
	v4, v6 := e.families(setBased)
	// mark (4) . dispatch key (8, 12 or 24; twice for a range: its first
	// and its last key) . guest address . port (8 or 20), for each family
	// published
	buf := make([]byte, 0, 4+(12*2+8)*2+24*2+20)
	buf = binary.NativeEndian.AppendUint32(buf, e.MarkID|ctmark.Owned)
	mark := buf[0:4:4]
	// AppendBinary writes an address's 4 or 16 bytes (none for the zero
	// Addr: a wildcard has no address in its key) into buf, allocating
	// nothing: a first apply builds 100,000 units.
	key := func(addr netip.Addr, port uint16) {
		buf, _ = addr.AppendBinary(buf)
		buf = append(buf, proto, 0, 0, 0)
		buf = binary.BigEndian.AppendUint16(buf, port)
		buf = append(buf, 0, 0)
	}
	side := func(addr, guest netip.Addr) (dispatch, target []byte) {
		at := len(buf)
		key(addr, e.HostPort)
		if e.IsRange() {
			key(addr, e.HostPortLast)
		}
		dispatch = buf[at:len(buf):len(buf)]
		at = len(buf)
		buf, _ = guest.AppendBinary(buf)
		if !e.keepsPort() {
			buf = binary.BigEndian.AppendUint16(buf, e.GuestPort)
			buf = append(buf, 0, 0)
		}
		return dispatch, buf[at:len(buf):len(buf)]
	}
	// The maps of each family: exact or interval dispatch, the guest with
	// its port or the port kept.
	any4, addr4, target4, any6, addr6, target6 := MapExpAny, MapExpAddr, MapExpTarget, MapExpAny6, MapExpAddr6, MapExpTarget6
	if e.IsRange() {
		any4, addr4, any6, addr6 = MapExpAnyRange, MapExpAddrRange, MapExpAny6Range, MapExpAddr6Range
	}
	if e.keepsPort() {
		target4, target6 = MapExpTargetAddr, MapExpTargetAddr6
	}
	// A shifted range: one target element per port, mark . host port to
	// the guest address . its port.
	byPort := func(set string, guest netip.Addr) {
		for i := 0; i <= int(e.HostPortLast)-int(e.HostPort); i++ {
			// key (8) then value (address . port), one buffer
			b := make([]byte, 0, 8+16+4)
			b = append(b, mark...)
			b = binary.BigEndian.AppendUint16(b, e.HostPort+uint16(i))
			b = append(b, 0, 0)
			b, _ = guest.AppendBinary(b)
			b = binary.BigEndian.AppendUint16(b, e.GuestPort+uint16(i))
			b = append(b, 0, 0)
			add(set, ElemSpec{Key: b[:8:8], Val: b[8:]})
		}
	}
	// Each family published: its host address (none for a wildcard),
	// its guest address, and its maps.
	type family struct {
		on                      bool
		host, guest             netip.Addr
		anyMap, addrMap, target string
		byPortMap               string
	}
	host := e.HostAddr
	if e.Wildcard() {
		host = netip.Addr{}
	}
	for _, f := range []family{
		{v4, host, e.GuestAddr, any4, addr4, target4, MapExpTargetPort},
		{v6, host, e.GuestAddr6, any6, addr6, target6, MapExpTargetPort6},
	} {
		if !f.on {
			continue
		}
		dispatch, target := side(f.host, f.guest)
		if e.Wildcard() {
			add(f.anyMap, ElemSpec{Key: dispatch, Val: mark})
		} else {
			add(f.addrMap, ElemSpec{Key: dispatch, Val: mark})
		}
		if e.shifted() {
			byPort(f.byPortMap, f.guest)
		} else {
			add(f.target, ElemSpec{Key: mark, Val: target})
		}
	}
	if !setBased {
		return u, nil
	}
	add(MapExpBytesOrig, ElemSpec{Key: mark})
	add(MapExpBytesReply, ElemSpec{Key: mark})
	if e.MaxConns <= 0 {
		return u, nil
	}
	// The set-based cap: the exposure's set of open connections, the
	// chain that admits into it, and its refused counter.
	add(MapExpCap, ElemSpec{Key: mark, Verdict: CapChain(e.Name)})
	if proto == unix.IPPROTO_TCP {
		add(SetCappedTCP, ElemSpec{Key: binaryutil.NativeEndian.PutUint32(e.MarkID)})
	}
	u.own = capObjects(e, proto)
	return u, nil
}

// capObjects are a capped exposure's own objects under the set-based cap.
func capObjects(e Exposure, proto byte) *TableSpec {
	t := NewTableSpec(nftables.TableFamilyINet)
	fam := t.Family
	t.Counters[RefusedCounter(e.Name)] = CounterSpec{Name: RefusedCounter(e.Name), Exposure: e.Name}
	t.addSet(&SetSpec{Name: ConnsSet(e.Name), Key: ConnKeyType, Dynamic: true, Size: uint32(e.MaxConns),
		Comment: "open connections of " + e.Name, Stateful: true, Owner: e.Name, SeedID: e.MarkID})
	// The add fails (and the rule stops) once the set holds MaxConns
	// connections.
	admit := append(append(nfprotoIPv4(), l4proto(proto)...),
		&expr.Payload{DestRegister: 1, Base: expr.PayloadBaseNetworkHeader, Offset: 12, Len: 4},
		&expr.Payload{DestRegister: 9, Base: expr.PayloadBaseNetworkHeader, Offset: 16, Len: 4},
		&expr.Payload{DestRegister: 10, Base: expr.PayloadBaseTransportHeader, Offset: 0, Len: 2},
		&expr.Payload{DestRegister: 11, Base: expr.PayloadBaseTransportHeader, Offset: 2, Len: 2},
		&expr.Dynset{SrcRegKey: 1, SetName: ConnsSet(e.Name), Operation: unix.NFT_DYNSET_OP_ADD})
	// Admitted, the caller goes where the exposure's target map says (the
	// chain is reached by goto: it ends in the DNAT).
	dnat := dnatToTarget()
	switch {
	case e.keepsPort():
		dnat = dnatToAddr(MapExpTargetAddr, unix.NFPROTO_IPV4)
	case e.shifted():
		dnat = dnatByPort(MapExpTargetPort, unix.NFPROTO_IPV4)
	}
	rules := []RuleSpec{rule(fam, e.Name, append(admit, dnat...)...)}
	rej := &expr.Reject{Type: unix.NFT_REJECT_TCP_RST}
	if proto != unix.IPPROTO_TCP {
		rej = &expr.Reject{Type: unix.NFT_REJECT_ICMPX_UNREACH, Code: unix.NFT_REJECT_ICMPX_PORT_UNREACH}
	}
	if proto == unix.IPPROTO_TCP {
		// Full in the kernel: let package nft's slow path decide exactly.
		// Without a listener (no element) the lookup fails and the next
		// rule refuses.
		rules = append(rules, rule(fam, e.Name+": full in the kernel, to the slow path", append(l4proto(proto),
			&expr.Meta{Key: expr.MetaKeyL4PROTO, Register: 1},
			&expr.Lookup{SourceRegister: 1, DestRegister: 1, IsDestRegSet: true, SetName: MapOverflow},
			&expr.Redir{RegisterProtoMin: 1, Flags: unix.NF_NAT_RANGE_PROTO_SPECIFIED})...))
	}
	rules = append(rules, rule(fam, e.Name+": over the cap", append(l4proto(proto),
		&expr.Objref{Type: unix.NFT_OBJECT_COUNTER, Name: RefusedCounter(e.Name)}, rej)...))
	t.addChain(&ChainSpec{Name: CapChain(e.Name), Owner: e.Name, Rules: rules})
	return t
}

// assemble is a whole inet table: the fixed part and every unit.
func assemble(fixed *TableSpec, n int, units func(yield func(*unit) bool)) *TableSpec {
	whole := &TableSpec{Family: fixed.Family, Counters: maps.Clone(fixed.Counters),
		Sets: make(map[string]*SetSpec, len(fixed.Sets)), Chains: maps.Clone(fixed.Chains)}
	for name, s := range fixed.Sets {
		if s.PerExposure {
			c := *s // the fixed part's own stays empty
			c.Elems = make(map[string]ElemSpec, n)
			s = &c
		}
		whole.Sets[name] = s
	}
	for u := range units {
		for _, ue := range u.elems {
			whole.Sets[ue.set].Elems[string(ue.e.Key)] = ue.e
		}
		if u.own != nil {
			maps.Copy(whole.Counters, u.own.Counters)
			maps.Copy(whole.Chains, u.own.Chains)
			maps.Copy(whole.Sets, u.own.Sets)
		}
	}
	return whole
}

// Whole is both tables for r, everything in them: what Render prints (the
// golden files) and what a replace creates.
func Whole(r Rules) (inet, bridge *TableSpec, err error) {
	fixed, bridge, err := buildFixed(r)
	if err != nil {
		return nil, nil, err
	}
	units := make([]*unit, 0, len(r.Exposures))
	for _, e := range r.Exposures {
		_, setBased := r.setBased()
		u, err := unitOf(e, setBased)
		if err != nil {
			return nil, nil, err
		}
		units = append(units, u)
	}
	return assemble(fixed, len(units), slices.Values(units)), bridge, nil
}

// dispatchSide decodes the host side from the key of an element of a
// dispatch map (the maps looked up by address, protocol and port).
func dispatchSide(set string, k []byte) (HostSide, bool) {
	// An interval map's key is the first key and the last: the side is
	// the range from the first's port to the last's.
	last := func(h HostSide, end []byte) (HostSide, bool) {
		if p := binary.BigEndian.Uint16(end); p > h.Port {
			h.PortLast = p
		}
		return h, true
	}
	switch {
	case set == MapExpAnyRange && len(k) == 16:
		return last(HostSide{k[0], netip.IPv4Unspecified(), binary.BigEndian.Uint16(k[4:6]), 0}, k[12:14])
	case set == MapExpAddrRange && len(k) == 24:
		return last(HostSide{k[4], netip.AddrFrom4([4]byte(k[0:4])), binary.BigEndian.Uint16(k[8:10]), 0}, k[20:22])
	case set == MapExpAny6Range && len(k) == 16:
		return last(HostSide{k[0], netip.IPv6Unspecified(), binary.BigEndian.Uint16(k[4:6]), 0}, k[12:14])
	case set == MapExpAddr6Range && len(k) == 48:
		return last(HostSide{k[16], netip.AddrFrom16([16]byte(k[0:16])), binary.BigEndian.Uint16(k[20:22]), 0}, k[44:46])
	case set == MapExpAny && len(k) == 8:
		return HostSide{k[0], netip.IPv4Unspecified(), binary.BigEndian.Uint16(k[4:6]), 0}, true
	case set == MapExpAddr && len(k) == 12:
		return HostSide{k[4], netip.AddrFrom4([4]byte(k[0:4])), binary.BigEndian.Uint16(k[8:10]), 0}, true
	case set == MapExpAny6 && len(k) == 8:
		return HostSide{k[0], netip.IPv6Unspecified(), binary.BigEndian.Uint16(k[4:6]), 0}, true
	case set == MapExpAddr6 && len(k) == 24:
		return HostSide{k[16], netip.AddrFrom16([16]byte(k[0:16])), binary.BigEndian.Uint16(k[20:22]), 0}, true
	}
	return HostSide{}, false
}

// desiredBridge: anti-spoof per guest port and guest isolation.
func desiredBridge(r Rules) *TableSpec {
	t := NewTableSpec(nftables.TableFamilyBridge)
	fam := t.Family
	ports := &SetSpec{Name: setGuestPorts, Key: nftables.TypeIFName, Comment: "guest ports under anti-spoof", Elems: map[string]ElemSpec{}}
	addrs := &SetSpec{Name: setGuestAddrs, Key: nftables.MustConcatSetType(nftables.TypeIFName, nftables.TypeEtherAddr, nftables.TypeIPAddr),
		Comment: "port, mac and address of each guest", Elems: map[string]ElemSpec{}}
	macs := &SetSpec{Name: setGuestMACs, Key: nftables.MustConcatSetType(nftables.TypeIFName, nftables.TypeEtherAddr),
		Comment: "port and mac of each guest", Elems: map[string]ElemSpec{}}
	for _, g := range r.Guests {
		p := ifnameKey(g.Tap)
		ports.Elems[string(p)] = ElemSpec{Key: p, Comment: g.Name}
		pm := append(append([]byte{}, p...), pad4(g.MAC)...)
		macs.Elems[string(pm)] = ElemSpec{Key: pm, Comment: g.Name}
		if g.Addr.IsValid() {
			pma := append(append([]byte{}, pm...), g.Addr.AsSlice()...)
			addrs.Elems[string(pma)] = ElemSpec{Key: pma, Comment: g.Name}
		}
	}
	t.addSet(ports)
	t.addSet(addrs)
	t.addSet(macs)
	v6 := r.Subnet6.IsValid()
	if v6 {
		addrs6 := &SetSpec{Name: setGuestAddrs6, Key: nftables.MustConcatSetType(nftables.TypeIFName, nftables.TypeEtherAddr, nftables.TypeIP6Addr),
			Comment: "port, mac and ipv6 addresses of each guest", Elems: map[string]ElemSpec{}}
		for _, g := range r.Guests {
			pm := append(append([]byte{}, ifnameKey(g.Tap)...), pad4(g.MAC)...)
			for _, a := range []netip.Addr{g.Addr6, LinkLocal(g.MAC)} {
				if a.IsValid() {
					k := append(append([]byte{}, pm...), a.AsSlice()...)
					addrs6.Elems[string(k)] = ElemSpec{Key: k, Comment: g.Name}
				}
			}
		}
		t.addSet(addrs6)
	}
	t.addChain(&ChainSpec{Name: chainBrPre, Hook: &HookSpec{nftables.ChainTypeFilter, *nftables.ChainHookPrerouting, -200},
		Rules: []RuleSpec{rule(fam, "guest ports", append(ifnameInSet(unix.NFT_META_IIFNAME, setGuestPorts),
			&expr.Verdict{Kind: expr.VerdictJump, Chain: chainAntiSpoof})...)}})
	var as []RuleSpec
	if v6 {
		// IPv6: no router advertisement from a guest (brokkr is the guests'
		// only router); no neighbour advertisement for an address not the
		// guest's (ND's counterpart of ARP's sender check: from its own
		// source a guest could otherwise move another's address to its MAC
		// in the host's and the guests' neighbour caches, or fail another's
		// duplicate address detection at boot); then only the guest's own
		// addresses (its SLAAC address and its link-local one), and
		// duplicate address detection from :: with its own MAC, for any
		// address as ARP probes are (so a guest configured with another's
		// address hears it defended).
		as = append(as,
			rule(fam, "router advertisement from a guest", append(append(etherType(0x86dd), icmp6Type(134)...), &expr.Counter{}, drop())...),
			rule(fam, "neighbour advertisement", append(append(etherType(0x86dd), icmp6Type(136)...),
				&expr.Verdict{Kind: expr.VerdictJump, Chain: chainNDTargets})...),
			rule(fam, "own mac and ipv6 address", append(append(etherType(0x86dd),
				&expr.Meta{Key: expr.MetaKeyIIFNAME, Register: 1},
				&expr.Payload{DestRegister: 12, Base: expr.PayloadBaseLLHeader, Offset: 6, Len: 6},
				&expr.Payload{DestRegister: 14, Base: expr.PayloadBaseNetworkHeader, Offset: 8, Len: 16},
				&expr.Lookup{SourceRegister: 1, SetName: setGuestAddrs6}), accept())...),
			rule(fam, "duplicate address detection from own mac", append(append(append(etherType(0x86dd),
				&expr.Payload{DestRegister: 1, Base: expr.PayloadBaseNetworkHeader, Offset: 8, Len: 16},
				&expr.Cmp{Op: expr.CmpOpEq, Register: 1, Data: make([]byte, 16)}),
				l4proto(unix.IPPROTO_ICMPV6)...),
				&expr.Meta{Key: expr.MetaKeyIIFNAME, Register: 1},
				&expr.Payload{DestRegister: 12, Base: expr.PayloadBaseLLHeader, Offset: 6, Len: 6},
				&expr.Lookup{SourceRegister: 1, SetName: setGuestMACs}, accept())...),
		)
	}
	last := "spoofed or not ipv4"
	if v6 {
		last = "spoofed, or neither ipv4 nor ipv6"
	}
	as = append(as,
		rule(fam, "own mac and address", append(append(etherType(0x0800),
			&expr.Meta{Key: expr.MetaKeyIIFNAME, Register: 1},
			&expr.Payload{DestRegister: 12, Base: expr.PayloadBaseLLHeader, Offset: 6, Len: 6},
			&expr.Payload{DestRegister: 14, Base: expr.PayloadBaseNetworkHeader, Offset: 12, Len: 4},
			&expr.Lookup{SourceRegister: 1, SetName: setGuestAddrs}), accept())...),
		rule(fam, "dhcp from own mac", append(append(append(append(etherType(0x0800),
			&expr.Payload{DestRegister: 1, Base: expr.PayloadBaseNetworkHeader, Offset: 12, Len: 4},
			&expr.Cmp{Op: expr.CmpOpEq, Register: 1, Data: []byte{0, 0, 0, 0}}),
			udpPorts(68, 67)...),
			&expr.Meta{Key: expr.MetaKeyIIFNAME, Register: 1},
			&expr.Payload{DestRegister: 12, Base: expr.PayloadBaseLLHeader, Offset: 6, Len: 6},
			&expr.Lookup{SourceRegister: 1, SetName: setGuestMACs}), accept())...),
		rule(fam, "arp for own mac and address", append(append(etherType(0x0806),
			&expr.Meta{Key: expr.MetaKeyIIFNAME, Register: 1},
			&expr.Payload{DestRegister: 12, Base: expr.PayloadBaseNetworkHeader, Offset: 8, Len: 6},
			&expr.Payload{DestRegister: 14, Base: expr.PayloadBaseNetworkHeader, Offset: 14, Len: 4},
			&expr.Lookup{SourceRegister: 1, SetName: setGuestAddrs}), accept())...),
		rule(fam, "arp probe from own mac", append(append(etherType(0x0806),
			&expr.Payload{DestRegister: 1, Base: expr.PayloadBaseNetworkHeader, Offset: 14, Len: 4},
			&expr.Cmp{Op: expr.CmpOpEq, Register: 1, Data: []byte{0, 0, 0, 0}},
			&expr.Meta{Key: expr.MetaKeyIIFNAME, Register: 1},
			&expr.Payload{DestRegister: 12, Base: expr.PayloadBaseNetworkHeader, Offset: 8, Len: 6},
			&expr.Lookup{SourceRegister: 1, SetName: setGuestMACs}), accept())...),
		rule(fam, last, &expr.Counter{}, drop()),
	)
	t.addChain(&ChainSpec{Name: chainAntiSpoof, Rules: as})
	if v6 {
		t.addChain(&ChainSpec{Name: chainNDTargets, Rules: ndTargets(fam, r.Guests)})
	}
	if r.IsolateGuests {
		t.addChain(&ChainSpec{Name: chainBrForward, Hook: &HookSpec{nftables.ChainTypeFilter, *nftables.ChainHookForward, -200},
			Rules: []RuleSpec{rule(fam, "isolate guests", append(append(ifnameInSet(unix.NFT_META_IIFNAME, setGuestPorts),
				ifnameInSet(unix.NFT_META_OIFNAME, setGuestPorts)...), drop())...)}})
	}
	return t
}

// ndTargets: one rule per guest dropping a neighbour advertisement whose
// target is neither of its addresses. A rule per guest, not a set lookup:
// nft 1.0.6 (Debian 12) can neither name the target (icmpv6 taddr, 1.0.9)
// nor read a raw payload back from a concatenation, so a lookup would list
// as garbage there. Only neighbour advertisements jump here.
func ndTargets(fam nftables.TableFamily, guests []Guest) []RuleSpec {
	gs := append([]Guest(nil), guests...)
	sort.Slice(gs, func(i, j int) bool { return gs[i].Tap < gs[j].Tap })
	var rs []RuleSpec
	for _, g := range gs {
		x := ifname(expr.MetaKeyIIFNAME, g.Tap, expr.CmpOpEq)
		for _, a := range []netip.Addr{LinkLocal(g.MAC), g.Addr6} {
			if a.IsValid() {
				x = append(x, &expr.Payload{DestRegister: 1, Base: expr.PayloadBaseTransportHeader, Offset: 8, Len: 16},
					&expr.Cmp{Op: expr.CmpOpNeq, Register: 1, Data: a.AsSlice()})
			}
		}
		rs = append(rs, rule(fam, g.Name+": advertised address not its own", append(x, &expr.Counter{}, drop())...))
	}
	return rs
}

// ConnKeyType: original source address, destination address, source port,
// destination port. The destination port tells apart two connections of
// one caller from one source port to two ports of a range (Linux reuses an
// ephemeral port across destinations); for one port it is the host port.
var ConnKeyType = nftables.MustConcatSetType(nftables.TypeIPAddr, nftables.TypeIPAddr, nftables.TypeInetService, nftables.TypeInetService)

// ConnKey is a cap-set element: the connection's original source address,
// destination address, source port and destination port (each field
// padded to 4 bytes, as the kernel lays out a concatenation).
func ConnKey(src, dst netip.AddrPort) []byte {
	k := make([]byte, 16)
	a, b := src.Addr().As4(), dst.Addr().As4()
	copy(k, a[:])
	copy(k[4:], b[:])
	binary.BigEndian.PutUint16(k[8:], src.Port())
	binary.BigEndian.PutUint16(k[12:], dst.Port())
	return k
}

// ConnOfKey is the connection a ConnKey names.
func ConnOfKey(k []byte) (src, dst netip.AddrPort, ok bool) {
	if len(k) != 16 {
		return src, dst, false
	}
	src = netip.AddrPortFrom(netip.AddrFrom4([4]byte(k[0:4])), binary.BigEndian.Uint16(k[8:10]))
	dst = netip.AddrPortFrom(netip.AddrFrom4([4]byte(k[4:8])), binary.BigEndian.Uint16(k[12:14]))
	return src, dst, true
}

// --- expression helpers (each in the form `nft` prints back) ---

func ProtoNum(p string) byte {
	if p == "udp" {
		return unix.IPPROTO_UDP
	}
	return unix.IPPROTO_TCP
}

func pad4(b []byte) []byte {
	out := make([]byte, (len(b)+3)/4*4)
	copy(out, b)
	return out
}

func ifnameKey(name string) []byte {
	b := make([]byte, 16)
	copy(b, name)
	return b
}

func accept() expr.Any { return &expr.Verdict{Kind: expr.VerdictAccept} }
func drop() expr.Any   { return &expr.Verdict{Kind: expr.VerdictDrop} }

func nfprotoIPv4() []expr.Any {
	return []expr.Any{&expr.Meta{Key: expr.MetaKeyNFPROTO, Register: 1},
		&expr.Cmp{Op: expr.CmpOpEq, Register: 1, Data: []byte{unix.NFPROTO_IPV4}}}
}

func ipPrefix(offset uint32, p netip.Prefix, op expr.CmpOp) []expr.Any {
	mask := make([]byte, 4)
	binary.BigEndian.PutUint32(mask, ^uint32(0)<<(32-p.Bits()))
	return append(nfprotoIPv4(),
		&expr.Payload{DestRegister: 1, Base: expr.PayloadBaseNetworkHeader, Offset: offset, Len: 4},
		&expr.Bitwise{SourceRegister: 1, DestRegister: 1, Len: 4, Mask: mask, Xor: []byte{0, 0, 0, 0}},
		&expr.Cmp{Op: op, Register: 1, Data: p.Masked().Addr().AsSlice()})
}

func nfprotoIPv6() []expr.Any {
	return []expr.Any{&expr.Meta{Key: expr.MetaKeyNFPROTO, Register: 1},
		&expr.Cmp{Op: expr.CmpOpEq, Register: 1, Data: []byte{unix.NFPROTO_IPV6}}}
}

// ip6Prefix compares the IPv6 address at offset with p (a /128: no mask).
func ip6Prefix(offset uint32, p netip.Prefix, op expr.CmpOp) []expr.Any {
	load := append(nfprotoIPv6(), &expr.Payload{DestRegister: 1, Base: expr.PayloadBaseNetworkHeader, Offset: offset, Len: 16})
	if p.Bits() < 128 {
		mask := make([]byte, 16)
		for i := 0; i < p.Bits(); i++ {
			mask[i/8] |= 0x80 >> (i % 8)
		}
		load = append(load, &expr.Bitwise{SourceRegister: 1, DestRegister: 1, Len: 16, Mask: mask, Xor: make([]byte, 16)})
	}
	return append(load, &expr.Cmp{Op: op, Register: 1, Data: p.Masked().Addr().AsSlice()})
}

func ip6SaddrIn(p netip.Prefix) []expr.Any { return ip6Prefix(8, p, expr.CmpOpEq) }

// icmp6Type matches ICMPv6 messages of type t.
func icmp6Type(t byte) []expr.Any {
	return append(l4proto(unix.IPPROTO_ICMPV6),
		&expr.Payload{DestRegister: 1, Base: expr.PayloadBaseTransportHeader, Offset: 0, Len: 1},
		&expr.Cmp{Op: expr.CmpOpEq, Register: 1, Data: []byte{t}})
}

// guardRules drop packets from outside addressed to 127/8. (A packet from
// outside to ::1 never reaches netfilter: the kernel drops it on receipt,
// RFC 4291 2.5.3, in ip6_rcv_core.)
func guardRules(Rules) []RuleSpec {
	return []RuleSpec{rule(nftables.TableFamilyINet, "drop remote packets to loopback",
		append(append(ipDaddrIn(netip.MustParsePrefix("127.0.0.0/8")), ifname(unix.NFT_META_IIFNAME, "lo", expr.CmpOpNeq)...), &expr.Counter{}, drop())...)}
}

func ipDaddrIn(p netip.Prefix) []expr.Any    { return ipPrefix(16, p, expr.CmpOpEq) }
func ipDaddrNotIn(p netip.Prefix) []expr.Any { return ipPrefix(16, p, expr.CmpOpNeq) }
func ipSaddrIn(p netip.Prefix) []expr.Any    { return ipPrefix(12, p, expr.CmpOpEq) }

func ifname(key expr.MetaKey, name string, op expr.CmpOp) []expr.Any {
	return []expr.Any{&expr.Meta{Key: key, Register: 1}, &expr.Cmp{Op: op, Register: 1, Data: ifnameKey(name)}}
}

func ifnameInSet(key expr.MetaKey, set string) []expr.Any {
	return []expr.Any{&expr.Meta{Key: key, Register: 1}, &expr.Lookup{SourceRegister: 1, SetName: set}}
}

func fibDaddrLocal() []expr.Any {
	return []expr.Any{&expr.Fib{Register: 1, FlagDADDR: true, ResultADDRTYPE: true},
		&expr.Cmp{Op: expr.CmpOpEq, Register: 1, Data: binaryutil.NativeEndian.PutUint32(unix.RTN_LOCAL)}}
}

func l4proto(p byte) []expr.Any {
	return []expr.Any{&expr.Meta{Key: expr.MetaKeyL4PROTO, Register: 1},
		&expr.Cmp{Op: expr.CmpOpEq, Register: 1, Data: []byte{p}}}
}

func l4Dport(p byte, port uint16) []expr.Any {
	return append(l4proto(p),
		&expr.Payload{DestRegister: 1, Base: expr.PayloadBaseTransportHeader, Offset: 2, Len: 2},
		&expr.Cmp{Op: expr.CmpOpEq, Register: 1, Data: binaryutil.BigEndian.PutUint16(port)})
}

func udpPorts(sport, dport uint16) []expr.Any {
	return append(l4proto(unix.IPPROTO_UDP),
		&expr.Payload{DestRegister: 1, Base: expr.PayloadBaseTransportHeader, Offset: 0, Len: 2},
		&expr.Cmp{Op: expr.CmpOpEq, Register: 1, Data: binaryutil.BigEndian.PutUint16(sport)},
		&expr.Payload{DestRegister: 1, Base: expr.PayloadBaseTransportHeader, Offset: 2, Len: 2},
		&expr.Cmp{Op: expr.CmpOpEq, Register: 1, Data: binaryutil.BigEndian.PutUint16(dport)})
}

func tcpFlagsAny(flags byte) []expr.Any {
	return append(l4proto(unix.IPPROTO_TCP),
		&expr.Payload{DestRegister: 1, Base: expr.PayloadBaseTransportHeader, Offset: 13, Len: 1},
		&expr.Bitwise{SourceRegister: 1, DestRegister: 1, Len: 1, Mask: []byte{flags}, Xor: []byte{0}},
		&expr.Cmp{Op: expr.CmpOpNeq, Register: 1, Data: []byte{0}})
}

func ctMarkMasked(mask uint32) []expr.Any {
	return []expr.Any{&expr.Ct{Register: 1, Key: expr.CtKeyMARK},
		&expr.Bitwise{SourceRegister: 1, DestRegister: 1, Len: 4, Mask: binaryutil.NativeEndian.PutUint32(mask), Xor: []byte{0, 0, 0, 0}}}
}

func ctDirection(dir byte) []expr.Any {
	return []expr.Any{&expr.Ct{Register: 1, Key: expr.CtKeyDIRECTION},
		&expr.Cmp{Op: expr.CmpOpEq, Register: 1, Data: []byte{dir}}}
}

func ctStateAny(bits uint32) []expr.Any {
	return []expr.Any{&expr.Ct{Register: 1, Key: expr.CtKeySTATE},
		&expr.Bitwise{SourceRegister: 1, DestRegister: 1, Len: 4, Mask: binaryutil.NativeEndian.PutUint32(bits), Xor: []byte{0, 0, 0, 0}},
		&expr.Cmp{Op: expr.CmpOpNeq, Register: 1, Data: []byte{0, 0, 0, 0}}}
}

func ctStatusDNAT() []expr.Any {
	const ipsDstNAT = 1 << 5 // IPS_DST_NAT
	return []expr.Any{&expr.Ct{Register: 1, Key: expr.CtKeySTATUS},
		&expr.Bitwise{SourceRegister: 1, DestRegister: 1, Len: 4, Mask: binaryutil.NativeEndian.PutUint32(ipsDstNAT), Xor: []byte{0, 0, 0, 0}},
		&expr.Cmp{Op: expr.CmpOpNeq, Register: 1, Data: []byte{0, 0, 0, 0}}}
}

func etherType(t uint16) []expr.Any {
	return []expr.Any{&expr.Payload{DestRegister: 1, Base: expr.PayloadBaseLLHeader, Offset: 12, Len: 2},
		&expr.Cmp{Op: expr.CmpOpEq, Register: 1, Data: binaryutil.BigEndian.PutUint16(t)}}
}

// ip daddr . meta l4proto . th dport, in the 32-bit registers nft uses for
// concatenations (reg 1 == reg32 00, then 9, 10).
func loadAddrProtoPort() []expr.Any {
	return append(nfprotoIPv4(),
		&expr.Payload{DestRegister: 1, Base: expr.PayloadBaseNetworkHeader, Offset: 16, Len: 4},
		&expr.Meta{Key: expr.MetaKeyL4PROTO, Register: 9},
		&expr.Payload{DestRegister: 10, Base: expr.PayloadBaseTransportHeader, Offset: 2, Len: 2})
}

// ip6 daddr . meta l4proto . th dport: the address fills NFT_REG_1 (reg32
// 00-03), the protocol reg32 04 (NFT_REG_2's first word), the port reg32 05.
func loadAddr6ProtoPort() []expr.Any {
	return append(nfprotoIPv6(),
		&expr.Payload{DestRegister: 1, Base: expr.PayloadBaseNetworkHeader, Offset: 24, Len: 16},
		&expr.Meta{Key: expr.MetaKeyL4PROTO, Register: 2},
		&expr.Payload{DestRegister: 13, Base: expr.PayloadBaseTransportHeader, Offset: 2, Len: 2})
}

func loadProtoPort() []expr.Any {
	return []expr.Any{&expr.Meta{Key: expr.MetaKeyL4PROTO, Register: 1},
		&expr.Payload{DestRegister: 9, Base: expr.PayloadBaseTransportHeader, Offset: 2, Len: 2}}
}

func lookupVmap(set string) expr.Any {
	return &expr.Lookup{SourceRegister: 1, DestRegister: 0, IsDestRegSet: true, SetName: set}
}

// markFrom sets the connection's mark to what the key loaded before maps
// to in set: ct mark set <key> map @set.
func markFrom(set string) []expr.Any {
	return []expr.Any{&expr.Lookup{SourceRegister: 1, DestRegister: 1, IsDestRegSet: true, SetName: set},
		&expr.Ct{Register: 1, Key: expr.CtKeyMARK, SourceRegister: true}}
}

// dnatToTarget DNATs to the guest the connection's mark maps to: dnat ip to
// ct mark map @exp-target. The map's data is address . port, which lands
// in reg32 00 and 01 (NFT_REG_1 and the 32-bit register after it).
func dnatToTarget() []expr.Any {
	return []expr.Any{&expr.Ct{Register: 1, Key: expr.CtKeyMARK},
		&expr.Lookup{SourceRegister: 1, DestRegister: 1, IsDestRegSet: true, SetName: MapExpTarget},
		&expr.NAT{Type: expr.NATTypeDestNAT, Family: unix.NFPROTO_IPV4, RegAddrMin: 1, RegAddrMax: 1, RegProtoMin: 9, RegProtoMax: 9, Specified: true}}
}

// dnatToAddr DNATs to the address the mark maps to in set, the port
// kept: dnat ip|ip6 to ct mark map @exp-target-addr[6].
func dnatToAddr(set string, family uint32) []expr.Any {
	return []expr.Any{&expr.Ct{Register: 1, Key: expr.CtKeyMARK},
		&expr.Lookup{SourceRegister: 1, DestRegister: 1, IsDestRegSet: true, SetName: set},
		&expr.NAT{Type: expr.NATTypeDestNAT, Family: family, RegAddrMin: 1, RegAddrMax: 1}}
}

// dnatByPort DNATs by the mark and the port dialled to the guest address
// and port set maps them to: dnat ip|ip6 to ct mark . th dport map
// @exp-target-port[6]. The key is the mark (reg32 00) and the port (reg32
// 01); the data lands as dnatToTarget's (IPv4) and dnat6ToTarget's do.
func dnatByPort(set string, family uint32) []expr.Any {
	proto := uint32(9)
	if family == unix.NFPROTO_IPV6 {
		proto = 2
	}
	return []expr.Any{&expr.Ct{Register: 1, Key: expr.CtKeyMARK},
		&expr.Payload{DestRegister: 9, Base: expr.PayloadBaseTransportHeader, Offset: 2, Len: 2},
		&expr.Lookup{SourceRegister: 1, DestRegister: 1, IsDestRegSet: true, SetName: set},
		&expr.NAT{Type: expr.NATTypeDestNAT, Family: family, RegAddrMin: 1, RegAddrMax: 1, RegProtoMin: proto, RegProtoMax: proto, Specified: true}}
}

// dnat6ToTarget: dnat ip6 to ct mark map @exp-target6. The data is an IPv6
// address (NFT_REG_1) and the port after it (reg32 04, NFT_REG_2).
func dnat6ToTarget() []expr.Any {
	return []expr.Any{&expr.Ct{Register: 1, Key: expr.CtKeyMARK},
		&expr.Lookup{SourceRegister: 1, DestRegister: 1, IsDestRegSet: true, SetName: MapExpTarget6},
		&expr.NAT{Type: expr.NATTypeDestNAT, Family: unix.NFPROTO_IPV6, RegAddrMin: 1, RegAddrMax: 1, RegProtoMin: 2, RegProtoMax: 2, Specified: true}}
}
