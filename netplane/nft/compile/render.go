package compile

import (
	"encoding/binary"
	"encoding/hex"
	"fmt"
	"net/netip"
	"slices"
	"strconv"
	"strings"

	"github.com/google/nftables"
	"github.com/google/nftables/binaryutil"
	"github.com/google/nftables/expr"
	"golang.org/x/sys/unix"
)

// Render prints a table in `nft -f` syntax: what the builder's expressions
// mean, read back the way nft itself would write them. It knows exactly the
// expressions the builder emits; anything else is an error, so a new kind of
// expression cannot reach the kernel unrendered (and untested).
func Render(t *TableSpec) (string, error) {
	var b strings.Builder
	fmt.Fprintf(&b, "table %s %s {\n", familyName(t.Family), TableName)
	first := true
	sep := func() {
		if !first {
			b.WriteString("\n")
		}
		first = false
	}
	for _, n := range sortedKeys(t.Counters) {
		sep()
		fmt.Fprintf(&b, "\tcounter %s {\n\t\tpackets 0 bytes 0\n\t}\n", n)
	}
	for _, n := range sortedKeys(t.Sets) {
		sep()
		if err := renderSet(&b, t.Sets[n]); err != nil {
			return "", fmt.Errorf("set %s: %w", n, err)
		}
	}
	for _, n := range sortedKeys(t.Chains) {
		sep()
		c := t.Chains[n]
		fmt.Fprintf(&b, "\tchain %s {\n", n)
		if c.Hook != nil {
			hook, err := hookName(c.Hook.Hook)
			if err != nil {
				return "", fmt.Errorf("chain %s: %w", n, err)
			}
			fmt.Fprintf(&b, "\t\ttype %s hook %s priority %d; policy accept;\n", c.Hook.Typ, hook, c.Hook.Priority)
		}
		for i, r := range c.Rules {
			s, err := renderRule(t, r)
			if err != nil {
				return "", fmt.Errorf("chain %s rule %d (%s): %w", n, i, r.Comment, err)
			}
			fmt.Fprintf(&b, "\t\t%s\n", s)
		}
		b.WriteString("\t}\n")
	}
	b.WriteString("}\n")
	return b.String(), nil
}

func hookName(h nftables.ChainHook) (string, error) {
	switch h {
	case *nftables.ChainHookPrerouting:
		return "prerouting", nil
	case *nftables.ChainHookInput:
		return "input", nil
	case *nftables.ChainHookForward:
		return "forward", nil
	case *nftables.ChainHookOutput:
		return "output", nil
	case *nftables.ChainHookPostrouting:
		return "postrouting", nil
	}
	return "", fmt.Errorf("unknown hook %d", h)
}

func renderSet(b *strings.Builder, s *SetSpec) error {
	kind := "set"
	typ := s.Key.Name
	if s.IsMap {
		kind = "map"
		typ += " : " + s.Data.Name
	}
	fmt.Fprintf(b, "\t%s %s {\n\t\ttype %s\n", kind, s.Name, typ)
	if s.Size > 0 {
		fmt.Fprintf(b, "\t\tsize %d\n", s.Size)
	}
	if s.Dynamic {
		b.WriteString("\t\tflags dynamic\n")
	}
	if s.Interval {
		b.WriteString("\t\tflags interval\n")
	}
	if s.Counter {
		b.WriteString("\t\tcounter\n")
	}
	if s.Comment != "" {
		fmt.Fprintf(b, "\t\tcomment %q\n", s.Comment)
	}
	var elems []string
	for _, k := range sortedKeys(s.Elems) {
		e := s.Elems[k]
		var key string
		var err error
		if s.Interval {
			key, err = renderInterval(s.Key, e.Key)
		} else {
			key, err = renderKey(s.Key, e.Key)
		}
		if err != nil {
			return fmt.Errorf("element %x: %w", e.Key, err)
		}
		if e.Comment != "" {
			key += fmt.Sprintf(" comment %q", e.Comment)
		}
		if s.IsMap {
			if e.Verdict != "" {
				key += " : goto " + e.Verdict
			} else {
				v, err := renderKey(s.Data, e.Val)
				if err != nil {
					return fmt.Errorf("element %s: value %x of type %s: %w", key, e.Val, s.Data.Name, err)
				}
				key += " : " + v
			}
		}
		elems = append(elems, key)
	}
	if len(elems) > 0 {
		fmt.Fprintf(b, "\t\telements = { %s }\n", strings.Join(elems, ",\n\t\t\t     "))
	}
	b.WriteString("\t}\n")
	return nil
}

// typeLen is the length of one key component of the types the builder uses.
var typeLen = map[string]int{
	nftables.TypeIPAddr.Name: 4, nftables.TypeInetProto.Name: 1, nftables.TypeInetService.Name: 2,
	nftables.TypeIFName.Name: 16, nftables.TypeEtherAddr.Name: 6, nftables.TypeMark.Name: 4,
	nftables.TypeIP6Addr.Name: 16,
}

// renderKey prints a set key: concatenated components are each padded to 4
// bytes (the kernel's 32-bit registers); a single one is not.
func renderKey(t nftables.SetDatatype, k []byte) (string, error) {
	parts := strings.Split(t.Name, " . ")
	var out []string
	for _, p := range parts {
		n, ok := typeLen[p]
		if !ok {
			return "", fmt.Errorf("key type %s", p)
		}
		if len(k) < n {
			return "", fmt.Errorf("key too short for %s", t.Name)
		}
		s, err := renderValue(p, k[:n])
		if err != nil {
			return "", err
		}
		out = append(out, s)
		if len(parts) > 1 {
			n = (n + 3) / 4 * 4
		}
		k = k[min(n, len(k)):]
	}
	if len(k) != 0 {
		return "", fmt.Errorf("key longer than %s", t.Name)
	}
	return strings.Join(out, " . "), nil
}

// renderInterval prints an interval map's key, its first key followed by
// its last: the components before the last are the same in both (the
// builder makes only such keys), the last is a range ("tcp . 30000-30099";
// one value when first and last are equal, as nft prints it).
func renderInterval(t nftables.SetDatatype, k []byte) (string, error) {
	if len(k)%2 != 0 {
		return "", fmt.Errorf("interval key of odd length")
	}
	first, err := renderKey(t, k[:len(k)/2])
	if err != nil {
		return "", err
	}
	last, err := renderKey(t, k[len(k)/2:])
	if err != nil {
		return "", err
	}
	fi, li := strings.LastIndex(first, " . "), strings.LastIndex(last, " . ")
	if first[:fi+1] != last[:li+1] {
		return "", fmt.Errorf("interval %s to %s: only the last component may be a range", first, last)
	}
	if first == last {
		return first, nil
	}
	return first + "-" + last[li+3:], nil
}

func renderValue(typ string, b []byte) (string, error) {
	switch typ {
	case nftables.TypeIPAddr.Name:
		return netip.AddrFrom4([4]byte(b)).String(), nil
	case nftables.TypeIP6Addr.Name:
		return netip.AddrFrom16([16]byte(b)).String(), nil
	case nftables.TypeInetProto.Name:
		return protoName(b[0]), nil
	case nftables.TypeInetService.Name:
		return strconv.Itoa(int(binary.BigEndian.Uint16(b))), nil
	case nftables.TypeIFName.Name:
		return strconv.Quote(strings.TrimRight(string(b), "\x00")), nil
	case nftables.TypeEtherAddr.Name:
		return fmt.Sprintf("%02x:%02x:%02x:%02x:%02x:%02x", b[0], b[1], b[2], b[3], b[4], b[5]), nil
	case nftables.TypeMark.Name:
		return fmt.Sprintf("0x%08x", binaryutil.NativeEndian.Uint32(b)), nil
	}
	return "", fmt.Errorf("value type %s", typ)
}

func protoName(p byte) string {
	switch p {
	case unix.IPPROTO_TCP:
		return "tcp"
	case unix.IPPROTO_UDP:
		return "udp"
	case unix.IPPROTO_ICMPV6:
		return "ipv6-icmp"
	}
	return strconv.Itoa(int(p))
}

// operand is what a register holds while a rule is read.
type operand struct {
	text string // e.g. "ip daddr", "meta l4proto"
	kind string // how a constant compared with it prints: see renderData
	len  int    // bytes
	imm  []byte // an immediate value (text is empty)
	// A bitwise applied to it: mask and xor.
	mask, xor []byte
}

// token is one printed piece of a rule; a dependency (the protocol match
// nft adds by itself in front of a header field) is dropped when such a
// field follows, as nft prints it.
type token struct {
	text string
	dep  string // "nh" or "th": the layer this match is a dependency of
	used bool   // a field of that layer followed: leave the match out
}

type ruleReader struct {
	t      *TableSpec
	regs   map[int]operand
	toks   []token
	nh, th string // protocol of the network and transport header, once matched
}

// reg32 numbers registers in 32-bit units: NFT_REG_1..4 are 16 bytes each,
// NFT_REG32_00.. are 4.
func reg32(r uint32) int {
	if r >= 1 && r <= 4 {
		return int(r-1) * 4
	}
	return int(r) - 8
}

func renderRule(t *TableSpec, r RuleSpec) (string, error) {
	rr := &ruleReader{t: t, regs: map[int]operand{}}
	for _, e := range r.Exprs {
		if err := rr.read(e); err != nil {
			return "", err
		}
	}
	var parts []string
	for _, tk := range rr.toks {
		if !tk.used {
			parts = append(parts, tk.text)
		}
	}
	if r.Comment != "" {
		parts = append(parts, fmt.Sprintf("comment %q", r.Comment))
	}
	return strings.Join(parts, " "), nil
}

func (rr *ruleReader) emit(text string) { rr.toks = append(rr.toks, token{text: text}) }

// uses marks the dependencies of a header field as implied by it.
func (rr *ruleReader) uses(layer string) {
	for i := range rr.toks {
		if rr.toks[i].dep == layer {
			rr.toks[i].used = true
		}
	}
}

func (rr *ruleReader) get(r uint32) (operand, error) {
	o, ok := rr.regs[reg32(r)]
	if !ok {
		return o, fmt.Errorf("register %d read before it is loaded", r)
	}
	return o, nil
}

func (rr *ruleReader) read(e expr.Any) error {
	switch x := e.(type) {
	case *expr.Meta:
		if x.SourceRegister {
			return fmt.Errorf("meta set %v", x.Key)
		}
		o := operand{}
		switch x.Key {
		case expr.MetaKeyNFPROTO:
			o = operand{text: "meta nfproto", kind: "nfproto", len: 1}
		case expr.MetaKeyL4PROTO:
			o = operand{text: "meta l4proto", kind: "proto", len: 1}
		case expr.MetaKeyIIFNAME:
			o = operand{text: "iifname", kind: "ifname", len: 16}
		case expr.MetaKeyOIFNAME:
			o = operand{text: "oifname", kind: "ifname", len: 16}
		default:
			return fmt.Errorf("meta key %v", x.Key)
		}
		rr.regs[reg32(x.Register)] = o
	case *expr.Payload:
		if x.OperationType != expr.PayloadLoad {
			return fmt.Errorf("payload write")
		}
		o, err := rr.payload(x)
		if err != nil {
			return err
		}
		rr.regs[reg32(x.DestRegister)] = o
	case *expr.Ct:
		if x.SourceRegister {
			if x.Key != expr.CtKeyMARK {
				return fmt.Errorf("ct set %v", x.Key)
			}
			o, err := rr.get(x.Register)
			if err != nil {
				return err
			}
			v, err := markValue(o)
			if err != nil {
				return err
			}
			rr.emit("ct mark set " + v)
			return nil
		}
		o := operand{len: 4}
		switch x.Key {
		case expr.CtKeyMARK:
			o.text, o.kind = "ct mark", "hex"
		case expr.CtKeySTATE:
			o.text, o.kind = "ct state", "ctstate"
		case expr.CtKeySTATUS:
			o.text, o.kind = "ct status", "ctstatus"
		case expr.CtKeyDIRECTION:
			o.text, o.kind, o.len = "ct direction", "ctdir", 1
		default:
			return fmt.Errorf("ct key %v", x.Key)
		}
		rr.regs[reg32(x.Register)] = o
	case *expr.Fib:
		if !x.FlagDADDR || !x.ResultADDRTYPE || x.FlagSADDR || x.FlagIIF || x.FlagOIF || x.FlagMARK || x.ResultOIF || x.ResultOIFNAME {
			return fmt.Errorf("fib other than daddr type")
		}
		rr.regs[reg32(x.Register)] = operand{text: "fib daddr type", kind: "addrtype", len: 4}
	case *expr.Bitwise:
		o, err := rr.get(x.SourceRegister)
		if err != nil {
			return err
		}
		if o.mask != nil || len(x.Mask) != o.len || len(x.Xor) != o.len {
			return fmt.Errorf("bitwise on %s", o.text)
		}
		o.mask, o.xor = x.Mask, x.Xor
		rr.regs[reg32(x.DestRegister)] = o
	case *expr.Immediate:
		rr.regs[reg32(x.Register)] = operand{imm: x.Data, len: len(x.Data)}
	case *expr.Cmp:
		return rr.cmp(x)
	case *expr.Lookup:
		return rr.lookup(x)
	case *expr.Dynset:
		if x.Operation != unix.NFT_DYNSET_OP_ADD || x.SrcRegData != 0 || x.Timeout != 0 || len(x.Exprs) > 0 {
			return fmt.Errorf("dynset other than add")
		}
		key, err := rr.key(x.SrcRegKey, x.SetName)
		if err != nil {
			return err
		}
		rr.emit(fmt.Sprintf("add @%s { %s }", x.SetName, key))
	case *expr.Counter:
		rr.emit("counter")
	case *expr.Objref:
		if x.Type != unix.NFT_OBJECT_COUNTER {
			return fmt.Errorf("objref type %d", x.Type)
		}
		rr.emit(fmt.Sprintf("counter name %q", x.Name))
	case *expr.Verdict:
		switch x.Kind {
		case expr.VerdictAccept:
			rr.emit("accept")
		case expr.VerdictDrop:
			rr.emit("drop")
		case expr.VerdictJump:
			rr.emit("jump " + x.Chain)
		case expr.VerdictGoto:
			rr.emit("goto " + x.Chain)
		default:
			return fmt.Errorf("verdict %d", x.Kind)
		}
	case *expr.NAT:
		return rr.nat(x)
	case *expr.Masq:
		if x.Random || x.FullyRandom || x.Persistent || x.ToPorts {
			return fmt.Errorf("masquerade with flags")
		}
		rr.emit("masquerade")
	case *expr.Redir:
		if x.Flags != unix.NF_NAT_RANGE_PROTO_SPECIFIED || x.RegisterProtoMax != 0 {
			return fmt.Errorf("redirect flags %d", x.Flags)
		}
		o, err := rr.get(x.RegisterProtoMin)
		if err != nil {
			return err
		}
		if o.kind != "mapped" {
			return fmt.Errorf("redirect to %s", o.text)
		}
		rr.emit("redirect to :" + o.text)
	case *expr.Reject:
		switch {
		case x.Type == unix.NFT_REJECT_TCP_RST:
			rr.emit("reject with tcp reset")
		case x.Type == unix.NFT_REJECT_ICMPX_UNREACH && x.Code == unix.NFT_REJECT_ICMPX_PORT_UNREACH:
			rr.emit("reject with icmpx port-unreachable")
		default:
			return fmt.Errorf("reject type %d code %d", x.Type, x.Code)
		}
	default:
		return fmt.Errorf("expression %T the renderer does not know", e)
	}
	return nil
}

func (rr *ruleReader) payload(x *expr.Payload) (operand, error) {
	bad := fmt.Errorf("payload base %d offset %d len %d", x.Base, x.Offset, x.Len)
	switch x.Base {
	case expr.PayloadBaseLLHeader:
		switch {
		case x.Offset == 6 && x.Len == 6:
			return operand{text: "ether saddr", kind: "ether", len: 6}, nil
		case x.Offset == 12 && x.Len == 2:
			return operand{text: "ether type", kind: "ethertype", len: 2}, nil
		}
	case expr.PayloadBaseNetworkHeader:
		rr.uses("nh")
		switch {
		case rr.nh == "arp" && x.Offset == 8 && x.Len == 6:
			return operand{text: "arp saddr ether", kind: "ether", len: 6}, nil
		case rr.nh == "arp" && x.Offset == 14 && x.Len == 4:
			return operand{text: "arp saddr ip", kind: "ip", len: 4}, nil
		case rr.nh == "ip" && x.Offset == 12 && x.Len == 4:
			return operand{text: "ip saddr", kind: "ip", len: 4}, nil
		case rr.nh == "ip" && x.Offset == 16 && x.Len == 4:
			return operand{text: "ip daddr", kind: "ip", len: 4}, nil
		case rr.nh == "ip6" && x.Offset == 8 && x.Len == 16:
			return operand{text: "ip6 saddr", kind: "ip6", len: 16}, nil
		case rr.nh == "ip6" && x.Offset == 24 && x.Len == 16:
			return operand{text: "ip6 daddr", kind: "ip6", len: 16}, nil
		}
	case expr.PayloadBaseTransportHeader:
		th := rr.th
		if th == "" {
			th = "th"
		} else {
			rr.uses("th")
		}
		switch {
		case x.Offset == 0 && x.Len == 2:
			return operand{text: th + " sport", kind: "port", len: 2}, nil
		case x.Offset == 2 && x.Len == 2:
			return operand{text: th + " dport", kind: "port", len: 2}, nil
		case th == "tcp" && x.Offset == 13 && x.Len == 1:
			return operand{text: "tcp flags", kind: "tcpflags", len: 1}, nil
		case th == "icmpv6" && x.Offset == 0 && x.Len == 1:
			return operand{text: "icmpv6 type", kind: "icmpv6type", len: 1}, nil
		case th == "th" && x.Offset == 8 && x.Len == 16:
			// The neighbour discovery target address, raw: nft 1.0.6 has
			// no name for it (1.0.9 calls it icmpv6 taddr).
			return operand{text: "@th,64,128", kind: "raw", len: 16}, nil
		}
	}
	return operand{}, bad
}

func (rr *ruleReader) cmp(x *expr.Cmp) error {
	o, err := rr.get(x.Register)
	if err != nil {
		return err
	}
	if o.imm != nil || o.kind == "mapped" {
		return fmt.Errorf("compare with a constant")
	}
	var op string
	switch x.Op {
	case expr.CmpOpEq:
	case expr.CmpOpNeq:
		op = "!= "
	default:
		return fmt.Errorf("cmp op %d", x.Op)
	}
	if len(x.Data) != o.len {
		return fmt.Errorf("cmp %s with %d bytes", o.text, len(x.Data))
	}
	// A masked value tested against zero is a flag test ("any of").
	if o.mask != nil && isZero(o.xor) && isZero(x.Data) && x.Op == expr.CmpOpNeq {
		if flags, ok := flagNames(o.kind, o.mask); ok {
			rr.emit(o.text + " " + flags)
			return nil
		}
	}
	// A masked address is a prefix.
	if o.mask != nil {
		bits, ok := prefixBits(o.mask)
		if o.kind != "ip" && o.kind != "ip6" || !ok || !isZero(o.xor) {
			return fmt.Errorf("masked compare of %s", o.text)
		}
		a, _ := netip.AddrFromSlice(x.Data)
		p := netip.PrefixFrom(a, bits)
		rr.emit(o.text + " " + op + p.String())
		return nil
	}
	v, err := renderData(o.kind, x.Data)
	if err != nil {
		return fmt.Errorf("%s: %w", o.text, err)
	}
	tk := token{text: o.text + " " + op + v}
	if x.Op == expr.CmpOpEq {
		// The protocol matches nft puts in front of header fields by
		// itself: printed only when no such field follows.
		switch {
		case o.kind == "nfproto" && v == "ipv4":
			tk.dep, rr.nh = "nh", "ip"
		case o.kind == "nfproto" && v == "ipv6":
			tk.dep, rr.nh = "nh", "ip6"
		case o.kind == "ethertype" && (v == "ip" || v == "arp" || v == "ip6"):
			tk.dep, rr.nh = "nh", v
		case o.kind == "proto" && (v == "tcp" || v == "udp"):
			tk.dep, rr.th = "th", v
		case o.kind == "proto" && v == "ipv6-icmp":
			tk.dep, rr.th = "th", "icmpv6"
		}
	}
	rr.toks = append(rr.toks, tk)
	return nil
}

// key reads a set key of set's type from the registers starting at r.
func (rr *ruleReader) key(r uint32, set string) (string, error) {
	s, ok := rr.t.Sets[set]
	if !ok {
		return "", fmt.Errorf("set %s is not in the table", set)
	}
	n := len(strings.Split(s.Key.Name, " . "))
	idx := reg32(r)
	var parts []string
	for i := 0; i < n; i++ {
		o, ok := rr.regs[idx]
		if !ok || o.imm != nil {
			return "", fmt.Errorf("key of @%s: component %d not loaded", set, i)
		}
		t := o.text
		if o.mask != nil {
			if o.kind != "hex" || !isZero(o.xor) {
				return "", fmt.Errorf("key of @%s: masked %s", set, o.text)
			}
			t += fmt.Sprintf(" & 0x%08x", binaryutil.NativeEndian.Uint32(o.mask))
		}
		parts = append(parts, t)
		idx += (o.len + 3) / 4
	}
	return strings.Join(parts, " . "), nil
}

func (rr *ruleReader) lookup(x *expr.Lookup) error {
	if x.Invert {
		return fmt.Errorf("inverted lookup")
	}
	key, err := rr.key(x.SourceRegister, x.SetName)
	if err != nil {
		return err
	}
	switch {
	case !x.IsDestRegSet:
		rr.emit(key + " @" + x.SetName)
	case x.DestRegister == 0:
		rr.emit(key + " vmap @" + x.SetName)
	default:
		// The data fills as many 32-bit registers as it needs; the ones
		// after the first are the same value, continued.
		text := key + " map @" + x.SetName
		n := int(rr.t.Sets[x.SetName].Data.Bytes)
		idx := reg32(x.DestRegister)
		rr.regs[idx] = operand{text: text, kind: "mapped", len: n}
		for i := 1; i < (n+3)/4; i++ {
			rr.regs[idx+i] = operand{text: text, kind: "mapped-cont", len: n - 4*i}
		}
	}
	return nil
}

func (rr *ruleReader) nat(x *expr.NAT) error {
	fam := "ip"
	if x.Family == unix.NFPROTO_IPV6 {
		fam = "ip6"
	}
	if x.Type != expr.NATTypeDestNAT || (x.Family != unix.NFPROTO_IPV4 && x.Family != unix.NFPROTO_IPV6) || x.Specified != (x.RegProtoMin != 0) ||
		x.RegAddrMax != 0 && x.RegAddrMax != x.RegAddrMin || x.RegProtoMax != 0 && x.RegProtoMax != x.RegProtoMin ||
		x.Random || x.FullyRandom || x.Persistent || x.Prefix {
		return fmt.Errorf("nat other than dnat ip|ip6 to addr:port")
	}
	a, err := rr.get(x.RegAddrMin)
	if err != nil {
		return err
	}
	if x.RegProtoMin == 0 && a.kind == "mapped" && (fam == "ip" && a.len == 4 || fam == "ip6" && a.len == 16) {
		// The address alone, from a map: the port is kept.
		rr.emit("dnat " + fam + " to " + a.text)
		return nil
	}
	p, err := rr.get(x.RegProtoMin)
	if err != nil {
		return err
	}
	switch {
	case fam == "ip" && len(a.imm) == 4 && len(p.imm) == 2:
		rr.emit(fmt.Sprintf("dnat ip to %s:%d", netip.AddrFrom4([4]byte(a.imm)), binary.BigEndian.Uint16(p.imm)))
	case fam == "ip" && a.kind == "mapped" && a.len == 8 && p.kind == "mapped-cont" && p.text == a.text && reg32(x.RegProtoMin) == reg32(x.RegAddrMin)+1:
		// One map lookup whose data is address . port.
		rr.emit("dnat ip to " + a.text)
	case fam == "ip6" && a.kind == "mapped" && a.len == 20 && p.kind == "mapped-cont" && p.text == a.text && reg32(x.RegProtoMin) == reg32(x.RegAddrMin)+4:
		// The IPv6 address fills four 32-bit registers, the port the next.
		rr.emit("dnat ip6 to " + a.text)
	default:
		return fmt.Errorf("dnat to %q:%q", a.text, p.text)
	}
	return nil
}

// markValue is the right side of `ct mark set`.
func markValue(o operand) (string, error) {
	switch {
	case len(o.imm) == 4:
		return fmt.Sprintf("0x%08x", binaryutil.NativeEndian.Uint32(o.imm)), nil
	case o.kind == "mapped" && o.len == 4:
		return o.text, nil
	case o.text == "ct mark" && o.mask != nil:
		m, x := binaryutil.NativeEndian.Uint32(o.mask), binaryutil.NativeEndian.Uint32(o.xor)
		switch {
		case m == ^x:
			return fmt.Sprintf("ct mark | 0x%08x", x), nil
		case x == 0:
			return fmt.Sprintf("ct mark & 0x%08x", m), nil
		}
	}
	return "", fmt.Errorf("ct mark set from %q", o.text)
}

func renderData(kind string, b []byte) (string, error) {
	switch kind {
	case "nfproto":
		switch b[0] {
		case unix.NFPROTO_IPV4:
			return "ipv4", nil
		case unix.NFPROTO_IPV6:
			return "ipv6", nil
		}
	case "proto":
		return protoName(b[0]), nil
	case "ifname":
		return strconv.Quote(strings.TrimRight(string(b), "\x00")), nil
	case "ip":
		return netip.AddrFrom4([4]byte(b)).String(), nil
	case "ip6":
		return netip.AddrFrom16([16]byte(b)).String(), nil
	case "icmpv6type":
		switch b[0] {
		case 133:
			return "nd-router-solicit", nil
		case 134:
			return "nd-router-advert", nil
		case 135:
			return "nd-neighbor-solicit", nil
		case 136:
			return "nd-neighbor-advert", nil
		}
	case "port":
		return strconv.Itoa(int(binary.BigEndian.Uint16(b))), nil
	case "ethertype":
		switch binary.BigEndian.Uint16(b) {
		case 0x0800:
			return "ip", nil
		case 0x0806:
			return "arp", nil
		case 0x86dd:
			return "ip6", nil
		}
	case "addrtype":
		if binaryutil.NativeEndian.Uint32(b) == unix.RTN_LOCAL {
			return "local", nil
		}
	case "ctdir":
		switch b[0] {
		case 0:
			return "original", nil
		case 1:
			return "reply", nil
		}
	case "hex":
		return fmt.Sprintf("0x%08x", binaryutil.NativeEndian.Uint32(b)), nil
	case "raw":
		// A raw payload's value, as nft prints an integer: big-endian
		// hex without leading zeros.
		if v := strings.TrimLeft(hex.EncodeToString(b), "0"); v != "" {
			return "0x" + v, nil
		}
		return "0x0", nil
	}
	return "", fmt.Errorf("value %x", b)
}

// Flag names of the flag types the builder tests.
var flagBits = map[string][]struct {
	bit  uint32
	name string
}{
	"ctstate":  {{1, "invalid"}, {2, "established"}, {4, "related"}, {8, "new"}, {64, "untracked"}},
	"ctstatus": {{1, "expected"}, {2, "seen-reply"}, {4, "assured"}, {8, "confirmed"}, {16, "snat"}, {32, "dnat"}, {512, "dying"}},
	"tcpflags": {{0x01, "fin"}, {0x02, "syn"}, {0x04, "rst"}, {0x08, "psh"}, {0x10, "ack"}, {0x20, "urg"}, {0x40, "ecn"}, {0x80, "cwr"}},
}

func flagNames(kind string, mask []byte) (string, bool) {
	bits, ok := flagBits[kind]
	if !ok {
		return "", false
	}
	var m uint32
	if len(mask) == 1 {
		m = uint32(mask[0])
	} else {
		m = binaryutil.NativeEndian.Uint32(mask)
	}
	var names []string
	for _, f := range bits {
		if m&f.bit != 0 {
			names = append(names, f.name)
			m &^= f.bit
		}
	}
	return strings.Join(names, ","), m == 0 && len(names) > 0
}

func prefixBits(mask []byte) (int, bool) {
	if len(mask) != 4 && len(mask) != 16 {
		return 0, false
	}
	bits := 0
	for bits < 8*len(mask) && mask[bits/8]&(0x80>>(bits%8)) != 0 {
		bits++
	}
	for i := bits; i < 8*len(mask); i++ {
		if mask[i/8]&(0x80>>(i%8)) != 0 {
			return 0, false // not a prefix: a one after a zero
		}
	}
	return bits, true
}

func isZero(b []byte) bool { return !slices.ContainsFunc(b, func(c byte) bool { return c != 0 }) }
