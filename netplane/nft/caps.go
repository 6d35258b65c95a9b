package nft

import (
	"errors"
	"maps"
	"sync"
	"sync/atomic"
	"time"

	"github.com/brokkr/brokkr/bpf/ctmark"
	"github.com/brokkr/brokkr/netplane/conntrack"
	"github.com/brokkr/brokkr/netplane/nft/compile"
)

// The set-based cap, the fallback where the BPF nat path cannot load. Each
// capped exposure has a set `conns-NAME` of size MaxConns holding its open
// connections, each as its original tuple (source address . destination
// address . source port; protocol and host port are the exposure's):
//   - admission (nat prerouting/output, first packet only):
//     `add @conns-NAME { ip saddr . ip daddr . tcp sport }` fails once the
//     set is full. The kernel's size check is an atomic compare-and-
//     increment, so parallel SYNs on several CPUs cannot overshoot: the
//     upper bound is exact.
//   - a full set, TCP: the caller goes to the slow path (overflow.go),
//     which frees the slots of connections that have closed and admits it
//     if one is free, or resets it and counts it refused; so nobody is
//     refused while fewer than MaxConns are open. UDP (and TCP when the
//     slow path is off): the next rule counts the caller as refused and
//     rejects it.
//   - closing, in the kernel, in packet order: a FIN in each direction (or
//     one RST) sets both close bits of the ct mark. (Deleting the member in
//     the datapath does not work: the kernel only marks the element dead
//     and gives the slot back at the set's next GC, ~1 s later. A
//     synchronous check through NFQUEUE is impossible here: this kernel has
//     no CONFIG_NFT_QUEUE.)
//   - release, by this watcher: on the conntrack update event that shows a
//     connection closed (both bits, TIME_WAIT/CLOSE) or its destroy event
//     (UDP, timeouts), the member is deleted by a netlink batch, which frees
//     the slot at once. So a closed connection stops counting after the
//     watcher's latency (~2 ms measured: see BENCHMARKS.md).
//   - a sweep (every 5 s, for exposures that refused someone, and after
//     lost events) removes members whose connection has no conntrack entry
//     or has closed, one conntrack GET per member and no dump: e.g. a SYN
//     dropped before its entry was confirmed. A member without an entry is
//     looked up again 2 ms later before it is removed, because a
//     just-admitted connection is in the set a moment before its entry is
//     confirmed.
//   - across converges: an incremental update never touches a set's
//     elements; a set that is (re)created (whole-table replace, repaired
//     drift, a new size) is seeded in the same batch from conntrack's open
//     entries carrying the exposure's mark.

// SetCap runs the set-based cap beside a Table: its index of the applied
// exposures (fed by the Table after every batch), the watcher, the slow
// path and the counters.
type SetCap struct {
	k    *nlKernel
	t    *Table
	opts setCapOptions

	// idxMu: the applied exposures, as the watcher, the slow path and
	// Counters look them up.
	idxMu  sync.RWMutex
	byID   map[uint32]Exposure // mark id → exposure
	idOf   map[string]uint32   // exposure → its mark id (a change finds its old mark without a scan)
	byHost map[compile.HostSide]Exposure
	ranges map[compile.HostSide]Exposure // the port ranges of byHost, looked through by port

	sets capSets // the cap sets' members

	w     atomic.Pointer[capWatcher] // nil once stopped
	ov    atomic.Pointer[overflow]   // the slow path (TCP): started by the first capped TCP exposure
	first atomic.Bool                // the first batch was applied: the watcher swept once
}

// SetCapOption configures StartSetCap.
type SetCapOption func(*setCapOptions)

type setCapOptions struct {
	carrier      Carrier
	overflowWait time.Duration
}

// StartSetCap runs the set-based cap beside t: the watcher now, the slow
// path with the first capped TCP exposure. t's batches feed its index from
// then on; Rules with SetBasedCap get its slow path's port.
func StartSetCap(t *Table, opts ...SetCapOption) (*SetCap, error) {
	o := setCapOptions{overflowWait: DefaultOverflowWait}
	for _, f := range opts {
		f(&o)
	}
	if t.nl == nil {
		return nil, errors.New("nft: the set-based cap needs a table in a namespace")
	}
	c := &SetCap{k: t.nl, t: t, opts: o, byID: map[uint32]Exposure{}, idOf: map[string]uint32{}, byHost: map[compile.HostSide]Exposure{},
		ranges: map[compile.HostSide]Exposure{}}
	c.sets = capSets{k: t.nl, capped: c.capped, dropped: map[string]time.Time{}}
	w, err := startCapWatcher(c)
	if err != nil {
		return nil, err
	}
	c.w.Store(w)
	t.mu.Lock()
	defer t.mu.Unlock()
	t.before, t.applied, t.cap = c.before, c.applied, c
	// What the table holds already (a Converge before the cap started).
	c.applied(t.appliedAll())
	return c, nil
}

// Close stops the watcher and the slow path; the table stays as it is.
func (c *SetCap) Close() error {
	c.t.mu.Lock()
	if c.t.cap == c {
		c.t.before, c.t.applied, c.t.cap = nil, nil, nil
	}
	c.t.mu.Unlock()
	c.stop()
	return nil
}

func (c *SetCap) stop() {
	if o := c.ov.Swap(nil); o != nil {
		o.stop()
	}
	if w := c.w.Swap(nil); w != nil {
		w.stop()
	}
}

// before starts the slow path the first time r has a capped TCP exposure
// on the set-based cap (without one nothing is ever redirected to it, and
// it would hold a port for nothing), and points r at its port (Table.mu).
func (c *SetCap) before(r *Rules) error {
	sc, ok := r.Cap.(compile.SetBasedCap)
	if !ok {
		return nil
	}
	if c.ov.Load() == nil && hasCappedTCP(r.Exposures) {
		o, err := startOverflow(c, c.readOverflowPort(), c.opts.carrier, c.opts.overflowWait)
		if err != nil {
			return err
		}
		c.ov.Store(o)
	}
	sc.OverflowPort = c.overflowPort()
	r.Cap = sc
	return nil
}

// applied updates the index from a batch's changes (Table.mu).
func (c *SetCap) applied(changes []compile.Change) {
	c.idxMu.Lock()
	for _, ch := range changes {
		e := ch.Exposure
		switch ch.Kind {
		case compile.Removed:
			if c.byID[e.MarkID].Name == e.Name {
				delete(c.byID, e.MarkID)
			}
			if c.idOf[e.Name] == e.MarkID {
				delete(c.idOf, e.Name)
			}
			if c.byHost[ch.HostSide].Name == e.Name {
				delete(c.byHost, ch.HostSide)
				delete(c.ranges, ch.HostSide)
			}
		default:
			if id, ok := c.idOf[e.Name]; ok && id != e.MarkID && c.byID[id].Name == e.Name {
				delete(c.byID, id) // its mark changed
			}
			c.byID[e.MarkID], c.idOf[e.Name] = e, e.MarkID
			c.byHost[ch.HostSide] = e
			if e.IsRange() {
				c.ranges[ch.HostSide] = e
			}
		}
	}
	c.idxMu.Unlock()
	if o := c.ov.Load(); o != nil {
		for _, ch := range changes {
			if ch.Kind == compile.Removed {
				o.forget(ch.Exposure.Name)
			}
		}
	}
	if w := c.w.Load(); !c.first.Swap(true) && w != nil {
		select {
		case w.kick <- struct{}{}:
		default:
		}
	}
}

func hasCappedTCP(exps []Exposure) bool {
	for _, e := range exps {
		if e.MaxConns > 0 && e.Protocol == "tcp" && !e.LoopbackOnly() {
			return true
		}
	}
	return false
}

type capWatcher struct {
	c    *SetCap
	w    *conntrack.Watcher
	done chan struct{}
	wg   sync.WaitGroup

	kick     chan struct{}     // a full sweep is due (first converge)
	released map[string]bool   // connections freed before their entry was destroyed
	refused  map[string]uint64 // refused count at the last sweep
}

const sweepEvery = 5 * time.Second

func startCapWatcher(c *SetCap) (*capWatcher, error) {
	w, err := conntrack.Watch(c.k.nsPath, ctmark.Owned, ctmark.Owned)
	if err != nil {
		return nil, err
	}
	cw := &capWatcher{c: c, w: w, done: make(chan struct{}), kick: make(chan struct{}, 1),
		released: map[string]bool{}, refused: map[string]uint64{}}
	cw.wg.Add(1)
	go cw.run()
	return cw, nil
}

func (cw *capWatcher) stop() {
	close(cw.done)
	cw.wg.Wait()
	_ = cw.w.Close()
}

func (cw *capWatcher) run() {
	defer cw.wg.Done()
	tick := time.NewTicker(sweepEvery)
	defer tick.Stop()
	for {
		select {
		case e := <-cw.w.C():
			pending := map[string][][]byte{}
			cw.ended1(e, pending)
			// Take what else is queued, then commit once.
		more:
			for i := 0; i < 4096; i++ {
				select {
				case e := <-cw.w.C():
					cw.ended1(e, pending)
				default:
					break more
				}
			}
			cw.c.release(pending)
		case <-cw.w.Lost():
			cw.sweep(true)
		case <-cw.kick:
			// After a (re)start: connections that closed while no watcher
			// was listening may still hold slots.
			cw.sweep(true)
		case <-tick.C:
			cw.sweep(false)
		case <-cw.done:
			return
		}
	}
}

func (cw *capWatcher) ended1(e conntrack.Entry, pending map[string][][]byte) {
	id := e.Mark & ctmark.IDMask
	if id == 0 {
		return
	}
	exp, ok := cw.c.byMark(id)
	if !ok || exp.MaxConns <= 0 {
		return
	}
	closed := e.Destroyed || !e.Open() || e.Mark&ctmark.Closed == ctmark.Closed
	if !closed {
		return
	}
	k := compile.ConnKey(e.Orig, e.OrigDst)
	if cw.released[string(k)] {
		if e.Destroyed {
			delete(cw.released, string(k))
		}
		return
	}
	if !e.Destroyed {
		cw.released[string(k)] = true
	}
	pending[exp.Name] = append(pending[exp.Name], k)
}

func (c *SetCap) byMark(id uint32) (Exposure, bool) {
	c.idxMu.RLock()
	defer c.idxMu.RUnlock()
	e, ok := c.byID[id]
	return e, ok
}

// release deletes members from cap sets. A batch fails as a whole when one
// is already gone, so it is retried member by member.
func (c *SetCap) release(pending map[string][][]byte) {
	if len(pending) == 0 {
		return
	}
	c.k.membersMu.Lock()
	c.sets.releaseLocked(pending)
	c.k.membersMu.Unlock()
	if o := c.ov.Load(); o != nil {
		o.signalFreed() // callers waiting in the slow path look again
	}
}

// capped reports whether name is an applied exposure with a cap.
func (c *SetCap) capped(name string) bool {
	c.idxMu.RLock()
	defer c.idxMu.RUnlock()
	id, ok := c.idOf[name]
	return ok && c.byID[id].Name == name && c.byID[id].MaxConns > 0
}

// cappedExposures lists the applied exposures that have a cap.
func (c *SetCap) cappedExposures() []Exposure {
	c.idxMu.RLock()
	defer c.idxMu.RUnlock()
	var out []Exposure
	for _, e := range c.byID {
		if e.MaxConns > 0 {
			out = append(out, e)
		}
	}
	return out
}

// sweep removes members of cap sets whose connection is gone. all:
// every capped exposure (after lost events); otherwise only those that
// refused someone since the last sweep (a leaked slot only matters then).
func (cw *capWatcher) sweep(all bool) {
	c := cw.c
	capped := c.cappedExposures()
	if len(capped) == 0 {
		return
	}
	counters, err := c.k.counters()
	if err != nil {
		return
	}
	pending := map[string][][]byte{}
	ov := c.ov.Load()
	for _, e := range capped {
		r := counters[compile.RefusedCounter(e.Name)].Packets
		if ov != nil {
			r += ov.countsOf(e.Name).refused
		}
		if !all && r == cw.refused[e.Name] {
			continue
		}
		cw.refused[e.Name] = r
		c.k.membersMu.Lock()
		stale, _, err := c.sets.staleLocked(e)
		c.k.membersMu.Unlock()
		if err != nil {
			continue
		}
		if len(stale) > 0 {
			pending[e.Name] = stale
		}
	}
	c.release(pending)
}

// ExposureCounters are one exposure's kernel-path numbers.
type ExposureCounters struct {
	Accepted uint64 // connections admitted (the counters of the exposure's target elements + the cap slow path's)
	Refused  uint64 // connections refused by the cap (named counter NAME-refused + the slow path's)
	// The named counters' part of Accepted and Refused: absolute in the
	// kernel, where it outlives the daemon (the slow path's part is this
	// process's alone).
	KernelAccepted, KernelRefused uint64
	// Bytes per direction, IP packets as conntrack accounting counts them:
	// the counters of the exposure's exp-bytes-orig and exp-bytes-reply
	// elements, absolute in the kernel like the named counters.
	BytesIn  uint64 // caller -> guest
	BytesOut uint64 // guest -> caller
	Active   uint64 // conntrack entries with the exposure's mark that are still open
}

// Counters reads every exposure's counters.
func (c *SetCap) Counters() (map[string]ExposureCounters, error) {
	c.idxMu.RLock()
	byID := maps.Clone(c.byID) // a snapshot: the reads below take other locks
	anyRange := len(c.ranges) > 0
	c.idxMu.RUnlock()
	out := make(map[string]ExposureCounters, len(byID))
	if len(byID) == 0 {
		return out, nil
	}
	cv, err := c.k.counters()
	if err != nil {
		return nil, err
	}
	// Admitted: the connections DNATed to the guest, each a lookup of one
	// of the exposure's target elements: its exp-target element, or a port
	// range's exp-target-addr element or exp-target-port ones (one per
	// port, keyed mark . port), summed by mark.
	admitted := map[string]uint64{}
	targets := []string{compile.MapExpTarget}
	if anyRange { // the range maps are empty otherwise: not dumped on every pass
		targets = append(targets, compile.MapExpTargetAddr, compile.MapExpTargetPort)
	}
	for _, set := range targets {
		m, err := c.k.elemCounters(set)
		if err != nil {
			return nil, err
		}
		for k, v := range m {
			if len(k) >= 4 {
				admitted[k[:4]] += v.Packets
			}
		}
	}
	bytesIn, err := c.k.elemCounters(compile.MapExpBytesOrig)
	if err != nil {
		return nil, err
	}
	bytesOut, err := c.k.elemCounters(compile.MapExpBytesReply)
	if err != nil {
		return nil, err
	}
	ov := c.ov.Load()
	for _, e := range byID {
		mark := compile.MarkKey(e.MarkID)
		ka, kr := admitted[string(mark)], cv[compile.RefusedCounter(e.Name)].Packets
		ec := ExposureCounters{Accepted: ka, Refused: kr, KernelAccepted: ka, KernelRefused: kr,
			BytesIn: bytesIn[string(mark)].Bytes, BytesOut: bytesOut[string(mark)].Bytes}
		if ov != nil {
			// The slow path decides in userspace: a named counter cannot
			// be bumped from there.
			oc := ov.countsOf(e.Name)
			ec.Accepted += oc.accepted
			ec.Refused += oc.refused
		}
		out[e.Name] = ec
	}
	entries, err := c.k.ct.ByMark(ctmark.Owned, ctmark.Owned) // brokkr's entries only, filtered in the kernel
	if err != nil {
		return nil, err
	}
	for _, en := range entries {
		e, ok := byID[en.Mark&ctmark.IDMask]
		if !ok {
			continue
		}
		if en.Open() && en.Mark&ctmark.Closed != ctmark.Closed {
			ec := out[e.Name]
			ec.Active++
			out[e.Name] = ec
		}
	}
	return out, nil
}
