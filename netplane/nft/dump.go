package nft

import (
	"encoding/binary"
	"errors"
	"fmt"
	"strconv"

	"github.com/brokkr/brokkr/netplane/nft/compile"
	"github.com/google/nftables"
	"github.com/google/nftables/expr"
	"github.com/google/nftables/userdata"
	"github.com/mdlayher/netlink"
	"golang.org/x/sys/unix"
)

// Reading the kernel's state. google/nftables v0.3.0 has no generation-id
// query, fetches rules one chain at a time, mislabels a verdict map's key
// type and decodes set elements into fresh allocations (a dump of 100,000
// elements is most of a second that way), so these dumps are done here on a
// plain netfilter netlink socket in the same namespace; elements are walked
// in the receive buffer itself.

// udataFingerprint is the rule userdata TLV type brokkr stores a rule's
// fingerprint under (type 0 is the comment nft prints; nft skips types it
// does not know).
const udataFingerprint userdata.Type = 0x42

func nfMsg(msgType int, family nftables.TableFamily, flags netlink.HeaderFlags, attrs []netlink.Attribute) (netlink.Message, error) {
	data, err := netlink.MarshalAttributes(attrs)
	if err != nil {
		return netlink.Message{}, err
	}
	return netlink.Message{
		Header: netlink.Header{Type: netlink.HeaderType(unix.NFNL_SUBSYS_NFTABLES<<8 | msgType), Flags: flags},
		Data:   append([]byte{byte(family), unix.NFNETLINK_V0, 0, 0}, data...),
	}, nil
}

// genID returns the ruleset generation: it changes on every committed
// transaction in the namespace, so an unchanged generation proves nobody
// touched the tables since brokkr's own last commit.
func genID(c *netlink.Conn) (uint32, error) {
	m, err := nfMsg(unix.NFT_MSG_GETGEN, nftables.TableFamilyUnspecified, netlink.Request, nil)
	if err != nil {
		return 0, err
	}
	msgs, err := c.Execute(m)
	if err != nil {
		return 0, fmt.Errorf("getgen: %w", err)
	}
	var gen uint32
	found := false
	for _, msg := range msgs {
		if len(msg.Data) < 4 {
			continue
		}
		walk(msg.Data[4:], func(typ uint16, b []byte) {
			if typ == unix.NFTA_GEN_ID && len(b) == 4 {
				gen, found = binary.BigEndian.Uint32(b), true
			}
		})
	}
	if found {
		return gen, nil
	}
	return 0, errors.New("getgen: no generation id in reply")
}

// walk calls fn for each netlink attribute in b (type without the nested
// and byte-order flags), with its payload as a slice of b. A malformed
// attribute ends the walk.
func walk(b []byte, fn func(typ uint16, data []byte)) {
	for len(b) >= 4 {
		l := int(binary.NativeEndian.Uint16(b))
		if l < 4 || l > len(b) {
			return
		}
		fn(binary.NativeEndian.Uint16(b[2:])&^(unix.NLA_F_NESTED|unix.NLA_F_NET_BYTEORDER), b[4:l])
		b = b[min((l+3)&^3, len(b)):]
	}
}

// find is the payload of the first attribute of type typ in b.
func find(b []byte, typ uint16) []byte {
	var out []byte
	walk(b, func(t uint16, d []byte) {
		if t == typ && out == nil {
			out = d
		}
	})
	return out
}

func dump(c *netlink.Conn, msgType int, family nftables.TableFamily, attrs []netlink.Attribute) ([]netlink.Message, error) {
	m, err := nfMsg(msgType, family, netlink.Request|netlink.Dump, attrs)
	if err != nil {
		return nil, err
	}
	msgs, err := c.Execute(m)
	if err != nil {
		if errors.Is(err, unix.ENOENT) {
			return nil, nil
		}
		return nil, err
	}
	return msgs, nil
}

func tableAttr(typ uint16) []netlink.Attribute {
	return []netlink.Attribute{{Type: typ, Data: []byte(compile.TableName + "\x00")}}
}

// cstr is a NUL-terminated attribute as a string.
func cstr(b []byte) string {
	for i, c := range b {
		if c == 0 {
			return string(b[:i])
		}
	}
	return string(b)
}

// observeTable reads one of brokkr's tables from the kernel (nlMu held):
// a set that trusted names is not dumped at all; the others are dumped for
// their digest and decoded when read says so.
func observeTable(conn *nftables.Conn, raw *netlink.Conn, fam nftables.TableFamily, trusted func(string) bool, read func(string, compile.Digest) bool) (*compile.Observed, error) {
	o := compile.EmptyObserved()
	tabs, err := conn.ListTablesOfFamily(fam)
	if err != nil {
		return nil, fmt.Errorf("nft: list tables: %w", err)
	}
	for _, tb := range tabs {
		if tb.Name == compile.TableName {
			o.Exists = true
		}
	}
	if !o.Exists {
		return o, nil
	}
	chains, err := conn.ListChainsOfTableFamily(fam)
	if err != nil {
		return nil, fmt.Errorf("nft: list chains: %w", err)
	}
	rules, err := dumpRules(raw, fam)
	if err != nil {
		return nil, err
	}
	for _, c := range chains {
		if c.Table == nil || c.Table.Name != compile.TableName {
			continue
		}
		oc := &compile.ObsChain{Rules: rules[c.Name]}
		if c.Hooknum != nil && c.Priority != nil {
			oc.Hook = &compile.HookSpec{Typ: c.Type, Hook: *c.Hooknum, Priority: int32(*c.Priority)}
		}
		o.Chains[c.Name] = oc
	}
	shapes, err := dumpSets(raw, fam)
	if err != nil {
		return nil, err
	}
	for name, sh := range shapes {
		os := &compile.ObsSet{Shape: sh.SetShape}
		if trusted(name) {
			// A dump of 100,000 elements is seconds of kernel time (each
			// resumption walks the hash from its start).
			os.Trusted = true
		} else if !sh.Dynamic { // a cap set's members are runtime state: never read here
			d, elems, err := dumpElems(raw, fam, name, true)
			if err != nil {
				return nil, err
			}
			os.Digest = d
			if read(name, d) {
				os.Elems = elems()
			}
		}
		o.Sets[name] = os
	}
	if fam == nftables.TableFamilyINet {
		objs, err := conn.GetObjects(&nftables.Table{Name: compile.TableName, Family: fam})
		if err != nil {
			return nil, fmt.Errorf("nft: list counters: %w", err)
		}
		for _, ob := range objs {
			if n, _, ok := counterOf(ob); ok {
				o.Counters[n] = true
			}
		}
	}
	return o, nil
}

// dumpRules returns, per chain of the table, the fingerprints of its rules
// in order ("" for a rule without one).
func dumpRules(c *netlink.Conn, family nftables.TableFamily) (map[string][]string, error) {
	msgs, err := dump(c, unix.NFT_MSG_GETRULE, family, tableAttr(unix.NFTA_RULE_TABLE))
	if err != nil {
		return nil, fmt.Errorf("dump rules: %w", err)
	}
	out := map[string][]string{}
	for _, m := range msgs {
		if len(m.Data) < 4 {
			continue
		}
		var table, chain, fp string
		walk(m.Data[4:], func(typ uint16, b []byte) {
			switch typ {
			case unix.NFTA_RULE_TABLE:
				table = cstr(b)
			case unix.NFTA_RULE_CHAIN:
				chain = cstr(b)
			case unix.NFTA_RULE_USERDATA:
				fp, _ = userdata.GetString(b, udataFingerprint)
			}
		})
		if table == compile.TableName {
			out[chain] = append(out[chain], fp)
		}
	}
	return out, nil
}

type setInfo struct {
	compile.SetShape
}

// dumpSets returns the shape of every set of the table.
func dumpSets(c *netlink.Conn, family nftables.TableFamily) (map[string]setInfo, error) {
	msgs, err := dump(c, unix.NFT_MSG_GETSET, family, tableAttr(unix.NFTA_SET_TABLE))
	if err != nil {
		return nil, fmt.Errorf("dump sets: %w", err)
	}
	out := map[string]setInfo{}
	for _, m := range msgs {
		if len(m.Data) < 4 {
			continue
		}
		var name, table string
		var sh setInfo
		walk(m.Data[4:], func(typ uint16, b []byte) {
			u32 := func() uint32 {
				if len(b) < 4 {
					return 0
				}
				return binary.BigEndian.Uint32(b)
			}
			switch typ {
			case unix.NFTA_SET_TABLE:
				table = cstr(b)
			case unix.NFTA_SET_NAME:
				name = cstr(b)
			case unix.NFTA_SET_FLAGS:
				f := u32()
				sh.IsMap = f&unix.NFT_SET_MAP != 0
				sh.Dynamic = f&unix.NFT_SET_EVAL != 0
				sh.Interval = f&unix.NFT_SET_INTERVAL != 0
			case unix.NFTA_SET_KEY_TYPE:
				sh.KeyType = u32()
			case unix.NFTA_SET_KEY_LEN:
				sh.KeyLen = u32()
			case unix.NFTA_SET_DATA_TYPE:
				sh.DataType = u32()
			case unix.NFTA_SET_DESC:
				if s := find(b, unix.NFTA_SET_DESC_SIZE); len(s) == 4 {
					sh.Size = binary.BigEndian.Uint32(s)
				}
			case nftaSetExpr:
				_, sh.Counter = exprCounter(b)
			case nftaSetExpressions:
				walk(b, func(t uint16, x []byte) {
					if _, ok := exprCounter(x); t == unix.NFTA_LIST_ELEM && ok {
						sh.Counter = true
					}
				})
			}
		})
		if table == compile.TableName {
			out[name] = sh
		}
	}
	return out, nil
}

// elem is one set element as a dump holds it: slices of the receive
// buffer.
type elem struct {
	key, val, chain, comment []byte
	verdict                  int32
	isVerdict                bool
	counter                  compile.CounterValue // the element's counter (sets with one)
}

// Element attributes past what x/sys/unix names.
const (
	nftaSetElemKeyEnd      = 10 // NFTA_SET_ELEM_KEY_END
	nftaSetElemExpressions = 11 // NFTA_SET_ELEM_EXPRESSIONS
	nftaSetExpr            = 17 // NFTA_SET_EXPR
	nftaSetExpressions     = 18 // NFTA_SET_EXPRESSIONS
)

// exprCounter reads a counter expression (NFTA_EXPR_NAME "counter" and its
// NFTA_EXPR_DATA), if b is one.
func exprCounter(b []byte) (compile.CounterValue, bool) {
	var c compile.CounterValue
	isCounter := false
	walk(b, func(t uint16, d []byte) {
		switch t {
		case unix.NFTA_EXPR_NAME:
			isCounter = cstr(d) == "counter"
		case unix.NFTA_EXPR_DATA:
			walk(d, func(t uint16, v []byte) {
				if len(v) != 8 {
					return
				}
				switch t {
				case unix.NFTA_COUNTER_BYTES:
					c.Bytes = binary.BigEndian.Uint64(v)
				case unix.NFTA_COUNTER_PACKETS:
					c.Packets = binary.BigEndian.Uint64(v)
				}
			})
		}
	})
	return c, isCounter
}

// verdictText is how an element's verdict reads in an ElemSpec: the chain
// of a goto, otherwise its code and chain.
func (e *elem) verdictText() string {
	if !e.isVerdict {
		return ""
	}
	if e.verdict == int32(expr.VerdictGoto) {
		return string(e.chain)
	}
	return "<verdict " + strconv.Itoa(int(e.verdict)) + " " + string(e.chain) + ">"
}

func (e *elem) hash() uint64 {
	if e.isVerdict && e.verdict == int32(expr.VerdictGoto) {
		return compile.HashParts(e.key, nil, e.chain, e.comment)
	}
	return compile.HashParts(e.key, e.val, e.verdictText(), e.comment)
}

func (e *elem) spec() compile.ElemSpec {
	es := compile.ElemSpec{Key: append([]byte(nil), e.key...), Comment: string(e.comment), Verdict: e.verdictText(), Counter: e.counter}
	if !e.isVerdict {
		es.Val = append([]byte(nil), e.val...)
	}
	return es
}

// parseElem decodes one NFTA_LIST_ELEM of a set element list.
func parseElem(b []byte) elem {
	var e elem
	var end []byte // an interval element's last key: its key is first . last (compile.SetSpec.Interval)
	walk(b, func(typ uint16, d []byte) {
		switch typ {
		case unix.NFTA_SET_ELEM_KEY:
			e.key = find(d, unix.NFTA_DATA_VALUE)
		case nftaSetElemKeyEnd:
			end = find(d, unix.NFTA_DATA_VALUE)
		case unix.NFTA_SET_ELEM_DATA:
			if v := find(d, unix.NFTA_DATA_VERDICT); v != nil {
				e.isVerdict = true
				walk(v, func(t uint16, x []byte) {
					switch {
					case t == unix.NFTA_VERDICT_CODE && len(x) == 4:
						e.verdict = int32(binary.BigEndian.Uint32(x))
					case t == unix.NFTA_VERDICT_CHAIN:
						e.chain = x
						for i, c := range x {
							if c == 0 {
								e.chain = x[:i]
								break
							}
						}
					}
				})
			} else {
				e.val = find(d, unix.NFTA_DATA_VALUE)
			}
		case unix.NFTA_SET_ELEM_USERDATA:
			e.comment = udataComment(d)
		case unix.NFTA_SET_ELEM_EXPR:
			if c, ok := exprCounter(d); ok {
				e.counter = c
			}
		case nftaSetElemExpressions:
			walk(d, func(t uint16, x []byte) {
				if c, ok := exprCounter(x); t == unix.NFTA_LIST_ELEM && ok {
					e.counter = c
				}
			})
		}
	})
	if end != nil {
		e.key = append(append(make([]byte, 0, len(e.key)+len(end)), e.key...), end...)
	}
	return e
}

// udataComment is the comment TLV of an element's userdata, without its
// NUL.
func udataComment(u []byte) []byte {
	for len(u) >= 2 {
		typ, l := u[0], int(u[1])
		if 2+l > len(u) {
			return nil
		}
		if typ == byte(userdata.NFTNL_UDATA_SET_ELEM_COMMENT) {
			c := u[2 : 2+l]
			if n := len(c); n > 0 && c[n-1] == 0 {
				c = c[:n-1]
			}
			return c
		}
		u = u[2+l:]
	}
	return nil
}

// eachElem calls fn for every element of a dump of set elements.
func eachElem(msgs []netlink.Message, fn func(e *elem)) {
	for _, m := range msgs {
		if len(m.Data) < 4 {
			continue
		}
		walk(m.Data[4:], func(typ uint16, b []byte) {
			if typ != unix.NFTA_SET_ELEM_LIST_ELEMENTS {
				return
			}
			walk(b, func(t uint16, eb []byte) {
				if t == unix.NFTA_LIST_ELEM {
					e := parseElem(eb)
					fn(&e)
				}
			})
		})
	}
}

// dumpElems reads one set's elements: their digest, and (decode) a
// function that decodes them all, from the same dump, when called.
func dumpElems(c *netlink.Conn, family nftables.TableFamily, set string, decode bool) (compile.Digest, func() map[string]compile.ElemSpec, error) {
	msgs, err := dump(c, unix.NFT_MSG_GETSETELEM, family, []netlink.Attribute{
		{Type: unix.NFTA_SET_ELEM_LIST_TABLE, Data: []byte(compile.TableName + "\x00")},
		{Type: unix.NFTA_SET_ELEM_LIST_SET, Data: []byte(set + "\x00")},
	})
	if err != nil {
		return compile.Digest{}, nil, fmt.Errorf("dump elements of %s: %w", set, err)
	}
	var d compile.Digest
	eachElem(msgs, func(e *elem) { d = d.Add(e.hash()) })
	if !decode {
		return d, nil, nil
	}
	return d, func() map[string]compile.ElemSpec {
		out := make(map[string]compile.ElemSpec, d.Count)
		eachElem(msgs, func(e *elem) { out[string(e.key)] = e.spec() })
		return out
	}, nil
}

func counterOf(o nftables.Obj) (string, compile.CounterValue, bool) {
	switch c := o.(type) {
	case *nftables.CounterObj:
		return c.Name, compile.CounterValue{Packets: c.Packets, Bytes: c.Bytes}, true
	case *nftables.NamedObj:
		if ec, ok := c.Obj.(*expr.Counter); ok && c.Type == nftables.ObjTypeCounter {
			return c.Name, compile.CounterValue{Packets: ec.Packets, Bytes: ec.Bytes}, true
		}
	}
	return "", compile.CounterValue{}, false
}

// elemCounters reads the counters of a set's elements, by string(key).
func elemCounters(c *netlink.Conn, set string) (map[string]compile.CounterValue, error) {
	msgs, err := dump(c, unix.NFT_MSG_GETSETELEM, nftables.TableFamilyINet, []netlink.Attribute{
		{Type: unix.NFTA_SET_ELEM_LIST_TABLE, Data: []byte(compile.TableName + "\x00")},
		{Type: unix.NFTA_SET_ELEM_LIST_SET, Data: []byte(set + "\x00")},
	})
	if err != nil {
		return nil, fmt.Errorf("dump elements of %s: %w", set, err)
	}
	out := map[string]compile.CounterValue{}
	eachElem(msgs, func(e *elem) { out[string(e.key)] = e.counter })
	return out, nil
}

// readCounters reads the named counters of the inet table (nlMu held).
func readCounters(conn *nftables.Conn) (map[string]compile.CounterValue, error) {
	objs, err := conn.GetObjects(&nftables.Table{Name: compile.TableName, Family: nftables.TableFamilyINet})
	if err != nil {
		return nil, fmt.Errorf("nft: read counters: %w", err)
	}
	out := map[string]compile.CounterValue{}
	for _, o := range objs {
		if n, v, ok := counterOf(o); ok {
			out[n] = v
		}
	}
	return out, nil
}

// lookupElems gets the elements of set at keys, one request each (the
// kernel answers a request for several with one message per element, and a
// reader that stops at the first leaves the others on the socket): an error
// names a missing one (ENOENT).
func lookupElems(c *netlink.Conn, family nftables.TableFamily, set string, keys [][]byte) (map[string]compile.ElemSpec, error) {
	out := map[string]compile.ElemSpec{}
	for _, k := range keys {
		var w attrWriter
		w.cstr(unix.NFTA_SET_ELEM_LIST_TABLE, compile.TableName)
		w.cstr(unix.NFTA_SET_ELEM_LIST_SET, set)
		w.nest(unix.NFTA_SET_ELEM_LIST_ELEMENTS, func() {
			w.nest(unix.NFTA_LIST_ELEM, func() { w.key(k, compile.IntervalSet(set)) })
		})
		msgs, err := c.Execute(netlink.Message{
			Header: netlink.Header{Type: netlink.HeaderType(unix.NFNL_SUBSYS_NFTABLES<<8 | unix.NFT_MSG_GETSETELEM), Flags: netlink.Request},
			Data:   append([]byte{byte(family), unix.NFNETLINK_V0, 0, 0}, w.b...),
		})
		if err != nil {
			return nil, fmt.Errorf("get an element of %s: %w", set, err)
		}
		eachElem(msgs, func(e *elem) { out[string(e.key)] = e.spec() })
	}
	return out, nil
}
