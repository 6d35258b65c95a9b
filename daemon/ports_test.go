package daemon

import (
	"net/netip"
	"testing"

	"github.com/stretchr/testify/assert"

	"github.com/brokkr/brokkr/internal/spec"
	"github.com/brokkr/brokkr/netplane/hold"
)

func TestHostSidesAreWhatNoProxyListenerBinds(t *testing.T) {
	any4, lo4 := netip.IPv4Unspecified(), netip.MustParseAddr("127.0.0.1")
	x := func(m spec.Mode, a netip.Addr) spec.Exposure {
		return spec.Exposure{Name: "x", Mode: m, HostAddr: a, HostPort: 80, Proto: spec.Proto("tcp")}
	}
	s := func(a string) hold.Side { return hold.Side{Addr: netip.MustParseAddr(a), Proto: "tcp", Port: 80} }
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
	} {
		assert.Equal(t, c.want, hostSides(c.e, c.ipv6, c.sck), c.what)
	}
}
