package proxy

import (
	"errors"
	"net"
	"net/netip"
	"os"
	"sync"
	"sync/atomic"
	"syscall"
	"time"

	"github.com/brokkr/brokkr/bpf"
)

// DefaultDialTimeout bounds the dial into the guest that every accepted
// connection makes before it is counted as carried. A guest that does not
// answer within it costs the caller a reset, not a hang.
const DefaultDialTimeout = 2 * time.Second

// Manager runs the listeners of the exposures and carries connections to
// the guests. An exposure may have several listeners (auto's 127.0.0.1 and
// ::1), one per host address, keyed by (name, address); they all count into
// the exposure's one slot, found by name. Converge is its only input; it is safe to call from one goroutine
// at a time, and from many (they serialise on the lock).
type Manager struct {
	resolve  Resolver
	resolve6 Resolver // IPv6 addresses for IPv6 callers; nil: IPv4 for all
	stats    *bpf.Store
	// dialTimeout bounds each dial into a guest (DefaultDialTimeout).
	dialTimeout time.Duration
	// listenTCP opens a TCP exposure's listener. It is a field so a test can
	// hand the accept loop a listener whose Accept fails on cue, the way a
	// real one only does under load a test cannot stage.
	listenTCP func(checked) (net.Listener, error)
	holders   func(proto string, addr netip.AddrPort) string // WithHolders; nil: not looked up

	// mu guards live and every exposure's socket fields and reason; the
	// serving goroutines write those under it, so a status is never a torn
	// read of a loop that is dying at the same moment.
	mu   sync.Mutex
	live map[listenerKey]*exposure

	// loops counts the goroutines that own a socket (accept loops, UDP read
	// loops), so StopAll returns only once none of them is left.
	loops sync.WaitGroup

	// carried holds every accepted TCP caller until its connection ends.
	// Revoking an exposure lets them drain; StopAll ends them and waits, so
	// nothing counts into the store after StopAll returns and the daemon can
	// close (unmap) it safely.
	carriedMu sync.Mutex
	carried   map[sock]struct{}
	stopped   bool
	carriedWG sync.WaitGroup

	// carriers is the hand-off to parked carrier goroutines (see admit).
	// Closing quitCarriers (StopAll) ends the parked ones; carrierWG counts
	// every carrier goroutine so StopAll returns only once none is left.
	carriers     chan carryJob
	idleCarriers atomic.Int32
	quitCarriers chan struct{}
	quitOnce     sync.Once
	carrierWG    sync.WaitGroup

	logs logLimiter

	// Hand-over state (handover.go). inherit and frozenMode are guarded by
	// mu; freezing, pairs and frozenPairs by carriedMu.
	inherit     map[string]*os.File
	frozenMode  bool
	freezing    bool
	pairs       map[*pair]struct{}
	frozenPairs []*pair
	hold        chan struct{}
	holdOnce    sync.Once
	stopping    chan struct{} // closed when StopAll begins
	stopOnce    sync.Once

	// UDP flows adopted before their socket is bound, by listener name
	// (guarded by mu).
	inheritFlows map[string][]FrozenPair

	// Waking suspended VMs (wake.go); nil: a caller of one is dropped.
	waker    Waker
	wakeHold time.Duration
}

// NewManager returns a Manager that finds guests through resolve and counts
// into stats. With stats nil it counts into an in-memory store of its own.
func NewManager(resolve Resolver, stats *bpf.Store, opts ...Option) *Manager {
	m := &Manager{resolve: resolve, stats: stats, dialTimeout: DefaultDialTimeout,
		listenTCP: listenTCP, live: map[listenerKey]*exposure{}, carried: map[sock]struct{}{},
		carriers: make(chan carryJob), quitCarriers: make(chan struct{}), logs: newLogLimiter(),
		inherit: map[string]*os.File{}, stopping: make(chan struct{})}
	for _, o := range opts {
		o(m)
	}
	if stats == nil {
		m.stats = bpf.NewInMemory("counters in memory only: the proxy was given no BPF store")
	}
	return m
}

// listenerKey names one listener: the exposure, the host address it
// binds (unmapped; the unspecified address of its family for "any") and
// the port (one of a range's; HostPort for a single port).
type listenerKey struct {
	id   string
	addr netip.Addr
	port uint16
}

// exposure is one listener's running state. It lives as long as its key is
// desired; a changed spec rebinds its socket but keeps the exposure, so the
// connections still draining through the old socket keep counting toward the
// cap — the descriptors they hold are still spent.
type exposure struct {
	id        string
	key       string // listenKey of the spec the socket was bound for
	name      string // listenerName of a bound TCP socket
	ln        net.Listener
	udp       *udpRelay
	stop      chan struct{} // closed when the current socket is closed on purpose
	boundAddr string
	reason    string
	lost      string // why the serving loop gave its socket back, until rebound

	maxConns atomic.Int64              // 0 = unlimited; updated in place
	idle     atomic.Int64              // UDP flow idle timeout in ns; updated in place
	conns    atomic.Int64              // open TCP connections or UDP flows, across rebinds
	pp       atomic.Uint32             // the PROXY header written to the guest (ppVersion); updated in place
	allow    atomic.Pointer[allowList] // allowFrom; nil = everyone; updated in place

	ctr *counterRef
}

func (ex *exposure) bound() bool { return ex.ln != nil || ex.udp != nil }

// closeSocket closes the listening socket on purpose (m.mu held). Clearing
// the fields first is what tells the serving loop that its exit is expected.
// TCP connections already carried keep flowing: a revocation drains. UDP flows
// end with their socket, since their replies leave through it.
func (ex *exposure) closeSocket() {
	if ex.stop != nil {
		close(ex.stop)
		ex.stop = nil
	}
	if ex.ln != nil {
		ex.ln.Close()
		ex.ln = nil
	}
	if ex.udp != nil {
		ex.udp.close()
		ex.udp = nil
	}
	ex.boundAddr, ex.name = "", ""
}

// counterRef holds an exposure's slot for as long as the exposure or any
// connection it carried is alive, so a connection draining after its
// exposure was deleted never adds to a slot that was zeroed and handed to
// another exposure.
type counterRef struct {
	slot    *bpf.Slot
	refs    atomic.Int64
	deleted atomic.Bool
}

func (c *counterRef) acquire() { c.refs.Add(1) }

func (c *counterRef) release() {
	if c.refs.Add(-1) == 0 {
		c.slot.Release(c.deleted.Load())
	}
}

// Converge makes the running exposures match desired and returns one Status
// per desired spec, in order. It compares with what is actually running (a
// listener whose loop died counts as not running), so calling it again with
// the same input changes nothing and repairs whatever broke in between.
func (m *Manager) Converge(desired []Spec) []Status {
	m.logs.flush()
	checks, errs, owners := validateAll(desired)

	m.mu.Lock()
	defer m.mu.Unlock()
	if m.frozenMode {
		return nil // frozen for a hand-over: nothing is bound or unbound
	}

	wanted := make(map[listenerKey]bool, len(desired))
	ids := make(map[string]bool, len(desired))
	for i, c := range checks {
		if owners[i] {
			wanted[c.key()] = true
			ids[c.Name] = true
		}
	}
	for k, ex := range m.live {
		if !wanted[k] {
			ex.closeSocket()
			delete(m.live, k)
			// The slot is the exposure's: deleted only when no listener of
			// the name is desired any more.
			ex.ctr.deleted.Store(!ids[k.id])
			ex.ctr.release()
		}
	}

	out := make([]Status, len(desired))
	for i := range desired {
		out[i] = m.convergeOne(checks[i], errs[i], owners[i])
	}
	return out
}

// convergeOne brings one exposure to its spec (m.mu held).
func (m *Manager) convergeOne(c checked, invalid error, owner bool) Status {
	st := Status{ID: c.Name, State: StateFailed}
	ex := m.live[c.key()]
	if invalid != nil {
		st.Reason = invalid.Error()
		if !owner {
			return st // another spec owns this ID; its counters are its own
		}
		if ex != nil {
			// The spec can no longer be honoured: stop serving the old one,
			// but keep the counters, since the exposure is still desired.
			ex.closeSocket()
			ex.key = ""
			st.Counters = ex.ctr.slot.Read()
		} else if cs, ok := m.stats.Lookup(c.Name); ok {
			st.Counters = cs
		}
		return st
	}

	if ex == nil {
		slot, err := m.stats.Attach(c.Name, bpf.ProtoNumber(string(c.Proto)), c.HostPort)
		if err != nil {
			st.Reason = "counters: " + err.Error()
			return st
		}
		ex = &exposure{id: c.Name, ctr: &counterRef{slot: slot}}
		ex.ctr.refs.Store(1)
		m.live[c.key()] = ex
	}
	ex.maxConns.Store(int64(c.MaxConns))
	ex.ctr.slot.SetCap(uint32(c.MaxConns))
	ex.idle.Store(int64(c.idle))
	ex.pp.Store(ppOf(c.ProxyProtocol))
	if !ex.allow.Load().same(c.AllowFrom) {
		ex.allow.Store(newAllowList(c.AllowFrom))
	}

	if ex.key != c.listenKey() {
		ex.closeSocket() // a changed spec is a close and a rebind
		ex.key = c.listenKey()
		ex.reason = ""
	}
	var note string
	if !ex.bound() {
		if err := m.bind(ex, c); err != nil {
			ex.reason = err.Error()
			if errors.Is(err, syscall.EADDRINUSE) && m.holders != nil {
				if h := m.holders(string(c.Proto), netip.AddrPortFrom(c.host, c.port())); h != "" {
					ex.reason += ": held by " + h
				}
			}
			st.Reason = ex.reason
			st.Counters = ex.ctr.slot.Read()
			return st
		}
		if ex.lost != "" {
			note = "rebound after " + ex.lost
		}
		ex.reason, ex.lost = "", ""
		m.relabel(c)
	}

	st.BoundAddr = ex.boundAddr
	st.Counters = ex.ctr.slot.Read()
	st.State = StateActive
	st.Reason = join(note, ex.reason)
	if m.guestAddr(c.Target, false) == "" {
		st.State = StatePending
		st.Reason = join("guest has no address yet", st.Reason)
	}
	return st
}

// relabel rewrites the slot's protocol and host port (the port the OS picked
// for HostPort 0, or a changed one; a range's first) so bpftool shows the
// exposure's shape. An Attach of a name already held finds the same slot;
// releasing that extra hold at once leaves the exposure's own.
func (m *Manager) relabel(c checked) {
	port := c.HostPort
	ex := m.live[c.key()]
	if ap, err := netip.ParseAddrPort(ex.boundAddr); err == nil && port == 0 {
		port = ap.Port()
	}
	if sl, err := m.stats.Attach(c.Name, bpf.ProtoNumber(string(c.Proto)), port); err == nil {
		sl.Release(false)
	}
}

// bind opens the exposure's socket and starts the goroutine that serves it
// (m.mu held).
func (m *Manager) bind(ex *exposure, c checked) error {
	stop := make(chan struct{})
	switch c.Proto {
	case "tcp":
		name := listenerName(c.Name, c.listenKey())
		ln, ok := m.inherited(name)
		if !ok {
			var err error
			if ln, err = m.listenTCP(c); err != nil {
				return err
			}
		}
		// Accepted from on raw descriptors (sock.go); through Accept if
		// the socket cannot be taken over (out of descriptors).
		if tl, ok := ln.(*net.TCPListener); ok {
			if rl, err := newRawListener(tl); err == nil {
				ln = rl
			}
		}
		ex.ln, ex.stop, ex.boundAddr, ex.name = ln, stop, ln.Addr().String(), name
		m.loops.Add(1)
		go func() {
			defer m.loops.Done()
			m.serveTCP(ex, ln, stop, c.Target, int(c.guestPort()), c.HostPort)
		}()
	case "udp":
		name := listenerName(c.Name, c.listenKey())
		conn, flows, ok := m.inheritedUDP(name)
		if !ok {
			var err error
			if conn, err = listenUDP(c); err != nil {
				return err
			}
		}
		r := newUDPRelay(m, ex, conn, c, stop)
		ex.udp, ex.stop, ex.boundAddr, ex.name = r, stop, conn.LocalAddr().String(), name
		r.adopt(flows)
		m.loops.Add(1)
		go func() {
			defer m.loops.Done()
			r.serve()
		}()
	}
	return nil
}

// StopAll closes every listener, ends every carried connection and UDP flow,
// and releases every slot without deleting it: the daemon is stopping, the
// exposures are not (connections do not survive a daemon restart; VMs do).
// It returns once no goroutine of the Manager is left, so the store can be
// closed right after. A stopped Manager carries nothing more.
func (m *Manager) StopAll() {
	m.stopOnce.Do(func() { close(m.stopping) })
	m.carriedMu.Lock()
	m.stopped = true
	for c := range m.carried {
		c.Close()
	}
	m.carriedMu.Unlock()

	m.mu.Lock()
	for k, ex := range m.live {
		ex.closeSocket()
		delete(m.live, k)
		ex.ctr.release()
	}
	for name, f := range m.inherit {
		f.Close()
		delete(m.inherit, name)
	}
	for name, flows := range m.inheritFlows {
		for _, fp := range flows {
			fp.Guest.Close()
		}
		delete(m.inheritFlows, name)
	}
	m.mu.Unlock()
	m.loops.Wait()
	m.carriedWG.Wait()
	// No accept loop is left, so no carrier is started or handed a job now.
	m.quitOnce.Do(func() { close(m.quitCarriers) })
	m.carrierWG.Wait()
}

// track registers an accepted caller, or reports false once StopAll has run.
func (m *Manager) track(c sock) bool {
	m.carriedMu.Lock()
	defer m.carriedMu.Unlock()
	if m.stopped {
		return false
	}
	m.carried[c] = struct{}{}
	m.carriedWG.Add(1)
	return true
}

func (m *Manager) untrack(c sock) {
	m.carriedMu.Lock()
	delete(m.carried, c)
	m.carriedMu.Unlock()
	m.carriedWG.Done()
}

func join(a, b string) string {
	switch {
	case a == "":
		return b
	case b == "":
		return a
	}
	return a + "; " + b
}
