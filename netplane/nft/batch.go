package nft

import (
	"encoding/binary"
	"errors"
	"fmt"
	"io"
	"time"

	"github.com/brokkr/brokkr/netplane/nft/compile"

	"github.com/google/nftables"
	"github.com/google/nftables/expr"
	"github.com/google/nftables/userdata"
	"github.com/mdlayher/netlink"
	"golang.org/x/sys/unix"
)

// Committing a batch without per-message acknowledgements.
//
// google/nftables v0.3.0 asks the kernel to ACK every message of a batch
// (and to echo every rule back) and then reads those replies one recvmsg at
// a time: 40,000 replies for 10,000 exposures, measured as most of the
// apply time. The kernel reports a failed message with an error even when
// no ACK was asked for, and it handles the whole batch inside sendmsg, so
// nft(8)'s way is enough: send the batch with no ACK/ECHO flags, then one
// ordinary request (GETGEN) behind it; every error of the batch is queued
// before that request's reply, whose arrival proves the batch was handled.
// google/nftables still builds the messages (one place that marshals
// objects), on a Conn whose "socket" only records them.

// batchConn is a google/nftables Conn that records the messages Flush would
// send instead of sending them. Messages built here (addRule) are put in
// order between them: what google/nftables queued before is flushed (and
// recorded) first, and each recorded batch loses its begin/end markers.
type batchConn struct {
	*nftables.Conn
	sent []netlink.Message
}

func newBatchConn() (*batchConn, error) {
	b := &batchConn{}
	c, err := nftables.New(nftables.WithTestDial(func(req []netlink.Message) ([]netlink.Message, error) {
		if len(req) >= 2 {
			b.sent = append(b.sent, req[1:len(req)-1]...) // without BATCH_BEGIN/END
		}
		// io.EOF: every read Flush makes for an ACK gets "no reply".
		return nil, io.EOF
	}))
	if err != nil {
		return nil, fmt.Errorf("nft: %w", err)
	}
	b.Conn = c
	return b, nil
}

// batchTimeout bounds the wait for the kernel's answer to one batch.
const batchTimeout = 60 * time.Second

// addRule queues one rule (appended to its chain) from the expressions the
// rule's fingerprint was computed from: google/nftables would marshal every
// expression a second time (~60 ms CPU for 10,000 exposures).
func (b *batchConn) addRule(tab *nftables.Table, chain string, r compile.RuleSpec, userData []byte) error {
	if err := b.Conn.Flush(); err != nil { // what was queued before goes first
		return err
	}
	list := make([]netlink.Attribute, len(r.Raw))
	for i, x := range r.Raw {
		list[i] = netlink.Attribute{Type: unix.NLA_F_NESTED | unix.NFTA_LIST_ELEM, Data: x}
	}
	exprs, err := netlink.MarshalAttributes(list)
	if err != nil {
		return err
	}
	m, err := nfMsg(unix.NFT_MSG_NEWRULE, tab.Family, netlink.Request|netlink.Create|unix.NLM_F_APPEND, []netlink.Attribute{
		{Type: unix.NFTA_RULE_TABLE, Data: []byte(tab.Name + "\x00")},
		{Type: unix.NFTA_RULE_CHAIN, Data: []byte(chain + "\x00")},
		{Type: unix.NLA_F_NESTED | unix.NFTA_RULE_EXPRESSIONS, Data: exprs},
		{Type: unix.NFTA_RULE_USERDATA, Data: userData},
	})
	if err != nil {
		return err
	}
	b.sent = append(b.sent, m)
	return nil
}

// commit sends the recorded batch on raw (one sendmsg) and returns the
// kernel's errors for it, if any; nil means the batch was committed.
func (b *batchConn) commit(raw *netlink.Conn) error {
	if err := b.Conn.Flush(); err != nil { // marshals and records
		return err
	}
	if len(b.sent) == 0 {
		return nil
	}
	marker := func(t uint16) netlink.Message {
		return netlink.Message{Header: netlink.Header{Type: netlink.HeaderType(t), Flags: netlink.Request},
			Data: []byte{unix.AF_UNSPEC, unix.NFNETLINK_V0, 0, unix.NFNL_SUBSYS_NFTABLES}}
	}
	msgs := make([]netlink.Message, 0, len(b.sent)+2)
	msgs = append(msgs, marker(unix.NFNL_MSG_BATCH_BEGIN))
	for _, m := range b.sent {
		m.Header.Flags &^= netlink.Acknowledge | unix.NLM_F_ECHO
		m.Header.Sequence, m.Header.PID = 0, 0 // raw numbers them
		msgs = append(msgs, m)
	}
	msgs = append(msgs, marker(unix.NFNL_MSG_BATCH_END))
	b.sent = nil
	if _, err := raw.SendMessages(msgs); err != nil {
		return fmt.Errorf("send batch: %w", err)
	}
	sync, err := nfMsg(unix.NFT_MSG_GETGEN, nftables.TableFamilyUnspecified, netlink.Request, nil)
	if err != nil {
		return err
	}
	sent, err := raw.Send(sync)
	if err != nil {
		return fmt.Errorf("send batch: %w", err)
	}
	_ = raw.SetReadDeadline(time.Now().Add(batchTimeout))
	defer func() { _ = raw.SetReadDeadline(time.Time{}) }()
	var errs error
	for {
		replies, err := raw.Receive()
		if err != nil {
			var op *netlink.OpError
			if errors.As(err, &op) && op.Err != nil && !errors.Is(op.Err, unix.ENOBUFS) && !op.Timeout() {
				// An error message for one message of the batch (or for
				// its commit): the batch is aborted; keep reading.
				errs = errors.Join(errs, err)
				continue
			}
			// Lost replies or no answer: the outcome is unknown.
			return errors.Join(errs, fmt.Errorf("receive batch replies: %w", err))
		}
		for _, r := range replies {
			if r.Header.Sequence == sent.Header.Sequence {
				return errs
			}
		}
	}
}

// attrWriter appends netlink attributes to a buffer: a batch of 100,000
// exposures is 200,000 elements, and google/nftables marshals each element
// into several fresh allocations (and cannot give an element a counter
// value, which a replace must carry).
type attrWriter struct{ b []byte }

func (w *attrWriter) attr(typ uint16, data []byte) {
	l := 4 + len(data)
	w.b = binary.NativeEndian.AppendUint16(w.b, uint16(l))
	w.b = binary.NativeEndian.AppendUint16(w.b, typ)
	w.b = append(w.b, data...)
	for l%4 != 0 {
		w.b = append(w.b, 0)
		l++
	}
}

// nest writes a nested attribute whose payload fn writes.
func (w *attrWriter) nest(typ uint16, fn func()) {
	at := len(w.b)
	w.b = append(w.b, 0, 0, 0, 0)
	fn()
	binary.NativeEndian.PutUint16(w.b[at:], uint16(len(w.b)-at))
	binary.NativeEndian.PutUint16(w.b[at+2:], typ|unix.NLA_F_NESTED)
}

func (w *attrWriter) cstr(typ uint16, s string) {
	l := 4 + len(s) + 1
	w.b = binary.NativeEndian.AppendUint16(w.b, uint16(l))
	w.b = binary.NativeEndian.AppendUint16(w.b, typ)
	w.b = append(w.b, s...)
	w.b = append(w.b, 0)
	for l%4 != 0 {
		w.b = append(w.b, 0)
		l++
	}
}

// key writes an element's key: an interval set's as its first key and its
// last (NFTA_SET_ELEM_KEY_END).
func (w *attrWriter) key(k []byte, interval bool) {
	if !interval {
		w.nest(unix.NFTA_SET_ELEM_KEY, func() { w.attr(unix.NFTA_DATA_VALUE, k) })
		return
	}
	first, last := splitInterval(k)
	w.nest(unix.NFTA_SET_ELEM_KEY, func() { w.attr(unix.NFTA_DATA_VALUE, first) })
	w.nest(nftaSetElemKeyEnd, func() { w.attr(unix.NFTA_DATA_VALUE, last) })
}

// elem writes one set element (counting: the set's elements have counters,
// and this one starts at e.Counter).
func (w *attrWriter) elem(e *compile.ElemSpec, counting, interval bool) {
	w.nest(unix.NFTA_LIST_ELEM, func() {
		w.key(e.Key, interval)
		switch {
		case e.Verdict != "":
			w.nest(unix.NFTA_SET_ELEM_DATA, func() {
				w.nest(unix.NFTA_DATA_VERDICT, func() {
					code := int32(expr.VerdictGoto)
					w.attr(unix.NFTA_VERDICT_CODE, binary.BigEndian.AppendUint32(nil, uint32(code)))
					w.cstr(unix.NFTA_VERDICT_CHAIN, e.Verdict)
				})
			})
		case len(e.Val) > 0:
			w.nest(unix.NFTA_SET_ELEM_DATA, func() { w.attr(unix.NFTA_DATA_VALUE, e.Val) })
		}
		if e.Comment != "" {
			w.attr(unix.NFTA_SET_ELEM_USERDATA, userdata.AppendString(nil, userdata.NFTNL_UDATA_SET_ELEM_COMMENT, e.Comment))
		}
		if counting && e.Counter != (compile.CounterValue{}) {
			// The one expression as NFTA_SET_ELEM_EXPR, which every
			// kernel takes: 5.10 has no NFTA_SET_ELEM_EXPRESSIONS (5.12)
			// and ignored it, so a replaced table's element counters
			// started again at zero there (the kernel matrix's 5.10 leg).
			w.nest(unix.NFTA_SET_ELEM_EXPR, func() {
				w.cstr(unix.NFTA_EXPR_NAME, "counter")
				w.nest(unix.NFTA_EXPR_DATA, func() {
					w.attr(unix.NFTA_COUNTER_BYTES, binary.BigEndian.AppendUint64(nil, e.Counter.Bytes))
					w.attr(unix.NFTA_COUNTER_PACKETS, binary.BigEndian.AppendUint64(nil, e.Counter.Packets))
				})
			})
		}
	})
}

// addElems queues elements of set in NEWSETELEM messages, each element list
// under maxElemBytes (its attribute length is 16 bits).
func (b *batchConn) addElems(fam nftables.TableFamily, set string, counting bool, elems []compile.ElemSpec) error {
	if err := b.Conn.Flush(); err != nil { // what was queued before goes first
		return err
	}
	for len(elems) > 0 {
		var w attrWriter
		w.cstr(unix.NFTA_SET_ELEM_LIST_TABLE, compile.TableName)
		w.cstr(unix.NFTA_SET_ELEM_LIST_SET, set)
		n := 0
		w.nest(unix.NFTA_SET_ELEM_LIST_ELEMENTS, func() {
			start := len(w.b)
			for n < len(elems) && n < maxElemCount && len(w.b)-start < maxElemBytes {
				w.elem(&elems[n], counting, compile.IntervalSet(set))
				n++
			}
		})
		elems = elems[n:]
		b.sent = append(b.sent, netlink.Message{
			Header: netlink.Header{Type: netlink.HeaderType(unix.NFNL_SUBSYS_NFTABLES<<8 | unix.NFT_MSG_NEWSETELEM), Flags: netlink.Request | netlink.Create},
			Data:   append([]byte{byte(fam), unix.NFNETLINK_V0, 0, 0}, w.b...),
		})
	}
	return nil
}

// nftnlUdataSetDataByteorder is libnftnl's NFTNL_UDATA_SET_DATABYTEORDER:
// how nft reads a map's data. google/nftables v0.3.0 writes only the key's;
// without it nft prints host-endian data (a mark) byte-reversed.
const nftnlUdataSetDataByteorder = 1

// hostEndianData adds to the NEWSET message just queued that the set's data
// is host-endian, as nft itself records it.
func (b *batchConn) hostEndianData() error {
	if err := b.Conn.Flush(); err != nil {
		return err
	}
	if len(b.sent) == 0 {
		return errors.New("nft: no set queued")
	}
	m := &b.sent[len(b.sent)-1]
	if len(m.Data) < 4 || m.Header.Type&0xff != unix.NFT_MSG_NEWSET {
		return errors.New("nft: the last message is not a new set")
	}
	tlv := userdata.AppendUint32(nil, nftnlUdataSetDataByteorder, 1) // BYTEORDER_HOST_ENDIAN
	var w attrWriter
	found := false
	b0 := m.Data[4:]
	for len(b0) >= 4 {
		l := int(binary.NativeEndian.Uint16(b0))
		if l < 4 || l > len(b0) {
			return errors.New("nft: a malformed new set")
		}
		typ, d := binary.NativeEndian.Uint16(b0[2:]), b0[4:l]
		if typ&^(unix.NLA_F_NESTED|unix.NLA_F_NET_BYTEORDER) == unix.NFTA_SET_USERDATA {
			found = true
			d = append(append([]byte(nil), tlv...), d...)
		}
		w.attr(typ, d)
		b0 = b0[min((l+3)&^3, len(b0)):]
	}
	if !found {
		w.attr(unix.NFTA_SET_USERDATA, tlv)
	}
	m.Data = append(m.Data[:4:4], w.b...)
	m.Header.Length = 0 // sending computes it again from Data
	return nil
}
