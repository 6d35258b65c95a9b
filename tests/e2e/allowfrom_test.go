package e2e

import (
	"context"
	"encoding/json"
	"errors"
	"net"
	"os"
	"path/filepath"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/brokkr/brokkr/bpf"
	"github.com/brokkr/brokkr/daemon/api"
	"github.com/brokkr/brokkr/internal/kernelfeat"
	"github.com/brokkr/brokkr/internal/nstest"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

// allowFrom through the real daemon: a nat and a proxy exposure that only
// the fixture's client (192.0.2.0/24) may call, with a cap of 1 each, and a
// second caller at 198.18.0.2 that may not.
const allowConfig = `
stateDir: {{state}}
runDir: {{run}}
bpfDir: {{bpf}}
network:
  bridge: brk-e2a0
  cidr: 10.213.9.1/24
hypervisor:
  kind: qemu
exposures:
  - {name: guarded, target: 10.213.9.200, guestPort: 7000, hostPort: 7000, mode: nat, maxConns: 1, allowFrom: [192.0.2.0/24, "2001:db8::/32"]}
  - {name: guarded-px, target: 10.213.9.200, guestPort: 7000, hostPort: 7002, mode: proxy, maxConns: 1, allowFrom: [192.0.2.0/24]}
`

// bpftoolDenied reads exposure_denied_v2 with bpftool, as an operator
// would: the entry of each named exposure's slot (found in
// exposure_stats_v2).
func (e *env) bpftoolDenied(t testing.TB, names ...string) map[string]uint64 {
	t.Helper()
	slots := map[int]string{}
	for slot, v := range bpftoolLookups(t, filepath.Join(e.bpfDir, bpf.MapName), e.bpfDir) {
		var ent struct {
			Name string `json:"name"`
		}
		require.NoError(t, json.Unmarshal(v, &ent))
		slots[slot] = ent.Name
	}
	got := map[string]uint64{}
	for slot, v := range bpftoolLookups(t, filepath.Join(e.bpfDir, bpf.DeniedMapName), e.bpfDir) {
		for _, n := range names {
			if slots[slot] != n {
				continue
			}
			var d struct {
				Denied uint64 `json:"denied"`
			}
			require.NoError(t, json.Unmarshal(v, &d), string(v))
			got[n] = d.Denied
		}
	}
	return got
}

// droppedNotReset: a nat caller outside allowFrom sees its connect time out
// (one SYN: the deadline is below the first retransmission), never a RST.
func droppedNotReset(t *testing.T, ns *nstest.NS, addr string) {
	t.Helper()
	c, err := dial(ns, addr, 500*time.Millisecond)
	if err == nil {
		c.Close()
	}
	var ne net.Error
	require.True(t, errors.As(err, &ne) && ne.Timeout(), "dropped, not carried nor reset: %v", err)
}

func TestAllowFromThroughTheRealDaemonOnNatAndProxy(t *testing.T) {
	nstest.RequireRoot(t)
	kernelfeat.Require(t, kernelfeat.NatPath...)
	e := &env{t: t, fixture: newFixture(t, "e2a")}
	cfg := strings.NewReplacer("{{state}}", e.state, "{{run}}", e.run, "{{bpf}}", e.bpfDir).Replace(allowConfig)
	require.NoError(t, os.WriteFile(e.cfgPath, []byte(cfg), 0o600))
	t.Cleanup(e.logOnFailure)
	other := nstest.New(t, "other")
	nstest.Link(t, e.host, "brk-e2a-o", "198.18.0.1/24", other, "eth0", "198.18.0.2/24")
	other.MustRun(t, "ip", "route", "add", "default", "via", "198.18.0.1")

	e.startDaemon()
	e.waitStatus("both exposures active", 20*time.Second, func(st api.Status) bool {
		a, ok1 := exposure(st, "guarded")
		b, ok2 := exposure(st, "guarded-px")
		return ok1 && ok2 && a.State == "active" && b.State == "active"
	})
	g := nstest.New(t, "guest")
	e.host.MustRun(t, "ip", "link", "add", "brk-e2a-g", "type", "veth", "peer", "name", "eth0", "netns", g.Name)
	e.host.MustRun(t, "ip", "link", "set", "brk-e2a-g", "master", "brk-e2a0", "up")
	g.MustRun(t, "ip", "addr", "add", "10.213.9.200/24", "dev", "eth0")
	g.MustRun(t, "ip", "link", "set", "eth0", "up")
	g.MustRun(t, "ip", "route", "add", "default", "via", "10.213.9.1")
	g.ServeEcho(t, "0.0.0.0:7000")
	nat, px := hostIP+":7000", hostIP+":7002"

	// nat: the denied caller first, then the allowed one takes the cap's
	// one place, then the denied one again.
	droppedNotReset(t, other, nat)
	a := hold(t, e.client, nat)
	droppedNotReset(t, other, nat)
	// proxy: closed at accept, the allowed caller carried.
	assert.True(t, refused(other, px), "a proxy caller outside allowFrom is closed")
	b := hold(t, e.client, px)
	st := e.status()
	x, _ := exposure(st, "guarded")
	assert.EqualValues(t, 2, x.Denied)
	assert.EqualValues(t, 1, x.Accepted)
	assert.EqualValues(t, 0, x.Refused, "denied callers never reach the cap")
	assert.EqualValues(t, 1, x.Active)
	y, _ := exposure(st, "guarded-px")
	assert.EqualValues(t, 1, y.Denied)
	assert.EqualValues(t, 1, y.Accepted)
	assert.EqualValues(t, 0, y.Refused)
	b.Close()

	// With the daemon down the nat path goes on dropping and counting,
	// and bpftool reads the count.
	e.stopDaemon(syscall.SIGKILL)
	droppedNotReset(t, other, nat)
	got := e.bpftoolDenied(t, "guarded", "guarded-px")
	assert.EqualValues(t, 3, got["guarded"], "counted with no daemon, read by bpftool")
	assert.EqualValues(t, 1, got["guarded-px"])
	a.Close()

	e.startDaemon()
	st = e.waitStatus("the restarted daemon's pass", 20*time.Second, func(st api.Status) bool {
		x, ok := exposure(st, "guarded")
		return ok && x.State == "active"
	})
	x, _ = exposure(st, "guarded")
	assert.EqualValues(t, 3, x.Denied, "a restart neither loses nor doubles")
	droppedNotReset(t, other, nat)
	text, err := api.NewClient(e.sock).Metrics(context.Background())
	require.NoError(t, err)
	assert.Contains(t, text, `brokkr_exposure_denied_total{exposure="guarded"} 4`)
	assert.Contains(t, text, `brokkr_exposure_denied_total{exposure="guarded-px"} 1`)
	out, _, code := e.brokkr("stats", "--bpf-dir", e.bpfDir)
	require.Equal(t, 0, code, out)
	assert.Contains(t, out, "DENIED")
}
