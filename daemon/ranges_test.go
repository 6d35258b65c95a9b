package daemon

import (
	"context"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/brokkr/brokkr/daemon/api"
	"github.com/brokkr/brokkr/daemon/config"
)

const rangeConfig = `
vms:
  - {name: web, kernel: /k}
exposures:
  - {name: games, vm: web, guestPort: "30000-30009", hostPort: "30000-30009", mode: proxy, hostAddress: 0.0.0.0, protocol: udp}
  - {name: one, vm: web, guestPort: 80, hostPort: "31000-31002", mode: proxy, hostAddress: 0.0.0.0}
`

// A port range is one exposure: the proxy gets one listener per port of
// it, and status, metrics and the listing show the range.
func TestPortRangeInStatusMetricsAndTheProxy(t *testing.T) {
	r := newRig(t, rangeConfig)
	r.d.Pass(context.Background())
	specs, _ := r.px.specs()
	var ports []uint16
	for _, s := range specs {
		if s.Name == "games" {
			ports = append(ports, s.Port)
			assert.Equal(t, s.Port, s.GuestPortOf(s.Port), "the guest range keeps each port")
		}
	}
	assert.Equal(t, []uint16{30000, 30001, 30002, 30003, 30004, 30005, 30006, 30007, 30008, 30009}, ports)

	byName := map[string]api.Exposure{}
	for _, e := range r.d.Status().Exposures {
		byName[e.Name] = e
	}
	g, one := byName["games"], byName["one"]
	assert.Equal(t, [4]int{30000, 30009, 30000, 30009}, [4]int{g.HostPort, g.HostPortLast, g.GuestPort, g.GuestPortLast})
	assert.Equal(t, [4]int{31000, 31002, 80, 0}, [4]int{one.HostPort, one.HostPortLast, one.GuestPort, one.GuestPortLast})
	assert.Equal(t, "pending", one.State, "every listener of the range reports (the guest has no address yet)")
	assert.Equal(t, "guest has no address yet", one.Reason)
	assert.Equal(t, "31000-31002", one.HostPorts())
	assert.Equal(t, "80", one.GuestPorts())

	text := scrape(t, r)
	assert.Contains(t, text, `brokkr_exposure_info{exposure="games",host_address="0.0.0.0",host_port="30000-30009",mode="proxy",protocol="udp"} 1`)
	assert.Contains(t, text, `brokkr_exposure_info{exposure="one",host_address="0.0.0.0",host_port="31000-31002",mode="proxy",protocol="tcp"} 1`)
}

// A row names a few of its reasons, not one per port of a range.
func TestMergePartsBoundsItsReasons(t *testing.T) {
	var parts []part
	for _, r := range []string{"a", "b", "c", "d", "e", "f", "a"} {
		parts = append(parts, part{"proxy", "failed", r})
	}
	_, why := mergeParts(parts)
	assert.Equal(t, "proxy: a; proxy: b; proxy: c; proxy: d; and 2 more", why)
	require.NotEmpty(t, why)
}

// A range put through the API is journalled and replayed as a range, and
// compacted into desired.json as the config spells it (a string); a PUT
// overlapping it is refused naming the field, and changes nothing.
func TestAPortRangeIsJournalledAndReplayed(t *testing.T) {
	r := newRig(t, rigConfig)
	put(t, r, "games", `{"vm": "db", "guestPort": "40000-40009", "hostPort": "30000-30009", "mode": "nat", "protocol": "udp"}`)
	w := do(t, r.d.Handler(), "PUT", "/v1/exposures/bad", `{"vm": "db", "guestPort": 1, "hostPort": 30005, "mode": "nat", "protocol": "udp"}`)
	assert.Equal(t, 422, w.Code, w.Body.String())
	assert.Contains(t, w.Body.String(), `hostPort: 30005/udp on every address overlaps exposures[5] (\"30000-30009\"/udp on every address)`)

	again := newRigWith(t, r.host)
	var got config.Exposure
	for _, e := range again.d.Desired().Exposures {
		if e.Name == "games" {
			got = e
		}
	}
	assert.Equal(t, config.Range(30000, 30009), got.HostPort)
	assert.Equal(t, config.Range(40000, 40009), got.GuestPort)
	assert.Contains(t, string(desiredFile(t, again)), `"guestPort": "40000-40009",
      "hostPort": "30000-30009",`)
	for _, e := range again.d.Desired().Exposures {
		assert.NotEqual(t, "bad", e.Name)
	}
}
