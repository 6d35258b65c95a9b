package daemon

import (
	"net"
	"net/netip"
	"syscall"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/brokkr/brokkr/internal/nstest"
	"github.com/brokkr/brokkr/internal/spec"
	"github.com/brokkr/brokkr/netplane/hold"
)

func TestHostSidesAreWhatNoProxyListenerBinds(t *testing.T) {
	any4, lo4 := netip.IPv4Unspecified(), netip.MustParseAddr("127.0.0.1")
	x := func(m spec.Mode, a netip.Addr) spec.Exposure {
		return spec.Exposure{Name: "x", Mode: m, HostAddr: a, HostPort: 80, Proto: spec.Proto("tcp")}
	}
	s := func(a string) hold.Side { return hold.Side{Addr: netip.MustParseAddr(a), Proto: "tcp", Port: 80} }
	v6ByProxy := x(spec.ModeAuto, netip.Addr{})
	v6ByProxy.IPv6ByProxy = true
	for _, c := range []struct {
		what      string
		e         spec.Exposure
		ipv6, sck bool
		want      []hold.Side
	}{
		{"nat", x(spec.ModeNAT, any4), true, true, []hold.Side{s("0.0.0.0")}},
		{"nat, no socket path", x(spec.ModeNAT, any4), true, false, []hold.Side{s("0.0.0.0")}},
		{"proxy: its listener holds it", x(spec.ModeProxy, any4), true, true, nil},
		{"auto with the socket path, ::1 too", x(spec.ModeAuto, any4), true, true, []hold.Side{s("0.0.0.0"), s("::1")}},
		{"auto with the socket path, no IPv6", x(spec.ModeAuto, any4), false, true, []hold.Side{s("0.0.0.0")}},
		{"auto on loopback with the socket path", x(spec.ModeAuto, lo4), true, true, []hold.Side{s("127.0.0.1")}},
		{"auto without the socket path: loopback proxies", x(spec.ModeAuto, any4), true, false, nil},
		{"auto on a host address without the socket path", x(spec.ModeAuto, netip.MustParseAddr("192.0.2.1")), true, false, []hold.Side{s("192.0.2.1")}},
		{"auto of both families", x(spec.ModeAuto, netip.Addr{}), true, true, []hold.Side{s("0.0.0.0"), s("::")}},
		{"auto of both families, IPv6 by the proxy on ::", v6ByProxy, true, true, []hold.Side{s("0.0.0.0")}},
		{"auto of both families, IPv6 by the proxy, no socket path: loopback proxies", v6ByProxy, true, false, nil},
	} {
		assert.Equal(t, c.want, hostSides(c.e, c.ipv6, c.sck), c.what)
	}
}

// A range holds one socket per port and address.
func TestHostSidesOfARange(t *testing.T) {
	e := spec.Exposure{Name: "r", Mode: spec.ModeNAT, HostPort: 30000, HostPortLast: 30002, Proto: spec.UDP}
	var got []string
	for _, s := range hostSides(e, true, true) {
		got = append(got, s.String())
	}
	assert.Equal(t, []string{"0.0.0.0:30000/udp", "0.0.0.0:30001/udp", "0.0.0.0:30002/udp", "[::]:30000/udp", "[::]:30001/udp", "[::]:30002/udp"}, got)
}

// Held in the kernel: a host program cannot bind a middle port of a held
// range, of either family, and a port beside the range stays free.
func TestARangesPortsAreHeld(t *testing.T) {
	nstest.RequireRoot(t)
	ns := nstest.New(t, "host")
	ns.MustRun(t, "ip", "link", "set", "lo", "up")
	s := hold.New(ns.Path, nil)
	t.Cleanup(s.Close)
	e := spec.Exposure{Name: "r", Mode: spec.ModeNAT, HostPort: 30000, HostPortLast: 30099, Proto: spec.TCP}
	require.Empty(t, s.Sync(map[string][]hold.Side{"r": hostSides(e, true, true)}))
	listen := func(network, addr string) error {
		return ns.Do(func() error {
			ln, err := net.Listen(network, addr)
			if err == nil {
				ln.Close()
			}
			return err
		})
	}
	for _, a := range []string{"0.0.0.0:30000", "127.0.0.1:30050", "0.0.0.0:30099"} {
		assert.ErrorIs(t, listen("tcp4", a), syscall.EADDRINUSE, a)
	}
	assert.ErrorIs(t, listen("tcp6", "[::1]:30050"), syscall.EADDRINUSE)
	assert.NoError(t, listen("tcp4", "127.0.0.1:30100"), "beside the range")
	assert.NoError(t, listen("tcp4", "127.0.0.1:29999"), "beside the range")
}

// inUseHolds says every side of ports is in use by one program.
type inUseHolds struct{ ports map[uint16]bool }

func (h inUseHolds) Sync(map[string][]hold.Side) map[string]error { return nil }
func (h inUseHolds) Take([]hold.Side) error                       { return nil }
func (h inUseHolds) Check(sd hold.Side) error {
	if h.ports[sd.Port] {
		return &hold.InUseError{Side: sd, Holder: "pid 7 (squat)"}
	}
	return nil
}

// A range's ports in use are one warning, naming the first and counting
// the others; a single port's sides each their own, as before.
func TestPortWarningsOfARange(t *testing.T) {
	d := &Daemon{opts: Options{Holds: inUseHolds{ports: map[uint16]bool{30001: true, 30002: true, 30005: true, 8080: true}}}}
	m := &spec.Desired{Exposures: []spec.Exposure{
		{Name: "r", Mode: spec.ModeNAT, Proto: spec.TCP, HostAddr: netip.IPv4Unspecified(), HostPort: 30000, HostPortLast: 30009},
		{Name: "one", Mode: spec.ModeNAT, Proto: spec.TCP, HostPort: 8080},
		{Name: "free", Mode: spec.ModeNAT, Proto: spec.TCP, HostPort: 30000, HostPortLast: 30000},
	}}
	assert.Equal(t, []string{
		"exposure r: 0.0.0.0:30001/tcp is in use by pid 7 (squat) (and 2 more of its ports): it stays failed (no DNAT, the holder keeps its callers) until the port frees",
		"exposure one: 0.0.0.0:8080/tcp is in use by pid 7 (squat): it stays failed (no DNAT, the holder keeps its callers) until the port frees",
	}, d.portWarnings(m))
}
