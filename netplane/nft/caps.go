package nft

import (
	"encoding/binary"
	"errors"
	"maps"
	"net/netip"
	"strings"
	"sync"
	"time"

	"github.com/brokkr/brokkr/netplane/nft/compile"

	"github.com/brokkr/brokkr/netplane/conntrack"
	"github.com/google/nftables"
)

// The cap. Each capped exposure has a set `conns-NAME` of size MaxConns
// holding its open connections, each as its original tuple (source address
// . destination address . source port; protocol and host port are the
// exposure's):
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

type capWatcher struct {
	t    *Table
	w    *conntrack.Watcher
	done chan struct{}
	wg   sync.WaitGroup

	mu    sync.Mutex           // ended: written by the watcher, read by Counters
	ended map[string][2]uint64 // bytes in/out of ended connections, per exposure

	kick     chan struct{}     // a full sweep is due (first converge)
	released map[string]bool   // connections freed before their entry was destroyed
	refused  map[string]uint64 // refused count at the last sweep
}

const sweepEvery = 5 * time.Second

func startCapWatcher(t *Table) (*capWatcher, error) {
	w, err := conntrack.Watch(t.nsPath, compile.MarkOwned, compile.MarkOwned)
	if err != nil {
		return nil, err
	}
	c := &capWatcher{t: t, w: w, done: make(chan struct{}), kick: make(chan struct{}, 1), ended: map[string][2]uint64{},
		released: map[string]bool{}, refused: map[string]uint64{}}
	c.wg.Add(1)
	go c.run()
	return c, nil
}

func (c *capWatcher) stop() {
	close(c.done)
	c.wg.Wait()
	_ = c.w.Close()
}

func (c *capWatcher) run() {
	defer c.wg.Done()
	tick := time.NewTicker(sweepEvery)
	defer tick.Stop()
	for {
		select {
		case e := <-c.w.C():
			pending := map[string][][]byte{}
			c.ended1(e, pending)
			// Take what else is queued, then commit once.
		more:
			for i := 0; i < 4096; i++ {
				select {
				case e := <-c.w.C():
					c.ended1(e, pending)
				default:
					break more
				}
			}
			c.release(pending)
		case <-c.w.Lost():
			c.sweep(true)
		case <-c.kick:
			// After a (re)start: connections that closed while no watcher
			// was listening may still hold slots.
			c.sweep(true)
		case <-tick.C:
			c.sweep(false)
		case <-c.done:
			return
		}
	}
}

func (c *capWatcher) ended1(e conntrack.Entry, pending map[string][][]byte) {
	id := e.Mark & compile.MarkIDMask
	if id == 0 {
		return
	}
	t := c.t
	t.idxMu.RLock()
	exp, ok := t.byID[id]
	t.idxMu.RUnlock()
	if ok && e.Destroyed {
		c.mu.Lock()
		b := c.ended[exp.Name]
		b[0] += e.BytesOrig
		b[1] += e.BytesRepl
		c.ended[exp.Name] = b
		c.mu.Unlock()
	}
	if !ok || exp.MaxConns <= 0 {
		return
	}
	closed := e.Destroyed || !e.Open() || e.Mark&compile.MarkClosed == compile.MarkClosed
	if !closed {
		return
	}
	k := compile.ConnKey(e.Orig, e.OrigDst)
	if c.released[string(k)] {
		if e.Destroyed {
			delete(c.released, string(k))
		}
		return
	}
	if !e.Destroyed {
		c.released[string(k)] = true
	}
	pending[exp.Name] = append(pending[exp.Name], k)
}

// release deletes ids from cap sets. A batch fails as a whole when one id
// is already gone, so it is retried id by id.
func (c *capWatcher) release(pending map[string][][]byte) {
	if len(pending) == 0 {
		return
	}
	c.t.capMu.Lock()
	c.t.releaseLocked(pending)
	c.t.capMu.Unlock()
	if o := c.t.ov.Load(); o != nil {
		o.signalFreed() // callers waiting in the slow path look again
	}
}

// capped reports whether name is an applied exposure with a cap.
func (t *Table) capped(name string) bool {
	t.idxMu.RLock()
	defer t.idxMu.RUnlock()
	id, ok := t.ids[name]
	return ok && t.applied && t.byID[id].MaxConns > 0
}

// releaseLocked deletes connections from cap sets (capMu held).
func (t *Table) releaseLocked(pending map[string][][]byte) {
	if len(pending) == 0 {
		return
	}
	inet, _ := t.tables()
	send := func(set string, keys [][]byte) error {
		els := make([]nftables.SetElement, len(keys))
		for i, k := range keys {
			els[i] = nftables.SetElement{Key: k}
		}
		return t.nl(func() error {
			// The lasting socket: SetDeleteElements only fails before
			// queuing.
			if err := t.conn.SetDeleteElements(&nftables.Set{Table: inet, Name: set}, els); err != nil {
				return err
			}
			err := t.conn.Flush()
			if err == nil {
				// Each successful batch moves the ruleset generation by
				// one; Converge discounts these so its fast path stays
				// valid.
				t.ownCommits++
			}
			return err
		})
	}
	for name, keys := range pending {
		if !t.capped(name) {
			continue
		}
		// A key the slow path deleted already would fail the batch, and a
		// failed batch costs the kernel's abort (~10 ms measured).
		keep := keys[:0:0]
		for _, k := range keys {
			if _, ok := t.dropped[name+"\x00"+string(k)]; ok {
				delete(t.dropped, name+"\x00"+string(k))
				continue
			}
			keep = append(keep, k)
		}
		if keys = keep; len(keys) == 0 {
			continue
		}
		if err := send(compile.ConnsSet(name), keys); err != nil && !errors.Is(err, errClosed) && len(keys) > 1 {
			for _, k := range keys {
				_ = send(compile.ConnsSet(name), [][]byte{k})
			}
		}
	}
}

// sweep removes members of cap sets whose connection is gone. all:
// every capped exposure (after lost events); otherwise only those that
// refused someone since the last sweep (a leaked slot only matters then).
func (c *capWatcher) sweep(all bool) {
	t := c.t
	var capped []Exposure
	t.idxMu.RLock()
	if t.applied {
		for _, e := range t.byID {
			if e.MaxConns > 0 {
				capped = append(capped, e)
			}
		}
	}
	t.idxMu.RUnlock()
	if len(capped) == 0 {
		return
	}
	var counters map[string]counterValue
	if err := t.nl(func() (err error) { counters, err = t.readCounters(); return err }); err != nil {
		return
	}
	pending := map[string][][]byte{}
	ov := t.ov.Load()
	for _, e := range capped {
		r := counters[compile.RefusedCounter(e.Name)].packets
		if ov != nil {
			r += ov.countsOf(e.Name).refused
		}
		if !all && r == c.refused[e.Name] {
			continue
		}
		c.refused[e.Name] = r
		t.capMu.Lock()
		stale, _, err := t.staleLocked(e)
		t.capMu.Unlock()
		if err != nil {
			continue
		}
		if len(stale) > 0 {
			pending[e.Name] = stale
		}
	}
	c.release(pending)
}

// staleLocked lists the members of e's cap set whose connection has no
// conntrack entry or has closed: one GET per member, no dump (capMu held).
// members is how many the set holds.
func (t *Table) staleLocked(e Exposure) (stale [][]byte, members int, err error) {
	inet, _ := t.tables()
	var els []nftables.SetElement
	err = t.nl(func() (err error) {
		els, err = t.conn.GetSetElements(&nftables.Set{Table: inet, Name: compile.ConnsSet(e.Name), KeyType: compile.ConnKeyType})
		return err
	})
	if err != nil {
		return nil, 0, err
	}
	var missing [][]byte
	check := func(k []byte) (gone, closed bool, err error) {
		src := netip.AddrPortFrom(netip.AddrFrom4([4]byte(k[0:4])), binary.BigEndian.Uint16(k[8:10]))
		dst := netip.AddrPortFrom(netip.AddrFrom4([4]byte(k[4:8])), e.HostPort)
		en, ok, err := t.ct.Get(compile.ProtoNum(e.Protocol), src, dst)
		if err != nil {
			return false, false, err
		}
		return !ok, ok && (!en.Open() || en.Mark&compile.MarkClosed == compile.MarkClosed), nil
	}
	for _, el := range els {
		if len(el.Key) != 12 {
			continue
		}
		members++
		gone, closed, err := check(el.Key)
		if err != nil {
			return nil, 0, err
		}
		switch {
		case closed:
			stale = append(stale, el.Key)
		case gone:
			missing = append(missing, el.Key)
		}
	}
	if len(missing) > 0 {
		// A connection admitted a moment ago is in the set before its
		// conntrack entry is confirmed (end of the same packet's path):
		// look again after a short pause before calling it gone.
		time.Sleep(2 * time.Millisecond)
		for _, k := range missing {
			if gone, closed, err := check(k); err == nil && (gone || closed) {
				stale = append(stale, k)
			}
		}
	}
	return stale, members, nil
}

// endedBytes returns (and keeps) the bytes of ended connections.
func (c *capWatcher) endedBytes(name string) (uint64, uint64) {
	c.mu.Lock()
	defer c.mu.Unlock()
	b := c.ended[name]
	return b[0], b[1]
}

// ExposureCounters are one exposure's kernel-path numbers.
type ExposureCounters struct {
	Accepted uint64 // connections admitted (named counter NAME-accepted + the cap slow path's)
	Refused  uint64 // connections refused by the cap (named counter NAME-refused + the slow path's)
	// The named counters' part of Accepted and Refused: absolute in the
	// kernel, where it outlives the daemon (the slow path's part is this
	// process's alone).
	KernelAccepted, KernelRefused uint64
	BytesIn                       uint64 // caller -> guest, conntrack accounting (live + ended)
	BytesOut                      uint64 // guest -> caller
	Active                        uint64 // conntrack entries with the exposure's mark that are still open
}

// Counters reads every exposure's counters.
func (t *Table) Counters() (map[string]ExposureCounters, error) {
	t.idxMu.RLock()
	applied := t.applied
	byID := maps.Clone(t.byID) // a snapshot: the reads below take other locks
	t.idxMu.RUnlock()
	out := make(map[string]ExposureCounters, len(byID))
	if !applied {
		return out, nil
	}
	var cv map[string]counterValue
	if err := t.nl(func() (err error) { cv, err = t.readCounters(); return err }); err != nil {
		return nil, err
	}
	ov, w := t.ov.Load(), t.caps.Load()
	for _, e := range byID {
		ka, kr := cv[compile.AcceptedCounter(e.Name)].packets, cv[compile.RefusedCounter(e.Name)].packets
		ec := ExposureCounters{Accepted: ka, Refused: kr, KernelAccepted: ka, KernelRefused: kr}
		if ov != nil {
			// The slow path decides in userspace: a named counter cannot
			// be bumped from there.
			oc := ov.countsOf(e.Name)
			ec.Accepted += oc.accepted
			ec.Refused += oc.refused
		}
		if w != nil {
			ec.BytesIn, ec.BytesOut = w.endedBytes(e.Name)
		}
		out[e.Name] = ec
	}
	entries, err := t.ct.ByMark(compile.MarkOwned, compile.MarkOwned) // brokkr's entries only, filtered in the kernel
	if err != nil {
		return nil, err
	}
	for _, en := range entries {
		e, ok := byID[en.Mark&compile.MarkIDMask]
		if !ok {
			continue
		}
		ec := out[e.Name]
		ec.BytesIn += en.BytesOrig
		ec.BytesOut += en.BytesRepl
		if en.Open() && en.Mark&compile.MarkClosed != compile.MarkClosed {
			ec.Active++
		}
		out[e.Name] = ec
	}
	// Bytes are live entries plus ended ones; an entry that just ended is
	// briefly in neither (its destroy event not yet counted). Never report
	// less than before: a reader taking the difference would read a drop as
	// a reset.
	t.hwMu.Lock()
	defer t.hwMu.Unlock()
	hw := make(map[string][2]uint64, len(out))
	for n, ec := range out {
		prev := t.bytesHW[n]
		ec.BytesIn, ec.BytesOut = max(ec.BytesIn, prev[0]), max(ec.BytesOut, prev[1])
		hw[n] = [2]uint64{ec.BytesIn, ec.BytesOut}
		out[n] = ec
	}
	t.bytesHW = hw
	return out, nil
}

// flushChanged deletes the conntrack entries of every exposure host side
// that a change (not a repair) created, changed or removed.
func (t *Table) flushChanged(p *compile.Plan, changed []string, keys map[string]compile.UnitKey) map[string]int {
	isChange := map[string]bool{}
	for _, c := range changed {
		isChange[c] = true
	}
	type side = hostSide
	sides := map[side]string{}
	for _, set := range []string{compile.MapExpAny, compile.MapExpAddr} {
		for _, es := range [][]compile.ElemSpec{p.DelElems[set], p.AddElems[set]} {
			for _, e := range es {
				if sd, ok := decodeHostSide(set, e.Key); ok {
					sides[sd] = e.Comment
				}
			}
		}
	}
	// An exposure whose chain is new or rewritten: found from the changes
	// themselves, so a Converge with one change does not walk every
	// exposure.
	for _, c := range changed {
		rest, ok := strings.CutPrefix(c, "chain "+compile.ExpChain(""))
		if !ok {
			rest, ok = strings.CutPrefix(c, "rules of chain "+compile.ExpChain(""))
		}
		if !ok {
			continue
		}
		for _, what := range []string{" missing", " differs", " differ"} {
			name, ok := strings.CutSuffix(rest, what)
			if !ok {
				continue
			}
			if k, ok := keys[name]; ok {
				sides[hostSideOf(k.Exp)] = k.Exp.Name
			}
		}
	}
	// Elements repaired (not changed) are dropped from the list: a repair
	// restores what was there, the flows are still right.
	for _, d := range p.Diffs {
		if strings.HasPrefix(d.Object, "element ") && !isChange[d.String()] {
			for _, set := range []string{compile.MapExpAny, compile.MapExpAddr} {
				if strings.HasPrefix(d.Object, "element "+set+"[") {
					name := strings.TrimSuffix(strings.TrimPrefix(d.Object, "element "+set+"["), "]")
					for k, v := range sides {
						if v == name {
							delete(sides, k)
						}
					}
				}
			}
		}
	}
	if len(sides) == 0 {
		return nil
	}
	list := make([]conntrack.HostSide, 0, len(sides))
	names := make([]string, 0, len(sides))
	for s, name := range sides {
		list = append(list, conntrack.HostSide{Proto: s.proto, Addr: s.addr, Port: s.port})
		names = append(names, name)
	}
	counts, err := t.ct.DeleteHostSides(list)
	if err != nil {
		t.log.Warn("nft: conntrack flush failed", "err", err)
	}
	out := map[string]int{}
	for i, n := range counts {
		out[names[i]] += n
	}
	return out
}

type hostSide struct {
	proto uint8
	addr  netip.Addr
	port  uint16
}

func decodeHostSide(set string, k []byte) (hostSide, bool) {
	switch {
	case set == compile.MapExpAny && len(k) == 8:
		return hostSide{k[0], netip.Addr{}, binary.BigEndian.Uint16(k[4:6])}, true
	case set == compile.MapExpAddr && len(k) == 12:
		return hostSide{k[4], netip.AddrFrom4([4]byte(k[0:4])), binary.BigEndian.Uint16(k[8:10])}, true
	}
	return hostSide{}, false
}
