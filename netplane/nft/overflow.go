package nft

import (
	"context"
	"encoding/binary"
	"errors"
	"fmt"
	"io"
	"net"
	"net/netip"
	"sync"
	"sync/atomic"
	"time"

	"github.com/brokkr/brokkr/bpf/ctmark"
	"github.com/brokkr/brokkr/netplane/nft/compile"

	"github.com/brokkr/brokkr/internal/nlsafe"
	"github.com/google/nftables"
	"golang.org/x/sys/unix"
)

// The cap's slow path (TCP). The kernel admits a connection while its
// exposure's set has a free slot; it cannot tell a slot held by a connection
// that closed a moment ago (the watcher has not deleted it yet) from one that
// is really in use. So when the set is full the kernel does not refuse: the
// exposure chain marks the connection and redirects it (`redirect to :meta
// l4proto map @overflow`) to one listener of this package in the managed
// namespace. Its handler decides exactly:
//   - the exposure comes from SO_ORIGINAL_DST (the host side the caller
//     dialed);
//   - a control-plane add of the caller's original tuple to the set: the
//     kernel's size check is the same atomic one as the datapath's, so the
//     upper bound stays exact whoever adds;
//   - if the set is full, every member is looked up in conntrack and those
//     that have closed are deleted (a netlink delete frees the slot at once),
//     then the add is tried again;
//   - if the set is still full, the caller waits up to the overflow wait for
//     a slot (a connection whose close is in flight), woken by each release,
//     and is then reset (SO_LINGER 0) and counted as refused.
//
// An admitted caller is counted as accepted, its guest is dialed from the
// managed namespace, and both connections go to the Carrier. The caller's
// connection carries the exposure's ct mark (set by the redirect rule), so
// the close chain and the watcher free its slot exactly as for a DNATed
// connection, and Counters reports its bytes and activity from conntrack.
// Connections that find a free slot never leave the kernel fast path.
//
// UDP keeps the kernel-only cap: a datagram cannot wait for a decision, and
// its flows end by timeout, not by a close that could race a new flow.
//
// What callers and operators see:
//   - a caller refused by the slow path completes its TCP handshake (with
//     the listener) and is then reset, like a caller the proxy refuses; a
//     caller refused in the kernel gets the reset instead of a SYN-ACK;
//   - the listener holds one TCP port (ephemeral, kept across restarts when
//     still free) on every address of the managed namespace; a direct
//     connection to it is reset and counted nowhere;
//   - while no Table is open (the daemon is down) the overflow map still
//     points at the port: a caller finding the cap full is reset by the
//     kernel (no listener) and not counted; every other caller is admitted
//     by the kernel as usual.

// Carrier carries one connection admitted by the slow path: client is the
// caller (accepted in the managed namespace), guest is already connected to
// the exposure's guest. It owns both and closes them when done; it may block
// for the life of the connection or hand them off and return.
type Carrier func(exposure string, client, guest *net.TCPConn)

// WithOverflow sets the Carrier of the cap's slow path (default: a splice in
// both directions with half-close, run by the SetCap).
func WithOverflow(c Carrier) SetCapOption { return func(o *setCapOptions) { o.carrier = c } }

// DefaultOverflowWait covers a connection whose last FIN is in flight when
// the next caller arrives (its peer closes a moment after the caller did),
// and the watcher's lag on a loaded host: 25 ms refused 1 of 1,000
// sequential callers at a cap of 2 in the kernel matrix's 6.1 VM (TCG,
// slow-path decisions 59 ms on average, 245 ms at most). Only a caller
// that is refused in the end waits it all.
const DefaultOverflowWait = 100 * time.Millisecond

const guestDialTimeout = 2 * time.Second

// recheckEvery: while a caller waits, the members are checked again this
// often in case no release event comes.
const recheckEvery = 5 * time.Millisecond

// overflow is the set-based cap's slow path: a listener that takes the
// callers a full kernel set turned away and admits them once a place frees.
// Its 16 fields are one listener's state: the three counters of its own
// latency sit beside the lock-held maps rather than in a type of their own
// because they are written on the same path and read only by tests.
type overflow struct {
	c     *SetCap
	ln    *net.TCPListener
	port  uint16
	carry Carrier
	wait  time.Duration

	ctx    context.Context // ended by stop: aborts dials and waits
	cancel context.CancelFunc
	wg     sync.WaitGroup

	mu      sync.Mutex
	held    map[*net.TCPConn]struct{} // connections a blocking Carrier still holds
	counts  map[string]*ovCount
	freed   chan struct{}        // closed (and replaced) whenever slots are freed
	sweptAt map[string]time.Time // start of the last full check, per exposure

	// Latency of admitted callers (accepted to guest dialed), for tests and
	// the record in BENCHMARKS.md.
	decisions atomic.Int64
	decideNs  atomic.Int64
	maxNs     atomic.Int64
}

type ovCount struct{ accepted, refused uint64 }

// startOverflow listens in the table's namespace, on prevPort when it is
// still free (the overflow map keeps pointing there across a restart), else
// on an ephemeral port.
func startOverflow(c *SetCap, prevPort uint16, carry Carrier, wait time.Duration) (*overflow, error) {
	var ln *net.TCPListener
	if prevPort != 0 {
		ln, _ = c.listenTCP(prevPort) // taken meanwhile: any port will do
	}
	if ln == nil {
		var err error
		if ln, err = c.listenTCP(0); err != nil {
			return nil, fmt.Errorf("nft: cap slow-path listener: %w", err)
		}
	}
	if carry == nil {
		carry = spliceBoth
	}
	ctx, cancel := context.WithCancel(context.Background())
	o := &overflow{c: c, ln: ln, port: uint16(ln.Addr().(*net.TCPAddr).Port), carry: carry, wait: wait,
		ctx: ctx, cancel: cancel, held: map[*net.TCPConn]struct{}{}, counts: map[string]*ovCount{},
		freed: make(chan struct{}), sweptAt: map[string]time.Time{}}
	o.wg.Add(1)
	go o.serve()
	return o, nil
}

// stop closes the listener and the connections a blocking Carrier holds,
// and waits for every handler.
func (o *overflow) stop() {
	o.cancel()
	_ = o.ln.Close()
	o.mu.Lock()
	for c := range o.held {
		c.Close()
	}
	o.mu.Unlock()
	o.wg.Wait()
}

func (o *overflow) serve() {
	defer o.wg.Done()
	for {
		c, err := o.ln.AcceptTCP()
		if err != nil {
			if errors.Is(err, net.ErrClosed) || o.ctx.Err() != nil {
				return
			}
			// Out of descriptors or similar: the backlog keeps callers
			// waiting meanwhile.
			o.c.t.log.Warn("nft: cap slow path: accept", "err", err)
			select {
			case <-time.After(5 * time.Millisecond):
			case <-o.ctx.Done():
				return
			}
			continue
		}
		o.wg.Add(1)
		go o.handle(c)
	}
}

func (o *overflow) handle(c *net.TCPConn) {
	defer o.wg.Done()
	t0 := time.Now()
	src, dst, err := origTuple(c)
	var e Exposure
	// A redirected connection's original destination is the exposure's
	// host side, not this socket's own address.
	local, _ := c.LocalAddr().(*net.TCPAddr)
	ok := err == nil && local != nil && local.AddrPort() != dst
	if ok {
		e, ok = o.c.exposureAt(dst)
	}
	if !ok || e.MaxConns <= 0 {
		// Not redirected by a capped exposure (a direct connection to the
		// listener's port): nothing to carry.
		reset(c)
		return
	}
	key := compile.ConnKey(src, dst)
	if !o.admit(e, key, src, dst, t0) {
		o.c.notMember(e.Name, key)
		o.count(e.Name, false)
		reset(c)
		return
	}
	o.count(e.Name, true)
	guest, err := o.c.dialGuest(o.ctx, netip.AddrPortFrom(e.GuestAddr, e.GuestPortOf(dst.Port())))
	o.record(t0)
	if err != nil {
		// Admitted but the guest cannot be reached: the caller learns at
		// once, and its slot goes back now rather than at the RST's event.
		reset(c)
		o.c.dropMember(e.Name, key)
		return
	}
	if !o.hold(c, guest) {
		reset(c)
		guest.Close()
		return
	}
	o.carry(e.Name, c, guest)
	o.unhold(c, guest)
}

// admit gives the caller a slot if one is free or frees up within the wait.
func (o *overflow) admit(e Exposure, key []byte, src, dst netip.AddrPort, arrived time.Time) bool {
	deadline := arrived.Add(o.wait)
	since := arrived
	for {
		freed := o.freedChan() // before looking: a release after it wakes us
		added, err := o.tryAdd(e, key, since)
		if err != nil {
			o.c.t.log.Warn("nft: cap slow path: adding to the cap set", "exposure", e.Name, "err", err)
			return false
		}
		if added {
			// A caller that already closed (its close event came before its
			// member existed) must not keep the slot.
			if en, ok, err := o.c.k.ct.Get(unix.IPPROTO_TCP, src, dst); err == nil && (!ok || !en.Open() || en.Mark&ctmark.Closed == ctmark.Closed) {
				o.c.dropMember(e.Name, key)
			}
			return true
		}
		if since.After(deadline) {
			return false // the last look, after the wait, found no slot either
		}
		tm := time.NewTimer(min(time.Until(deadline), recheckEvery))
		select {
		case <-freed:
			tm.Stop()
		case <-tm.C:
			// Look again with a fresh check of the members: a close whose
			// event the watcher did not get (a connection older than the
			// watcher has none) is found there.
			since = time.Now()
		case <-o.ctx.Done():
			tm.Stop()
			return false
		}
	}
}

// tryAdd adds key to e's set if it has room. A full set's members are first
// checked against conntrack and the closed ones deleted, unless a check that
// started after since already did that (it saw every close before since):
// under a flood, one check serves every caller queued behind it.
//
// The set is read before adding because a refused add aborts the whole
// netlink transaction, which costs ~10 ms in the kernel (measured); the add
// itself is still the exact, atomic size check (a datapath add may take the
// last slot between the read and the add: then it fails with ENFILE).
func (o *overflow) tryAdd(e Exposure, key []byte, since time.Time) (bool, error) {
	c := o.c
	c.k.membersMu.Lock()
	defer c.k.membersMu.Unlock()
	if _, ok := c.byMark(e.MarkID); !ok {
		return false, errors.New("exposure not applied")
	}
	o.mu.Lock()
	checked := o.sweptAt[e.Name].After(since)
	o.mu.Unlock()
	set := &nftables.Set{Table: table(famInet), Name: compile.ConnsSet(e.Name), KeyType: compile.ConnKeyType, Concatenation: true}
	var members int
	if checked {
		els, err := c.sets.members(e)
		if err != nil {
			return false, err
		}
		members = len(els)
	} else {
		start := time.Now()
		stale, n, err := c.sets.staleLocked(e)
		if err != nil {
			return false, err
		}
		o.mu.Lock()
		o.sweptAt[e.Name] = start
		o.mu.Unlock()
		if len(stale) > 0 {
			c.sets.dropLocked(e.Name, stale)
			defer o.signalFreed() // others waiting on this exposure
		}
		members = n - len(stale)
	}
	if members >= e.MaxConns {
		return false, nil
	}
	err := c.k.sideCommit(func() error {
		if err := c.k.conn.SetAddElements(set, []nftables.SetElement{{Key: key}}); err != nil {
			return err
		}
		return c.k.conn.Flush()
	})
	switch {
	case err == nil:
		delete(c.sets.dropped, e.Name+"\x00"+string(key))
		return true, nil
	case errors.Is(err, unix.ENFILE):
		return false, nil
	}
	return false, err
}

func (o *overflow) freedChan() chan struct{} {
	o.mu.Lock()
	defer o.mu.Unlock()
	return o.freed
}

// signalFreed wakes every caller waiting for a slot.
func (o *overflow) signalFreed() {
	o.mu.Lock()
	close(o.freed)
	o.freed = make(chan struct{})
	o.mu.Unlock()
}

func (o *overflow) count(name string, accepted bool) {
	o.mu.Lock()
	defer o.mu.Unlock()
	c := o.counts[name]
	if c == nil {
		c = &ovCount{}
		o.counts[name] = c
	}
	if accepted {
		c.accepted++
	} else {
		c.refused++
	}
}

func (o *overflow) countsOf(name string) ovCount {
	o.mu.Lock()
	defer o.mu.Unlock()
	if c := o.counts[name]; c != nil {
		return *c
	}
	return ovCount{}
}

// forget drops the counts of an exposure that is gone (a new exposure of
// the same name starts from zero, like its kernel counters).
func (o *overflow) forget(name string) {
	o.mu.Lock()
	defer o.mu.Unlock()
	delete(o.counts, name)
	delete(o.sweptAt, name)
}

func (o *overflow) record(t0 time.Time) {
	d := int64(time.Since(t0))
	o.decisions.Add(1)
	o.decideNs.Add(d)
	for {
		m := o.maxNs.Load()
		if d <= m || o.maxNs.CompareAndSwap(m, d) {
			return
		}
	}
}

func (o *overflow) hold(cs ...*net.TCPConn) bool {
	o.mu.Lock()
	defer o.mu.Unlock()
	if o.ctx.Err() != nil {
		return false
	}
	for _, c := range cs {
		o.held[c] = struct{}{}
	}
	return true
}

func (o *overflow) unhold(cs ...*net.TCPConn) {
	o.mu.Lock()
	defer o.mu.Unlock()
	for _, c := range cs {
		delete(o.held, c)
	}
}

// origTuple is the caller's address and the host side it dialed, before
// the redirect.
func origTuple(c *net.TCPConn) (src, dst netip.AddrPort, err error) {
	ra, ok := c.RemoteAddr().(*net.TCPAddr)
	if !ok {
		return src, dst, errors.New("no remote address")
	}
	src = ra.AddrPort()
	src = netip.AddrPortFrom(src.Addr().Unmap(), src.Port())
	rc, err := c.SyscallConn()
	if err != nil {
		return src, dst, err
	}
	var m *unix.IPv6Mreq
	var serr error
	if err := rc.Control(func(fd uintptr) {
		// SO_ORIGINAL_DST returns a sockaddr_in; IPv6Mreq is a 20-byte
		// buffer that holds it.
		m, serr = unix.GetsockoptIPv6Mreq(int(fd), unix.IPPROTO_IP, unix.SO_ORIGINAL_DST)
	}); err != nil {
		return src, dst, err
	}
	if serr != nil {
		return src, dst, fmt.Errorf("SO_ORIGINAL_DST: %w", serr)
	}
	dst = netip.AddrPortFrom(netip.AddrFrom4([4]byte(m.Multiaddr[4:8])), binary.BigEndian.Uint16(m.Multiaddr[2:4]))
	return src, dst, nil
}

// exposureAt finds the TCP exposure published at dst: one bound to that
// address first, then one bound to every address.
func (c *SetCap) exposureAt(dst netip.AddrPort) (Exposure, bool) {
	c.idxMu.RLock()
	defer c.idxMu.RUnlock()
	// The address dialled, then the wildcards it falls under: 0.0.0.0
	// (hostAddress "0.0.0.0") and every address of both families ("").
	addrs := []netip.Addr{dst.Addr(), netip.IPv4Unspecified(), {}}
	for _, a := range addrs {
		if e, ok := c.byHost[compile.HostSide{Proto: unix.IPPROTO_TCP, Addr: a, Port: dst.Port()}]; ok {
			return e, true
		}
	}
	// A port of a range: the ranges are few (each is up to 4096 ports).
	for _, a := range addrs {
		for hs, e := range c.ranges {
			if hs.Proto == unix.IPPROTO_TCP && hs.Addr == a && e.HasPort(dst.Port()) {
				return e, true
			}
		}
	}
	return Exposure{}, false
}

// dropMember deletes one member of an exposure's cap set from the slow path.
func (c *SetCap) dropMember(name string, key []byte) {
	c.k.membersMu.Lock()
	c.sets.dropLocked(name, [][]byte{key})
	c.k.membersMu.Unlock()
	if o := c.ov.Load(); o != nil {
		o.signalFreed()
	}
}

// notMember records a refused caller: its connection carries the
// exposure's mark, so its close event reaches the watcher, which must not try
// to delete a member that never was.
func (c *SetCap) notMember(name string, key []byte) {
	c.k.membersMu.Lock()
	c.sets.noteDroppedLocked(name, [][]byte{key})
	c.k.membersMu.Unlock()
}

// overflowPort is the port the overflow map points at (0: no slow path).
func (c *SetCap) overflowPort() uint16 {
	if o := c.ov.Load(); o != nil {
		return o.port
	}
	return 0
}

// readOverflowPort reads the port the overflow map of an existing table
// points at (a previous process's listener), 0 if none.
func (c *SetCap) readOverflowPort() uint16 {
	var els []nftables.SetElement
	err := c.k.nl(func() (err error) {
		els, err = c.k.conn.GetSetElements(&nftables.Set{Table: table(famInet), Name: compile.MapOverflow, IsMap: true,
			KeyType: nftables.TypeInetProto, DataType: nftables.TypeInetService})
		return err
	})
	if err != nil {
		return 0
	}
	for _, el := range els {
		if len(el.Key) >= 1 && el.Key[0] == unix.IPPROTO_TCP && len(el.Val) >= 2 {
			return binary.BigEndian.Uint16(el.Val[:2])
		}
	}
	return 0
}

func (c *SetCap) listenTCP(port uint16) (*net.TCPListener, error) {
	var ln net.Listener
	err := c.inNS(func() (err error) {
		ln, err = net.Listen("tcp4", fmt.Sprintf("0.0.0.0:%d", port))
		return err
	})
	if err != nil {
		return nil, err
	}
	return ln.(*net.TCPListener), nil
}

// dialGuest connects to a guest from the managed namespace.
func (c *SetCap) dialGuest(ctx context.Context, a netip.AddrPort) (*net.TCPConn, error) {
	var conn net.Conn
	d := net.Dialer{Timeout: guestDialTimeout}
	err := c.inNS(func() (err error) {
		conn, err = d.DialContext(ctx, "tcp4", a.String())
		return err
	})
	if err != nil {
		return nil, err
	}
	return conn.(*net.TCPConn), nil
}

// inNS runs fn on a thread in the managed namespace (sockets keep the
// namespace they were made in).
func (c *SetCap) inNS(fn func() error) error { return nlsafe.Do(c.k.nsPath, fn) }

// spliceBoth is the default Carrier: both directions, each half-closed at
// its EOF; any error ends the whole connection.
func spliceBoth(_ string, client, guest *net.TCPConn) {
	half := func(dst, src *net.TCPConn) {
		if _, err := io.Copy(dst, src); err != nil {
			src.Close()
			dst.Close()
			return
		}
		_ = dst.CloseWrite()
	}
	done := make(chan struct{})
	go func() {
		half(guest, client)
		close(done)
	}()
	half(client, guest)
	<-done
	client.Close()
	guest.Close()
}

// reset closes a caller with a RST (SO_LINGER 0): it learns at once that it
// was refused instead of reading an orderly, empty reply.
func reset(c *net.TCPConn) {
	_ = c.SetLinger(0)
	c.Close()
}
