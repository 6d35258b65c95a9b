package config

import (
	"encoding/json"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/brokkr/brokkr/internal/spec"
)

// proxyProtocol is refused, naming its field, where no header can be
// written: on mode nat (the kernel path keeps the caller's address and
// writes nothing) and on UDP; and anything but "", v1, v2 is refused.
func TestProxyProtocolRefusalsNameTheirField(t *testing.T) {
	const pre = "exposures: [{name: ok, target: 10.213.0.9, guestPort: 1, hostPort: 1}, "
	cases := []struct{ in, want string }{
		{pre + "{name: e, target: 10.213.0.9, guestPort: 1, hostPort: 2, mode: nat, proxyProtocol: v1}]",
			"exposures[1].proxyProtocol: v1 cannot be written on mode nat: the kernel path keeps the caller's address and writes no header; use mode proxy or auto (carried by the proxy)"},
		{pre + "{name: e, target: 10.213.0.9, guestPort: 1, hostPort: 2, mode: nat, proxyProtocol: v2}]",
			"exposures[1].proxyProtocol: v2 cannot be written on mode nat: the kernel path keeps the caller's address and writes no header; use mode proxy or auto (carried by the proxy)"},
		{pre + "{name: e, target: 10.213.0.9, guestPort: 1, hostPort: 2, protocol: udp, mode: proxy, proxyProtocol: v2}]",
			"exposures[1].proxyProtocol: v2 is for TCP only: a UDP exposure carries no PROXY header"},
		{pre + "{name: e, target: 10.213.0.9, guestPort: 1, hostPort: 2, protocol: udp, proxyProtocol: v1}]",
			"exposures[1].proxyProtocol: v1 is for TCP only: a UDP exposure carries no PROXY header"},
		{pre + "{name: e, target: 10.213.0.9, guestPort: 1, hostPort: 2, proxyProtocol: V2}]",
			`exposures[1].proxyProtocol: "V2" is not one of "" (none), v1, v2`},
		{pre + "{name: e, target: 10.213.0.9, guestPort: 1, hostPort: 2, proxyProtocol: 'true'}]",
			`exposures[1].proxyProtocol: "true" is not one of "" (none), v1, v2`},
	}
	for _, c := range cases {
		assert.Equal(t, []string{c.want}, errorsOf(t, c.in), c.in)
	}
	// A boolean is not a version: the shape check names the field too.
	got := errorsOf(t, pre+"{name: e, target: 10.213.0.9, guestPort: 1, hostPort: 2, proxyProtocol: true}]")
	require.Len(t, got, 1)
	assert.Contains(t, got[0], "exposures[1].proxyProtocol: ")
}

// The version reaches the model as its one typed field, on proxy and auto
// (any hostAddress auto takes); none is the default. auto's address rules
// stay auto's: a header does not make IPv6 host addresses valid on auto.
func TestProxyProtocolReachesTheModel(t *testing.T) {
	c, m, err := Load([]byte(`
exposures:
  - {name: a, target: 10.213.0.9, guestPort: 80, hostPort: 8080, proxyProtocol: v1}
  - {name: b, target: 10.213.0.9, guestPort: 80, hostPort: 8081, mode: proxy, hostAddress: '::', proxyProtocol: v2}
  - {name: c, target: 10.213.0.9, guestPort: 80, hostPort: 8082, hostAddress: 127.0.0.1, proxyProtocol: v2}
  - {name: d, target: 10.213.0.9, guestPort: 80, hostPort: 8083, mode: nat, proxyProtocol: ""}
  - {name: e, target: 10.213.0.9, guestPort: 80, hostPort: 8084}
`))
	require.NoError(t, err)
	want := []spec.ProxyProtocol{spec.ProxyV1, spec.ProxyV2, spec.ProxyV2, spec.ProxyNone, spec.ProxyNone}
	require.Len(t, m.Exposures, len(want))
	for i, w := range want {
		assert.Equal(t, w, m.Exposures[i].ProxyProtocol, m.Exposures[i].Name)
	}
	assert.False(t, m.Exposures[0].UsesKernel(), "auto with a header: the proxy carries every caller")

	// desired.json keeps the key, and a config without one is unchanged.
	b, err := json.Marshal(c.Exposures[0])
	require.NoError(t, err)
	assert.Contains(t, string(b), `"proxyProtocol":"v1"`)
	b, err = json.Marshal(c.Exposures[4])
	require.NoError(t, err)
	assert.NotContains(t, string(b), "proxyProtocol")

	assert.Equal(t, []string{"exposures[0].hostAddress: :: is IPv6 and the exposure has no target6; give target6, or mode proxy"},
		errorsOf(t, "exposures: [{name: e, target: 10.213.0.9, guestPort: 1, hostPort: 2, hostAddress: '::', proxyProtocol: v1}]"))
}
