package proxy

import (
	"errors"
	"io"
	"net"
	"strconv"
	"syscall"
	"time"
)

// The pause an accept loop takes while the process is out of descriptors:
// it starts short so a brief shortage costs little, and doubles up to a
// ceiling so a long one does not spin.
const (
	acceptPauseFloor   = 5 * time.Millisecond
	acceptPauseCeiling = time.Second
)

// copyChunk bounds one io.CopyN call of a carried connection, so its byte
// counters move while a long transfer is still running. The chunk goes
// through io.LimitedReader, which Go's splice path unwraps: the copy is still
// splice(2) (see TestCarriedBytesGoThroughSplice).
const copyChunk = 1 << 20

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
	ex.ctr.acquire()
	go func() {
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
	errc := make(chan struct{})
	go func() {
		copyHalf(guest, client, func(n int64) { slot.AddBytes(uint64(n), 0) })
		close(errc)
	}()
	copyHalf(client, guest, func(n int64) { slot.AddBytes(0, uint64(n)) })
	<-errc
	client.Close()
	guest.Close()
}

// copyHalf moves one direction until the source says EOF, then half-closes
// the destination so the other side sees the end while the reverse direction
// keeps flowing. Any other error (a reset, a write to a closed peer) ends the
// whole connection, which is what unblocks the other direction.
//
// Both ends are *net.TCPConn, never wrapped, so Go moves the bytes with
// splice(2); bytes are counted from what io.CopyN reports.
func copyHalf(dst, src *net.TCPConn, count func(int64)) {
	for {
		n, err := io.CopyN(dst, src, copyChunk)
		if n > 0 {
			count(n)
		}
		switch {
		case err == nil:
			continue
		case errors.Is(err, io.EOF):
			_ = dst.CloseWrite()
		default:
			src.Close()
			dst.Close()
		}
		return
	}
}

// reset closes a caller with a RST (SO_LINGER 0), so it learns at once that
// it was not carried instead of reading an orderly, empty reply.
func reset(c net.Conn) {
	if tc, ok := c.(*net.TCPConn); ok {
		_ = tc.SetLinger(0)
	}
	c.Close()
}
