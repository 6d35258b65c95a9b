package nft

import (
	"errors"
	"fmt"
	"io"
	"time"

	"github.com/brokkr/brokkr/netplane/nft/compile"

	"github.com/google/nftables"
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
