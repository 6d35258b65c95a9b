package config

import (
	"encoding/json"
	"fmt"
	"strings"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	"go.yaml.in/yaml/v3"

	"github.com/brokkr/brokkr/internal/spec"
)

// A range of host ports is one exposure: the model holds its first and last
// port, and the guest port is one for all of it or the same range.
func TestPortRangeModel(t *testing.T) {
	_, m, err := Load([]byte(`
vms: [{name: web, kernel: /k}]
exposures:
  - {name: one, vm: web, guestPort: 8080, hostPort: "30000-30099", mode: proxy}
  - {name: same, vm: web, guestPort: "31000-31009", hostPort: "31000-31009", mode: proxy}
  - {name: plain, vm: web, guestPort: 80, hostPort: 8080, mode: proxy}
  - {name: quoted, vm: web, guestPort: "81", hostPort: "8081", mode: proxy}
  - {name: short, vm: web, guestPort: 82, hostPort: "8082-8082", mode: proxy}
  - {name: shifted, vm: web, guestPort: "40000-40009", hostPort: "32000-32009", mode: nat}
`))
	require.NoError(t, err)
	got := make([][4]uint16, len(m.Exposures))
	for i, e := range m.Exposures {
		got[i] = [4]uint16{e.HostPort, e.HostPortLast, e.GuestPort, e.GuestPortLast}
	}
	assert.Equal(t, [][4]uint16{{30000, 30099, 8080, 0}, {31000, 31009, 31000, 31009}, {8080, 0, 80, 0}, {8081, 0, 81, 0}, {8082, 0, 82, 0},
		{32000, 32009, 40000, 40009}}, got)
	shifted := m.Exposures[5]
	assert.Equal(t, uint16(40005), shifted.GuestPortOf(32005))
	assert.False(t, shifted.SamePorts())
	assert.Equal(t, "40000-40009", shifted.GuestPortText())
	one, same := m.Exposures[0], m.Exposures[1]
	assert.True(t, one.IsRange())
	assert.Equal(t, 100, one.PortCount())
	assert.Equal(t, uint16(8080), one.GuestPortOf(30050))
	assert.Equal(t, uint16(31005), same.GuestPortOf(31005))
	assert.True(t, same.SamePorts())
	assert.False(t, one.SamePorts())
	assert.Equal(t, "30000-30099", one.HostPortText())
	assert.Equal(t, "8080", one.GuestPortText())
	assert.False(t, m.Exposures[4].IsRange(), "8082-8082 is one port")
}

// What is wrong with a port or a range is said with its field and value.
func TestPortRangeErrorsNameTheirField(t *testing.T) {
	ex := func(host, guest string) string {
		return "vms: [{name: web, kernel: /k}]\nexposures:\n  - {name: e, vm: web, mode: proxy, hostPort: " + host + ", guestPort: " + guest + "}\n"
	}
	cases := []struct{ in, want string }{
		{ex(`"30099-30000"`, "80"), `exposures[0].hostPort: "30099-30000": the first port is above the last`},
		{ex(`"1-5000"`, "80"), `exposures[0].hostPort: "1-5000" is 5000 ports, more than the 4096 a range may have`},
		{ex(`"65000-70000"`, "80"), `exposures[0].hostPort: "65000-70000" is out of range (1..65535)`},
		{ex(`"0-10"`, "80"), `exposures[0].hostPort: "0-10" is out of range (1..65535)`},
		{ex("8080", `"80-81"`), `exposures[0].guestPort: "80-81" is a range and hostPort 8080 is one port; give one guest port`},
		{ex(`"30000-30099"`, `"30000-30009"`), `exposures[0].guestPort: "30000-30009" is 10 ports and hostPort "30000-30099" is 100; give a range of the same length, or one port`},
		{ex(`"30000-"`, "80"), `exposures[0].hostPort: "30000-" is not a port or a range of ports (8080, "30000-30099")`},
		{ex(`"1-2-3"`, "80"), `exposures[0].hostPort: "1-2-3" is not a port or a range of ports (8080, "30000-30099")`},
		{ex(`"-5"`, "80"), `exposures[0].hostPort: "-5" is not a port or a range of ports (8080, "30000-30099")`},
		{ex(`web`, "80"), `exposures[0].hostPort: "web" is not a port or a range of ports (8080, "30000-30099")`},
	}
	for _, c := range cases {
		assert.Equal(t, []string{c.want}, errorsOf(t, c.in), c.in)
	}
	// The longest range there may be.
	_, err := Parse([]byte(ex(`"1-4096"`, "80")))
	assert.NoError(t, err)
}

// Overlap checks treat ranges as ranges, whichever came first.
func TestPortRangeOverlap(t *testing.T) {
	base := "vms: [{name: a, kernel: /k}]\nexposures:\n"
	ex := func(name, addr, proto, port string) string {
		return "  - {name: " + name + ", vm: a, guestPort: 1, hostPort: " + port + ", hostAddress: " + addr + ", protocol: " + proto + ", mode: proxy}\n"
	}
	cases := []struct {
		name, body, want string
	}{
		{"a single port inside an earlier range", ex("x", "0.0.0.0", "tcp", `"30000-30099"`) + ex("y", "0.0.0.0", "tcp", "30050"),
			`exposures[1].hostPort: 30050/tcp on 0.0.0.0 overlaps exposures[0] ("30000-30099"/tcp on 0.0.0.0)`},
		{"a range over an earlier single port", ex("x", "0.0.0.0", "tcp", "30099") + ex("y", "''", "tcp", `"30000-30099"`),
			`exposures[1].hostPort: "30000-30099"/tcp on every address overlaps exposures[0] (30099/tcp on 0.0.0.0)`},
		{"two ranges", ex("x", "127.0.0.1", "tcp", `"30000-30099"`) + ex("y", "0.0.0.0", "tcp", `"30099-31500"`),
			`exposures[1].hostPort: "30099-31500"/tcp on 0.0.0.0 overlaps exposures[0] ("30000-30099"/tcp on 127.0.0.1)`},
		{"a range across blocks inside another", ex("x", "0.0.0.0", "udp", `"1000-5000"`) + ex("y", "0.0.0.0", "udp", `"3000-3001"`),
			`exposures[1].hostPort: "3000-3001"/udp on 0.0.0.0 overlaps exposures[0] ("1000-5000"/udp on 0.0.0.0)`},
		{"next to each other", ex("x", "0.0.0.0", "tcp", `"30000-30099"`) + ex("y", "0.0.0.0", "tcp", `"30100-30199"`) + ex("z", "0.0.0.0", "tcp", "29999"), ""},
		{"other protocol", ex("x", "0.0.0.0", "tcp", `"30000-30099"`) + ex("y", "0.0.0.0", "udp", "30050"), ""},
		{"other address", ex("x", "127.0.0.1", "tcp", `"30000-30099"`) + ex("y", "127.0.0.2", "tcp", `"30000-30099"`), ""},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			_, err := Parse([]byte(base + tc.body))
			if tc.want == "" {
				assert.NoError(t, err)
				return
			}
			require.Error(t, err)
			assert.Equal(t, tc.want, err.Error())
		})
	}
}

// Every mode carries a range; the socket path's translations, one per
// port of every auto exposure, are bounded by its map, and a state past
// it is refused naming the bound (Compile and LiveExposures alike).
func TestPortRangeModesAndTheSocketPathBound(t *testing.T) {
	for _, m := range []string{"auto", "nat", "proxy"} {
		in := "vms: [{name: a, kernel: /k}]\nexposures: [{name: e, vm: a, guestPort: 1, hostPort: '30000-30009', mode: " + m + "}]\n"
		_, err := Parse([]byte(in))
		assert.NoError(t, err, m)
	}
	c, err := Parse([]byte("vms: [{name: a, kernel: /k}]\n"))
	require.NoError(t, err)
	zero := 0
	ranges := spec.MaxSocketPathPorts / spec.MaxPortRange
	for i := range ranges {
		// Half of them TCP, half UDP: one protocol has 65535 ports.
		first := 1 + i/2*spec.MaxPortRange
		c.Exposures = append(c.Exposures, Exposure{Name: fmt.Sprint("r", i), VM: "a", Protocol: []string{"tcp", "udp"}[i%2], GuestPort: P(80),
			HostPort: Range(first, first+spec.MaxPortRange-1), Mode: "auto", MaxConns: &zero})
	}
	model, errs := Compile(c)
	require.Empty(t, errs, "exactly as many ports as the socket path holds")
	live := NewLiveExposures(c, model)
	more := []Exposure{
		{Name: "one", VM: "a", Protocol: "udp", GuestPort: P(80), HostPort: P(40000), Mode: "auto", MaxConns: &zero},
		{Name: "two", VM: "a", Protocol: "udp", GuestPort: P(80), HostPort: Range(40000, 40001), Mode: "auto", MaxConns: &zero},
	}
	for i, e := range more {
		next, _, _ := c.WithExposure(e)
		_, errs = Compile(next)
		require.Len(t, errs, 1, e.Name)
		assert.Equal(t, fmt.Sprintf("exposures[%d].hostPort: %s: the socket path would translate %d host ports with it, more than the %d it holds (one per port of every auto exposure)",
			ranges, e.HostPort.quoted(), spec.MaxSocketPathPorts+1+i, spec.MaxSocketPathPorts), errs[0].Error())
		_, ok := live.Check(e)
		assert.False(t, ok, e.Name)
	}
	// In proxy mode the socket path has no part in it; a replacement at
	// the bound keeps its own count.
	proxied := more[1]
	proxied.Mode = "proxy"
	_, ok := live.Check(proxied)
	assert.True(t, ok)
	again := c.Exposures[3]
	again.GuestPort = P(81)
	_, ok = live.Check(again)
	assert.True(t, ok, "a replacement at the bound")
	next, _, _ := c.WithExposure(again)
	_, errs = Compile(next)
	assert.Empty(t, errs)
	// Removing a range frees its ports for another.
	live.Remove("r1")
	_, ok = live.Check(more[1])
	assert.True(t, ok)
}

// desired.json and the API's body keep a single port an integer; a range
// is a string, and both read back the same.
func TestPortMarshalsAsWritten(t *testing.T) {
	e := Exposure{Name: "e", HostPort: Range(30000, 30099), GuestPort: P(80)}
	b, err := json.Marshal(e)
	require.NoError(t, err)
	assert.Contains(t, string(b), `"guestPort":80,"hostPort":"30000-30099"`)
	var back Exposure
	require.NoError(t, json.Unmarshal(b, &back))
	assert.Equal(t, e.HostPort, back.HostPort)
	assert.Equal(t, e.GuestPort, back.GuestPort)
	y, err := yaml.Marshal(e)
	require.NoError(t, err)
	assert.True(t, strings.Contains(string(y), "hostPort: 30000-30099\n") && strings.Contains(string(y), "guestPort: 80\n"), string(y))
	one, err := DecodeExposure(b)
	require.NoError(t, err)
	assert.Equal(t, e.HostPort, one.HostPort)
}
