// Package dhcp is brokkr's DHCPv4 server on the guest bridge. It answers
// only MACs it was told about (the VMs' stable MACs from ipam), each with its
// one assigned address, and stays silent for every other client, so a
// foreign machine on the bridge gets nothing from brokkr. Packets are parsed
// and built with github.com/insomniacslk/dhcp; the socket is made by its
// server4 package, on a thread inside the managed namespace.
//
// DNS: brokkr serves no DNS, so replies carry a DNS option only when the
// caller configures servers.
package dhcp

import (
	"encoding/binary"
	"errors"
	"fmt"
	"log/slog"
	"net"
	"net/netip"
	"sync"
	"time"

	"github.com/insomniacslk/dhcp/dhcpv4"
	"github.com/insomniacslk/dhcp/dhcpv4/server4"

	"github.com/brokkr/brokkr/internal/nlsafe"
)

// DefaultLeaseTime is the lease handed out when Config.LeaseTime is zero.
// Addresses are fixed per MAC, so the lease length only sets how often a
// guest checks in (and how soon a silent one counts as gone).
const DefaultLeaseTime = time.Hour

// Config is what the server says about the network.
type Config struct {
	Interface string       // the bridge
	Server    netip.Prefix // the bridge's address and prefix: server id, router, netmask
	MTU       int          // sent as option 26 when > 0
	LeaseTime time.Duration
	DNS       []netip.Addr // sent only when non-empty
}

// Binding is one known guest: its MAC and the only address it may have.
type Binding struct {
	MAC  net.HardwareAddr
	Addr netip.Addr
}

// Server answers DHCP on one interface until Close.
type Server struct {
	cfg     Config
	log     *slog.Logger
	conn    net.PacketConn
	onLease func(mac net.HardwareAddr, addr netip.Addr)
	done    chan struct{}
	now     func() time.Time

	mu       sync.Mutex
	bindings map[string]netip.Addr // MAC string → address
	leased   map[string]lease
}

type lease struct {
	addr  netip.Addr
	until time.Time
}

// Start opens the server's socket inside the namespace at nsPath ("" = the
// current one), bound to cfg.Interface, port 67, and starts serving.
// onLease, if set, is called after each ACK (from the serving goroutine).
func Start(nsPath string, cfg Config, log *slog.Logger, onLease func(net.HardwareAddr, netip.Addr)) (*Server, error) {
	if !cfg.Server.Addr().Is4() {
		return nil, fmt.Errorf("dhcp: server address %s is not IPv4", cfg.Server)
	}
	if cfg.LeaseTime <= 0 {
		cfg.LeaseTime = DefaultLeaseTime
	}
	if log == nil {
		log = slog.New(slog.DiscardHandler)
	}
	var conn net.PacketConn
	err := nlsafe.Do(nsPath, func() error {
		c, err := server4.NewIPv4UDPConn(cfg.Interface, &net.UDPAddr{Port: dhcpv4.ServerPort})
		conn = c
		return err
	})
	if err != nil {
		return nil, fmt.Errorf("dhcp: listening on %s: %w", cfg.Interface, err)
	}
	s := &Server{
		cfg: cfg, log: log, conn: conn, onLease: onLease, done: make(chan struct{}), now: time.Now,
		bindings: map[string]netip.Addr{}, leased: map[string]lease{},
	}
	go s.serve()
	return s, nil
}

// Config is the configuration the server runs with.
func (s *Server) Config() Config { return s.cfg }

// SetBindings replaces the known guests. A guest whose address changed
// loses its leased state until it asks again.
func (s *Server) SetBindings(bs []Binding) {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.bindings = make(map[string]netip.Addr, len(bs))
	for _, b := range bs {
		s.bindings[b.MAC.String()] = b.Addr
	}
	for mac, l := range s.leased {
		if s.bindings[mac] != l.addr {
			delete(s.leased, mac)
		}
	}
}

// Leased maps the MAC (as a string) of every guest holding an unexpired
// lease to its address.
func (s *Server) Leased() map[string]netip.Addr {
	s.mu.Lock()
	defer s.mu.Unlock()
	now := s.now()
	out := map[string]netip.Addr{}
	for mac, l := range s.leased {
		if now.Before(l.until) {
			out[mac] = l.addr
		}
	}
	return out
}

// Close stops serving and waits for the serving goroutine to end.
func (s *Server) Close() error {
	err := s.conn.Close()
	<-s.done
	return err
}

func (s *Server) serve() {
	defer close(s.done)
	buf := make([]byte, 1500)
	for {
		n, peer, err := s.conn.ReadFrom(buf)
		if err != nil {
			if !errors.Is(err, net.ErrClosed) {
				s.log.Error("dhcp: read failed, server stopped", "err", err)
			}
			return
		}
		req, err := dhcpv4.FromBytes(buf[:n])
		if err != nil {
			s.log.Debug("dhcp: malformed packet", "peer", peer, "err", err)
			continue
		}
		resp, acked := s.Handle(req)
		if resp == nil {
			continue
		}
		if _, err := s.conn.WriteTo(resp.ToBytes(), replyTo(req)); err != nil {
			s.log.Warn("dhcp: sending reply", "mac", req.ClientHWAddr, "type", resp.MessageType(), "err", err)
			continue
		}
		if acked && s.onLease != nil {
			a, _ := netip.AddrFromSlice(resp.YourIPAddr.To4())
			s.onLease(req.ClientHWAddr, a)
		}
	}
}

// replyTo picks the destination per RFC 2131 4.1: a client that has an
// address (renewing) gets unicast; one that has none gets a broadcast (it
// cannot answer ARP yet, and a raw unicast to its MAC would need a raw
// socket). Relayed requests are not served: guests sit on the bridge.
func replyTo(req *dhcpv4.DHCPv4) net.Addr {
	if ip := req.ClientIPAddr.To4(); ip != nil && !ip.Equal(net.IPv4zero) {
		return &net.UDPAddr{IP: ip, Port: dhcpv4.ClientPort}
	}
	return &net.UDPAddr{IP: net.IPv4bcast, Port: dhcpv4.ClientPort}
}

// Handle decides the reply to one request: nil for a request to ignore
// (unknown MAC, relayed, meant for another server, not a request), an
// OFFER/ACK with the guest's assigned address, or a NAK for a guest asking
// for an address that is not its own. acked is true for an ACK.
func (s *Server) Handle(req *dhcpv4.DHCPv4) (resp *dhcpv4.DHCPv4, acked bool) {
	if req.OpCode != dhcpv4.OpcodeBootRequest || len(req.ClientHWAddr) != 6 {
		return nil, false
	}
	if gw := req.GatewayIPAddr.To4(); gw != nil && !gw.Equal(net.IPv4zero) {
		return nil, false
	}
	mac := req.ClientHWAddr.String()
	s.mu.Lock()
	defer s.mu.Unlock()
	addr, known := s.bindings[mac]
	if !known {
		return nil, false
	}
	serverID := net.IP(s.cfg.Server.Addr().AsSlice())
	if sid := req.ServerIdentifier(); sid != nil && !sid.Equal(serverID) {
		if req.MessageType() == dhcpv4.MessageTypeRequest {
			// The guest chose another server's offer; drop what we thought.
			delete(s.leased, mac)
		}
		return nil, false
	}
	ip := net.IP(addr.AsSlice())
	switch req.MessageType() {
	case dhcpv4.MessageTypeDiscover:
		return s.reply(req, dhcpv4.MessageTypeOffer, ip), false
	case dhcpv4.MessageTypeRequest:
		want := req.RequestedIPAddress()
		if want == nil || want.Equal(net.IPv4zero) {
			want = req.ClientIPAddr // renewing / rebinding: ciaddr carries it
		}
		if !want.Equal(ip) {
			delete(s.leased, mac)
			return s.reply(req, dhcpv4.MessageTypeNak, nil), false
		}
		s.leased[mac] = lease{addr: addr, until: s.now().Add(s.cfg.LeaseTime)}
		return s.reply(req, dhcpv4.MessageTypeAck, ip), true
	case dhcpv4.MessageTypeRelease, dhcpv4.MessageTypeDecline:
		delete(s.leased, mac)
	case dhcpv4.MessageTypeInform:
		return s.reply(req, dhcpv4.MessageTypeAck, nil), false
	}
	return nil, false
}

func (s *Server) reply(req *dhcpv4.DHCPv4, typ dhcpv4.MessageType, yiaddr net.IP) *dhcpv4.DHCPv4 {
	serverID := net.IP(s.cfg.Server.Addr().AsSlice())
	mods := []dhcpv4.Modifier{
		dhcpv4.WithMessageType(typ),
		dhcpv4.WithServerIP(serverID),
		dhcpv4.WithOption(dhcpv4.OptServerIdentifier(serverID)),
	}
	if typ != dhcpv4.MessageTypeNak {
		mask := net.CIDRMask(s.cfg.Server.Bits(), 32)
		mods = append(mods,
			dhcpv4.WithOption(dhcpv4.OptSubnetMask(mask)),
			dhcpv4.WithOption(dhcpv4.OptRouter(serverID)),
		)
		if yiaddr != nil {
			mods = append(mods,
				dhcpv4.WithYourIP(yiaddr),
				dhcpv4.WithOption(dhcpv4.OptIPAddressLeaseTime(s.cfg.LeaseTime)),
				dhcpv4.WithOption(dhcpv4.OptRenewTimeValue(s.cfg.LeaseTime/2)),
				dhcpv4.WithOption(dhcpv4.OptRebindingTimeValue(s.cfg.LeaseTime*7/8)),
			)
		}
		if s.cfg.MTU > 0 {
			mtu := make([]byte, 2)
			binary.BigEndian.PutUint16(mtu, uint16(s.cfg.MTU))
			mods = append(mods, dhcpv4.WithOption(dhcpv4.OptGeneric(dhcpv4.OptionInterfaceMTU, mtu)))
		}
		if len(s.cfg.DNS) > 0 {
			var dns []net.IP
			for _, a := range s.cfg.DNS {
				dns = append(dns, a.AsSlice())
			}
			mods = append(mods, dhcpv4.WithOption(dhcpv4.OptDNS(dns...)))
		}
	}
	resp, err := dhcpv4.NewReplyFromRequest(req, mods...)
	if err != nil { // only fails on a random transaction id, which a reply copies
		s.log.Error("dhcp: building reply", "err", err)
		return nil
	}
	return resp
}
