package daemon

import (
	"context"
	"io"
	"log/slog"
	"strings"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/brokkr/brokkr/bpf"
	"github.com/brokkr/brokkr/daemon/config"
	"github.com/brokkr/brokkr/internal/nstest"
	"github.com/brokkr/brokkr/netplane"
)

// A network the plane refuses (network.bridge names a bridge brokkr did not
// make) reaches status as what it is: every exposure that needs the network
// is failed with the plane's reason, not pending "not reported yet"; the
// VMs say why they wait; and the warning names the plane once.
func TestARefusedNetworkFailsEveryExposureWithTheReason(t *testing.T) {
	ns := nstest.New(t, "host")
	ns.MustRun(t, "ip", "link", "add", "brokkr0", "type", "bridge") // someone else's

	host, err := config.Parse([]byte(`
network: {bridge: brokkr0}
vms: [{name: web, kernel: /k}]
exposures:
  - {name: web-nat, vm: web, guestPort: 80, hostPort: 8080, mode: nat}
  - {name: web-auto, vm: web, guestPort: 80, hostPort: 8081}
  - {name: web-proxy, vm: web, guestPort: 80, hostPort: 8082, mode: proxy}
`))
	require.NoError(t, err)
	host.StateDir, host.RunDir = t.TempDir(), shortDir(t)
	store := bpf.NewInMemory("test")
	t.Cleanup(func() { _ = store.Close() })
	plane, err := netplane.New(netplane.Options{NetNS: ns.Path, StateDir: host.StateDir, Stats: store})
	require.NoError(t, err)
	t.Cleanup(func() { _ = plane.Close() })
	c := &calls{}
	addrs := NewAddressBook()
	d, err := New(Options{Host: host, Store: store, Supervisor: &recSup{calls: c}, Network: plane,
		Proxy: &recProxy{calls: c, resolve: addrs.Resolve}, Addresses: addrs,
		Logger: slog.New(slog.NewTextHandler(io.Discard, nil))})
	require.NoError(t, err)

	d.Pass(context.Background())
	st := d.Status()
	const why = `network.bridge: link "brokkr0" exists and was not created by brokkr`
	require.Len(t, st.Exposures, 3)
	for _, x := range st.Exposures {
		assert.Equal(t, "failed", x.State, "%s: %s", x.Name, x.Reason)
		assert.Contains(t, x.Reason, why, x.Name)
		assert.NotContains(t, x.Reason, "not reported", x.Name)
	}
	require.Len(t, st.VMs, 1)
	assert.Contains(t, st.VMs[0].Detail, why, "the VM says why it is held")
	all := strings.Join(st.Warnings, "\n")
	assert.Contains(t, all, why)
	assert.NotContains(t, all, "netplane: netplane:")
	assert.Empty(t, ns.MustRun(t, "ip", "-br", "link", "show", "master", "brokkr0"), "nothing was attached to the foreign bridge")
}
