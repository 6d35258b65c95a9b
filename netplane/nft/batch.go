package nft

import (
	"errors"
	"fmt"
	"io"
	"time"

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
// send instead of sending them.
type batchConn struct {
	*nftables.Conn
	sent []netlink.Message
}

func newBatchConn() (*batchConn, error) {
	b := &batchConn{}
	c, err := nftables.New(nftables.WithTestDial(func(req []netlink.Message) ([]netlink.Message, error) {
		if req != nil {
			b.sent = append(b.sent, req...)
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

// commit sends the recorded batch on raw (one sendmsg) and returns the
// kernel's errors for it, if any; nil means the batch was committed.
func (b *batchConn) commit(raw *netlink.Conn) error {
	if err := b.Conn.Flush(); err != nil { // marshals and records
		return err
	}
	if len(b.sent) == 0 {
		return nil
	}
	msgs := make([]netlink.Message, len(b.sent))
	for i, m := range b.sent {
		m.Header.Flags &^= netlink.Acknowledge | unix.NLM_F_ECHO
		m.Header.Sequence, m.Header.PID = 0, 0 // raw numbers them
		msgs[i] = m
	}
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
