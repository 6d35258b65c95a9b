// Package radv configures the guests' IPv6 on brokkr's bridge: it sends
// router advertisements of the guests' /64, from which every guest forms
// its address by SLAAC out of its own MAC (ipam.SLAAC), so brokkr knows
// each guest's address without asking it; and it sends neighbour
// solicitations for those addresses, so it learns which guest holds its
// address (the answer names the guest's MAC). The guest needs nothing but
// its kernel's defaults. Messages are built and parsed by
// github.com/mdlayher/ndp; the socket is a raw ICMPv6 socket bound to the
// bridge's link-local address (so it sends and hears on the bridge alone),
// made on a thread inside the managed namespace.
//
// Until the host forwards IPv6 (Config.DefaultRouter: it does once IPv6
// callers of published ports are DNATed to the guests) the advertisements
// carry a router lifetime of 0: guests get the on-link /64 and no default
// route, and a dual-stack client in a guest falls back to IPv4 at once
// rather than waiting on a route that goes nowhere.
package radv

import (
	"errors"
	"fmt"
	"log/slog"
	"net"
	"net/netip"
	"strconv"
	"sync"
	"time"

	"github.com/mdlayher/ndp"
	"golang.org/x/net/ipv6"
	"golang.org/x/sys/unix"

	"github.com/brokkr/brokkr/internal/nlsafe"
)

// ErrNotReady says the bridge has no usable link-local address yet: the
// kernel gives it one only once a port has carrier (a VMM opened a tap),
// and only after its duplicate address detection. Advertisements must come
// from a link-local address; start again later.
var ErrNotReady = errors.New("radv: the bridge has no usable link-local address yet")

// Config is what the advertisements say.
type Config struct {
	Interface string       // the bridge
	Prefix    netip.Prefix // network.cidr6: the guests' on-link, autonomous /64
	MTU       int          // advertised when > 0
	// DefaultRouter advertises the bridge as the guests' default router
	// (router lifetime 30 min): set once the host forwards IPv6, so that
	// guests can answer IPv6 callers from beyond their /64 and reach out.
	DefaultRouter bool
}

// routerLifetime is advertised with DefaultRouter: RFC 4861's default,
// three times the longest interval between advertisements.
const routerLifetime = 30 * time.Minute

// Binding is one known guest: its MAC and the IPv6 address it forms.
type Binding struct {
	MAC  net.HardwareAddr
	Addr netip.Addr
}

// timing is how often things are sent; the defaults, or a test's.
type timing struct {
	tick     time.Duration // how often the sender looks at what is due
	initial  []time.Duration
	interval time.Duration // unsolicited advertisements after the initial ones
	probe    time.Duration // a guest not seen is solicited this often while it boots,
	booting  time.Duration // for this long after it appeared; then less and less often,
	reprobe  time.Duration // up to this; a guest seen is solicited again after this
	seenFor  time.Duration // a guest counts as seen this long after its answer
	minRS    time.Duration // at most one solicited advertisement per this
}

// defaults: initial advertisements (RFC 4861 6.2.4), then one a minute; a
// guest that boots in between solicits one and is answered at once. A new
// guest gets the initial ones again, over the half minute a VM takes to
// boot at worst: a guest is configured without depending on its own
// solicitations.
var defaults = timing{
	tick:     time.Second,
	initial:  []time.Duration{0, 2 * time.Second, 4 * time.Second, 8 * time.Second, 16 * time.Second, 32 * time.Second},
	interval: time.Minute,
	probe:    2 * time.Second,
	booting:  32 * time.Second,
	reprobe:  time.Minute,
	seenFor:  3 * time.Minute,
	minRS:    100 * time.Millisecond,
}

// Server advertises on one bridge until Close or Withdraw. Its 16 fields
// are one sender's: what it sends from (conn, src, mac), when (t, now,
// lastRS), to whom (bindings, newGuest), and its life (stop, wg, closing,
// withdrawn); the guests' bindings share mu with the writes so that no
// advertisement can follow a withdrawal.
type Server struct {
	cfg     Config
	t       timing
	log     *slog.Logger
	conn    *ndp.Conn
	src     netip.Addr // the link-local address it sends from
	mac     net.HardwareAddr
	onSeen  func(net.HardwareAddr, netip.Addr)
	now     func() time.Time
	stop    chan struct{}
	wg      sync.WaitGroup
	closing sync.Once

	mu       sync.Mutex
	bindings map[netip.Addr]*guest // by address
	lastRS   time.Time
	newGuest bool // a binding came: the initial advertisements again
	// withdrawn: every advertisement from now on carries lifetimes 0.
	// Advertisements are written under mu, so none with the prefix's
	// lifetimes can follow the withdrawal onto the wire (the sender's
	// initial one raced Withdraw's and, sent second, undid it).
	withdrawn bool
}

type guest struct {
	mac      net.HardwareAddr
	added    time.Time
	seenAt   time.Time // zero: never answered
	probedAt time.Time
	wait     time.Duration // until the next solicitation of a guest not seen
}

// Start opens the server's socket inside the namespace at nsPath ("" = the
// current one) and starts advertising. onSeen, if set, is called (from a
// serving goroutine) when a guest answers for its address after not being
// seen. ErrNotReady: try again later.
func Start(nsPath string, cfg Config, log *slog.Logger, onSeen func(net.HardwareAddr, netip.Addr)) (*Server, error) {
	return start(nsPath, cfg, log, onSeen, defaults)
}

func start(nsPath string, cfg Config, log *slog.Logger, onSeen func(net.HardwareAddr, netip.Addr), t timing) (*Server, error) {
	if !cfg.Prefix.Addr().Is6() || cfg.Prefix.Addr().Is4In6() || cfg.Prefix.Bits() != 64 {
		return nil, fmt.Errorf("radv: prefix %s is not an IPv6 /64", cfg.Prefix)
	}
	if log == nil {
		log = slog.New(slog.DiscardHandler)
	}
	s := &Server{cfg: cfg, t: t, log: log, onSeen: onSeen, now: time.Now, stop: make(chan struct{}),
		bindings: map[netip.Addr]*guest{}}
	err := nlsafe.Do(nsPath, func() error {
		ifi, err := net.InterfaceByName(cfg.Interface)
		if err != nil {
			return err
		}
		s.mac = ifi.HardwareAddr
		// The socket may be used from threads in another namespace, where
		// the net package would resolve an interface name to that
		// namespace's index: name the bridge by its index instead.
		byIndex := *ifi
		byIndex.Name = strconv.Itoa(ifi.Index)
		c, src, err := ndp.Listen(&byIndex, ndp.LinkLocal)
		if err != nil {
			// No link-local address, or only a tentative one (bind
			// refuses it until its DAD is done).
			if errors.Is(err, unix.EADDRNOTAVAIL) || !hasLinkLocal(ifi) {
				return ErrNotReady
			}
			return err
		}
		s.conn, s.src = c, src
		return nil
	})
	if err != nil {
		if errors.Is(err, ErrNotReady) {
			return nil, ErrNotReady
		}
		return nil, fmt.Errorf("radv: listening on %s: %w", cfg.Interface, err)
	}
	// Router solicitations go to all-routers; answers to our solicitations
	// come to our address. Nothing else is read.
	var f ipv6.ICMPFilter
	f.SetAll(true)
	f.Accept(ipv6.ICMPTypeRouterSolicitation)
	f.Accept(ipv6.ICMPTypeNeighborAdvertisement)
	if err := s.conn.SetICMPFilter(&f); err != nil {
		s.conn.Close()
		return nil, fmt.Errorf("radv: ICMPv6 filter: %w", err)
	}
	if err := s.conn.JoinGroup(netip.IPv6LinkLocalAllRouters()); err != nil {
		s.conn.Close()
		return nil, fmt.Errorf("radv: joining all-routers on %s: %w", cfg.Interface, err)
	}
	s.wg.Add(2)
	go s.read()
	go s.send()
	return s, nil
}

func hasLinkLocal(ifi *net.Interface) bool {
	addrs, err := ifi.Addrs()
	if err != nil {
		return false
	}
	for _, a := range addrs {
		if n, ok := a.(*net.IPNet); ok && n.IP.To4() == nil && n.IP.IsLinkLocalUnicast() {
			return true
		}
	}
	return false
}

// Config is the configuration the server runs with.
func (s *Server) Config() Config { return s.cfg }

// SetBindings replaces the known guests. A guest whose address or MAC
// changed is not seen until it answers again.
func (s *Server) SetBindings(bs []Binding) {
	s.mu.Lock()
	defer s.mu.Unlock()
	next := make(map[netip.Addr]*guest, len(bs))
	for _, b := range bs {
		if g, ok := s.bindings[b.Addr]; ok && g.mac.String() == b.MAC.String() {
			next[b.Addr] = g
			continue
		}
		next[b.Addr] = &guest{mac: append(net.HardwareAddr(nil), b.MAC...), added: s.now(), wait: s.t.probe}
		s.newGuest = true
	}
	s.bindings = next
}

// Seen maps the MAC (as a string) of every guest that answered for its
// address lately to that address.
func (s *Server) Seen() map[string]netip.Addr {
	s.mu.Lock()
	defer s.mu.Unlock()
	now := s.now()
	out := map[string]netip.Addr{}
	for a, g := range s.bindings {
		if s.fresh(g, now) {
			out[g.mac.String()] = a
		}
	}
	return out
}

func (s *Server) fresh(g *guest, now time.Time) bool {
	return !g.seenAt.IsZero() && now.Sub(g.seenAt) < s.t.seenFor
}

// Close stops advertising and waits for the serving goroutines. The guests
// keep their addresses (the advertised lifetimes are infinite): VMs outlive
// the daemon, and the next one advertises the same prefix.
func (s *Server) Close() error {
	var err error
	s.closing.Do(func() {
		close(s.stop)
		err = s.conn.Close()
		s.wg.Wait()
	})
	return err
}

// Withdraw tells the guests the prefix is gone (lifetimes 0: the on-link
// route goes at once, the address is deprecated and dropped within two
// hours, as RFC 4862 5.5.3 has it), then closes. For a changed or removed
// network.cidr6.
func (s *Server) Withdraw() error {
	s.mu.Lock()
	s.withdrawn = true
	s.mu.Unlock()
	// RFC 4861 6.2.5's final advertisements, back to back: a guest that
	// misses one keeps the route until the next daemon's advertisement.
	var err error
	for range finalAdverts {
		err = errors.Join(err, s.advertise(netip.IPv6LinkLocalAllNodes()))
	}
	return errors.Join(err, s.Close())
}

// finalAdverts is RFC 4861's MAX_FINAL_RTR_ADVERTISEMENTS.
const finalAdverts = 3

// advertise writes the advertisement to one address (all-nodes for the
// periodic ones), withdrawn once Withdraw has begun.
func (s *Server) advertise(to netip.Addr) error {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.conn.WriteTo(s.advert(s.withdrawn), nil, to)
}

// advert is the router advertisement: the /64 on-link and autonomous, the
// bridge's MAC, the MTU, router lifetime 0 unless DefaultRouter (see the
// package comment).
func (s *Server) advert(withdraw bool) *ndp.RouterAdvertisement {
	life := ndp.Infinity
	if withdraw {
		life = 0
	}
	opts := []ndp.Option{
		&ndp.PrefixInformation{
			PrefixLength: 64, OnLink: true, AutonomousAddressConfiguration: true,
			ValidLifetime: life, PreferredLifetime: life, Prefix: s.cfg.Prefix.Masked().Addr(),
		},
		&ndp.LinkLayerAddress{Direction: ndp.Source, Addr: s.mac},
	}
	if s.cfg.MTU > 0 {
		opts = append(opts, ndp.NewMTU(uint32(s.cfg.MTU)))
	}
	ra := &ndp.RouterAdvertisement{CurrentHopLimit: 64, Options: opts}
	if s.cfg.DefaultRouter && !withdraw {
		ra.RouterLifetime = routerLifetime
	}
	return ra
}

// send advertises (the initial ones, then every interval) and solicits
// each guest's address while it is not seen, and again now and then while
// it is.
func (s *Server) send() {
	defer s.wg.Done()
	var start, next time.Time
	var initial []time.Duration
	again := func(now time.Time) {
		start, next, initial = now, now, s.t.initial
		if len(initial) > 0 {
			next, initial = start.Add(initial[0]), initial[1:]
		}
	}
	again(s.now())
	tick := time.NewTicker(s.t.tick)
	defer tick.Stop()
	for {
		now := s.now()
		s.mu.Lock()
		if s.newGuest {
			s.newGuest = false
			again(now)
		}
		s.mu.Unlock()
		if !now.Before(next) {
			if err := s.advertise(netip.IPv6LinkLocalAllNodes()); err != nil {
				s.log.Debug("radv: advertising", "err", err)
			}
			if len(initial) > 0 {
				next, initial = start.Add(initial[0]), initial[1:]
			} else {
				next = now.Add(s.t.interval)
			}
		}
		s.probe(now)
		select {
		case <-s.stop:
			return
		case <-tick.C:
		}
	}
}

// probe solicits the addresses that are due.
func (s *Server) probe(now time.Time) {
	for _, a := range s.due(now) {
		snm, err := ndp.SolicitedNodeMulticast(a)
		if err != nil {
			continue
		}
		ns := &ndp.NeighborSolicitation{TargetAddress: a,
			Options: []ndp.Option{&ndp.LinkLayerAddress{Direction: ndp.Source, Addr: s.mac}}}
		if err := s.conn.WriteTo(ns, nil, snm); err != nil {
			s.log.Debug("radv: soliciting", "addr", a, "err", err)
		}
	}
}

// due lists the addresses to solicit now and takes them as solicited. A
// guest that does not answer (not booted yet, no IPv6, or its answers never
// reach the host) is asked every probe while it boots, then half as often
// each time, down to once a reprobe: a bridge of guests that never answer
// is not flooded.
func (s *Server) due(now time.Time) []netip.Addr {
	var due []netip.Addr
	s.mu.Lock()
	defer s.mu.Unlock()
	for a, g := range s.bindings {
		wait := g.wait
		if s.fresh(g, now) {
			wait, g.wait = s.t.reprobe, s.t.probe
			if g.seenAt.After(g.probedAt) {
				g.probedAt = g.seenAt // the clock runs from the answer
			}
		}
		if now.Sub(g.probedAt) >= wait {
			if !s.fresh(g, now) && now.Sub(g.added) >= s.t.booting {
				g.wait = min(2*g.wait, s.t.reprobe)
			}
			g.probedAt = now
			due = append(due, a)
		}
	}
	return due
}

// read answers router solicitations and takes neighbour advertisements
// for the guests' addresses.
func (s *Server) read() {
	defer s.wg.Done()
	for {
		m, _, from, err := s.conn.ReadFrom()
		if err != nil {
			select {
			case <-s.stop:
			default:
				s.log.Error("radv: read failed, server stopped", "err", err)
			}
			return
		}
		switch m := m.(type) {
		case *ndp.RouterSolicitation:
			s.solicited(from)
		case *ndp.NeighborAdvertisement:
			s.answered(m)
		}
	}
}

// solicited answers a router solicitation, unicast to a soliciting
// address (all-nodes for one that has none yet), at most one per minRS.
func (s *Server) solicited(from netip.Addr) {
	s.mu.Lock()
	now := s.now()
	if now.Sub(s.lastRS) < s.t.minRS {
		s.mu.Unlock()
		return
	}
	s.lastRS = now
	s.mu.Unlock()
	to := from.WithZone("")
	if !to.IsLinkLocalUnicast() {
		to = netip.IPv6LinkLocalAllNodes()
	}
	if err := s.advertise(to); err != nil {
		s.log.Debug("radv: answering a router solicitation", "to", to, "err", err)
	}
}

// answered takes a neighbour advertisement: for a known address from the
// guest's own MAC (the target link-layer option, which an answer to a
// multicast solicitation carries), the guest holds its address.
func (s *Server) answered(na *ndp.NeighborAdvertisement) {
	var lla net.HardwareAddr
	for _, o := range na.Options {
		if l, ok := o.(*ndp.LinkLayerAddress); ok && l.Direction == ndp.Target {
			lla = l.Addr
		}
	}
	s.mu.Lock()
	g, ok := s.bindings[na.TargetAddress.WithZone("")]
	if !ok || lla.String() != g.mac.String() {
		s.mu.Unlock()
		return
	}
	now := s.now()
	announce := !s.fresh(g, now)
	g.seenAt = now
	mac := g.mac
	s.mu.Unlock()
	if announce && s.onSeen != nil {
		s.onSeen(mac, na.TargetAddress.WithZone(""))
	}
}
