package nft

import (
	"encoding/binary"
	"errors"
	"fmt"

	"github.com/brokkr/brokkr/internal/nlsafe"
	"github.com/brokkr/brokkr/netplane/nft/compile"
	"golang.org/x/net/bpf"
	"golang.org/x/sys/unix"
)

// Knowing what others changed, without reading 100,000 elements back.
//
// The kernel sends every committed change of the ruleset to the listeners
// of NFNLGRP_NFTABLES (what `nft monitor` prints): the table, the object,
// and for set elements the set. A socket in the managed namespace listens,
// with a socket filter that drops what brokkr's own sockets committed (a
// notification carries the committing socket's port id), so only other
// programs' changes are queued, and a pass drains them before it plans:
// they are delivered before the commit that made them returns, so a drain
// after another program's commit always holds its notifications. Another
// program committing to its own tables costs a pass nothing; one touching
// brokkr's tables makes the pass read what it touched. When notifications
// are lost (the socket's buffer overflowed) or the socket could not be
// made, the pass falls back to the ruleset generation and a full read.

// foreignChanges is what other programs changed in brokkr's tables.
type foreignChanges struct {
	lost  bool            // notifications were lost, or none are listened to: anything may have changed
	other bool            // a table, chain, rule, set or object of brokkr's, or a bridge-table element
	sets  map[string]bool // sets of the inet table whose elements changed
}

// monitorBuf is the notification socket's receive buffer: another program
// rewriting brokkr's 100,000-element maps between two passes overflows it,
// which only means a full read.
const monitorBuf = 8 << 20

type monitor struct {
	fd     int
	buf    []byte
	missed bool // a window without notifications had another commit in it
}

// quietMin: a batch with at least this many elements is committed with the
// socket out of the group. A listener makes the kernel build a notification
// per element (measured: a 200,000-element batch took 1.7-2.4 s of CPU with
// one, 0.6 s without), and brokkr's own would only be dropped by the
// filter. Whether another program committed meanwhile is told by the
// generation instead.
const quietMin = 1000

func (m *monitor) membership(opt int) error {
	return unix.SetsockoptInt(m.fd, unix.SOL_NETLINK, opt, unix.NFNLGRP_NFTABLES)
}

// openMonitor listens to the ruleset's changes in the namespace, less those
// committed from the sockets with port ids own.
func openMonitor(nsPath string, own ...uint32) (*monitor, error) {
	fd := -1
	err := nlsafe.Do(nsPath, func() (err error) {
		fd, err = unix.Socket(unix.AF_NETLINK, unix.SOCK_RAW|unix.SOCK_CLOEXEC|unix.SOCK_NONBLOCK, unix.NETLINK_NETFILTER)
		return err
	})
	if err != nil {
		return nil, fmt.Errorf("nft: notification socket: %w", err)
	}
	fail := func(err error) (*monitor, error) {
		unix.Close(fd)
		return nil, fmt.Errorf("nft: notification socket: %w", err)
	}
	if err := unix.SetsockoptInt(fd, unix.SOL_SOCKET, unix.SO_RCVBUFFORCE, monitorBuf); err != nil {
		return fail(err)
	}
	prog, err := dropFrom(own)
	if err != nil {
		return fail(err)
	}
	if err := unix.SetsockoptSockFprog(fd, unix.SOL_SOCKET, unix.SO_ATTACH_FILTER, prog); err != nil {
		return fail(err)
	}
	if err := unix.Bind(fd, &unix.SockaddrNetlink{Family: unix.AF_NETLINK, Groups: 1 << (unix.NFNLGRP_NFTABLES - 1)}); err != nil {
		return fail(err)
	}
	return &monitor{fd: fd, buf: make([]byte, 1<<16)}, nil
}

// quiet runs commit (one batch) with the socket out of the group; gen is
// the generation as others move it. Unless the generation moved by exactly
// the one batch, another program committed while nobody listened, and the
// next drain says notifications were lost.
func (m *monitor) quiet(gen func() (uint32, error), commit func() error) error {
	g0, err := gen()
	if err == nil {
		err = m.membership(unix.NETLINK_DROP_MEMBERSHIP)
	}
	if err != nil {
		m.missed = true
		return commit()
	}
	cerr := commit()
	if err := m.membership(unix.NETLINK_ADD_MEMBERSHIP); err != nil {
		// Deaf from now on: every drain reports loss.
		m.missed = true
		return cerr
	}
	want := g0
	if cerr == nil {
		want++
	}
	if g1, err := gen(); err != nil || g1 != want {
		m.missed = true
	}
	return cerr
}

// dropFrom is a socket filter dropping messages whose nlmsg_pid is one of
// pids. Classic BPF loads words in network order; nlmsg_pid is host order.
func dropFrom(pids []uint32) (*unix.SockFprog, error) {
	prog := []bpf.Instruction{bpf.LoadAbsolute{Off: 12, Size: 4}}
	for i, p := range pids {
		var b [4]byte
		binary.NativeEndian.PutUint32(b[:], p)
		prog = append(prog, bpf.JumpIf{Cond: bpf.JumpEqual, Val: binary.BigEndian.Uint32(b[:]), SkipTrue: uint8(len(pids) - i)})
	}
	prog = append(prog, bpf.RetConstant{Val: 0xffffffff}, bpf.RetConstant{Val: 0})
	raw, err := bpf.Assemble(prog)
	if err != nil {
		return nil, err
	}
	ins := make([]unix.SockFilter, len(raw))
	for i, r := range raw {
		ins[i] = unix.SockFilter{Code: r.Op, Jt: r.Jt, Jf: r.Jf, K: r.K}
	}
	return &unix.SockFprog{Len: uint16(len(ins)), Filter: &ins[0]}, nil
}

func (m *monitor) close() error { return unix.Close(m.fd) }

// drain reads every queued notification and sorts what touches brokkr's
// tables.
func (m *monitor) drain() (foreignChanges, error) {
	f := foreignChanges{sets: map[string]bool{}, lost: m.missed}
	m.missed = false
	for {
		n, _, err := unix.Recvfrom(m.fd, m.buf, unix.MSG_DONTWAIT)
		switch {
		case errors.Is(err, unix.EAGAIN):
			return f, nil
		case errors.Is(err, unix.ENOBUFS):
			f.lost = true // and go on: what is queued after is still news
			continue
		case errors.Is(err, unix.EINTR):
			continue
		case err != nil:
			return foreignChanges{lost: true}, err
		}
		eachNlmsg(m.buf[:n], func(typ uint16, data []byte) { f.note(typ, data) })
	}
}

// eachNlmsg calls fn for every netlink message in b.
func eachNlmsg(b []byte, fn func(typ uint16, data []byte)) {
	for len(b) >= unix.NLMSG_HDRLEN {
		l := int(binary.NativeEndian.Uint32(b))
		if l < unix.NLMSG_HDRLEN || l > len(b) {
			return
		}
		fn(binary.NativeEndian.Uint16(b[4:]), b[unix.NLMSG_HDRLEN:l])
		b = b[min((l+3)&^3, len(b)):]
	}
}

// note sorts one notification. Attribute 1 is the table's name in every
// object's message (NFTA_TABLE_NAME, NFTA_CHAIN_TABLE, NFTA_RULE_TABLE,
// NFTA_SET_TABLE, NFTA_SET_ELEM_LIST_TABLE, NFTA_OBJ_TABLE, ...).
func (f *foreignChanges) note(typ uint16, data []byte) {
	if typ>>8 != unix.NFNL_SUBSYS_NFTABLES || len(data) < 4 {
		return
	}
	msg := int(typ & 0xff)
	if msg == unix.NFT_MSG_NEWGEN {
		return
	}
	fam := data[0]
	if fam != byte(famInet) && fam != byte(famBridge) {
		return
	}
	if cstr(find(data[4:], 1)) != compile.TableName {
		return
	}
	if (msg == unix.NFT_MSG_NEWSETELEM || msg == unix.NFT_MSG_DELSETELEM) && fam == byte(famInet) {
		f.sets[cstr(find(data[4:], unix.NFTA_SET_ELEM_LIST_SET))] = true
		return
	}
	f.other = true
}
