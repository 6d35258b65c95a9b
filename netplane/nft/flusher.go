package nft

import (
	"log/slog"
	"sync"

	"github.com/brokkr/brokkr/netplane/nft/compile"
)

// flusher deletes the conntrack entries of host sides that an Update
// withdrew or moved, off the path of the Update: a flush walks the
// host's whole conntrack hash (13–17 ms here, whatever it deletes), which
// made it nearly all of an exposure change's cost. The sides of changes
// that come while a flush runs share the next walk. The flows of a removed
// exposure are cut within a walk of its acknowledgement (kube-proxy clears
// conntrack after its sync too); the order that matters is kept: a change
// that publishes a host side again first waits for that side's pending
// flush (takeBefore), so the flush never cuts the new exposure's flows.
//
// A whole Converge flushes synchronously as before (its Result says what).
type flusher struct {
	k   kernel
	log *slog.Logger

	mu       sync.Mutex
	pending  map[compile.HostSide]string // side → the exposure it was
	inflight map[compile.HostSide]bool   // the sides of the flush under way
	started  bool
	closed   bool
	kick     chan struct{}
	done     chan struct{}

	walk sync.Mutex // one flush at a time, asynchronous or not
}

func newFlusher(k kernel, log *slog.Logger) *flusher {
	return &flusher{k: k, log: log, pending: map[compile.HostSide]string{}, kick: make(chan struct{}, 1), done: make(chan struct{})}
}

// add queues the sides changes ask to flush and wakes the flusher (its
// goroutine starts with the first side).
func (f *flusher) add(changes []compile.Change) {
	f.mu.Lock()
	defer f.mu.Unlock()
	n := 0
	for _, c := range changes {
		if c.Flush {
			f.pending[c.HostSide] = c.Exposure.Name
			n++
		}
	}
	if n == 0 {
		return
	}
	if f.closed {
		return // the kernel's sockets are closed: no batch gets here
	}
	if !f.started {
		f.started = true
		go f.run()
	}
	select {
	case f.kick <- struct{}{}:
	default:
	}
}

// takeBefore flushes now the pending sides that changes publish again (the
// same protocol and port), so none is flushed after its new elements are
// in.
func (f *flusher) takeBefore(changes []compile.Change) {
	f.mu.Lock()
	hit := false
	same := func(s compile.HostSide, c compile.Change) bool {
		return s.Proto == c.HostSide.Proto && s.Port == c.HostSide.Port
	}
	for _, c := range changes {
		if c.Kind == compile.Removed {
			continue
		}
		for s := range f.pending {
			hit = hit || same(s, c)
		}
		for s := range f.inflight {
			hit = hit || same(s, c)
		}
	}
	f.mu.Unlock()
	if hit {
		f.drain() // waits for the flush under way, then flushes the rest
	}
}

func (f *flusher) run() {
	defer close(f.done)
	for range f.kick {
		f.drain()
	}
}

// drain flushes every pending side in one call (one walk, or one filtered
// dump per side, as conntrack picks).
func (f *flusher) drain() {
	f.walk.Lock()
	defer f.walk.Unlock()
	f.mu.Lock()
	sides := make([]compile.HostSide, 0, len(f.pending))
	names := make([]string, 0, len(f.pending))
	for s, n := range f.pending {
		sides = append(sides, s)
		names = append(names, n)
	}
	clear(f.pending)
	f.inflight = make(map[compile.HostSide]bool, len(sides))
	for _, s := range sides {
		f.inflight[s] = true
	}
	f.mu.Unlock()
	defer func() {
		f.mu.Lock()
		f.inflight = nil
		f.mu.Unlock()
	}()
	if len(sides) == 0 {
		return
	}
	counts, err := f.k.flush(sides)
	if err != nil {
		f.log.Warn("nft: conntrack flush failed", "err", err)
	}
	for i, n := range counts {
		if n > 0 {
			f.log.Debug("nft: conntrack entries flushed", "exposure", names[i], "entries", n)
		}
	}
}

// close stops the goroutine after flushing what is pending.
func (f *flusher) close() {
	f.mu.Lock()
	if f.closed {
		f.mu.Unlock()
		return
	}
	f.closed = true
	started := f.started
	f.mu.Unlock()
	if started {
		close(f.kick)
		<-f.done
	}
	f.drain()
}
