package proxy

import (
	"errors"
	"io"
	"log/slog"
	"net"
	"net/netip"
	"os"
	"sync/atomic"
	"syscall"
	"time"

	"golang.org/x/sys/unix"

	"github.com/brokkr/brokkr/internal/spec"
)

// The pause an accept loop takes while the process is out of descriptors:
// it starts short so a brief shortage costs little, and doubles up to a
// ceiling so a long one does not spin.
const (
	acceptPauseFloor   = 5 * time.Millisecond
	acceptPauseCeiling = time.Second
)

// serveTCP is one listener's accept loop. A shortage of descriptors (EMFILE,
// ENFILE) pauses it and keeps the port: handing the listener back would ask
// the next converge for a descriptor the process does not have, and the
// backlog keeps callers waiting instead of refused. Any other accept error is
// a broken listener: the loop gives it back, with the reason, for the next
// converge to rebind.
//
// slotPort labels the slot where a carried connection's place is counted
// on a hand-over: the exposure's host port (a range's first); 0: the port
// bound (HostPort 0, the OS picked it).
func (m *Manager) serveTCP(ex *exposure, ln net.Listener, stop chan struct{}, to spec.Target, guestPort int, slotPort uint16) {
	hostPort := slotPort
	if a, ok := ln.Addr().(*net.TCPAddr); ok && hostPort == 0 {
		hostPort = uint16(a.Port)
	}
	if !m.held(stop) {
		return
	}
	// A rawListener is accepted from on raw descriptors (sock.go); any
	// other (one that could not be taken over, a test's) through Accept.
	rl, _ := ln.(*rawListener)
	// The address callers dialled: the listener's (without a link-local
	// one's zone, as getsockname gives it), unless it is a wildcard one
	// (then asked of the caller's socket only when needed, see admit).
	var local netip.AddrPort
	if rl != nil {
		if la := rl.addr.AddrPort(); !la.Addr().IsUnspecified() {
			local = noZone(la)
		}
	}
	var pause time.Duration
	for {
		var c sock
		var remote netip.AddrPort
		var err error
		if rl != nil {
			var f *os.File
			if f, remote, err = rl.accept(); err == nil {
				c = f
			}
		} else {
			var nc net.Conn
			if nc, err = ln.Accept(); err == nil {
				tc, ok := nc.(*net.TCPConn)
				if !ok {
					nc.Close()
					continue
				}
				c = tc
				if ra, ok := tc.RemoteAddr().(*net.TCPAddr); ok {
					remote = noZone(ra.AddrPort())
				}
			}
		}
		if err != nil {
			if outOfDescriptors(err) {
				if pause == 0 {
					m.setReason(ex, ln, "out of descriptors: "+err.Error()+" (port stays bound; retrying)")
					m.logs.event(slog.LevelWarn, ex.id, evShortage,
						"proxy: out of descriptors; accepting paused, the port stays bound", "err", err)
				}
				pause = nextPause(pause)
				select {
				case <-time.After(pause):
					continue
				case <-stop:
					return
				}
			}
			m.mu.Lock()
			dead := ex.ln == ln // not closed on purpose
			if dead {
				ex.closeSocket()
				ex.reason = "accept: " + err.Error()
				ex.lost = ex.reason
			}
			m.mu.Unlock()
			if dead {
				m.logs.event(slog.LevelError, ex.id, evDeadLoop,
					"proxy: accept loop ended; the listener is rebound on the next converge", "err", err)
			}
			return
		}
		if pause != 0 {
			pause = 0
			m.setReason(ex, ln, "")
			m.logs.event(slog.LevelInfo, ex.id, evRecover, "proxy: accepting again after a descriptor shortage")
		}
		m.admit(ex, c, remote, local, to, uint16(guestPort), hostPort)
	}
}

// nextPause is the accept loop's backoff: 5 ms, then doubling up to 1 s.
func nextPause(p time.Duration) time.Duration {
	if p == 0 {
		return acceptPauseFloor
	}
	return min(p*2, acceptPauseCeiling)
}

// setReason records a listener's warning, if that listener is still the
// exposure's current one.
func (m *Manager) setReason(ex *exposure, ln net.Listener, reason string) {
	m.mu.Lock()
	if ex.ln == ln {
		ex.reason = reason
	}
	m.mu.Unlock()
}

func outOfDescriptors(err error) bool {
	return errors.Is(err, syscall.EMFILE) || errors.Is(err, syscall.ENFILE)
}

// admit applies the cap. The count is taken before the decision and given
// back on refusal, so a burst of simultaneous callers cannot all read a stale
// count and all pass.
//
// remote is the caller's address; local the address it dialled, or the
// zero AddrPort when the listener is a wildcard one (asked of the socket
// only when allowFrom or a PROXY header needs it).
func (m *Manager) admit(ex *exposure, c sock, remote, local netip.AddrPort, to spec.Target, guestPort, hostPort uint16) {
	// allowFrom first: a caller from elsewhere is closed at accept and
	// takes no place of the cap.
	if a := ex.allow.Load(); a != nil {
		src := remote.Addr()
		if !remote.Addr().Unmap().IsLoopback() && !local.IsValid() {
			local = sockLocalAddr(c)
		}
		if !hostLocal(src, local.Addr()) && !a.allows(src) {
			// Counted and noted before the caller learns it: whoever saw
			// the close sees the books already written.
			ex.ctr.slot.AddDenied(1)
			m.logs.event(slog.LevelInfo, ex.id, evDenied, "proxy: caller not in allowFrom closed", "from", src)
			_ = c.Close()
			return
		}
	}
	// The place is taken in the exposure's slot, against the one cap every
	// path of the exposure shares (the kernel's and the other listeners').
	if !ex.ctr.slot.Reserve() {
		ex.ctr.slot.AddRefused(1)
		m.logs.event(slog.LevelWarn, ex.id, evRefused, "proxy: caller refused at the connection cap", "maxConns", ex.maxConns.Load())
		reset(c)
		return
	}
	ex.conns.Add(1)
	if !m.track(c) {
		ex.conns.Add(-1)
		ex.ctr.slot.Closed()
		reset(c)
		return
	}
	ex.ctr.acquire()
	job := carryJob{ex: ex, c: c, remote: remote, local: local, to: to, guestPort: guestPort, hostPort: hostPort}
	select {
	case m.carriers <- job: // a parked carrier takes it
	default:
		m.carrierWG.Add(1)
		go m.carrier(job)
	}
}

// maxIdleCarriers bounds the carrier goroutines parked for reuse.
const maxIdleCarriers = 32

// carrierIdle is how long a parked carrier waits for the next caller before
// it exits, so a daemon at rest after a burst holds no extra goroutines.
var carrierIdle = 30 * time.Second

// carryJob is one admitted caller waiting to be carried.
type carryJob struct {
	ex                  *exposure
	c                   sock
	remote, local       netip.AddrPort // local: zero when not known yet (see admit)
	to                  spec.Target
	guestPort, hostPort uint16
}

// carrier carries one connection, then parks for the next instead of
// exiting. Why: a fresh goroutine's stack was copied to a larger one on
// every connection (about 5% of the proxy's CPU at high connection rates,
// measured while the dial into the guest ran deep in the net package, before
// sock.go's dialTCP; not measured since); a reused carrier
// already has the stack, and the accept loop hands it a job without starting
// a goroutine. At most maxIdleCarriers park; a burst's extra ones exit.
func (m *Manager) carrier(job carryJob) {
	defer m.carrierWG.Done()
	// Not stopped on exit: an unreferenced timer is collected (Go 1.23+).
	var idle *time.Timer
	for {
		// Called straight from this loop, not through a helper with defers:
		// that one more frame under every held connection cost 1.3 kB per
		// held idle connection (measured; the cause not pinned down).
		m.carry(&job)
		job.ex.conns.Add(-1)
		job.ex.ctr.release()
		m.untrack(job.c)
		if m.idleCarriers.Add(1) > maxIdleCarriers {
			m.idleCarriers.Add(-1)
			return
		}
		if idle == nil {
			idle = time.NewTimer(carrierIdle)
		} else {
			idle.Reset(carrierIdle)
		}
		select {
		case job = <-m.carriers:
			m.idleCarriers.Add(-1)
		case <-idle.C:
			m.idleCarriers.Add(-1)
			return
		case <-m.quitCarriers:
			m.idleCarriers.Add(-1)
			return
		}
	}
}

// carry dials the guest and, only once that worked, counts the connection
// and splices it. A caller the proxy cannot carry (no guest address yet, a
// guest that does not answer) is reset at once and counted as dropped. A
// connection frozen for a hand-over keeps its place under the cap: the next
// process takes it over (see handover.go), so Closed is not called here.
func (m *Manager) carry(job *carryJob) {
	ex, client, to, hostPort := job.ex, job.c, job.to, job.hostPort
	slot := ex.ctr.slot
	v6 := fromIPv6(job.remote)
	addr := m.guestAddr(to, v6)
	if addr == "" {
		slot.AddDropped(1)
		slot.Closed()
		reset(client)
		return
	}
	guest, err := m.dialGuest(to, addr, job.guestPort, v6)
	if err != nil {
		slot.AddDropped(1)
		slot.Closed()
		reset(client)
		return
	}
	if v := ex.pp.Load(); v != ppNone {
		// Before the first byte of the caller's, as a plain write: the
		// payload keeps the splice path.
		local := job.local
		if !local.IsValid() {
			local = sockLocalAddr(client)
		}
		if err := writePPHeader(guest, job.remote, local, v); err != nil {
			guest.Close()
			slot.AddDropped(1)
			slot.Closed()
			reset(client)
			return
		}
	}
	slot.AddAccepted(1)
	p := &pair{client: client, guest: guest, id: ex.id, hostPort: hostPort}
	if !m.runPair(p, func(n int64) { slot.AddBytes(uint64(n), 0) }, func(n int64) { slot.AddBytes(0, uint64(n)) }) {
		slot.Closed()
	}
}

// pair is one carried connection: the caller's socket, the guest's, and
// what a freeze for a hand-over left of each direction.
type pair struct {
	client, guest sock
	id            string // "" for a connection Carry took from the network plane
	hostPort      uint16
	frozen        atomic.Bool
	// Index 0 is caller to guest (bytes_in), 1 guest to caller (bytes_out).
	pending [2][]byte // read from the source, not yet written to the destination
	done    [2]bool   // the direction reached EOF and was shut down
}

// freeze stops both directions at their next wait: a deadline in the past
// wakes a goroutine parked in the poller without touching the sockets.
func (p *pair) freeze() {
	p.frozen.Store(true)
	past := time.Unix(1, 0)
	_ = p.client.SetDeadline(past)
	_ = p.guest.SetDeadline(past)
}

type halfEnd int

const (
	halfEOF halfEnd = iota
	halfError
	halfFrozen
)

// runPair carries both directions until both ended, then closes both ends.
// It reports true when the pair was frozen for a hand-over instead: then
// both sockets are left open and the pair is kept for Freeze to collect.
func (m *Manager) runPair(p *pair, in, out func(int64)) (frozen bool) {
	if !m.register(p) {
		m.keepFrozen(p)
		return true
	}
	var ended atomic.Int32
	for _, d := range p.done {
		if d {
			ended.Add(1)
		}
	}
	var res [2]halfEnd
	errc := make(chan struct{})
	go func() {
		res[0] = copyHalf(p, 0, p.guest, p.client, in, &ended)
		close(errc)
	}()
	res[1] = copyHalf(p, 1, p.client, p.guest, out, &ended)
	<-errc
	m.unregister(p)
	if res[0] != halfError && res[1] != halfError && (res[0] == halfFrozen || res[1] == halfFrozen) {
		m.keepFrozen(p)
		return true
	}
	p.client.Close()
	p.guest.Close()
	return false
}

// Carry splices a connection that the network plane admitted on its cap's
// slow path (netplane/nft: the kernel's cap set was full, the plane found a
// slot): client is the caller, guest is already connected. It returns at
// once. The connection counts in no slot here: it carries its exposure's
// conntrack mark, so the network plane counts it (accepted, active, bytes)
// like every kernel-path connection. StopAll ends it like any carried one.
func (m *Manager) Carry(exposure string, client, guest *net.TCPConn) {
	if !m.track(client) {
		reset(client)
		guest.Close()
		return
	}
	go func() {
		defer m.untrack(client)
		m.runPair(&pair{client: client, guest: guest}, func(int64) {}, func(int64) {})
	}()
}

// copyHalf moves one direction until the source says EOF, then half-closes
// the destination so the other side sees the end while the reverse direction
// keeps flowing. Any other error (a reset, a write to a closed peer) ends the
// whole connection, which is what unblocks the other direction. A freeze
// (p.frozen, then a deadline error) ends it with both sockets open and what
// sat in the pipe saved in p.pending[dir].
//
// A direction starts by copying through a small buffer with recv and send
// (as HAProxy's splice-auto does): for the few bytes of a short connection
// these cost less than two splices and a pipe from the pool. The first read
// that fills the buffer switches the direction to splice for good
// (TestSmallChunksAreCopiedAndBulkIsSpliced).
//
// From then on the bytes go socket -> pipe -> socket with splice(2), never
// through user memory (TestCarriedBytesGoThroughSplice). The proxy drives splice itself
// rather than through io.Copy, for two reasons. An idle direction must not
// hold a pipe (two descriptors) while it waits: the pipe is taken only for a
// read that finds data and goes back to the pool before waiting
// (TestAnIdleConnectionHoldsOnlyItsTwoSockets). And a short connection pays
// no extra syscalls to learn that: the read itself says "no data yet"
// (EAGAIN), "EOF" (0) or how much it moved, where a MSG_PEEK probe and a
// SIOCINQ ioctl before every io.CopyN cost three or four more per direction.
// The counters move after every pipeful, so they follow long transfers.
//
// ended counts the directions that reached EOF. The second one skips the
// shutdown: splice closes both sockets as soon as it returns, and a close
// with nothing left unread sends the same FIN.
func copyHalf(pr *pair, dir int, dst, src sock, count func(int64), ended *atomic.Int32) (res halfEnd) {
	if pr.done[dir] {
		return halfEOF
	}
	var err error
	var p *pipe
	var b *chunk // the small buffer, held only while it holds bytes
	defer func() {
		switch {
		case err == nil:
			pr.done[dir] = true
			if ended.Add(1) < 2 {
				_ = closeWrite(dst)
			}
			res = halfEOF
		case pr.frozen.Load() && errors.Is(err, os.ErrDeadlineExceeded):
			if b != nil {
				pr.pending[dir] = append(pr.pending[dir], b.unsent()...)
			}
			if p != nil && p.queued > 0 {
				pr.pending[dir] = append(pr.pending[dir], drainPipe(p)...)
			}
			res = halfFrozen
		default:
			src.Close()
			dst.Close()
			res = halfError
		}
		putPipe(p)
		putChunk(b)
	}()
	// Bytes a previous process had read but not written go first.
	for len(pr.pending[dir]) > 0 {
		var n int
		n, err = dst.Write(pr.pending[dir])
		pr.pending[dir] = pr.pending[dir][n:]
		count(int64(n))
		if err != nil {
			return
		}
	}
	pr.pending[dir] = nil
	srcRC, err := src.SyscallConn()
	if err != nil {
		return
	}
	dstRC, err := dst.SyscallConn()
	if err != nil {
		return
	}
	for {
		var n int
		if n, err = recvIn(srcRC, &b); err != nil || n == 0 { // n == 0: EOF
			return
		}
		if err = sendOut(dstRC, b); err != nil {
			count(int64(b.sent))
			return
		}
		count(int64(n))
		full := n == len(b.buf)
		putChunk(b)
		b = nil
		if full {
			break
		}
	}
	for {
		var n int
		if n, err = spliceIn(srcRC, &p); err != nil {
			if errors.Is(err, errNoPipe) { // out of descriptors: copy through memory
				err = copyThroughMemory(pr, dir, dst, src, count)
			}
			return
		}
		if n == 0 { // EOF
			return
		}
		if err = spliceOut(dstRC, p); err != nil {
			// What reached dst counts here; what is left in the pipe
			// travels with a freeze and is counted where it is written.
			count(int64(n - p.queued))
			return
		}
		count(int64(n))
	}
}

// drainPipe reads what a frozen direction left in its pipe, so the bytes
// travel to the next process with the sockets and are written there first.
func drainPipe(p *pipe) []byte {
	buf := make([]byte, p.queued)
	got := 0
	for got < len(buf) {
		n, err := unix.Read(p.r, buf[got:])
		if err == unix.EINTR {
			continue
		}
		if err != nil || n <= 0 {
			break
		}
		got += n
	}
	p.queued -= got
	return buf[:got]
}

// errNoPipe: a pipe could not be made (out of descriptors, typically).
var errNoPipe = errors.New("no splice pipe")

// spliceIn waits until src has data or has ended and moves what is queued
// into *pp: the number of bytes moved, 0 at EOF. The pipe is taken from the
// pool only when needed and given back before every wait, so a direction
// waiting for data holds nothing but its socket.
func spliceIn(rc syscall.RawConn, pp **pipe) (int, error) {
	var moved int
	var serr error
	err := rc.Read(func(fd uintptr) bool {
		if *pp == nil {
			if *pp = getPipe(); *pp == nil {
				serr = errNoPipe
				return true
			}
		}
		for {
			n, err := sysSplice(int(fd), (*pp).w, maxPipe, unix.SPLICE_F_MOVE|unix.SPLICE_F_NONBLOCK)
			switch {
			case err == unix.EINTR:
				continue
			case err == unix.EAGAIN: // nothing queued (the pipe is always empty here)
				putPipe(*pp)
				*pp = nil
				return false
			case err != nil:
				serr = err
			default:
				moved = int(n)
				(*pp).queued = moved
			}
			return true
		}
	})
	if err != nil {
		return 0, err
	}
	return moved, serr
}

// recvIn waits until src has data or has ended and reads what is queued
// into *bp: the number of bytes read, 0 at EOF. Like spliceIn's pipe, the
// buffer is taken only when needed and given back before every wait.
func recvIn(rc syscall.RawConn, bp **chunk) (int, error) {
	var serr error
	err := rc.Read(func(fd uintptr) bool {
		if *bp == nil {
			*bp = getChunk()
		}
		for {
			n, err := sysRecv(int(fd), (*bp).buf[:])
			switch {
			case err == unix.EINTR:
				continue
			case err == unix.EAGAIN:
				putChunk(*bp)
				*bp = nil
				return false
			case err != nil:
				serr = err
			default:
				(*bp).n = n
			}
			return true
		}
	})
	if err != nil {
		return 0, err
	}
	if serr != nil {
		return 0, serr
	}
	return (*bp).n, nil
}

// sendOut writes what b holds to dst, waiting while dst's buffer is full;
// b.sent says how much went.
func sendOut(rc syscall.RawConn, b *chunk) error {
	var serr error
	err := rc.Write(func(fd uintptr) bool {
		for b.sent < b.n {
			n, err := sysSend(int(fd), b.buf[b.sent:b.n])
			switch {
			case err == unix.EINTR:
				continue
			case err == unix.EAGAIN:
				return false
			case err != nil:
				serr = err
				return true
			}
			b.sent += n
		}
		return true
	})
	if err != nil {
		return err
	}
	return serr
}

// spliceOut drains the pipe into dst, waiting while dst's buffer is full.
func spliceOut(rc syscall.RawConn, p *pipe) error {
	var serr error
	err := rc.Write(func(fd uintptr) bool {
		for p.queued > 0 {
			n, err := sysSplice(p.r, int(fd), p.queued, unix.SPLICE_F_MOVE|unix.SPLICE_F_NONBLOCK)
			switch {
			case err == unix.EINTR:
				continue
			case err == unix.EAGAIN:
				return false // wait for the poller to say writable
			case err != nil:
				serr = err
				return true
			case n == 0:
				serr = io.ErrUnexpectedEOF
				return true
			}
			p.queued -= int(n)
		}
		return true
	})
	if err != nil {
		return err
	}
	return serr
}

// copyThroughMemory is the fallback when no pipe can be made: one read and
// one write at a time, through a small buffer. A freeze mid-write keeps the
// unwritten rest in pr.pending[dir].
func copyThroughMemory(pr *pair, dir int, dst, src sock, count func(int64)) error {
	buf := make([]byte, 32<<10)
	for {
		n, err := src.Read(buf)
		if n > 0 {
			w, werr := dst.Write(buf[:n])
			count(int64(w))
			if werr != nil {
				pr.pending[dir] = append(pr.pending[dir], buf[w:n]...)
				return werr
			}
		}
		if errors.Is(err, io.EOF) {
			return nil
		}
		if err != nil {
			return err
		}
	}
}

// reset closes a caller with a RST (SO_LINGER 0), so it learns at once that
// it was not carried instead of reading an orderly, empty reply.
func reset(c sock) {
	setLinger0(c)
	c.Close()
}
