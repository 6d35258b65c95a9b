package nft

import (
	"fmt"

	"github.com/brokkr/brokkr/bpf/ctmark"
	"github.com/brokkr/brokkr/netplane/nft/compile"
	"github.com/google/nftables"
	"github.com/google/nftables/binaryutil"
	"github.com/google/nftables/expr"
	"github.com/google/nftables/userdata"
)

// apply sends ops as ONE batch. A batch that seeds a cap set holds
// membersMu from reading conntrack to its commit.
func (k *nlKernel) apply(ops []compile.Op) error {
	for _, o := range ops {
		if a, ok := o.(compile.AddSet); ok && a.Set.Stateful {
			k.membersMu.Lock()
			defer k.membersMu.Unlock()
			break
		}
	}
	conn, err := newBatchConn()
	if err != nil {
		return err
	}
	for _, o := range ops {
		if err := k.queue(conn, o); err != nil {
			return err
		}
	}
	commit := func() error { return k.nl(func() error { return conn.commit(k.raw) }) }
	if k.mon != nil && elems(ops) >= quietMin {
		err = k.mon.quiet(k.generation, commit)
	} else {
		err = commit()
	}
	if err != nil {
		return fmt.Errorf("nft: commit: %w", err)
	}
	return nil
}

func elems(ops []compile.Op) int {
	n := 0
	for _, o := range ops {
		switch x := o.(type) {
		case compile.AddElems:
			n += len(x.Elems)
		case compile.DelElems:
			n += len(x.Elems)
		}
	}
	return n
}

func table(f nftables.TableFamily) *nftables.Table {
	return &nftables.Table{Name: compile.TableName, Family: f}
}

// queue adds one operation's messages to the batch.
func (k *nlKernel) queue(conn *batchConn, o compile.Op) error {
	tab := table(o.Family())
	switch x := o.(type) {
	case compile.AddTable:
		conn.AddTable(tab)
	case compile.DelTable:
		conn.DelTable(tab)
	case compile.DelElems:
		return conn.SetDeleteElements(&nftables.Set{Table: tab, Name: x.Set}, toElems(x.Elems, compile.IntervalSet(x.Set)))
	case compile.FlushChain:
		conn.FlushChain(&nftables.Chain{Table: tab, Name: x.Chain})
	case compile.DelChain:
		conn.DelChain(&nftables.Chain{Table: tab, Name: x.Chain})
	case compile.DelSet:
		conn.DelSet(&nftables.Set{Table: tab, Name: x.Set})
	case compile.DelCounter:
		conn.DeleteObject(&nftables.NamedObj{Table: tab, Name: x.Name, Type: nftables.ObjTypeCounter})
	case compile.AddCounter:
		conn.AddObj(&nftables.NamedObj{Table: tab, Name: x.Name, Type: nftables.ObjTypeCounter,
			Obj: &expr.Counter{Packets: x.Value.Packets, Bytes: x.Value.Bytes}})
	case compile.AddSet:
		if err := conn.AddSet(toSet(tab, x.Set), nil); err != nil {
			return fmt.Errorf("nft: set %s: %w", x.Set.Name, err)
		}
		if x.Set.IsMap && x.Set.Data.Name == nftables.TypeMark.Name {
			if err := conn.hostEndianData(); err != nil {
				return err
			}
		}
		if x.Set.Stateful && !x.Fresh {
			seed, err := k.seedElems(x.Set)
			if err != nil {
				return err
			}
			for _, ch := range chunks(seed) {
				if err := conn.SetAddElements(toSet(tab, x.Set), ch); err != nil {
					return err
				}
			}
		}
	case compile.AddChain:
		ch := &nftables.Chain{Table: tab, Name: x.Chain.Name}
		if h := x.Chain.Hook; h != nil {
			hook, prio, pol := h.Hook, nftables.ChainPriority(h.Priority), nftables.ChainPolicyAccept
			ch.Hooknum, ch.Priority, ch.Type, ch.Policy = &hook, &prio, h.Typ, &pol
		}
		conn.AddChain(ch)
	case compile.AddRules:
		for _, r := range x.Chain.Rules {
			ud := userdata.AppendString(nil, userdata.TypeComment, r.Comment)
			ud = userdata.AppendString(ud, udataFingerprint, r.Fp)
			if err := conn.addRule(tab, x.Chain.Name, r, ud); err != nil {
				return err
			}
		}
	case compile.AddElems:
		return conn.addElems(tab.Family, x.Set.Name, x.Set.Counter, x.Elems)
	default:
		return fmt.Errorf("nft: operation %T", o)
	}
	return nil
}

// seedElems fills a cap set that is (re)created from the connections of its
// exposure that are still open, so a converge never forgets them.
func (k *nlKernel) seedElems(s *compile.SetSpec) ([]nftables.SetElement, error) {
	entries, err := k.ct.ByMark(s.SeedID, ctmark.IDMask)
	if err != nil {
		return nil, fmt.Errorf("nft: seeding cap of %s: %w", s.Owner, err)
	}
	var out []nftables.SetElement
	for _, e := range entries {
		if !e.Open() || e.Mark&ctmark.Closed == ctmark.Closed {
			continue
		}
		if uint32(len(out)) >= s.Size {
			break // the cap was lowered below what is open: the rest are not tracked
		}
		out = append(out, nftables.SetElement{Key: compile.ConnKey(e.Orig, e.OrigDst)})
	}
	return out, nil
}

// maxElemBytes keeps one NEWSETELEM list attribute well under the 16-bit
// netlink attribute length: past 64 KiB google/nftables' list wraps and the
// kernel stores a fraction of it with no error.
const (
	maxElemBytes = 48 << 10
	maxElemCount = 1000
)

func chunks(elems []nftables.SetElement) [][]nftables.SetElement {
	var out [][]nftables.SetElement
	start, size := 0, 0
	for i, e := range elems {
		n := 64 + len(e.Key) + len(e.Val) + len(e.Comment)
		if e.VerdictData != nil {
			n += 16 + len(e.VerdictData.Chain)
		}
		if i > start && (size+n > maxElemBytes || i-start >= maxElemCount) {
			out = append(out, elems[start:i])
			start, size = i, 0
		}
		size += n
	}
	if start < len(elems) {
		out = append(out, elems[start:])
	}
	return out
}

func toSet(tab *nftables.Table, s *compile.SetSpec) *nftables.Set {
	var order binaryutil.ByteOrder
	switch {
	case s.Key.Name == nftables.TypeIFName.Name || s.Key.Name == nftables.TypeMark.Name:
		// Host-endian types: without this nft prints them byte-reversed.
		order = binaryutil.NativeEndian
	}
	return &nftables.Set{KeyByteOrder: order, Table: tab, Name: s.Name, IsMap: s.IsMap, Dynamic: s.Dynamic, Interval: s.Interval, Size: s.Size, Counter: s.Counter,
		KeyType: s.Key, DataType: s.Data, Comment: s.Comment, Concatenation: len(s.Key.Name) > 0 && s.Key.Bytes > 0 && isConcat(s.Key)}
}

// splitInterval is an interval element's key as the kernel takes it: its
// first key (NFTA_SET_ELEM_KEY) and its last (NFTA_SET_ELEM_KEY_END).
func splitInterval(k []byte) (first, last []byte) { return k[:len(k)/2], k[len(k)/2:] }

func isConcat(d nftables.SetDatatype) bool {
	for _, c := range d.Name {
		if c == ' ' {
			return true
		}
	}
	return false
}

// toElems are es for google/nftables; an interval set's keys are split into
// the first key and the last (KeyEnd).
func toElems(es []compile.ElemSpec, interval bool) []nftables.SetElement {
	out := make([]nftables.SetElement, 0, len(es))
	for _, e := range es {
		se := nftables.SetElement{Key: e.Key, Val: e.Val, Comment: e.Comment}
		if interval {
			se.Key, se.KeyEnd = splitInterval(e.Key)
		}
		if e.Verdict != "" {
			se.VerdictData = &expr.Verdict{Kind: expr.VerdictGoto, Chain: e.Verdict}
		}
		out = append(out, se)
	}
	return out
}
