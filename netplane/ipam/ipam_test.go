package ipam

import (
	"fmt"
	"net"
	"net/netip"
	"os"
	"path/filepath"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	"go.uber.org/goleak"
)

func TestMain(m *testing.M) { goleak.VerifyTestMain(m) }

var bridge = netip.MustParsePrefix("10.213.0.1/24")

func macOf(vm string, attempt int) net.HardwareAddr {
	return net.HardwareAddr{0x52, 0x54, 0, byte(len(vm)), byte(vm[0]), byte(attempt)}
}

func req(vms ...string) Request { return Request{Bridge: bridge, VMs: vms, MAC: macOf} }

func TestLeasesSurviveARestart(t *testing.T) {
	dir := t.TempDir()
	p, err := Open(dir)
	require.NoError(t, err)
	first, failed, err := p.Reconcile(req("web", "db", "cache"))
	require.NoError(t, err)
	assert.Empty(t, failed)
	require.Len(t, first, 3)

	p2, err := Open(dir)
	require.NoError(t, err)
	assert.Equal(t, first, p2.Leases(), "a new pool on the same dir has the same leases")
	// Added in another order, with a new VM: the old ones keep their addresses.
	again, _, err := p2.Reconcile(req("zeta", "cache", "db", "web"))
	require.NoError(t, err)
	for vm, l := range first {
		assert.Equal(t, l, again[vm], vm)
	}
}

func TestAddressesAreUniqueAndSkipSpecialOnes(t *testing.T) {
	p, err := Open(t.TempDir())
	require.NoError(t, err)
	small := netip.MustParsePrefix("10.9.0.1/29") // .0 network, .7 broadcast, .1 bridge: 5 guests
	reserved := netip.MustParseAddr("10.9.0.4")
	var vms []string
	for i := 0; i < 5; i++ {
		vms = append(vms, fmt.Sprintf("vm%d", i))
	}
	leases, failed, err := p.Reconcile(Request{Bridge: small, VMs: vms, Reserved: []netip.Addr{reserved}, MAC: macOf})
	require.NoError(t, err)
	require.Len(t, failed, 1, "4 free addresses for 5 VMs")
	seen := map[netip.Addr]string{}
	for vm, l := range leases {
		assert.True(t, small.Masked().Contains(l.Addr))
		for _, bad := range []string{"10.9.0.0", "10.9.0.7", "10.9.0.1", "10.9.0.4"} {
			assert.NotEqual(t, netip.MustParseAddr(bad), l.Addr, vm)
		}
		assert.Empty(t, seen[l.Addr], "address %s leased twice", l.Addr)
		seen[l.Addr] = vm
	}
	for vm, err := range failed {
		assert.ErrorContains(t, err, "no free address", vm)
	}
}

func TestRemovedVMFreesItsAddress(t *testing.T) {
	dir := t.TempDir()
	p, err := Open(dir)
	require.NoError(t, err)
	small := netip.MustParsePrefix("10.9.0.1/30") // exactly one guest address: 10.9.0.2
	one := func(vms ...string) (map[string]Lease, map[string]error) {
		l, f, err := p.Reconcile(Request{Bridge: small, VMs: vms, MAC: macOf})
		require.NoError(t, err)
		return l, f
	}
	l, _ := one("a")
	assert.Equal(t, netip.MustParseAddr("10.9.0.2"), l["a"].Addr)
	_, f := one("a", "b")
	assert.Contains(t, f, "b", "a live lease is never reused")
	l, f = one("b")
	assert.Empty(t, f)
	assert.Equal(t, netip.MustParseAddr("10.9.0.2"), l["b"].Addr, "freed when a left")
	p2, err := Open(dir)
	require.NoError(t, err)
	assert.NotContains(t, p2.Leases(), "a", "the free is persisted")
}

func TestSubnetChangeAndReservationMoveALease(t *testing.T) {
	p, err := Open(t.TempDir())
	require.NoError(t, err)
	l, _, err := p.Reconcile(req("web"))
	require.NoError(t, err)
	old := l["web"]
	l, _, err = p.Reconcile(Request{Bridge: bridge, VMs: []string{"web"}, Reserved: []netip.Addr{old.Addr}, MAC: macOf})
	require.NoError(t, err)
	assert.NotEqual(t, old.Addr, l["web"].Addr, "a reserved address is taken back")
	assert.Equal(t, old.MAC, l["web"].MAC, "the MAC stays")
	l, _, err = p.Reconcile(Request{Bridge: netip.MustParsePrefix("10.50.0.1/24"), VMs: []string{"web"}, MAC: macOf})
	require.NoError(t, err)
	assert.True(t, netip.MustParsePrefix("10.50.0.0/24").Contains(l["web"].Addr))
}

func TestMACCollisionTakesTheNextAttempt(t *testing.T) {
	p, err := Open(t.TempDir())
	require.NoError(t, err)
	same := func(vm string, attempt int) net.HardwareAddr {
		return net.HardwareAddr{0x52, 0x54, 0, 0, 0, byte(attempt)}
	}
	l, _, err := p.Reconcile(Request{Bridge: bridge, VMs: []string{"a", "b"}, MAC: same})
	require.NoError(t, err)
	assert.NotEqual(t, l["a"].MAC, l["b"].MAC)
}

func TestCorruptFileIsAnErrorNotAReset(t *testing.T) {
	dir := t.TempDir()
	require.NoError(t, os.WriteFile(filepath.Join(dir, FileName), []byte(`{"version":1,"leases":[{"vm":"a","address":"10.0.0.300","mac":"52:54:00:00:00:01"}]}`), 0o644))
	_, err := Open(dir)
	assert.ErrorContains(t, err, "leases[0].address")
}

func TestParseRejects(t *testing.T) {
	for name, in := range map[string]string{
		"version":  `{"version":2,"leases":[]}`,
		"unknown":  `{"version":1,"leases":[],"x":1}`,
		"emptyvm":  `{"version":1,"leases":[{"vm":"","address":"10.0.0.2","mac":"52:54:00:00:00:01"}]}`,
		"v6":       `{"version":1,"leases":[{"vm":"a","address":"::1","mac":"52:54:00:00:00:01"}]}`,
		"mac8":     `{"version":1,"leases":[{"vm":"a","address":"10.0.0.2","mac":"00:00:00:00:fe:80:00:00"}]}`,
		"dupvm":    `{"version":1,"leases":[{"vm":"a","address":"10.0.0.2","mac":"52:54:00:00:00:01"},{"vm":"a","address":"10.0.0.3","mac":"52:54:00:00:00:02"}]}`,
		"dupaddr":  `{"version":1,"leases":[{"vm":"a","address":"10.0.0.2","mac":"52:54:00:00:00:01"},{"vm":"b","address":"10.0.0.2","mac":"52:54:00:00:00:02"}]}`,
		"dupmac":   `{"version":1,"leases":[{"vm":"a","address":"10.0.0.2","mac":"52:54:00:00:00:01"},{"vm":"b","address":"10.0.0.3","mac":"52:54:00:00:00:01"}]}`,
		"trailing": `{"version":1,"leases":[]} {}`,
	} {
		_, err := Parse([]byte(in))
		assert.Error(t, err, name)
	}
}

func FuzzParse(f *testing.F) {
	f.Add([]byte(`{"version":1,"leases":[{"vm":"web","address":"10.213.0.7","mac":"52:54:00:aa:bb:cc"}]}`))
	f.Add([]byte(`{"version":1,"leases":[]}`))
	f.Add([]byte(`{"version":1,"leases":[{"vm":"a","address":"10.0.0.2","mac":"52:54:00:00:00:01"},{"vm":"b","address":"10.0.0.3","mac":"52:54:00:00:00:02"}]}`))
	f.Add([]byte(`{"version":1}`))
	f.Add([]byte(`null`))
	f.Fuzz(func(t *testing.T, b []byte) {
		ls, err := Parse(b)
		if err != nil {
			return
		}
		// Whatever parses must survive a write and a read unchanged.
		m := map[string]Lease{}
		for _, l := range ls {
			m[l.VM] = l
		}
		out, err := Marshal(m)
		if err != nil {
			t.Fatal(err)
		}
		back, err := Parse(out)
		if err != nil {
			t.Fatalf("re-parse of %q: %v", out, err)
		}
		if len(back) != len(ls) {
			t.Fatalf("%d leases became %d", len(ls), len(back))
		}
		for _, l := range back {
			o := m[l.VM]
			if o.Addr != l.Addr || o.MAC.String() != l.MAC.String() {
				t.Fatalf("lease %q changed: %v -> %v", l.VM, o, l)
			}
		}
	})
}
