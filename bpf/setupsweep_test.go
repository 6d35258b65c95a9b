package bpf

import (
	"encoding/binary"
	"net"
	"testing"
	"time"

	"github.com/mdlayher/netlink"
	"github.com/stretchr/testify/require"
	"golang.org/x/sys/unix"
)

// nfQueue is the least of an NFQUEUE listener (nfnetlink_queue) a test
// needs to hold packets between two netfilter hooks: bind one queue, take
// the packets' ids, give verdicts.
type nfQueue struct {
	c   *netlink.Conn
	num uint16
}

const (
	nfnlSubsysQueue  = 3
	nfqnlMsgPacket   = 0
	nfqnlMsgVerdict  = 1
	nfqnlMsgConfig   = 2
	nfqaCfgCmd       = 1
	nfqaCfgParams    = 2
	nfqaPacketHdr    = 1
	nfqaVerdictHdr   = 2
	nfqnlCfgCmdBind  = 1
	nfqnlCopyMeta    = 1
	nfVerdictDrop    = 0
	nfVerdictAccept  = 1
	nfnetlinkVersion = 0
)

func (q *nfQueue) msg(typ int, attrs func(*netlink.AttributeEncoder)) netlink.Message {
	ae := netlink.NewAttributeEncoder()
	attrs(ae)
	b, err := ae.Encode()
	if err != nil {
		panic(err)
	}
	hdr := []byte{unix.AF_UNSPEC, nfnetlinkVersion, 0, 0}
	binary.BigEndian.PutUint16(hdr[2:], q.num)
	return netlink.Message{
		Header: netlink.Header{Type: netlink.HeaderType(nfnlSubsysQueue<<8 | typ), Flags: netlink.Request | netlink.Acknowledge},
		Data:   append(hdr, b...),
	}
}

func openNFQueue(t *testing.T, num uint16) *nfQueue {
	t.Helper()
	c, err := netlink.Dial(unix.NETLINK_NETFILTER, nil)
	require.NoError(t, err)
	t.Cleanup(func() { c.Close() })
	q := &nfQueue{c: c, num: num}
	_, err = c.Execute(q.msg(nfqnlMsgConfig, func(ae *netlink.AttributeEncoder) {
		ae.Bytes(nfqaCfgCmd, []byte{nfqnlCfgCmdBind, 0, 0, unix.AF_INET})
	}))
	require.NoError(t, err, "bind queue %d", num)
	params := make([]byte, 5) // copy_range 0 (the whole packet; meta mode copies none)
	params[4] = nfqnlCopyMeta
	_, err = c.Execute(q.msg(nfqnlMsgConfig, func(ae *netlink.AttributeEncoder) { ae.Bytes(nfqaCfgParams, params) }))
	require.NoError(t, err, "queue %d: copy mode", num)
	return q
}

// next returns the id of the next queued packet, or false when none came
// within the wait.
func (q *nfQueue) next(t *testing.T, within time.Duration) (uint32, bool) {
	t.Helper()
	require.NoError(t, q.c.SetReadDeadline(time.Now().Add(within)))
	for {
		msgs, err := q.c.Receive()
		if err != nil {
			return 0, false
		}
		for _, m := range msgs {
			if m.Header.Type != netlink.HeaderType(nfnlSubsysQueue<<8|nfqnlMsgPacket) || len(m.Data) < 4 {
				continue
			}
			ad, err := netlink.NewAttributeDecoder(m.Data[4:])
			require.NoError(t, err)
			for ad.Next() {
				if ad.Type() == nfqaPacketHdr && len(ad.Bytes()) >= 4 {
					return binary.BigEndian.Uint32(ad.Bytes()), true
				}
			}
		}
	}
}

func (q *nfQueue) verdict(t *testing.T, id, verdict uint32) {
	t.Helper()
	v := make([]byte, 8)
	binary.BigEndian.PutUint32(v, verdict)
	binary.BigEndian.PutUint32(v[4:], id)
	m := q.msg(nfqnlMsgVerdict, func(ae *netlink.AttributeEncoder) { ae.Bytes(nfqaVerdictHdr, v) })
	m.Header.Flags = netlink.Request
	_, err := q.c.Send(m)
	require.NoError(t, err)
}

// A connection's first packet passes brk_nat_pre (which tracks the flow)
// before conntrack confirms its entry, at the end of the hooks; until then
// the entry's timeout is relative, not a point in time. A sweep that came in
// between took the flow for an expired one and forgot it: the rest of the
// connection went uncounted (the soak's "bytes_minus_sent -200", one call of
// 100 bytes each way) and it was counted in dropped. Here the SYN is held in
// an NFQUEUE after the nat-path hook, across a sweep, then let go.
func TestASweepWhileAConnectionIsSetUpKeepsItsFlow(t *testing.T) {
	// The window between the DNAT and conntrack's confirmation is the
	// netfilter hooks' alone: the tc programs see confirmed entries only.
	requireNetfilterHooks(t)
	tp := newNatTopo(t, 10)
	np := tp.load(t)
	defer np.Close()
	// A first call starts the sweeper.
	c, err := dial(t, tp.client, "tcp4", "10.99.0.1:8080")
	require.NoError(t, err)
	roundTrip(t, c, []byte("warm"))
	c.Close()
	eventually(t, "active 0", func() bool { return tp.slot.Read().Active == 0 })

	// Held in FORWARD: after the PREROUTING hooks (the DNAT, the nat-path
	// program), before conntrack confirms the entry in POSTROUTING. (This
	// kernel has NFQUEUE as an xtables target only, not nft's queue.)
	out, err := tp.host.Command("iptables", "-A", "FORWARD", "-d", "10.213.0.11", "-p", "tcp", "--dport", "7000", "--syn",
		"-j", "NFQUEUE", "--queue-num", "7").CombinedOutput()
	require.NoError(t, err, string(out))
	var q *nfQueue
	require.NoError(t, tp.host.Do(func() error { q = openNFQueue(t, 7); return nil }))

	before := tp.slot.Read()
	type dialed struct {
		c   net.Conn
		err error
	}
	conn := make(chan dialed, 1)
	go func() {
		c, err := dial(t, tp.client, "tcp4", "10.99.0.1:8080")
		conn <- dialed{c, err}
	}()
	id, ok := q.next(t, 3*time.Second)
	require.True(t, ok, "the SYN never reached the queue")
	// The flow is tracked and its conntrack entry not confirmed: hold it
	// until a sweep has run, dropping the caller's retransmitted SYNs (each
	// a new entry of its own).
	s0 := sweeps(t, np)
	deadline := time.Now().Add(5 * time.Second)
	for sweeps(t, np) == s0 {
		require.True(t, time.Now().Before(deadline), "no sweep within 5 s")
		if again, ok := q.next(t, 20*time.Millisecond); ok {
			q.verdict(t, again, nfVerdictDrop)
		}
	}
	q.verdict(t, id, nfVerdictAccept)
	d := <-conn
	require.NoError(t, d.err)
	roundTrip(t, d.c, []byte("hello"))
	d.c.Close()
	eventually(t, "active 0", func() bool { return tp.slot.Read().Active == 0 })
	eventually(t, "the held call's bytes", func() bool {
		a := tp.slot.Read()
		return a.BytesIn-before.BytesIn == 5 && a.BytesOut-before.BytesOut == 5
	})
}
