package proxy

import (
	"errors"
	"io"
	"net"
	"strconv"
	"syscall"
	"time"

	"golang.org/x/sys/unix"
)

// The pause an accept loop takes while the process is out of descriptors:
// it starts short so a brief shortage costs little, and doubles up to a
// ceiling so a long one does not spin.
const (
	acceptPauseFloor   = 5 * time.Millisecond
	acceptPauseCeiling = time.Second
)

// copyChunk bounds one io.CopyN call of a streaming connection, and
// streamingQueue is how much must be queued for a connection to count as
// streaming (see copyHalf).
const (
	copyChunk      = 4 << 20
	streamingQueue = 64 << 10
)

// serveTCP is one listener's accept loop. A shortage of descriptors (EMFILE,
// ENFILE) pauses it and keeps the port: handing the listener back would ask
// the next converge for a descriptor the process does not have, and the
// backlog keeps callers waiting instead of refused. Any other accept error is
// a broken listener: the loop gives it back, with the reason, for the next
// converge to rebind.
func (m *Manager) serveTCP(ex *exposure, ln net.Listener, stop chan struct{}, vm string, guestPort int) {
	target := strconv.Itoa(guestPort)
	var pause time.Duration
	for {
		c, err := ln.Accept()
		if err != nil {
			if outOfDescriptors(err) {
				if pause == 0 {
					m.setReason(ex, ln, "out of descriptors: "+err.Error()+" (port stays bound; retrying)")
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
			if ex.ln == ln { // not closed on purpose
				ex.closeSocket()
				ex.reason = "accept: " + err.Error()
				ex.lost = ex.reason
			}
			m.mu.Unlock()
			return
		}
		if pause != 0 {
			pause = 0
			m.setReason(ex, ln, "")
		}
		m.admit(ex, c, vm, target)
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
func (m *Manager) admit(ex *exposure, c net.Conn, vm, guestPort string) {
	n := ex.conns.Add(1)
	if limit := ex.maxConns.Load(); limit > 0 && n > limit {
		ex.conns.Add(-1)
		ex.ctr.slot.AddRefused(1)
		reset(c)
		return
	}
	if !m.track(c) {
		ex.conns.Add(-1)
		reset(c)
		return
	}
	ex.ctr.acquire()
	go func() {
		defer m.untrack(c)
		defer ex.ctr.release()
		defer ex.conns.Add(-1)
		m.carry(ex, c, vm, guestPort)
	}()
}

// carry dials the guest and, only once that worked, counts the connection
// and splices it. A caller the proxy cannot carry (no guest address yet, a
// guest that does not answer) is reset at once and counted as dropped.
func (m *Manager) carry(ex *exposure, c net.Conn, vm, guestPort string) {
	slot := ex.ctr.slot
	client, ok := c.(*net.TCPConn)
	addr := m.resolve(vm)
	if !ok || addr == "" {
		slot.AddDropped(1)
		reset(c)
		return
	}
	g, err := m.dialer.Dial("tcp", net.JoinHostPort(addr, guestPort))
	if err != nil {
		slot.AddDropped(1)
		reset(c)
		return
	}
	guest := g.(*net.TCPConn)
	slot.Opened()
	defer slot.Closed()
	splice(client, guest, func(n int64) { slot.AddBytes(uint64(n), 0) }, func(n int64) { slot.AddBytes(0, uint64(n)) })
}

// splice carries both directions until both ended, then closes both ends.
func splice(client, guest *net.TCPConn, in, out func(int64)) {
	errc := make(chan struct{})
	go func() {
		copyHalf(guest, client, in)
		close(errc)
	}()
	copyHalf(client, guest, out)
	<-errc
	client.Close()
	guest.Close()
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
		splice(client, guest, func(int64) {}, func(int64) {})
	}()
}

// copyHalf moves one direction until the source says EOF, then half-closes
// the destination so the other side sees the end while the reverse direction
// keeps flowing. Any other error (a reset, a write to a closed peer) ends the
// whole connection, which is what unblocks the other direction.
//
// Both ends are *net.TCPConn, never wrapped, so io.CopyN moves the bytes with
// splice(2) (see TestCarriedBytesGoThroughSplice). The copy goes in bounded
// io.CopyN chunks, so the byte counters move while a connection is open, and
// a chunk starts only once the source has data: Go's splice holds a pipe (two
// descriptors) for as long as it waits for data, so an idle connection must
// not be waiting inside one. A connection with little queued gets a chunk of
// exactly that (it never waits in splice); a streaming one (streamingQueue or
// more queued) gets copyChunk, which spares the per-chunk checks while bulk
// data flows and at worst holds a pipe until a stalled stream resumes.
func copyHalf(dst, src *net.TCPConn, count func(int64)) {
	rc, err := src.SyscallConn()
	for err == nil {
		var queued int
		if queued, err = waitQueued(rc); err != nil {
			break
		}
		if queued == 0 { // EOF
			_ = dst.CloseWrite()
			return
		}
		// A streaming source gets a whole chunk: splice keeps its pipe
		// between reads, as in a plain io.Copy. Anything less gets exactly
		// what is queued, so the copy never waits inside splice.
		chunk := int64(queued)
		if queued >= streamingQueue {
			chunk = copyChunk
		}
		var n int64
		n, err = io.CopyN(dst, src, chunk)
		if n > 0 {
			count(n)
		}
	}
	if errors.Is(err, io.EOF) {
		_ = dst.CloseWrite()
		return
	}
	src.Close()
	dst.Close()
}

// waitQueued blocks, without holding anything but the socket, until the
// socket has bytes to read (it returns how many are queued), has reached EOF
// (0), or has failed.
func waitQueued(rc syscall.RawConn) (int, error) {
	var queued int
	var serr error
	err := rc.Read(func(fd uintptr) bool {
		var b [1]byte
		for {
			n, _, err := unix.Recvfrom(int(fd), b[:], unix.MSG_PEEK|unix.MSG_DONTWAIT)
			switch {
			case err == unix.EINTR:
				continue
			case err == unix.EAGAIN:
				return false // wait for the poller to say readable
			case err != nil:
				serr = err
			case n > 0:
				queued, err = unix.IoctlGetInt(int(fd), unix.SIOCINQ)
				if err != nil || queued < 1 {
					queued = 1
				}
			}
			return true
		}
	})
	if err != nil {
		return 0, err
	}
	return queued, serr
}

// reset closes a caller with a RST (SO_LINGER 0), so it learns at once that
// it was not carried instead of reading an orderly, empty reply.
func reset(c net.Conn) {
	if tc, ok := c.(*net.TCPConn); ok {
		_ = tc.SetLinger(0)
	}
	c.Close()
}
