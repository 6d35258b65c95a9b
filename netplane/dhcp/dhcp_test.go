package dhcp

import (
	"net"
	"net/netip"
	"os"
	"path/filepath"
	"testing"
	"time"

	"github.com/insomniacslk/dhcp/dhcpv4"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	"go.uber.org/goleak"

	"github.com/brokkr/brokkr/internal/nstest"
)

func TestMain(m *testing.M) { goleak.VerifyTestMain(m) }

var (
	known   = net.HardwareAddr{0x52, 0x54, 0x00, 0x12, 0x34, 0x56}
	unknown = net.HardwareAddr{0x52, 0x54, 0x00, 0x65, 0x43, 0x21}
	guestIP = netip.MustParseAddr("10.213.0.57")
	cfg     = Config{Interface: "brokkr0", Server: netip.MustParsePrefix("10.213.0.1/24"), MTU: 1450, LeaseTime: time.Minute}
)

// offline is a Server with no socket, to test the decisions alone.
func offline(now *time.Time) *Server {
	s := &Server{cfg: cfg, bindings: map[string]netip.Addr{}, leased: map[string]lease{}, now: func() time.Time { return *now }}
	s.SetBindings([]Binding{{MAC: known, Addr: guestIP}})
	return s
}

func TestHandleOffersAndAcksOnlyTheAssignedAddress(t *testing.T) {
	now := time.Unix(1000, 0)
	s := offline(&now)
	disc, err := dhcpv4.NewDiscovery(known)
	require.NoError(t, err)
	offer, acked := s.Handle(disc)
	require.NotNil(t, offer)
	assert.False(t, acked)
	assert.Equal(t, dhcpv4.MessageTypeOffer, offer.MessageType())
	assert.Equal(t, guestIP.String(), offer.YourIPAddr.String())
	assert.Equal(t, "10.213.0.1", offer.ServerIdentifier().String())
	assert.Equal(t, []string{"10.213.0.1"}, ipStrings(offer.Router()))
	assert.Equal(t, "ffffff00", offer.SubnetMask().String())
	assert.Empty(t, offer.DNS(), "no DNS is served")
	assert.Empty(t, s.Leased(), "an offer is not a lease")

	reqPkt, err := dhcpv4.NewRequestFromOffer(offer)
	require.NoError(t, err)
	ack, acked := s.Handle(reqPkt)
	require.NotNil(t, ack)
	assert.True(t, acked)
	assert.Equal(t, dhcpv4.MessageTypeAck, ack.MessageType())
	assert.Equal(t, time.Minute, ack.IPAddressLeaseTime(0))
	assert.Equal(t, map[string]netip.Addr{known.String(): guestIP}, s.Leased())

	now = now.Add(2 * time.Minute)
	assert.Empty(t, s.Leased(), "an expired lease no longer counts")
}

func TestHandleIgnoresUnknownRelayedAndOtherServers(t *testing.T) {
	now := time.Unix(1000, 0)
	s := offline(&now)
	disc, err := dhcpv4.NewDiscovery(unknown)
	require.NoError(t, err)
	resp, _ := s.Handle(disc)
	assert.Nil(t, resp, "unknown MAC gets nothing")

	relayed, err := dhcpv4.NewDiscovery(known, dhcpv4.WithGatewayIP(net.IPv4(10, 1, 1, 1)))
	require.NoError(t, err)
	resp, _ = s.Handle(relayed)
	assert.Nil(t, resp)

	other, err := dhcpv4.New(dhcpv4.WithHwAddr(known), dhcpv4.WithMessageType(dhcpv4.MessageTypeRequest),
		dhcpv4.WithOption(dhcpv4.OptServerIdentifier(net.IPv4(10, 213, 0, 2))),
		dhcpv4.WithOption(dhcpv4.OptRequestedIPAddress(guestIP.AsSlice())))
	require.NoError(t, err)
	resp, _ = s.Handle(other)
	assert.Nil(t, resp, "a request for another server's offer is not ours to answer")
}

func TestHandleNaksAWrongAddressAndForgetsOnRelease(t *testing.T) {
	now := time.Unix(1000, 0)
	s := offline(&now)
	wrong, err := dhcpv4.New(dhcpv4.WithHwAddr(known), dhcpv4.WithMessageType(dhcpv4.MessageTypeRequest),
		dhcpv4.WithOption(dhcpv4.OptRequestedIPAddress(net.IPv4(10, 213, 0, 99))))
	require.NoError(t, err)
	resp, acked := s.Handle(wrong)
	require.NotNil(t, resp)
	assert.False(t, acked)
	assert.Equal(t, dhcpv4.MessageTypeNak, resp.MessageType())
	assert.Equal(t, "0.0.0.0", resp.YourIPAddr.String())

	renew, err := dhcpv4.New(dhcpv4.WithHwAddr(known), dhcpv4.WithMessageType(dhcpv4.MessageTypeRequest),
		dhcpv4.WithClientIP(guestIP.AsSlice()))
	require.NoError(t, err)
	_, acked = s.Handle(renew)
	assert.True(t, acked, "a renewal by ciaddr is acked")
	assert.Len(t, s.Leased(), 1)

	rel, err := dhcpv4.New(dhcpv4.WithHwAddr(known), dhcpv4.WithMessageType(dhcpv4.MessageTypeRelease),
		dhcpv4.WithClientIP(guestIP.AsSlice()))
	require.NoError(t, err)
	resp, _ = s.Handle(rel)
	assert.Nil(t, resp)
	assert.Empty(t, s.Leased())

	_, acked = s.Handle(renew)
	require.True(t, acked)
	s.SetBindings([]Binding{{MAC: known, Addr: netip.MustParseAddr("10.213.0.58")}})
	assert.Empty(t, s.Leased(), "a changed assignment drops the old lease")
}

func ipStrings(ips []net.IP) []string {
	var out []string
	for _, ip := range ips {
		out = append(out, ip.String())
	}
	return out
}

// udhcpcScript records what udhcpc was told, one line per event.
const udhcpcScript = `#!/bin/sh
echo "$1 ip=$ip subnet=$subnet router=$router lease=$lease mtu=$mtu dns=$dns serverid=$serverid" >> "$(dirname "$0")/events"
`

// guest makes a namespace attached to the host's bridge by a veth whose
// guest end carries mac, like a VM's NIC on its tap.
func guest(t *testing.T, host *nstest.NS, role string, mac net.HardwareAddr) *nstest.NS {
	g := nstest.New(t, role)
	host.MustRun(t, "ip", "link", "add", "vh-"+role, "type", "veth", "peer", "name", "eth0", "address", mac.String(), "netns", g.Name)
	host.MustRun(t, "ip", "link", "set", "vh-"+role, "master", "brokkr0", "up")
	g.MustRun(t, "ip", "link", "set", "eth0", "up")
	return g
}

func TestRealClientGetsItsAddressAndUnknownGetsNothing(t *testing.T) {
	host := nstest.New(t, "host")
	host.MustRun(t, "ip", "link", "add", "brokkr0", "type", "bridge")
	host.MustRun(t, "ip", "addr", "add", "10.213.0.1/24", "dev", "brokkr0")
	host.MustRun(t, "ip", "link", "set", "brokkr0", "up")
	g1 := guest(t, host, "g1", known)
	g2 := guest(t, host, "g2", unknown)

	leases := make(chan net.HardwareAddr, 4)
	s, err := Start(host.Path, cfg, nil, func(mac net.HardwareAddr, _ netip.Addr) { leases <- mac })
	require.NoError(t, err)
	defer s.Close()
	s.SetBindings([]Binding{{MAC: known, Addr: guestIP}})

	dir := t.TempDir()
	script := filepath.Join(dir, "script")
	require.NoError(t, os.WriteFile(script, []byte(udhcpcScript), 0o755))
	out, err := g1.Run("busybox", "udhcpc", "-i", "eth0", "-n", "-q", "-f", "-t", "5", "-T", "1", "-s", script)
	require.NoError(t, err, out)
	events, err := os.ReadFile(filepath.Join(dir, "events"))
	require.NoError(t, err)
	assert.Contains(t, string(events), "bound ip=10.213.0.57 subnet=255.255.255.0 router=10.213.0.1 lease=60 mtu=1450 dns= serverid=10.213.0.1")
	select {
	case mac := <-leases:
		assert.Equal(t, known.String(), mac.String())
	case <-time.After(5 * time.Second):
		t.Fatal("no lease event")
	}
	assert.Equal(t, map[string]netip.Addr{known.String(): guestIP}, s.Leased())

	require.NoError(t, os.Remove(filepath.Join(dir, "events")))
	out, err = g2.Run("busybox", "udhcpc", "-i", "eth0", "-n", "-q", "-f", "-t", "2", "-T", "1", "-s", script)
	assert.Error(t, err, "an unknown MAC must not get a lease: %s", out)
	b, _ := os.ReadFile(filepath.Join(dir, "events"))
	assert.NotContains(t, string(b), "bound")
	assert.Len(t, s.Leased(), 1)
}

// Whatever arrives on the bridge, the server never panics and never hands
// out an address other than the sender's binding.
func FuzzHandle(f *testing.F) {
	for _, mt := range []dhcpv4.MessageType{dhcpv4.MessageTypeDiscover, dhcpv4.MessageTypeRequest, dhcpv4.MessageTypeRelease, dhcpv4.MessageTypeInform} {
		for _, mac := range []net.HardwareAddr{known, unknown} {
			p, err := dhcpv4.New(dhcpv4.WithHwAddr(mac), dhcpv4.WithMessageType(mt),
				dhcpv4.WithOption(dhcpv4.OptRequestedIPAddress(guestIP.AsSlice())))
			if err != nil {
				f.Fatal(err)
			}
			f.Add(p.ToBytes())
		}
	}
	f.Fuzz(func(t *testing.T, b []byte) {
		req, err := dhcpv4.FromBytes(b)
		if err != nil {
			return
		}
		now := time.Unix(1000, 0)
		s := offline(&now)
		resp, acked := s.Handle(req)
		if resp == nil {
			return
		}
		if req.ClientHWAddr.String() != known.String() {
			t.Fatalf("answered unknown MAC %s", req.ClientHWAddr)
		}
		y := resp.YourIPAddr
		if y != nil && !y.IsUnspecified() && !y.Equal(guestIP.AsSlice()) {
			t.Fatalf("offered %s, binding is %s", y, guestIP)
		}
		if acked && !y.Equal(guestIP.AsSlice()) {
			t.Fatalf("acked without the bound address: %s", y)
		}
		if _, err := dhcpv4.FromBytes(resp.ToBytes()); err != nil {
			t.Fatalf("reply does not parse: %v", err)
		}
	})
}
