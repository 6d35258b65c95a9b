package proxy

import (
	"errors"
	"log/slog"
	"net"
	"net/netip"
	"os"
	"strconv"
	"sync"
	"sync/atomic"
	"time"
	"unsafe"

	"golang.org/x/sys/unix"

	"github.com/brokkr/brokkr/internal/spec"
)

// udpRelay serves one UDP exposure: a socket on the host port and one flow
// per client (address, port and the local address it sent to), each with its
// own connected socket to the guest so the guest's replies come back to the
// right client without a lookup.
type udpRelay struct {
	m         *Manager
	ex        *exposure
	conn      *net.UDPConn
	target    spec.Target
	guestPort string
	slotPort  uint16        // the slot's label on a hand-over: the exposure's host port (a range's first); 0: the port bound
	pktinfo   bool          // wildcard bind: learn each datagram's local address
	stop      chan struct{} // the exposure's: closed when its socket is closed on purpose
	frozen    atomic.Bool   // stopped for a hand-over (handover.go)

	mu     sync.Mutex
	flows  map[flowKey]*udpFlow
	closed bool
	wg     sync.WaitGroup // flow readers
}

type flowKey struct {
	client netip.AddrPort
	local  netip.Addr // zero unless the socket is bound to a wildcard
}

type udpFlow struct {
	key      flowKey
	guest    *net.UDPConn
	oob      []byte       // IP_PKTINFO / IPV6_PKTINFO naming the reply's source
	lastSeen atomic.Int64 // unix ns of the last datagram either way
	once     sync.Once
}

func newUDPRelay(m *Manager, ex *exposure, conn *net.UDPConn, c checked, stop chan struct{}) *udpRelay {
	return &udpRelay{m: m, ex: ex, conn: conn, target: c.Target, guestPort: strconv.Itoa(int(c.guestPort())),
		slotPort: c.HostPort, pktinfo: c.host.IsUnspecified(), stop: stop, flows: map[flowKey]*udpFlow{}}
}

// freeze stops the read loop and every flow's reader at their next wait,
// the way a TCP pair is frozen: a read deadline in the past, with the
// sockets left open (m.mu held). A flow opened meanwhile sees frozen once
// it has set its own deadline. Datagrams arriving from now on wait in the
// socket buffers for the next process.
func (r *udpRelay) freeze() {
	r.frozen.Store(true)
	past := time.Unix(1, 0)
	r.mu.Lock()
	for _, f := range r.flows {
		_ = f.guest.SetReadDeadline(past)
	}
	r.mu.Unlock()
	_ = r.conn.SetReadDeadline(past)
}

// adopt carries on flows handed over with the socket: their places are
// already taken in the slot and they were counted accepted where they
// began. A flow whose socket cannot be taken over gives its place back.
func (r *udpRelay) adopt(flows []FrozenPair) {
	for _, fp := range flows {
		guest, err := fileConn[*net.UDPConn](fp.Guest)
		if err != nil {
			r.ex.ctr.slot.Closed()
			continue
		}
		key := flowKey{client: fp.Flow.Client, local: fp.Flow.Local}
		f := &udpFlow{key: key, guest: guest}
		if key.local.IsValid() {
			f.oob = pktinfoCmsg(key.local)
		}
		f.lastSeen.Store(fp.Flow.LastSeen)
		r.mu.Lock()
		r.flows[key] = f
		r.wg.Add(1)
		r.mu.Unlock()
		r.ex.conns.Add(1)
		r.ex.ctr.acquire()
		go r.replies(f)
	}
}

// close ends the socket and every flow (their replies leave through it, so
// they cannot outlive it). Called with m.mu held.
func (r *udpRelay) close() {
	r.mu.Lock()
	r.closed = true
	flows := make([]*udpFlow, 0, len(r.flows))
	for _, f := range r.flows {
		flows = append(flows, f)
	}
	r.mu.Unlock()
	r.conn.Close()
	for _, f := range flows {
		f.guest.Close() // its reader removes it
	}
}

// serve reads datagrams from clients and forwards each through its flow.
func (r *udpRelay) serve() {
	defer r.wg.Wait()
	if !r.m.held(r.stop) {
		return
	}
	buf := make([]byte, 65535)
	oob := make([]byte, 256)
	for {
		n, oobn, _, from, err := r.conn.ReadMsgUDPAddrPort(buf, oob)
		if err != nil {
			if r.frozen.Load() {
				return // the socket goes to the next process as it is
			}
			r.m.mu.Lock()
			dead := r.ex.udp == r // not closed on purpose
			if dead {
				r.ex.closeSocket()
				r.ex.reason = "read: " + err.Error()
				r.ex.lost = r.ex.reason
			}
			r.m.mu.Unlock()
			if dead {
				r.m.logs.event(slog.LevelError, r.ex.id, evDeadLoop,
					"proxy: UDP read loop ended; the socket is rebound on the next converge", "err", err)
			}
			return
		}
		key := flowKey{client: netip.AddrPortFrom(from.Addr().Unmap(), from.Port())}
		if r.pktinfo {
			key.local = localAddr(oob[:oobn])
		}
		f := r.flow(key)
		if f == nil {
			continue
		}
		f.lastSeen.Store(time.Now().UnixNano())
		if w, err := f.guest.Write(buf[:n]); err == nil {
			r.ex.ctr.slot.AddBytes(uint64(w), 0)
		}
	}
}

// flow finds or opens the client's flow. A new flow past the cap is refused;
// one that cannot reach the guest (no address yet, no socket) is dropped. The
// datagram that asked for it is discarded either way.
func (r *udpRelay) flow(key flowKey) *udpFlow {
	r.mu.Lock()
	f := r.flows[key]
	r.mu.Unlock()
	if f != nil {
		return f
	}
	ex, slot := r.ex, r.ex.ctr.slot
	if a := ex.allow.Load(); a != nil && !hostLocal(key.client.Addr(), r.localAddr(key)) && !a.allows(key.client.Addr()) {
		slot.AddDenied(1) // each datagram of a source not allowed, as on the nat path
		r.m.logs.event(slog.LevelInfo, ex.id, evDenied, "proxy: UDP datagram from outside allowFrom dropped", "from", key.client.Addr())
		return nil
	}
	if !slot.Reserve() { // the exposure's one cap, shared by every path
		slot.AddRefused(1)
		r.m.logs.event(slog.LevelWarn, ex.id, evRefused, "proxy: UDP flow refused at the connection cap", "maxConns", ex.maxConns.Load())
		return nil
	}
	ex.conns.Add(1)
	r.m.wakeFor(r.target)
	addr := r.m.guestAddr(r.target, key.client.Addr().Is6() && !key.client.Addr().Is4In6())
	var guest *net.UDPConn
	if addr != "" {
		ga, err := net.ResolveUDPAddr("udp", net.JoinHostPort(addr, r.guestPort))
		if err == nil {
			guest, err = net.DialUDP("udp", nil, ga)
		}
		if outOfDescriptors(err) {
			r.m.logs.event(slog.LevelWarn, ex.id, evShortage, "proxy: out of descriptors; UDP flow dropped", "err", err)
		}
	}
	if guest == nil {
		ex.conns.Add(-1)
		slot.Closed()
		slot.AddDropped(1)
		return nil
	}
	f = &udpFlow{key: key, guest: guest}
	if key.local.IsValid() {
		f.oob = pktinfoCmsg(key.local)
	}
	r.mu.Lock()
	if r.closed {
		r.mu.Unlock()
		guest.Close()
		ex.conns.Add(-1)
		slot.Closed()
		return nil
	}
	r.flows[key] = f
	r.wg.Add(1)
	r.mu.Unlock()
	ex.ctr.acquire()
	slot.AddAccepted(1)
	f.lastSeen.Store(time.Now().UnixNano())
	go r.replies(f)
	return f
}

// replies carries the guest's datagrams back to the client until the flow
// has been idle (no datagram either way) for the exposure's idle timeout.
//
// A freeze parks the flow instead: socket open, place kept, for the next
// process.
func (r *udpRelay) replies(f *udpFlow) {
	defer r.wg.Done()
	defer func() {
		if r.frozen.Load() {
			r.park(f)
		} else {
			r.end(f)
		}
	}()
	if !r.m.held(r.stop) {
		return
	}
	buf := make([]byte, 65535)
	for {
		idle := time.Duration(r.ex.idle.Load())
		last := time.Unix(0, f.lastSeen.Load())
		if time.Since(last) >= idle {
			return
		}
		_ = f.guest.SetReadDeadline(last.Add(idle))
		if r.frozen.Load() { // after the deadline: freeze's own may be overwritten
			return
		}
		n, err := f.guest.Read(buf)
		if err != nil {
			if r.frozen.Load() {
				return
			}
			// A deadline is re-checked against the latest datagram; an ICMP
			// unreachable from the guest is not the end of the flow.
			if errors.Is(err, os.ErrDeadlineExceeded) || errors.Is(err, unix.ECONNREFUSED) {
				continue
			}
			return
		}
		f.lastSeen.Store(time.Now().UnixNano())
		if w, _, err := r.conn.WriteMsgUDPAddrPort(buf[:n], f.oob, f.key.client); err == nil {
			r.ex.ctr.slot.AddBytes(0, uint64(w))
		}
	}
}

// park lets go of a frozen flow in this process: its socket and its place
// under the cap go on to the next one.
func (r *udpRelay) park(f *udpFlow) {
	r.ex.conns.Add(-1)
	r.ex.ctr.release()
}

func (r *udpRelay) end(f *udpFlow) {
	f.once.Do(func() {
		r.mu.Lock()
		if r.flows[f.key] == f {
			delete(r.flows, f.key)
		}
		r.mu.Unlock()
		f.guest.Close()
		r.ex.ctr.slot.Closed()
		r.ex.conns.Add(-1)
		r.ex.ctr.release()
	})
}

// localAddr reads the datagram's destination address from IP_PKTINFO or
// IPV6_PKTINFO.
func localAddr(oob []byte) netip.Addr {
	msgs, err := unix.ParseSocketControlMessage(oob)
	if err != nil {
		return netip.Addr{}
	}
	for _, msg := range msgs {
		switch {
		case msg.Header.Level == unix.IPPROTO_IP && msg.Header.Type == unix.IP_PKTINFO && len(msg.Data) >= unix.SizeofInet4Pktinfo:
			pi := (*unix.Inet4Pktinfo)(unsafe.Pointer(&msg.Data[0]))
			return netip.AddrFrom4(pi.Addr)
		case msg.Header.Level == unix.IPPROTO_IPV6 && msg.Header.Type == unix.IPV6_PKTINFO && len(msg.Data) >= unix.SizeofInet6Pktinfo:
			pi := (*unix.Inet6Pktinfo)(unsafe.Pointer(&msg.Data[0]))
			return netip.AddrFrom16(pi.Addr)
		}
	}
	return netip.Addr{}
}

// pktinfoCmsg builds the control message that makes a reply leave from local,
// the address the client sent to, rather than whatever the route picks: a
// client talking to the host's second address expects the answer from there.
func pktinfoCmsg(local netip.Addr) []byte {
	if local.Is4() {
		b := make([]byte, unix.CmsgSpace(unix.SizeofInet4Pktinfo))
		h := (*unix.Cmsghdr)(unsafe.Pointer(&b[0]))
		h.Level, h.Type = unix.IPPROTO_IP, unix.IP_PKTINFO
		h.SetLen(unix.CmsgLen(unix.SizeofInet4Pktinfo))
		pi := (*unix.Inet4Pktinfo)(unsafe.Pointer(&b[unix.CmsgLen(0)]))
		pi.Spec_dst = local.As4()
		return b
	}
	b := make([]byte, unix.CmsgSpace(unix.SizeofInet6Pktinfo))
	h := (*unix.Cmsghdr)(unsafe.Pointer(&b[0]))
	h.Level, h.Type = unix.IPPROTO_IPV6, unix.IPV6_PKTINFO
	h.SetLen(unix.CmsgLen(unix.SizeofInet6Pktinfo))
	pi := (*unix.Inet6Pktinfo)(unsafe.Pointer(&b[unix.CmsgLen(0)]))
	pi.Addr = local.As16()
	return b
}

// localAddr is the address a flow's datagrams were sent to: the one the
// wildcard socket's pktinfo gave, else the socket's own (asked only for a
// restricted exposure's new flow).
func (r *udpRelay) localAddr(key flowKey) netip.Addr {
	if key.local.IsValid() {
		return key.local
	}
	return addrOf(r.conn.LocalAddr())
}
