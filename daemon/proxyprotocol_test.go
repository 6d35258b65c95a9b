package daemon

import (
	"context"
	"io"
	"log/slog"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/brokkr/brokkr/bpf"
	"github.com/brokkr/brokkr/daemon/config"
	"github.com/brokkr/brokkr/internal/spec"
)

// Through a whole pass: an auto exposure with a PROXY header is not handed
// to the network plane, the proxy gets its listeners (0.0.0.0 and ::1) with
// the header, and its status row is the proxy's part alone and echoes the
// header; the same exposure without one is nftables' as before.
func TestAPassHandsAnAutoExposureWithAProxyHeaderToTheProxyAlone(t *testing.T) {
	host, err := config.Parse([]byte(`
vms: [{name: web, kernel: /k}]
exposures:
  - {name: pp, vm: web, guestPort: 80, hostPort: 8080, proxyProtocol: v1}
  - {name: plain, vm: web, guestPort: 80, hostPort: 8081}
`))
	require.NoError(t, err)
	host.StateDir, host.RunDir = t.TempDir(), shortDir(t)
	c := &calls{}
	addrs := NewAddressBook()
	px := &recProxy{calls: c, resolve: addrs.Resolve}
	nw := &recNet{calls: c, leased: true}
	store := bpf.NewInMemory("test")
	defer store.Close()
	d, err := New(Options{Host: host, Store: store, Supervisor: &recSup{calls: c}, Network: nw,
		Proxy: px, Addresses: addrs, IPv6Loopback: true,
		Logger: slog.New(slog.NewTextHandler(io.Discard, nil))})
	require.NoError(t, err)
	d.Pass(context.Background())

	var kernel []string
	for _, e := range nw.desired().Exposures {
		kernel = append(kernel, e.Name)
	}
	assert.Equal(t, []string{"plain"}, kernel)
	specs, _ := px.specs()
	var got []string
	for _, s := range specs {
		got = append(got, s.Name+"@"+s.Listen.String()+" "+string(s.ProxyProtocol))
	}
	assert.Equal(t, []string{"pp@0.0.0.0 v1", "pp@:: v1", "plain@127.0.0.1 ", "plain@::1 "}, got)
	for _, s := range specs {
		if s.Name == "pp" {
			assert.Equal(t, spec.ProxyV1, s.ProxyProtocol)
		}
	}
	st := d.Status()
	assert.Equal(t, "v1", expo(st, "pp").ProxyProtocol)
	assert.Equal(t, "active", expo(st, "pp").State, expo(st, "pp").Reason)
	assert.Empty(t, expo(st, "plain").ProxyProtocol)
}
