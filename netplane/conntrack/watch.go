package conntrack

import (
	"errors"
	"fmt"
	"sync"
	"time"

	"github.com/mdlayher/netlink"
	ct "github.com/ti-mo/conntrack"
	"golang.org/x/net/bpf"
	"golang.org/x/sys/unix"
)

// Watcher delivers the update and destroy events of the conntrack entries
// of a namespace whose mark & mask == mark. The kernel filters (a socket
// filter on the event socket), so the flows of the rest of the host never
// reach the process: they cost it nothing and cannot overrun its socket.
// When the kernel drops events anyway (an overrun), the watcher reports it
// on Lost and listens again, so the consumer knows to re-read the table.
type Watcher struct {
	nsPath     string
	mark, mask uint32
	out        chan Entry
	lost       chan error
	done       chan struct{}
	wg         sync.WaitGroup

	mu     sync.Mutex
	cur    *netlink.Conn // the socket being read, closed by Close
	closed bool
}

// Watch subscribes to the events of the entries whose mark & mask == mark
// in the namespace at nsPath ("" = the caller's). It fails only if the first
// subscription fails.
func Watch(nsPath string, mark, mask uint32) (*Watcher, error) {
	w := &Watcher{nsPath: nsPath, mark: mark & mask, mask: mask,
		out: make(chan Entry, 4096), lost: make(chan error, 1), done: make(chan struct{})}
	c, err := w.listen()
	if err != nil {
		return nil, err
	}
	w.wg.Add(1)
	go w.run(c)
	return w, nil
}

// Multicast groups of ctnetlink (enum nfnetlink_groups).
const (
	groupCTUpdate  = 2
	groupCTDestroy = 3
)

func (w *Watcher) listen() (*netlink.Conn, error) {
	var c *netlink.Conn
	err := inNamespace(w.nsPath, func(cfg *netlink.Config) (err error) {
		c, err = netlink.Dial(unix.NETLINK_NETFILTER, cfg)
		return err
	})
	if err != nil {
		return nil, err
	}
	// A burst of thousands of closes must not overrun the socket.
	_ = c.SetReadBuffer(8 << 20)
	prog, err := markFilter(w.mark, w.mask)
	if err == nil {
		err = c.SetBPF(prog)
	}
	for _, g := range []uint32{groupCTUpdate, groupCTDestroy} {
		if err == nil {
			err = c.JoinGroup(g)
		}
	}
	if err != nil {
		c.Close()
		return nil, fmt.Errorf("conntrack: listen: %w", err)
	}
	return c, nil
}

// markFilter is a classic BPF socket filter that passes a ctnetlink message
// only if it has a CTA_MARK attribute whose value & mask == mark. The
// kernel's netlink attribute lookup (SKF_AD_NLATTR) finds the attribute
// among the top-level ones, after the netlink and nfgenmsg headers; loads
// from the packet are big-endian, as CTA_MARK is.
func markFilter(mark, mask uint32) ([]bpf.RawInstruction, error) {
	const (
		attrsStart = unix.NLMSG_HDRLEN + 4 // nlmsghdr + nfgenmsg
		ctaMark    = 8
		nlaHdrLen  = 4
	)
	return bpf.Assemble([]bpf.Instruction{
		bpf.LoadConstant{Dst: bpf.RegA, Val: attrsStart},
		bpf.LoadConstant{Dst: bpf.RegX, Val: ctaMark},
		bpf.LoadExtension{Num: bpf.ExtNetlinkAttr},           // A = offset of CTA_MARK, 0 if none
		bpf.JumpIf{Cond: bpf.JumpEqual, Val: 0, SkipTrue: 4}, // no mark: drop
		bpf.TAX{},
		bpf.LoadIndirect{Off: nlaHdrLen, Size: 4}, // A = the mark
		bpf.ALUOpConstant{Op: bpf.ALUOpAnd, Val: mask},
		bpf.JumpIf{Cond: bpf.JumpEqual, Val: mark, SkipFalse: 1},
		bpf.RetConstant{Val: 0xffffffff}, // pass the whole message
		bpf.RetConstant{Val: 0},          // drop
	})
}

func (w *Watcher) run(c *netlink.Conn) {
	defer w.wg.Done()
	for {
		if !w.setCurrent(c) {
			c.Close()
			return
		}
		err := w.read(c)
		c.Close()
		select {
		case <-w.done:
			return
		default:
		}
		w.report(err)
		for {
			if c, err = w.listen(); err == nil {
				break
			}
			w.report(err)
			select {
			case <-w.done:
				return
			case <-time.After(time.Second):
			}
		}
	}
}

// setCurrent makes c the socket Close interrupts; false if Close came first.
func (w *Watcher) setCurrent(c *netlink.Conn) bool {
	w.mu.Lock()
	defer w.mu.Unlock()
	if w.closed {
		return false
	}
	w.cur = c
	return true
}

func (w *Watcher) report(err error) {
	select {
	case w.lost <- err:
	default:
	}
}

// read delivers events from c until it fails (an overrun, or Close).
func (w *Watcher) read(c *netlink.Conn) error {
	for {
		msgs, err := c.Receive()
		if err != nil {
			return err
		}
		for _, m := range msgs {
			var ev ct.Event
			if ev.Unmarshal(m) != nil || ev.Flow == nil || (ev.Type != ct.EventDestroy && ev.Type != ct.EventUpdate) {
				continue
			}
			if ev.Flow.Mark&w.mask != w.mark { // the kernel filters; a check costs nothing
				continue
			}
			en := entry(ev.Flow)
			en.Destroyed = ev.Type == ct.EventDestroy
			select {
			case w.out <- en:
			case <-w.done:
				return errors.New("closed")
			}
		}
	}
}

// C delivers the events.
func (w *Watcher) C() <-chan Entry { return w.out }

// Lost says events were lost (or listening failed); the consumer re-reads.
func (w *Watcher) Lost() <-chan error { return w.lost }

// Close stops the watcher and waits for its goroutine.
func (w *Watcher) Close() error {
	w.mu.Lock()
	w.closed = true
	close(w.done)
	if w.cur != nil {
		w.cur.Close() // interrupts a blocked Receive
	}
	w.mu.Unlock()
	w.wg.Wait()
	return nil
}
