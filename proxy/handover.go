package proxy

import (
	"crypto/sha256"
	"encoding/hex"
	"fmt"
	"net"
	"net/netip"
	"os"
	"time"

	"github.com/brokkr/brokkr/bpf"
)

// Hand-over: a planned restart moves the proxy's sockets to the next
// process instead of closing them (docs/ARCHITECTURE.md, "Restart and
// upgrade"). Freeze stops the proxy at a point where everything it holds is
// in the kernel (listening sockets with their backlogs, connected sockets
// with their buffers) or in a Snapshot (bytes a direction had read into its
// pipe but not yet written); the next process builds its Manager from that
// Snapshot with Inherit and Adopt, and nothing is lost or counted twice.

// Snapshot is what Freeze hands over: the listening sockets (TCP listeners
// and UDP sockets) by ListenerName, the carried TCP connections and the UDP
// flows. The files are the caller's to close.
type Snapshot struct {
	Listeners map[string]*os.File
	Pairs     []FrozenPair
}

// FrozenPair is one carried connection stopped for a hand-over. Its place
// under the exposure's cap stays taken (proxy_active in the slot): the
// process that adopts it gives the place back when the connection ends.
//
// A UDP flow travels as a FrozenPair too, with Flow set, Client nil and
// Guest its connected socket to the guest: its client has no socket of its
// own (datagrams come and go through the exposure's one socket).
type FrozenPair struct {
	ID            string // exposure; "" for a nat slow-path connection (Carry)
	HostPort      uint16
	Client, Guest *os.File
	Pending       [2][]byte // caller to guest, guest to caller
	Done          [2]bool
	Flow          *FrozenFlow
}

// FrozenFlow is what a UDP flow is beside its guest socket.
type FrozenFlow struct {
	Listener string         // ListenerName of the exposure's socket
	Client   netip.AddrPort // where the replies go
	Local    netip.Addr     // the address the client sent to (wildcard binds)
	LastSeen int64          // unix ns of the last datagram either way
}

// listenerName names a TCP listener for the hand-over and systemd's fd
// store: stable for one exposure ID and listen address, and made only of
// characters an FDNAME may hold (no ':').
func listenerName(id, key string) string {
	h := sha256.Sum256([]byte(id + "\x00" + key))
	return "brokkr-px-" + hex.EncodeToString(h[:10])
}

// KeptActive counts, per exposure, the frozen connections that hold a place
// in its slot: what the next process's ResetActive must leave in place.
func (s *Snapshot) KeptActive(into map[string]uint64) {
	for _, p := range s.Pairs {
		if p.ID != "" {
			into[p.ID]++
		}
	}
}

// Close closes every file of the snapshot.
func (s *Snapshot) Close() {
	for _, f := range s.Listeners {
		f.Close()
	}
	for _, p := range s.Pairs {
		closeIf(p.Client)
		p.Guest.Close()
	}
}

// WithHold makes accept loops and adopted connections wait until Resume: a
// process taking over must not serve before the old one confirmed it gave
// up, or a failed hand-over would leave both carrying the same sockets.
func WithHold() Option {
	return func(m *Manager) { m.hold = make(chan struct{}) }
}

// Resume ends the hold: accept loops start and adopted connections carry on.
func (m *Manager) Resume() {
	m.holdOnce.Do(func() {
		if m.hold != nil {
			close(m.hold)
		}
	})
}

// held waits for Resume or stop; false means stop came first.
func (m *Manager) held(stop <-chan struct{}) bool {
	if m.hold == nil {
		return true
	}
	select {
	case <-m.hold:
		return true
	case <-stop:
		return false
	}
}

// Inherit gives the Manager listening sockets to bind from instead of
// opening new ones (a hand-over, or systemd's fd store after a crash). The
// Manager owns the files; the ones no exposure claims by the next
// DropUnclaimed are closed then.
func (m *Manager) Inherit(ls map[string]*os.File) {
	m.mu.Lock()
	defer m.mu.Unlock()
	for name, f := range ls {
		if old := m.inherit[name]; old != nil {
			old.Close()
		}
		m.inherit[name] = f
	}
}

// DropUnclaimed closes inherited listeners no exposure took and returns
// their names (so the daemon can remove them from systemd's fd store).
func (m *Manager) DropUnclaimed() []string {
	m.mu.Lock()
	defer m.mu.Unlock()
	var names []string
	for name, f := range m.inherit {
		f.Close()
		delete(m.inherit, name)
		names = append(names, name)
	}
	for name, flows := range m.inheritFlows {
		m.endFlows(flows)
		delete(m.inheritFlows, name)
	}
	return names
}

// fileListener is a TCP listener that can be handed over: a *rawListener,
// or a *net.TCPListener where the raw path could not be set up.
type fileListener interface {
	net.Listener
	File() (*os.File, error)
}

// ListenerFiles returns a duplicate of each bound TCP listener, by
// ListenerName, for systemd's fd store; only names not in have are
// duplicated. current lists every bound name.
func (m *Manager) ListenerFiles(have map[string]bool) (added map[string]*os.File, current []string) {
	m.mu.Lock()
	defer m.mu.Unlock()
	added = map[string]*os.File{}
	for _, ex := range m.live {
		fl, ok := ex.ln.(fileListener)
		if !ok || ex.name == "" {
			continue
		}
		current = append(current, ex.name)
		if have[ex.name] {
			continue
		}
		if f, err := fl.File(); err == nil {
			added[ex.name] = f
		}
	}
	return added, current
}

// inherited takes the inherited listener for name, if there is one.
func (m *Manager) inherited(name string) (net.Listener, bool) {
	f := m.inherit[name]
	if f == nil {
		return nil, false
	}
	delete(m.inherit, name)
	ln, err := net.FileListener(f)
	f.Close()
	if err != nil {
		return nil, false
	}
	return ln, true
}

// endFlows ends inherited UDP flows that will not be adopted: their guest
// sockets close and their places are given back.
func (m *Manager) endFlows(flows []FrozenPair) {
	for _, fp := range flows {
		fp.Guest.Close()
		m.closedPlace(fp.ID, "udp", fp.HostPort)
	}
}

// inheritedUDP takes the inherited UDP socket for name and the flows that
// came with it (m.mu held). Flows without their socket cannot reply and end.
func (m *Manager) inheritedUDP(name string) (*net.UDPConn, []FrozenPair, bool) {
	flows := m.inheritFlows[name]
	delete(m.inheritFlows, name)
	f := m.inherit[name]
	if f == nil {
		m.endFlows(flows)
		return nil, nil, false
	}
	delete(m.inherit, name)
	pc, err := net.FilePacketConn(f)
	f.Close()
	uc, ok := pc.(*net.UDPConn)
	if err != nil || !ok {
		if pc != nil {
			pc.Close()
		}
		m.endFlows(flows)
		return nil, nil, false
	}
	return uc, flows, true
}

// register adds a pair to the ones a freeze must stop, or reports false
// when a freeze already began (the pair is then frozen as it is).
func (m *Manager) register(p *pair) bool {
	m.carriedMu.Lock()
	defer m.carriedMu.Unlock()
	if m.freezing {
		p.frozen.Store(true)
		return false
	}
	if m.pairs == nil {
		m.pairs = map[*pair]struct{}{}
	}
	m.pairs[p] = struct{}{}
	return true
}

func (m *Manager) unregister(p *pair) {
	m.carriedMu.Lock()
	delete(m.pairs, p)
	m.carriedMu.Unlock()
}

func (m *Manager) keepFrozen(p *pair) {
	m.carriedMu.Lock()
	m.frozenPairs = append(m.frozenPairs, p)
	m.carriedMu.Unlock()
}

// Freeze stops the Manager for a hand-over and returns what it held. The
// TCP listeners are duplicated and then closed here, so callers queue in
// their backlogs; a UDP socket and its flows are stopped the same way
// (datagrams queue in the socket buffers) and handed over with each flow's
// client address and idle clock. Every carried connection is stopped where
// it stands (dials in progress finish first, at most the dial timeout).
// Converge binds nothing while frozen. Thaw undoes it.
func (m *Manager) Freeze() *Snapshot {
	snap := &Snapshot{Listeners: map[string]*os.File{}}
	type frozenRelay struct {
		r    *udpRelay
		name string
	}
	var relays []frozenRelay
	m.mu.Lock()
	m.frozenMode = true
	for _, ex := range m.live {
		if fl, ok := ex.ln.(fileListener); ok && ex.name != "" {
			if f, err := fl.File(); err == nil {
				snap.Listeners[ex.name] = f
			}
		}
		if r := ex.udp; r != nil && ex.name != "" {
			r.freeze()
			relays = append(relays, frozenRelay{r, ex.name})
			ex.udp = nil // closeSocket leaves it open
		}
		ex.closeSocket()
	}
	// Listeners inherited and not bound yet go on as they came.
	for name, f := range m.inherit {
		snap.Listeners[name] = f
		delete(m.inherit, name)
	}
	for name, flows := range m.inheritFlows {
		snap.Pairs = append(snap.Pairs, flows...)
		delete(m.inheritFlows, name)
	}
	m.mu.Unlock()
	m.loops.Wait() // the UDP loops too: every flow of a frozen relay is parked
	for _, fr := range relays {
		m.collectUDP(fr.r, fr.name, snap)
	}

	m.carriedMu.Lock()
	m.freezing = true
	for p := range m.pairs {
		p.freeze()
	}
	m.carriedMu.Unlock()
	// Every carried caller ends up frozen or finished; wait for that.
	for {
		m.carriedMu.Lock()
		n := len(m.carried)
		m.carriedMu.Unlock()
		if n == 0 {
			break
		}
		time.Sleep(time.Millisecond)
	}
	m.carriedMu.Lock()
	frozen := m.frozenPairs
	m.frozenPairs = nil
	m.carriedMu.Unlock()
	for _, p := range frozen {
		cf, err1 := dupFile(p.client)
		gf, err2 := dupFile(p.guest)
		p.client.Close()
		p.guest.Close()
		if err1 != nil || err2 != nil {
			// A socket that cannot be duplicated cannot be handed over;
			// it ends here, and so does its place.
			closeIf(cf)
			closeIf(gf)
			if p.id != "" {
				m.closedPlace(p.id, "tcp", p.hostPort)
			}
			continue
		}
		snap.Pairs = append(snap.Pairs, FrozenPair{ID: p.id, HostPort: p.hostPort, Client: cf, Guest: gf,
			Pending: p.pending, Done: p.done})
	}
	return snap
}

func closeIf(f *os.File) {
	if f != nil {
		f.Close()
	}
}

// collectUDP moves a frozen relay's socket and flows into snap. A socket
// that cannot be duplicated ends here, and so do the places of its flows.
func (m *Manager) collectUDP(r *udpRelay, name string, snap *Snapshot) {
	hostPort := r.slotPort
	if a, ok := r.conn.LocalAddr().(*net.UDPAddr); ok && hostPort == 0 {
		hostPort = uint16(a.Port)
	}
	sock, err := r.conn.File()
	r.conn.Close()
	if err == nil {
		snap.Listeners[name] = sock
	}
	for _, f := range r.flows {
		gf, gerr := f.guest.File()
		f.guest.Close()
		if err != nil || gerr != nil {
			closeIf(gf)
			m.closedPlace(r.ex.id, "udp", hostPort)
			continue
		}
		snap.Pairs = append(snap.Pairs, FrozenPair{ID: r.ex.id, HostPort: hostPort, Guest: gf,
			Flow: &FrozenFlow{Listener: name, Client: f.key.client, Local: f.key.local, LastSeen: f.lastSeen.Load()}})
	}
	r.flows = nil
}

// closedPlace gives back one place of the named exposure's slot.
func (m *Manager) closedPlace(id, proto string, port uint16) {
	if sl, err := m.stats.Attach(id, bpf.ProtoNumber(proto), port); err == nil {
		sl.Closed()
		sl.Release(false)
	}
}

// Thaw undoes Freeze after a failed hand-over: the listeners are bound
// again from the snapshot at the next Converge, and the connections carry
// on where they stopped.
func (m *Manager) Thaw(s *Snapshot) {
	m.carriedMu.Lock()
	m.freezing = false
	m.carriedMu.Unlock()
	m.mu.Lock()
	m.frozenMode = false
	m.mu.Unlock()
	m.Inherit(s.Listeners)
	m.Adopt(s.Pairs)
}

// Adopt carries on the frozen connections of another process (or of this
// one, after a failed hand-over), once the hold ends. Their places are
// already taken in their slots; each gives its place back when it ends.
// The Manager owns the files.
//
// UDP flows wait, by listener name, for the Converge that binds their
// exposure's socket; the flows of a socket no exposure claims by the next
// DropUnclaimed end then.
func (m *Manager) Adopt(pairs []FrozenPair) {
	for _, fp := range pairs {
		if fp.Flow != nil {
			m.mu.Lock()
			if m.inheritFlows == nil {
				m.inheritFlows = map[string][]FrozenPair{}
			}
			m.inheritFlows[fp.Flow.Listener] = append(m.inheritFlows[fp.Flow.Listener], fp)
			m.mu.Unlock()
			continue
		}
		client, err1 := fileConn[*net.TCPConn](fp.Client)
		guest, err2 := fileConn[*net.TCPConn](fp.Guest)
		if err1 != nil || err2 != nil {
			if client != nil {
				client.Close()
			}
			if guest != nil {
				guest.Close()
			}
			if fp.ID != "" {
				m.closedPlace(fp.ID, "tcp", fp.HostPort)
			}
			continue
		}
		p := &pair{client: client, guest: guest, id: fp.ID, hostPort: fp.HostPort, pending: fp.Pending, done: fp.Done}
		m.adopt(p)
	}
}

// fileConn turns a handed-over descriptor into its connection (a
// *net.TCPConn or *net.UDPConn) and closes the file, which FileConn dup'ed.
func fileConn[C net.Conn](f *os.File) (C, error) {
	defer f.Close()
	var zero C
	c, err := net.FileConn(f)
	if err != nil {
		return zero, err
	}
	cc, ok := c.(C)
	if !ok {
		c.Close()
		return zero, net.UnknownNetworkError(fmt.Sprintf("not a %T socket", zero))
	}
	return cc, nil
}

// adopt runs one adopted pair in its own goroutine, counted like a carried
// connection so StopAll ends it.
func (m *Manager) adopt(p *pair) {
	if !m.track(p.client) {
		p.client.Close()
		p.guest.Close()
		if p.id != "" {
			m.closedPlace(p.id, "tcp", p.hostPort)
		}
		return
	}
	var sl *bpf.Slot
	if p.id != "" {
		if s, err := m.stats.Attach(p.id, bpf.ProtoNumber("tcp"), p.hostPort); err == nil {
			sl = s
		}
	}
	go func() {
		defer m.untrack(p.client)
		if !m.held(m.stopping) {
			// Stopped before the hold ended: the pair stays frozen for the
			// caller's next move (StopAll closes it below).
			p.client.Close()
			p.guest.Close()
			if sl != nil {
				sl.Closed()
				sl.Release(false)
			}
			return
		}
		in, out := func(int64) {}, func(int64) {}
		if sl != nil {
			in = func(n int64) { sl.AddBytes(uint64(n), 0) }
			out = func(n int64) { sl.AddBytes(0, uint64(n)) }
		}
		frozen := m.runPair(p, in, out)
		if sl != nil {
			if !frozen {
				sl.Closed()
			}
			sl.Release(false)
		}
	}()
}
