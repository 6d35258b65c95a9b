package proxy

import (
	"net"
	"net/netip"
	"time"

	"github.com/brokkr/brokkr/internal/spec"
)

// Waker wakes suspended VMs (the daemon's Wakes): the proxy's side of
// waking a suspended VM on its first caller (docs/ARCHITECTURE.md,
// "Suspend and resume").
type Waker interface {
	// Wake asks for vm to be resumed and returns a channel closed once it
	// runs again; nil when it is not asleep. It must be cheap: it is asked
	// per connection.
	Wake(vm string) <-chan struct{}
}

// DefaultWakeHold bounds how long a caller of a suspended VM is held: a
// resume takes about a second under TCG, a cold boot after a state that
// does not load a few more.
const DefaultWakeHold = 30 * time.Second

// wakeRetry is the pause between two dials of a guest that has just been
// resumed but does not answer yet (it was booted cold instead).
const wakeRetry = 100 * time.Millisecond

// WithWaker makes the proxy hold a caller of a suspended VM (its place
// under the cap taken, like any caller's) until the VM runs again and its
// guest answers, for at most hold; then it is reset and counted as
// dropped, as any caller the proxy cannot carry. A UDP flow's first
// datagram only asks for the wake: it is sent on, and lost while the guest
// sleeps.
func WithWaker(w Waker, hold time.Duration) Option {
	return func(m *Manager) { m.waker, m.wakeHold = w, hold }
}

// dialGuest is the dial of carry: for a VM that is awake, one dial; for
// one that is asleep, the wake, the wait for it, and dials until the guest
// answers or the hold runs out.
func (m *Manager) dialGuest(to spec.Target, addr string, port uint16, v6 bool) (sock, error) {
	var ready <-chan struct{}
	if m.waker != nil && to.IsVM() {
		ready = m.waker.Wake(to.VM)
	}
	if ready == nil {
		return m.dial(addr, port, m.dialTimeout)
	}
	deadline := time.Now().Add(m.wakeHold)
	t := time.NewTimer(m.wakeHold)
	defer t.Stop()
	select {
	case <-ready:
	case <-t.C:
	case <-m.stopping:
		return nil, net.ErrClosed
	}
	for {
		// The address may have changed while the VM slept (a new lease).
		if a := m.guestAddr(to, v6); a != "" {
			addr = a
		}
		c, err := m.dial(addr, port, min(m.dialTimeout, max(time.Until(deadline), time.Millisecond)))
		if err == nil || time.Until(deadline) < wakeRetry {
			return c, err
		}
		select {
		case <-time.After(wakeRetry):
		case <-m.stopping:
			return nil, net.ErrClosed
		}
	}
}

// dial connects to a guest address (an IP address, as the resolvers give;
// a link-local one with its zone).
func (m *Manager) dial(addr string, port uint16, timeout time.Duration) (sock, error) {
	a, err := netip.ParseAddr(addr)
	if err != nil {
		return nil, &net.OpError{Op: "dial", Net: "tcp", Err: err}
	}
	f, err := dialTCP(netip.AddrPortFrom(a, port), timeout)
	if err != nil {
		return nil, err
	}
	return f, nil
}

// wakeFor asks for the wake of a UDP flow's VM, without waiting.
func (m *Manager) wakeFor(to spec.Target) {
	if m.waker != nil && to.IsVM() {
		m.waker.Wake(to.VM)
	}
}
