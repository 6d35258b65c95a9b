package proxy

import (
	"net"
	"net/netip"
	"strconv"
	"sync"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/brokkr/brokkr/internal/spec"
)

// familyServers is a guest service on both loopbacks, one port: over TCP
// it writes which of its addresses was dialled and closes; over UDP it
// answers each datagram the same way.
func familyServers(t *testing.T) int {
	t.Helper()
	ln4, err := net.Listen("tcp4", "127.0.0.1:0")
	require.NoError(t, err)
	port := ln4.Addr().(*net.TCPAddr).Port
	ln6, err := net.Listen("tcp6", "[::1]:"+strconv.Itoa(port))
	require.NoError(t, err)
	u4, err := net.ListenPacket("udp4", "127.0.0.1:"+strconv.Itoa(port))
	require.NoError(t, err)
	u6, err := net.ListenPacket("udp6", "[::1]:"+strconv.Itoa(port))
	require.NoError(t, err)
	var wg sync.WaitGroup
	t.Cleanup(func() { ln4.Close(); ln6.Close(); u4.Close(); u6.Close(); wg.Wait() })
	for _, ln := range []net.Listener{ln4, ln6} {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for {
				c, err := ln.Accept()
				if err != nil {
					return
				}
				_, _ = c.Write([]byte(c.LocalAddr().(*net.TCPAddr).IP.String()))
				c.Close()
			}
		}()
	}
	for _, pc := range []net.PacketConn{u4, u6} {
		wg.Add(1)
		go func() {
			defer wg.Done()
			buf := make([]byte, 100)
			for {
				_, from, err := pc.ReadFrom(buf)
				if err != nil {
					return
				}
				_, _ = pc.WriteTo([]byte(pc.LocalAddr().(*net.UDPAddr).IP.String()), from)
			}
		}()
	}
	return port
}

func readAllFrom(t *testing.T, addr string) string {
	t.Helper()
	c := dial(t, addr)
	b := make([]byte, 100)
	n, _ := c.Read(b)
	return string(b[:n])
}

func udpAsk(t *testing.T, addr string) string {
	t.Helper()
	c, err := net.Dial("udp", addr)
	require.NoError(t, err)
	defer c.Close()
	require.NoError(t, c.SetDeadline(time.Now().Add(5*time.Second)))
	_, err = c.Write([]byte("?"))
	require.NoError(t, err)
	b := make([]byte, 100)
	n, err := c.Read(b)
	require.NoError(t, err)
	return string(b[:n])
}

// A caller that came over IPv6 is carried to the guest's IPv6 address (the
// guest sees an IPv6 connection), one over IPv4 to its IPv4 address; a
// guest with no IPv6 address known takes IPv6 callers on its IPv4 one. TCP
// and UDP; all in the exposure's one slot.
func TestIPv6CallersAreCarriedToTheGuestsIPv6Address(t *testing.T) {
	g := &guests{addrs: map[string]string{"vm1": "127.0.0.1"}}
	g6 := &guests{addrs: map[string]string{"vm1": "::1"}}
	m := NewManager(g.resolve, nil, WithResolver6(g6.resolve))
	t.Cleanup(m.StopAll)
	port := familyServers(t)
	mk := func(name string, proto spec.Proto, listen string) Spec {
		return Spec{Exposure: spec.Exposure{Name: name, Target: spec.Target{VM: "vm1"}, Proto: proto, GuestPort: uint16(port)},
			Listen: netip.MustParseAddr(listen)}
	}
	specs := []Spec{mk("t", spec.TCP, "::1"), mk("t", spec.TCP, "127.0.0.1"), mk("u", spec.UDP, "::1"), mk("u", spec.UDP, "127.0.0.1")}
	st := m.Converge(specs)
	require.Len(t, st, 4)
	for _, s := range st {
		require.Equal(t, StateActive, s.State, s.Reason)
	}
	t6, t4, u6, u4 := st[0].BoundAddr, st[1].BoundAddr, st[2].BoundAddr, st[3].BoundAddr

	assert.Equal(t, "::1", readAllFrom(t, t6), "an IPv6 caller reaches the guest over IPv6")
	assert.Equal(t, "127.0.0.1", readAllFrom(t, t4))
	assert.Equal(t, "::1", udpAsk(t, u6))
	assert.Equal(t, "127.0.0.1", udpAsk(t, u4))

	g6.set("vm1", "") // not seen at its IPv6 address (any more)
	assert.Equal(t, "127.0.0.1", readAllFrom(t, t6), "no IPv6 address: the IPv4 one")
	assert.Equal(t, "127.0.0.1", udpAsk(t, u6))
}

// A v4-mapped caller on a dual-stack listener came over IPv4.
func TestFromIPv6(t *testing.T) {
	assert.True(t, fromIPv6(netip.MustParseAddrPort("[fd00::1]:80")))
	assert.False(t, fromIPv6(netip.MustParseAddrPort("[::ffff:10.0.0.1]:80")))
	assert.False(t, fromIPv6(netip.MustParseAddrPort("10.0.0.1:80")))
	assert.False(t, fromIPv6(netip.AddrPort{}))
}
