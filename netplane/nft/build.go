package nft

import (
	"encoding/binary"
	"hash/fnv"
	"net/netip"
	"sort"

	"github.com/google/nftables"
	"github.com/google/nftables/binaryutil"
	"github.com/google/nftables/expr"
	"golang.org/x/sys/unix"
)

// Connection marks. The low 29 bits of ct mark identify the exposure that
// DNATed the connection, and MarkOwned is set on every connection brokkr
// marks, so a counter read asks the kernel for brokkr's entries only (a mark
// filter) instead of every flow the host tracks. The two high bits record
// that a FIN was seen in the original and in the reply direction (a RST sets
// both). A connection whose two bits are set is closed as far as the cap is
// concerned.
const (
	MarkIDMask  uint32 = 0x1fffffff
	MarkOwned   uint32 = 0x20000000
	MarkFINOrig uint32 = 0x40000000
	MarkFINRepl uint32 = 0x80000000
	MarkClosed         = MarkFINOrig | MarkFINRepl
)

// connMark is the ct mark a connection of exposure id gets.
func connMark(id uint32) []byte { return binaryutil.NativeEndian.PutUint32(id | MarkOwned) }

// Names of the fixed objects of table inet brokkr.
const (
	chainPrerouting  = "prerouting"  // nat prerouting: DNAT dispatch
	chainOutput      = "output"      // nat output: DNAT dispatch for host-local callers
	chainPostrouting = "postrouting" // nat postrouting: hairpin + egress masquerade
	chainDispatch    = "dispatch"    // the two verdict-map lookups
	chainGuard       = "guard"       // raw prerouting: drop remote packets to 127/8
	chainInput       = "input"       // filter input: host isolation
	chainFromGuests  = "from-guests" // what a guest may send to the host itself
	chainClosePre    = "close-pre"   // FIN/RST bookkeeping for the cap (prerouting)
	chainCloseOut    = "close-out"   // the same for host-local callers (output)
	mapExpAddr       = "exp-addr"    // ip daddr . l4proto . dport : goto exp-NAME
	mapExpAny        = "exp-any"     // l4proto . dport : goto exp-NAME
	mapClosers       = "closers"     // mark id : goto close-NAME
	mapOverflow      = "overflow"    // l4proto : port of the cap's slow-path listener
	setGuestPorts    = "guest-ports" // bridge table: ports under anti-spoof
	setGuestAddrs    = "guest-addrs" // bridge table: port . mac . ipv4
	setGuestMACs     = "guest-macs"  // bridge table: port . mac
	chainBrPre       = "prerouting"  // bridge table: anti-spoof dispatch
	chainAntiSpoof   = "anti-spoof"  // bridge table: what a guest port may send
	chainBrForward   = "forward"     // bridge table: guest isolation
)

// Per-exposure object names.
func expChain(name string) string   { return "exp-" + name }
func closeChain(name string) string { return "close-" + name }
func connsSet(name string) string   { return "conns-" + name }
func acceptedCounter(name string) string {
	return name + "-accepted"
}
func refusedCounter(name string) string { return name + "-refused" }

// assignIDs gives every exposure a mark id: a hash of its name, probed
// linearly on collision. prev keeps ids already in use stable.
func assignIDs(exps []Exposure, prev map[string]uint32) map[string]uint32 {
	ids := make(map[string]uint32, len(exps))
	used := make(map[uint32]bool, len(exps))
	// Ids in prev are distinct, so keeping them needs no order; only the
	// new names are sorted (probing order decides their ids).
	var names []string
	for _, e := range exps {
		if id, ok := prev[e.Name]; ok && !used[id] {
			ids[e.Name], used[id] = id, true
		} else {
			names = append(names, e.Name)
		}
	}
	sort.Strings(names)
	for _, n := range names {
		if _, ok := ids[n]; ok {
			continue
		}
		h := fnv.New32a()
		h.Write([]byte(n))
		id := h.Sum32() & MarkIDMask
		for id == 0 || used[id] {
			id = (id + 1) & MarkIDMask
		}
		ids[n], used[id] = id, true
	}
	return ids
}

// desired computes the whole desired content of both tables.
func desired(r Rules, ids map[string]uint32) (inet, bridge *tableSpec) {
	inet = newTableSpec(nftables.TableFamilyINet)
	fam := nftables.TableFamilyINet
	subnet := r.Subnet.Masked()

	// Remote loopback guard: never let a packet from outside reach 127/8.
	inet.addChain(&chainSpec{name: chainGuard, hook: &hookSpec{nftables.ChainTypeFilter, *nftables.ChainHookPrerouting, -300},
		rules: []ruleSpec{rule(fam, "drop remote packets to loopback",
			append(append(ipDaddrIn(netip.MustParsePrefix("127.0.0.0/8")), ifname(unix.NFT_META_IIFNAME, "lo", expr.CmpOpNeq)...), &expr.Counter{}, drop())...)}})

	// DNAT dispatch: only for local destinations, never for 127/8.
	entry := func(comment string) ruleSpec {
		return rule(fam, comment, append(append(ipDaddrNotIn(netip.MustParsePrefix("127.0.0.0/8")), fibDaddrLocal()...),
			&expr.Verdict{Kind: expr.VerdictJump, Chain: chainDispatch})...)
	}
	inet.addChain(&chainSpec{name: chainPrerouting, hook: &hookSpec{nftables.ChainTypeNAT, *nftables.ChainHookPrerouting, -100},
		rules: []ruleSpec{entry("published ports")}})
	inet.addChain(&chainSpec{name: chainOutput, hook: &hookSpec{nftables.ChainTypeNAT, *nftables.ChainHookOutput, -100},
		rules: []ruleSpec{entry("published ports, host-local callers")}})
	inet.addChain(&chainSpec{name: chainDispatch, rules: []ruleSpec{
		rule(fam, "exposures bound to one address", append(loadAddrProtoPort(), lookupVmap(mapExpAddr))...),
		rule(fam, "exposures bound to every local address", append(loadProtoPort(), lookupVmap(mapExpAny))...),
	}})
	addSharedMaps(inet)
	if !r.KernelCap {
		desiredSetCap(inet, r)
	}

	// Masquerade: hairpin (a guest reaching a published port through the
	// host) and egress.
	post := []ruleSpec{rule(fam, "hairpin", append(append(append(ctStatusDNAT(), ifname(unix.NFT_META_OIFNAME, r.Bridge, expr.CmpOpEq)...),
		ipSaddrIn(subnet)...), &expr.Masq{})...)}
	if r.Masquerade {
		post = append(post, rule(fam, "egress", append(append(ipSaddrIn(subnet), ifname(unix.NFT_META_OIFNAME, r.Bridge, expr.CmpOpNeq)...), &expr.Masq{})...))
	}
	inet.addChain(&chainSpec{name: chainPostrouting, hook: &hookSpec{nftables.ChainTypeNAT, *nftables.ChainHookPostrouting, 100}, rules: post})

	// Host isolation: a guest reaches the host itself only for DHCP, DNS
	// and replies.
	inet.addChain(&chainSpec{name: chainInput, hook: &hookSpec{nftables.ChainTypeFilter, *nftables.ChainHookInput, 0},
		rules: []ruleSpec{rule(fam, "from guests", append(ifname(unix.NFT_META_IIFNAME, r.Bridge, expr.CmpOpEq),
			&expr.Verdict{Kind: expr.VerdictJump, Chain: chainFromGuests})...)}})
	fg := []ruleSpec{rule(fam, "replies", append(ctStateAny(expr.CtStateBitESTABLISHED|expr.CtStateBitRELATED), accept())...)}
	if r.DHCP {
		fg = append(fg, rule(fam, "dhcp", append(l4Dport(unix.IPPROTO_UDP, 67), accept())...))
	}
	if r.DNS {
		fg = append(fg, rule(fam, "dns", append(l4Dport(unix.IPPROTO_UDP, 53), accept())...),
			rule(fam, "dns", append(l4Dport(unix.IPPROTO_TCP, 53), accept())...))
	}
	if !r.KernelCap {
		// A guest calling a published port whose cap is full in the kernel is
		// redirected to the slow-path listener on the host (only brokkr's
		// redirect makes a connection to the host DNATed).
		fg = append(fg, rule(fam, "redirected to the cap slow path", append(append(l4proto(unix.IPPROTO_TCP), ctStatusDNAT()...), accept())...))
	}
	fg = append(fg, rule(fam, "nothing else reaches the host", drop()))
	inet.addChain(&chainSpec{name: chainFromGuests, rules: fg})

	for _, e := range r.Exposures {
		if !e.loopbackOnly() {
			addExposure(inet, e, ids[e.Name], r.KernelCap)
		}
	}

	return inet, desiredBridge(r)
}

// desiredSetCap adds the objects of the set-based cap (the fallback when the
// BPF nat path cannot load): the slow path's port map and the FIN/RST
// bookkeeping chains.
func desiredSetCap(inet *tableSpec, r Rules) {
	fam := inet.family
	// The cap's slow path: one element, the listener's port, so a new port
	// (a restart that could not get the old one) is one element, not every
	// capped chain.
	ov := &setSpec{name: mapOverflow, key: nftables.TypeInetProto, data: nftables.TypeInetService, isMap: true,
		comment: "cap slow path: listener port", elems: map[string]elemSpec{}}
	if r.overflowPort != 0 {
		k := []byte{unix.IPPROTO_TCP}
		ov.elems[string(k)] = elemSpec{key: k, val: binaryutil.BigEndian.PutUint16(r.overflowPort), comment: "cap slow path"}
	}
	inet.addSet(ov)

	// Cap bookkeeping: FIN/RST of a marked connection updates its mark bits
	// and, once closed, frees its slot. Only FIN/RST packets get past the
	// first comparison, so established traffic pays one load and compare.
	closeRule := rule(fam, "cap: closing connections",
		append(append(tcpFlagsAny(0x01|0x04), ctMarkMasked(MarkIDMask)...), lookupVmap(mapClosers))...)
	inet.addChain(&chainSpec{name: chainClosePre, hook: &hookSpec{nftables.ChainTypeFilter, *nftables.ChainHookPrerouting, -150},
		rules: []ruleSpec{closeRule}})
	inet.addChain(&chainSpec{name: chainCloseOut, hook: &hookSpec{nftables.ChainTypeFilter, *nftables.ChainHookOutput, -150},
		rules: []ruleSpec{closeRule}})
}

// Key types of the two exposure maps (built once: every unit has the maps).
var (
	expAddrKey = nftables.MustConcatSetType(nftables.TypeIPAddr, nftables.TypeInetProto, nftables.TypeInetService)
	expAnyKey  = nftables.MustConcatSetType(nftables.TypeInetProto, nftables.TypeInetService)
)

// addSharedMaps adds the verdict maps every exposure has an element in.
func addSharedMaps(inet *tableSpec) {
	inet.addSet(&setSpec{name: mapExpAddr, key: expAddrKey,
		data: nftables.TypeVerdict, isMap: true, comment: "exposures by address, protocol, port", elems: map[string]elemSpec{}})
	inet.addSet(&setSpec{name: mapExpAny, key: expAnyKey,
		data: nftables.TypeVerdict, isMap: true, comment: "exposures by protocol, port", elems: map[string]elemSpec{}})
	inet.addSet(&setSpec{name: mapClosers, key: nftables.TypeMark, data: nftables.TypeVerdict, isMap: true,
		comment: "capped tcp exposures by mark", elems: map[string]elemSpec{}})

}

// unitKey is everything one exposure's objects are built from.
type unitKey struct {
	e      Exposure
	id     uint32
	kernel bool // Rules.KernelCap
}

// unitOf is one exposure's objects alone: its chains, counters and cap set,
// and its elements in otherwise empty shared maps. Planning two units
// against each other yields exactly the batch for that exposure.
func unitOf(k *unitKey) *tableSpec {
	t := newTableSpec(nftables.TableFamilyINet)
	addSharedMaps(t)
	if k != nil && !k.e.loopbackOnly() {
		addExposure(t, k.e, k.id, k.kernel)
	}
	return t
}

// mergeUnit adds a unit's objects into a whole table.
func mergeUnit(dst, u *tableSpec) {
	for n, c := range u.counters {
		dst.counters[n] = c
	}
	for n, c := range u.chains {
		dst.chains[n] = c
	}
	for n, s := range u.sets {
		ds, ok := dst.sets[n]
		if !ok {
			dst.sets[n] = s
			continue
		}
		for k, e := range s.elems {
			ds.elems[k] = e
		}
	}
}

// addExposure adds everything one exposure needs: its chain, counters, map
// element, and for a cap its slot set (and close chain for TCP).
func addExposure(t *tableSpec, e Exposure, id uint32, kernelCap bool) {
	fam := t.family
	proto := protoNum(e.Protocol)
	inet := func(exprs ...expr.Any) []expr.Any { return exprs }
	if kernelCap {
		// The BPF nat path reads the mark and does the rest.
		t.addChain(&chainSpec{name: expChain(e.Name), owner: e.Name, rules: []ruleSpec{rule(fam, e.Name, append(l4proto(proto),
			&expr.Immediate{Register: 1, Data: connMark(id)},
			&expr.Ct{Register: 1, Key: expr.CtKeyMARK, SourceRegister: true},
			&expr.Immediate{Register: 1, Data: e.GuestAddr.AsSlice()},
			&expr.Immediate{Register: 2, Data: binaryutil.BigEndian.PutUint16(e.GuestPort)},
			&expr.NAT{Type: expr.NATTypeDestNAT, Family: unix.NFPROTO_IPV4, RegAddrMin: 1, RegProtoMin: 2, Specified: true})...)}})
		addDispatch(t, e, proto)
		return
	}
	t.counters[acceptedCounter(e.Name)] = counterSpec{name: acceptedCounter(e.Name), exposure: e.Name}
	if e.MaxConns > 0 {
		// Only a cap refuses: an uncapped exposure has no refused counter
		// (one object less per exposure in a 10,000-exposure batch).
		t.counters[refusedCounter(e.Name)] = counterSpec{name: refusedCounter(e.Name), exposure: e.Name}
	}

	admit := l4proto(proto)
	if e.MaxConns > 0 {
		t.addSet(&setSpec{name: connsSet(e.Name), key: connKeyType, dynamic: true, size: uint32(e.MaxConns),
			comment: "open connections of " + e.Name, stateful: true, owner: e.Name})
		// The add fails (and the rule stops) once the set holds MaxConns
		// connections.
		admit = append(append(nfprotoIPv4(), admit...),
			&expr.Payload{DestRegister: 1, Base: expr.PayloadBaseNetworkHeader, Offset: 12, Len: 4},
			&expr.Payload{DestRegister: 9, Base: expr.PayloadBaseNetworkHeader, Offset: 16, Len: 4},
			&expr.Payload{DestRegister: 10, Base: expr.PayloadBaseTransportHeader, Offset: 0, Len: 2},
			&expr.Dynset{SrcRegKey: 1, SetName: connsSet(e.Name), Operation: unix.NFT_DYNSET_OP_ADD})
	}
	admit = append(admit,
		&expr.Immediate{Register: 1, Data: connMark(id)},
		&expr.Ct{Register: 1, Key: expr.CtKeyMARK, SourceRegister: true},
		&expr.Objref{Type: unix.NFT_OBJECT_COUNTER, Name: acceptedCounter(e.Name)},
		&expr.Immediate{Register: 1, Data: e.GuestAddr.AsSlice()},
		&expr.Immediate{Register: 2, Data: binaryutil.BigEndian.PutUint16(e.GuestPort)},
		&expr.NAT{Type: expr.NATTypeDestNAT, Family: unix.NFPROTO_IPV4, RegAddrMin: 1, RegProtoMin: 2, Specified: true})
	rules := []ruleSpec{rule(fam, e.Name, admit...)}
	if e.MaxConns > 0 {
		rej := &expr.Reject{Type: unix.NFT_REJECT_TCP_RST}
		if proto != unix.IPPROTO_TCP {
			rej = &expr.Reject{Type: unix.NFT_REJECT_ICMPX_UNREACH, Code: unix.NFT_REJECT_ICMPX_PORT_UNREACH}
		}
		refuse := func(comment string, pre ...expr.Any) ruleSpec {
			return rule(fam, e.Name+": "+comment, append(append(l4proto(proto), pre...),
				&expr.Objref{Type: unix.NFT_OBJECT_COUNTER, Name: refusedCounter(e.Name)}, rej)...)
		}
		if proto == unix.IPPROTO_TCP {
			// Full in the kernel: let the slow path decide exactly (see
			// overflow.go). Without a listener (no element) the lookup fails
			// and the next rule refuses.
			rules = append(rules, rule(fam, e.Name+": full in the kernel, to the slow path", append(l4proto(proto),
				&expr.Immediate{Register: 1, Data: connMark(id)},
				&expr.Ct{Register: 1, Key: expr.CtKeyMARK, SourceRegister: true},
				&expr.Meta{Key: expr.MetaKeyL4PROTO, Register: 1},
				&expr.Lookup{SourceRegister: 1, DestRegister: 1, IsDestRegSet: true, SetName: mapOverflow},
				&expr.Redir{RegisterProtoMin: 1, Flags: unix.NF_NAT_RANGE_PROTO_SPECIFIED})...))
		}
		rules = append(rules, refuse("over the cap"))
		if proto == unix.IPPROTO_TCP {
			setBits := func(bits uint32) []expr.Any {
				return inet(&expr.Ct{Register: 1, Key: expr.CtKeyMARK},
					&expr.Bitwise{SourceRegister: 1, DestRegister: 1, Len: 4,
						Mask: binaryutil.NativeEndian.PutUint32(^bits), Xor: binaryutil.NativeEndian.PutUint32(bits)},
					&expr.Ct{Register: 1, Key: expr.CtKeyMARK, SourceRegister: true})
			}
			t.addChain(&chainSpec{name: closeChain(e.Name), owner: e.Name, rules: []ruleSpec{
				rule(fam, e.Name+": reset", append(tcpFlagsAny(0x04), setBits(MarkClosed)...)...),
				rule(fam, e.Name+": fin from caller", append(ctDirection(0), setBits(MarkFINOrig)...)...),
				rule(fam, e.Name+": fin from guest", append(ctDirection(1), setBits(MarkFINRepl)...)...),
			}})
			k := binaryutil.NativeEndian.PutUint32(id)
			t.sets[mapClosers].elems[string(k)] = elemSpec{key: k, verdict: closeChain(e.Name), comment: e.Name}
		}
	}
	t.addChain(&chainSpec{name: expChain(e.Name), owner: e.Name, rules: rules})
	addDispatch(t, e, proto)
}

// addDispatch adds the exposure's element in the dispatch map for its host
// side.
func addDispatch(t *tableSpec, e Exposure, proto byte) {
	if e.wildcard() {
		k := append(pad4([]byte{proto}), pad4(binaryutil.BigEndian.PutUint16(e.HostPort))...)
		t.sets[mapExpAny].elems[string(k)] = elemSpec{key: k, verdict: expChain(e.Name), comment: e.Name}
	} else {
		k := append(append(e.HostAddr.AsSlice(), pad4([]byte{proto})...), pad4(binaryutil.BigEndian.PutUint16(e.HostPort))...)
		t.sets[mapExpAddr].elems[string(k)] = elemSpec{key: k, verdict: expChain(e.Name), comment: e.Name}
	}
}

// desiredBridge: anti-spoof per guest port and guest isolation.
func desiredBridge(r Rules) *tableSpec {
	t := newTableSpec(nftables.TableFamilyBridge)
	fam := t.family
	ports := &setSpec{name: setGuestPorts, key: nftables.TypeIFName, comment: "guest ports under anti-spoof", elems: map[string]elemSpec{}}
	addrs := &setSpec{name: setGuestAddrs, key: nftables.MustConcatSetType(nftables.TypeIFName, nftables.TypeEtherAddr, nftables.TypeIPAddr),
		comment: "port, mac and address of each guest", elems: map[string]elemSpec{}}
	macs := &setSpec{name: setGuestMACs, key: nftables.MustConcatSetType(nftables.TypeIFName, nftables.TypeEtherAddr),
		comment: "port and mac of each guest", elems: map[string]elemSpec{}}
	for _, g := range r.Guests {
		p := ifnameKey(g.Tap)
		ports.elems[string(p)] = elemSpec{key: p, comment: g.Name}
		pm := append(append([]byte{}, p...), pad4(g.MAC)...)
		macs.elems[string(pm)] = elemSpec{key: pm, comment: g.Name}
		if g.Addr.IsValid() {
			pma := append(append([]byte{}, pm...), g.Addr.AsSlice()...)
			addrs.elems[string(pma)] = elemSpec{key: pma, comment: g.Name}
		}
	}
	t.addSet(ports)
	t.addSet(addrs)
	t.addSet(macs)
	t.addChain(&chainSpec{name: chainBrPre, hook: &hookSpec{nftables.ChainTypeFilter, *nftables.ChainHookPrerouting, -200},
		rules: []ruleSpec{rule(fam, "guest ports", append(ifnameInSet(unix.NFT_META_IIFNAME, setGuestPorts),
			&expr.Verdict{Kind: expr.VerdictJump, Chain: chainAntiSpoof})...)}})
	as := []ruleSpec{
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
		rule(fam, "spoofed or not ipv4", &expr.Counter{}, drop()),
	}
	t.addChain(&chainSpec{name: chainAntiSpoof, rules: as})
	if r.IsolateGuests {
		t.addChain(&chainSpec{name: chainBrForward, hook: &hookSpec{nftables.ChainTypeFilter, *nftables.ChainHookForward, -200},
			rules: []ruleSpec{rule(fam, "isolate guests", append(append(ifnameInSet(unix.NFT_META_IIFNAME, setGuestPorts),
				ifnameInSet(unix.NFT_META_OIFNAME, setGuestPorts)...), drop())...)}})
	}
	return t
}

// connKeyType: original source address, destination address, source port.
var connKeyType = nftables.MustConcatSetType(nftables.TypeIPAddr, nftables.TypeIPAddr, nftables.TypeInetService)

// connKey is a cap-set element: the connection's original source address,
// destination address and source port.
func connKey(src, dst netip.AddrPort) []byte {
	k := make([]byte, 12)
	a, b := src.Addr().As4(), dst.Addr().As4()
	copy(k, a[:])
	copy(k[4:], b[:])
	binary.BigEndian.PutUint16(k[8:], src.Port())
	return k
}

// --- expression helpers (each in the form `nft` prints back) ---

func protoNum(p string) byte {
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

func loadProtoPort() []expr.Any {
	return []expr.Any{&expr.Meta{Key: expr.MetaKeyL4PROTO, Register: 1},
		&expr.Payload{DestRegister: 9, Base: expr.PayloadBaseTransportHeader, Offset: 2, Len: 2}}
}

func lookupVmap(set string) expr.Any {
	return &expr.Lookup{SourceRegister: 1, DestRegister: 0, IsDestRegSet: true, SetName: set}
}
