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

// apply (also --dry-run) and status warn when the proxied exposures' caps
// could take more descriptors than brokkrd has, naming them; the exposures
// the proxy does not carry are not counted.
func TestApplyAndStatusWarnWhenProxyCapsExceedTheDescriptorLimit(t *testing.T) {
	r := newRig(t, rigConfig)
	limit := uint64(65536)
	old := noFileLimit
	noFileLimit = func() (uint64, error) { return limit, nil }
	t.Cleanup(func() { noFileLimit = old })

	cfg, err := config.Parse([]byte(rigConfig))
	require.NoError(t, err)
	plan, err := r.d.Apply(cfg, true)
	require.NoError(t, err)
	for _, w := range plan.Warnings {
		assert.NotContains(t, w, "descriptor budget", "within the limit")
	}

	// web-auto, web-proxy and lo-auto at 256, ext at 3: 2 × 771 = 1542.
	limit = 1024
	for _, dry := range []bool{true, false} {
		plan, err = r.d.Apply(cfg, dry)
		require.NoError(t, err)
		w := strings.Join(plan.Warnings, "\n")
		assert.Contains(t, w, "2 × 771 = 1542 descriptors, more than brokkrd's RLIMIT_NOFILE of 1024")
		assert.Contains(t, w, "web-auto (256), web-proxy (256), lo-auto (256), ext (3)")
		assert.NotContains(t, w, "web-nat", "nat mode is carried by the kernel")
	}
	r.d.Pass(context.Background())
	assert.Contains(t, strings.Join(r.d.Status().Warnings, "\n"), "descriptor budget: at their caps")
}
