package proxy

import (
	"bufio"
	"bytes"
	"encoding/hex"
	"io"
	"net"
	"net/netip"
	"sync"
	"testing"
	"time"

	proxyproto "github.com/pires/go-proxyproto"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/brokkr/brokkr/internal/nstest"
	"github.com/brokkr/brokkr/internal/spec"
)

// The headers, byte for byte, as the specification lays them out
// (haproxy's doc/proxy-protocol.txt, sections 2.1 and 2.2).
func TestPPHeaderBytes(t *testing.T) {
	ap := netip.MustParseAddrPort
	v1 := func(src, dst string) string {
		return string(appendPPHeader(nil, ppV1, ap(src), ap(dst)))
	}
	assert.Equal(t, "PROXY TCP4 192.0.2.1 198.51.100.2 51000 8080\r\n", v1("192.0.2.1:51000", "198.51.100.2:8080"))
	assert.Equal(t, "PROXY TCP6 2001:db8::1 2001:db8::2 1 65535\r\n", v1("[2001:db8::1]:1", "[2001:db8::2]:65535"))
	assert.Equal(t, "PROXY TCP4 192.0.2.1 198.51.100.2 1 2\r\n", v1("[::ffff:192.0.2.1]:1", "198.51.100.2:2"), "v4-mapped is IPv4")
	assert.Equal(t, "PROXY TCP6 ::ffff:192.0.2.1 2001:db8::2 1 2\r\n", v1("192.0.2.1:1", "[2001:db8::2]:2"), "mixed: both IPv6")
	assert.Equal(t, "PROXY TCP6 fe80::1 fe80::2 1 2\r\n", v1("[fe80::1%eth0]:1", "[fe80::2%eth0]:2"), "no zone")

	v2 := func(src, dst string) string {
		return hex.EncodeToString(appendPPHeader(nil, ppV2, ap(src), ap(dst)))
	}
	const sig = "0d0a0d0a000d0a515549540a"
	assert.Equal(t, sig+"21"+"11"+"000c"+"c0000201"+"c6336402"+"c738"+"1f90", v2("192.0.2.1:51000", "198.51.100.2:8080"))
	assert.Equal(t, sig+"21"+"21"+"0024"+"20010db8000000000000000000000001"+"20010db8000000000000000000000002"+"0001"+"ffff",
		v2("[2001:db8::1]:1", "[2001:db8::2]:65535"))

	// The longest v1 header fits the buffer and the specification's 107.
	full := v1("[ffff:ffff:ffff:ffff:ffff:ffff:ffff:fffe]:65535", "[ffff:ffff:ffff:ffff:ffff:ffff:ffff:fffe]:65535")
	assert.LessOrEqual(t, len(full), 107)
	assert.LessOrEqual(t, len(full), maxPPHeader)
	assert.Empty(t, appendPPHeader(nil, ppNone, ap("192.0.2.1:1"), ap("192.0.2.2:2")))
}

// Every header this encoder writes, read by an independent parser, gives
// back the addresses and ports it was given, and ends exactly where the
// payload starts.
func TestPPHeaderParsesWithAnIndependentParser(t *testing.T) {
	ap := netip.MustParseAddrPort
	cases := []struct {
		src, dst string
		tp       proxyproto.AddressFamilyAndProtocol
	}{
		{"192.0.2.1:51000", "198.51.100.2:8080", proxyproto.TCPv4},
		{"10.0.0.1:1", "10.0.0.1:65535", proxyproto.TCPv4},
		{"[2001:db8::1]:40000", "[2001:db8:ffff::2]:443", proxyproto.TCPv6},
		{"[::1]:5", "[::1]:6", proxyproto.TCPv6},
		{"192.0.2.1:7", "[2001:db8::2]:8", proxyproto.TCPv6},
	}
	for _, v := range []ppVersion{ppV1, ppV2} {
		for _, c := range cases {
			src, dst := ap(c.src), ap(c.dst)
			wire := append(appendPPHeader(nil, v, src, dst), "payload"...)
			br := bufio.NewReader(bytes.NewReader(wire))
			h, err := proxyproto.Read(br)
			require.NoError(t, err, "v%d %s -> %s", v, c.src, c.dst)
			assert.Equal(t, byte(v), h.Version)
			assert.True(t, h.Command.IsProxy())
			assert.Equal(t, c.tp, h.TransportProtocol)
			s, d, ok := h.TCPAddrs()
			require.True(t, ok)
			assert.Equal(t, src, unmapAP(s.AddrPort()), "source, v%d", v)
			assert.Equal(t, dst, unmapAP(d.AddrPort()), "destination, v%d", v)
			rest, _ := io.ReadAll(br)
			assert.Equal(t, "payload", string(rest))
		}
	}
}

func unmapAP(a netip.AddrPort) netip.AddrPort {
	return netip.AddrPortFrom(a.Addr().Unmap(), a.Port())
}

// ppSeen is what the test's guest read on one connection: the header (or
// the parser's error) and the caller's first line after it.
type ppSeen struct {
	h       *proxyproto.Header
	err     error
	payload string
}

// ppGuest is a guest service on loopback that reads a PROXY header with
// go-proxyproto, reports it, then echoes the caller's first line.
func ppGuest(t *testing.T) (int, <-chan ppSeen) {
	t.Helper()
	ln, err := net.Listen("tcp4", "127.0.0.1:0")
	require.NoError(t, err)
	seen := make(chan ppSeen, 16)
	var wg sync.WaitGroup
	t.Cleanup(func() { ln.Close(); wg.Wait() })
	wg.Add(1)
	go func() {
		defer wg.Done()
		for {
			c, err := ln.Accept()
			if err != nil {
				return
			}
			wg.Add(1)
			go func() {
				defer wg.Done()
				defer c.Close()
				_ = c.SetDeadline(time.Now().Add(5 * time.Second))
				br := bufio.NewReader(c)
				var s ppSeen
				s.h, s.err = proxyproto.Read(br)
				line, _ := br.ReadString('\n')
				s.payload = line
				seen <- s
				_, _ = c.Write([]byte(line))
			}()
		}
	}()
	return ln.Addr().(*net.TCPAddr).Port, seen
}

// A proxied TCP exposure with proxyProtocol v1, then v2 (changed in place:
// the listeners stay), then none: callers in a namespace of their own dial
// the proxy's wildcard listeners in another, on two IPv4 addresses and an
// IPv6 one; the guest parses each header with a real parser and finds the
// caller's own address and port as the source and the address and port it
// dialled as the destination, before the caller's first byte. Without a
// header the guest's first bytes are the caller's.
func TestProxyHeaderCarriesTheCallersAddressAndTheOneItDialled(t *testing.T) {
	host := nstest.New(t, "pph")
	caller := nstest.New(t, "ppc")
	nstest.Link(t, host, "pph0", "10.99.77.1/24", caller, "ppc0", "10.99.77.2/24")
	host.MustRun(t, "ip", "addr", "add", "10.99.77.3/24", "dev", "pph0")
	host.MustRun(t, "ip", "-6", "addr", "add", "fd00:99:77::1/64", "dev", "pph0", "nodad")
	caller.MustRun(t, "ip", "-6", "addr", "add", "fd00:99:77::2/64", "dev", "ppc0", "nodad")

	guestPort, seen := ppGuest(t)
	m, _ := newManager(t)
	m.listenTCP = func(c checked) (ln net.Listener, err error) {
		err = host.Do(func() error { ln, err = listenTCP(c); return err })
		return ln, err
	}
	specs := func(v spec.ProxyProtocol) []Spec {
		e := spec.Exposure{Name: "pp", Target: spec.Target{VM: "vm1"}, Proto: spec.TCP, GuestPort: uint16(guestPort),
			Mode: spec.ModeProxy, ProxyProtocol: v}
		return []Spec{{Exposure: e, Listen: netip.IPv4Unspecified()}, {Exposure: e, Listen: netip.IPv6Unspecified()}}
	}
	var bound []string
	for _, v := range []spec.ProxyProtocol{spec.ProxyV1, spec.ProxyV2, spec.ProxyNone} {
		st := m.Converge(specs(v))
		require.Len(t, st, 2)
		for _, s := range st {
			require.Equal(t, StateActive, s.State, s.Reason)
		}
		now := []string{st[0].BoundAddr, st[1].BoundAddr}
		if bound == nil {
			bound = now
		}
		require.Equal(t, bound, now, "a changed header keeps the listeners")
		p4, p6 := netip.MustParseAddrPort(bound[0]).Port(), netip.MustParseAddrPort(bound[1]).Port()

		for _, to := range []netip.AddrPort{
			netip.AddrPortFrom(netip.MustParseAddr("10.99.77.1"), p4),
			netip.AddrPortFrom(netip.MustParseAddr("10.99.77.3"), p4),
			netip.AddrPortFrom(netip.MustParseAddr("fd00:99:77::1"), p6),
		} {
			what := string(v) + " to " + to.String()
			var c net.Conn
			require.NoError(t, caller.Do(func() (err error) {
				c, err = net.DialTimeout("tcp", to.String(), 5*time.Second)
				return err
			}), what)
			require.NoError(t, c.SetDeadline(time.Now().Add(5*time.Second)))
			me := c.LocalAddr().(*net.TCPAddr).AddrPort()
			require.NotEqual(t, to.Addr(), me.Addr())
			_, err := c.Write([]byte("first bytes\n"))
			require.NoError(t, err)
			echo, err := bufio.NewReader(c).ReadString('\n')
			require.NoError(t, err, what)
			assert.Equal(t, "first bytes\n", echo, what)
			c.Close()

			var s ppSeen
			select {
			case s = <-seen:
			case <-time.After(5 * time.Second):
				t.Fatal("the guest saw no connection: " + what)
			}
			assert.Equal(t, "first bytes\n", s.payload, "%s: the caller's bytes follow the header intact", what)
			if v == spec.ProxyNone {
				assert.ErrorIs(t, s.err, proxyproto.ErrNoProxyProtocol, "%s: no header", what)
				continue
			}
			require.NoError(t, s.err, what)
			assert.Equal(t, byte(ppOf(v)), s.h.Version, what)
			want := proxyproto.TCPv4
			if to.Addr().Is6() {
				want = proxyproto.TCPv6
			}
			assert.Equal(t, want, s.h.TransportProtocol, what)
			src, dst, ok := s.h.TCPAddrs()
			require.True(t, ok, what)
			assert.Equal(t, me, unmapAP(src.AddrPort()), "%s: the source is the caller's real address", what)
			assert.Equal(t, to, unmapAP(dst.AddrPort()), "%s: the destination is the address dialled", what)
		}
	}
}

// Any pair of addresses and ports, either version: the independent parser
// reads back what was encoded (IPv4 pairs as TCP4, the rest as TCP6 with an
// IPv4 address v4-mapped) and the payload starts right after the header.
func FuzzPPHeaderRoundTrip(f *testing.F) {
	f.Add(uint8(1), []byte{192, 0, 2, 1}, uint16(51000), []byte{198, 51, 100, 2}, uint16(8080))
	f.Add(uint8(2), bytes.Repeat([]byte{0xff}, 16), uint16(65535), []byte{10, 0, 0, 1}, uint16(1))
	f.Add(uint8(2), netip.MustParseAddr("::ffff:10.1.2.3").AsSlice(), uint16(0), []byte{10, 0, 0, 1}, uint16(0))
	f.Fuzz(func(t *testing.T, ver uint8, sb []byte, sp uint16, db []byte, dp uint16) {
		sa, ok1 := netip.AddrFromSlice(sb)
		da, ok2 := netip.AddrFromSlice(db)
		if !ok1 || !ok2 {
			return
		}
		v := ppVersion(ver%2 + 1)
		src, dst := netip.AddrPortFrom(sa, sp), netip.AddrPortFrom(da, dp)
		wire := append(appendPPHeader(nil, v, src, dst), "x"...)
		if len(wire)-1 > maxPPHeader {
			t.Fatalf("header of %d bytes", len(wire)-1)
		}
		br := bufio.NewReader(bytes.NewReader(wire))
		h, err := proxyproto.Read(br)
		if err != nil {
			t.Fatalf("v%d %s -> %s: %v (%q)", v, src, dst, err, wire)
		}
		s, d, ok := h.TCPAddrs()
		if !ok {
			t.Fatalf("not TCP: %v", h.TransportProtocol)
		}
		four := sa.Unmap().Is4() && da.Unmap().Is4()
		want := func(a netip.AddrPort) netip.AddrPort {
			if four {
				return unmapAP(a)
			}
			return netip.AddrPortFrom(netip.AddrFrom16(a.Addr().As16()), a.Port())
		}
		got := func(a *net.TCPAddr) netip.AddrPort {
			ap := a.AddrPort()
			if four {
				return unmapAP(ap)
			}
			return netip.AddrPortFrom(netip.AddrFrom16(ap.Addr().As16()), ap.Port())
		}
		if got(s) != want(src) || got(d) != want(dst) {
			t.Fatalf("v%d: got %v -> %v, want %v -> %v", v, s, d, want(src), want(dst))
		}
		if rest, _ := io.ReadAll(br); string(rest) != "x" {
			t.Fatalf("payload after the header: %q", rest)
		}
	})
}
