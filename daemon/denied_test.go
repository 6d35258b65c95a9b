package daemon

import (
	"context"
	"encoding/json"
	"io"
	"log/slog"
	"net/netip"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/brokkr/brokkr/bpf"
	"github.com/brokkr/brokkr/daemon/config"
)

// denied (callers allowFrom turned away, counted into exposure_denied_v2 by
// the nat path's program and the proxy) reaches the status JSON and the
// metric from the shared slot.
func TestDeniedReachesStatusAndMetrics(t *testing.T) {
	r := newRig(t, rigConfig)
	slot, err := r.store.Attach("ext", bpf.ProtoTCP, 2222)
	require.NoError(t, err)
	defer slot.Release(false)
	slot.AddDenied(5)
	r.d.Pass(context.Background())
	e := expo(r.d.Status(), "ext")
	assert.EqualValues(t, 5, e.Denied)
	b, err := json.Marshal(e)
	require.NoError(t, err)
	assert.Contains(t, string(b), `"denied":5`)

	slot.AddDenied(1) // read at each request, not at the last pass
	c := serve(t, r)
	text, err := c.Metrics(context.Background())
	require.NoError(t, err)
	assert.Contains(t, text, `brokkr_exposure_denied_total{exposure="ext"} 6`)
	assert.Contains(t, text, `brokkr_exposure_denied_total{exposure="web-auto"} 0`)
}

// Where the nat path's fallback runs (no BPF netfilter programs), an
// exposure with allowFrom is carried by the proxy, never by an nft DNAT
// that would admit everyone, and status says so.
func TestOnTheFallbackRestrictedExposuresAreCarriedByTheProxy(t *testing.T) {
	host, err := config.Parse([]byte(`
exposures:
  - {name: guarded, target: 10.213.0.200, guestPort: 22, hostPort: 2222, mode: nat, allowFrom: [192.0.2.0/24]}
  - {name: open, target: 10.213.0.200, guestPort: 22, hostPort: 2223, mode: nat}
`))
	require.NoError(t, err)
	host.StateDir = t.TempDir()
	host.RunDir = shortDir(t)
	c := &calls{}
	addrs := NewAddressBook()
	net, px := &recNet{calls: c}, &recProxy{calls: c, resolve: addrs.Resolve}
	store := bpf.NewInMemory("test")
	defer store.Close()
	d, err := New(Options{Host: host, Store: store, Supervisor: &recSup{calls: c}, Network: net, Proxy: px, Addresses: addrs,
		Logger: slog.New(slog.NewTextHandler(io.Discard, nil)), Timeout: 200 * time.Millisecond,
		CappedAutoByProxy: "kernel 6.1 has no BPF netfilter programs (6.4)"})
	require.NoError(t, err)
	d.Pass(context.Background())
	var kernel []string
	for _, e := range net.last.Exposures {
		kernel = append(kernel, e.Name)
	}
	assert.Equal(t, []string{"open"}, kernel, "nft does not carry the restricted exposure")
	require.Len(t, px.last, 1)
	assert.Equal(t, "guarded", px.last[0].Name)
	assert.Equal(t, []netip.Prefix{netip.MustParsePrefix("192.0.2.0/24")}, px.last[0].AllowFrom, "the proxy enforces the list")
	assert.Contains(t, strings.Join(d.Status().Warnings, "\n"), "exposures [guarded] with allowFrom are carried by the proxy")
}
