// Package hold keeps exposures' host ports: one bound socket per host side
// (address, protocol, port), so that a host program's bind of a published
// port fails with EADDRINUSE instead of silently losing its callers to the
// DNAT, and so that a port a host program already holds is found before
// brokkr publishes over it (the squatter's callers are never hijacked).
//
// The sockets are bound, never listening: a connection the kernel paths
// did not translate is reset as it would be with no socket there, and a UDP
// socket's tiny receive buffer drops what reaches it. They are bound without
// SO_REUSEADDR, so even a program that sets it cannot bind the port; only
// where the port is busy with nothing but TIME_WAIT connections (a listener
// that just went) is the hold taken with SO_REUSEADDR, cleared right after
// the bind: such a program's bind then passes the port's fast path, but its
// listen() fails.
package hold

import (
	"errors"
	"fmt"
	"maps"
	"net/netip"
	"os"
	"slices"
	"strings"
	"sync"

	"golang.org/x/sys/unix"

	"github.com/brokkr/brokkr/internal/nlsafe"
	"github.com/brokkr/brokkr/internal/procfs"
)

// Side is one host side of an exposure.
type Side struct {
	Addr  netip.Addr
	Proto string // "tcp" or "udp"
	Port  uint16
}

func (s Side) String() string {
	return fmt.Sprintf("%s/%s", netip.AddrPortFrom(s.Addr, s.Port), s.Proto)
}

// InUseError is a host side another socket holds.
type InUseError struct {
	Side Side
	// Holder names the process holding it ("pid 812 (nginx)"), "" when
	// none could be found.
	Holder string
	// Self is set when the holder is this process (one of brokkr's own
	// proxy listeners that has not closed yet).
	Self bool
}

func (e *InUseError) Error() string {
	if e.Holder == "" {
		return fmt.Sprintf("%s is in use (address already in use)", e.Side)
	}
	return fmt.Sprintf("%s is in use by %s", e.Side, e.Holder)
}

// Set holds host sides in one network namespace. Its methods are safe for
// concurrent use; a nil Set holds nothing (Files, DropUnclaimed, Close).
type Set struct {
	netns string
	mu    sync.Mutex
	held  map[Side]*os.File
	// inherited are sockets a previous brokkrd handed over (Files' keys),
	// claimed by the first Sync that wants them; the rest are closed by
	// DropUnclaimed.
	inherited map[string]*os.File
	// named is the last InUseError of each side a bind found in use, with
	// the sockets it was found for: a squatted side is tried every pass,
	// and naming its holder reads every process's descriptors, which is
	// done again only when the sockets on the port change.
	named map[Side]namedErr
}

type namedErr struct {
	sockets string // the inodes, in order
	err     error
}

// New makes a Set for the namespace at netns ("" = the caller's) with the
// sockets a previous process handed over (nil: none).
func New(netns string, inherited map[string]*os.File) *Set {
	if inherited == nil {
		inherited = map[string]*os.File{}
	}
	return &Set{netns: netns, held: map[Side]*os.File{}, inherited: inherited, named: map[Side]namedErr{}}
}

// Sync holds exactly the sides of want (an exposure's name → its sides) and
// returns, for each exposure that could not take all of its sides, why (an
// *InUseError when another socket holds one). Sides no longer wanted are
// released first, so an exposure may take a port another one gave up in
// the same call. An exposure holds all of its sides or none.
func (s *Set) Sync(want map[string][]Side) map[string]error {
	s.mu.Lock()
	defer s.mu.Unlock()
	keep := map[Side]bool{}
	for _, sides := range want {
		for _, sd := range sides {
			keep[sd] = true
		}
	}
	for sd, f := range s.held {
		if !keep[sd] {
			f.Close()
			delete(s.held, sd)
		}
	}
	names := make([]string, 0, len(want))
	for n := range want {
		names = append(names, n)
	}
	slices.Sort(names)
	failed := map[string]error{}
	for _, n := range names {
		if err := s.takeAll(want[n]); err != nil {
			failed[n] = err
		}
	}
	return failed
}

// Take holds sides besides what is held (one exposure changed on its own,
// between passes): all of them or none. The next Sync keeps them if it
// wants them.
func (s *Set) Take(sides []Side) error {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.takeAll(sides)
}

// takeAll holds every side of sides not held yet, or none of them (s.mu
// held).
func (s *Set) takeAll(sides []Side) error {
	var took []Side
	for _, sd := range sides {
		if _, ok := s.held[sd]; ok {
			continue
		}
		f, err := s.take(sd)
		if err != nil {
			for _, t := range took {
				s.held[t].Close()
				delete(s.held, t)
			}
			return err
		}
		s.held[sd] = f
		took = append(took, sd)
	}
	return nil
}

// take binds one side: a handed-over socket if there is one, else a new
// socket.
func (s *Set) take(sd Side) (*os.File, error) {
	if f, ok := s.inherited[sd.String()]; ok {
		delete(s.inherited, sd.String())
		return f, nil
	}
	var f *os.File
	err := nlsafe.Do(s.netns, func() error {
		var err error
		f, err = bindSide(sd, false)
		if !errors.Is(err, unix.EADDRINUSE) {
			delete(s.named, sd)
			return err
		}
		inodes, only := socketsOn(sd)
		if only {
			// Nothing but TIME_WAIT: take it with SO_REUSEADDR (see the
			// package comment).
			if f, err = bindSide(sd, true); err == nil {
				delete(s.named, sd)
				return nil
			}
			inodes, _ = socketsOn(sd)
		}
		key := fmt.Sprint(slices.Sorted(maps.Keys(inodes)))
		if n, ok := s.named[sd]; ok && n.sockets == key {
			return n.err // the same sockets: the same holders
		}
		err = inUse(sd, procfs.SocketOwners(inodes))
		s.named[sd] = namedErr{key, err}
		return err
	})
	return f, err
}

func inUse(sd Side, holders []procfs.Owner) error {
	e := &InUseError{Side: sd}
	var names []string
	self := len(holders) > 0
	for _, h := range holders {
		names = append(names, named(h))
		self = self && h.PID == os.Getpid()
	}
	e.Holder, e.Self = strings.Join(names, ", "), self
	return e
}

// Check reports whether sd could be taken now, without holding it: nil, or
// why not. A side this Set holds can be.
func (s *Set) Check(sd Side) error {
	s.mu.Lock()
	_, held := s.held[sd]
	_, inh := s.inherited[sd.String()]
	s.mu.Unlock()
	if held || inh {
		return nil
	}
	return nlsafe.Do(s.netns, func() error {
		f, err := bindSide(sd, false)
		if errors.Is(err, unix.EADDRINUSE) {
			holders, _ := findHolders(sd)
			return inUse(sd, holders)
		}
		if err == nil {
			f.Close()
		}
		return err
	})
}

// Holds reports whether sd is held.
func (s *Set) Holds(sd Side) bool {
	s.mu.Lock()
	defer s.mu.Unlock()
	_, ok := s.held[sd]
	return ok
}

// Files returns duplicates of the held sockets for a hand-over, keyed by
// the side's String (New's inherited); the caller closes them.
func (s *Set) Files() (map[string]*os.File, error) {
	if s == nil {
		return nil, nil
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	out := make(map[string]*os.File, len(s.held))
	for sd, f := range s.held {
		fd, err := unix.FcntlInt(f.Fd(), unix.F_DUPFD_CLOEXEC, 0)
		if err != nil {
			for _, g := range out {
				g.Close()
			}
			return nil, fmt.Errorf("hold: duplicating %s: %w", sd, err)
		}
		out[sd.String()] = os.NewFile(uintptr(fd), "hold "+sd.String())
	}
	return out, nil
}

// DropUnclaimed closes the handed-over sockets no Sync wanted and returns
// their keys.
func (s *Set) DropUnclaimed() []string {
	if s == nil {
		return nil
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	var out []string
	for k, f := range s.inherited {
		f.Close()
		out = append(out, k)
	}
	s.inherited = map[string]*os.File{}
	slices.Sort(out)
	return out
}

// Close releases every side.
func (s *Set) Close() {
	if s == nil {
		return
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	for sd, f := range s.held {
		f.Close()
		delete(s.held, sd)
	}
	for k, f := range s.inherited {
		f.Close()
		delete(s.inherited, k)
	}
}

// bindSide makes a socket bound to sd in the calling thread's namespace.
func bindSide(sd Side, reuse bool) (*os.File, error) {
	var domain int
	var sa unix.Sockaddr
	if a := sd.Addr.Unmap(); a.Is4() {
		domain, sa = unix.AF_INET, &unix.SockaddrInet4{Port: int(sd.Port), Addr: a.As4()}
	} else {
		domain, sa = unix.AF_INET6, &unix.SockaddrInet6{Port: int(sd.Port), Addr: sd.Addr.As16()}
	}
	typ := unix.SOCK_STREAM
	if sd.Proto == "udp" {
		typ = unix.SOCK_DGRAM
	}
	fd, err := unix.Socket(domain, typ|unix.SOCK_CLOEXEC|unix.SOCK_NONBLOCK, 0)
	if err != nil {
		return nil, fmt.Errorf("socket for %s: %w", sd, err)
	}
	opt := func(level, name, v int) error {
		if err := unix.SetsockoptInt(fd, level, name, v); err != nil {
			return fmt.Errorf("setsockopt on %s: %w", sd, err)
		}
		return nil
	}
	err = nil
	if domain == unix.AF_INET6 {
		// "::" is IPv6 only, as for the proxy's listeners.
		err = opt(unix.IPPROTO_IPV6, unix.IPV6_V6ONLY, 1)
	}
	if err == nil && reuse {
		err = opt(unix.SOL_SOCKET, unix.SO_REUSEADDR, 1)
	}
	if err == nil && typ == unix.SOCK_DGRAM {
		// Nothing reads it: what the kernel paths do not translate is dropped.
		err = opt(unix.SOL_SOCKET, unix.SO_RCVBUF, 1)
	}
	if err == nil {
		if err = unix.Bind(fd, sa); err != nil {
			err = fmt.Errorf("binding %s: %w", sd, err)
		}
	}
	if err == nil && reuse {
		// Bound past the TIME_WAIT connections; from now on the socket
		// counts as one without SO_REUSEADDR in the kernel's conflict
		// checks, so a program's listen() on the port fails (its bind
		// still passes the bucket's fast path).
		err = opt(unix.SOL_SOCKET, unix.SO_REUSEADDR, 0)
	}
	if err != nil {
		unix.Close(fd)
		return nil, err
	}
	return os.NewFile(uintptr(fd), "hold "+sd.String()), nil
}

// Holders names the processes holding sd in the namespace at netns ("" =
// the caller's): "pid 812 (nginx)", several joined by ", ", or "" when none
// is found (a bound TCP socket that does not listen is not in /proc/net).
func Holders(netns string, sd Side) string {
	var names []string
	_ = nlsafe.Do(netns, func() error {
		hs, _ := findHolders(sd)
		for _, h := range hs {
			names = append(names, named(h))
		}
		return nil
	})
	return strings.Join(names, ", ")
}
