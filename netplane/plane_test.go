package netplane

import (
	"context"
	"net"
	"net/netip"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	"go.uber.org/goleak"

	"github.com/brokkr/brokkr/bpf"
	"github.com/brokkr/brokkr/internal/nstest"
	"github.com/brokkr/brokkr/netplane/link"
)

func TestMain(m *testing.M) { goleak.VerifyTestMain(m) }

func network() Network {
	return Network{Bridge: "brokkr0", CIDR: netip.MustParsePrefix("10.213.0.1/24"), MTU: 1500, DHCP: true, Masquerade: true}
}

// newPlane opens a Plane on ns that counts into an in-memory store; both
// are closed when the test ends.
func newPlane(t *testing.T, ns *nstest.NS, stateDir string) (*Plane, *bpf.Store) {
	t.Helper()
	store := bpf.NewInMemory("test")
	t.Cleanup(func() { _ = store.Close() })
	p, err := New(Options{NetNS: ns.Path, StateDir: stateDir, Stats: store})
	require.NoError(t, err)
	t.Cleanup(func() { _ = p.Close() })
	return p, store
}

// newPinnedPlane is newPlane on a pinned store in a bpffs of the test's own,
// so the BPF nat path can load.
func newPinnedPlane(t *testing.T, ns *nstest.NS, stateDir string) (*Plane, *bpf.Store) {
	t.Helper()
	store, err := bpf.Open(nstest.PrivateBPFFS(t))
	require.NoError(t, err)
	t.Cleanup(func() { _ = store.Close() })
	p, err := New(Options{NetNS: ns.Path, StateDir: stateDir, Stats: store})
	require.NoError(t, err)
	t.Cleanup(func() { _ = p.Close() })
	return p, store
}

// hostAndClient is a host namespace and a client namespace joined by a veth:
// the client is 10.99.0.2, the host 10.99.0.1.
func hostAndClient(t *testing.T) (host, client *nstest.NS) {
	t.Helper()
	host, client = nstest.New(t, "host"), nstest.New(t, "client")
	nstest.Link(t, client, "eth0", "10.99.0.2/24", host, "up0", "10.99.0.1/24")
	return host, client
}

func guestsOf(names ...string) []Guest {
	var gs []Guest
	for _, n := range names {
		gs = append(gs, Guest{Name: n})
	}
	return gs
}

func TestConvergeBuildsBridgeTapsAndAddresses(t *testing.T) {
	ns := nstest.New(t, "host")
	p, _ := newPlane(t, ns, t.TempDir())
	d := Desired{Network: network(), Guests: guestsOf("web", "a-long-runner-name-01")}
	rep := p.Converge(context.Background(), d)
	require.NoError(t, rep.Err)
	assert.Empty(t, rep.Repaired, "a first build is not drift")
	require.Len(t, rep.Guests, 2)
	subnet := netip.MustParsePrefix("10.213.0.0/24")
	for _, g := range rep.Guests {
		assert.Empty(t, g.Error)
		assert.Equal(t, link.TapName(g.Name), g.Tap)
		assert.True(t, subnet.Contains(g.Address), g.Address)
		assert.NotEqual(t, netip.MustParseAddr("10.213.0.1"), g.Address)
		assert.False(t, g.Leased, "no guest has asked yet")
		out := ns.MustRun(t, "ip", "-d", "link", "show", g.Tap)
		assert.Contains(t, out, "master brokkr0")
		assert.Contains(t, out, "hairpin on")
	}
	assert.NotEqual(t, rep.Guests[0].Address, rep.Guests[1].Address)
	assert.Equal(t, "1", strings.TrimSpace(ns.MustRun(t, "cat", "/proc/sys/net/ipv4/ip_forward")))

	again := p.Converge(context.Background(), d)
	require.NoError(t, again.Err)
	assert.Empty(t, again.Repaired, "idempotent")
	assert.Equal(t, rep.Guests, again.Guests)
}

func TestDriftIsRepairedAndReported(t *testing.T) {
	ns := nstest.New(t, "host")
	p, _ := newPlane(t, ns, t.TempDir())
	d := Desired{Network: network(), Guests: guestsOf("web")}
	require.NoError(t, p.Converge(context.Background(), d).Err)

	ns.MustRun(t, "ip", "link", "del", "brk-web")
	ns.MustRun(t, "ip", "link", "set", "brokkr0", "down")
	ns.MustRun(t, "ip", "addr", "flush", "dev", "brokkr0")
	ns.MustRun(t, "sh", "-c", "echo 0 > /proc/sys/net/ipv4/ip_forward")
	rep := p.Converge(context.Background(), d)
	require.NoError(t, rep.Err)
	all := strings.Join(rep.Repaired, "; ")
	assert.Contains(t, all, "tap brk-web was missing")
	assert.Contains(t, all, "bridge brokkr0 was down")
	assert.Contains(t, all, "bridge brokkr0 lost its address 10.213.0.1/24")
	assert.Contains(t, all, "net.ipv4.ip_forward was 0")
	assert.Equal(t, "1", strings.TrimSpace(ns.MustRun(t, "cat", "/proc/sys/net/ipv4/ip_forward")))
	out := ns.MustRun(t, "ip", "addr", "show", "brokkr0")
	assert.Contains(t, out, "10.213.0.1/24")
	assert.Contains(t, out, ",UP")
	assert.Contains(t, ns.MustRun(t, "ip", "-d", "link", "show", "brk-web"), "master brokkr0")

	ns.MustRun(t, "ip", "link", "del", "brokkr0")
	rep = p.Converge(context.Background(), d)
	require.NoError(t, rep.Err)
	assert.Contains(t, strings.Join(rep.Repaired, "; "), "bridge brokkr0 was missing")
	assert.Contains(t, strings.Join(rep.Repaired, "; "), "tap brk-web was not attached to brokkr0")
}

func TestAddressesSurviveARestartAndAreFreedWithTheVM(t *testing.T) {
	ns := nstest.New(t, "host")
	dir := t.TempDir()
	p, _ := newPlane(t, ns, dir)
	d := Desired{Network: network(), Guests: guestsOf("web", "db")}
	first := p.Converge(context.Background(), d)
	require.NoError(t, first.Err)
	require.NoError(t, p.Close())

	p2, _ := newPlane(t, ns, dir)
	second := p2.Converge(context.Background(), Desired{Network: network(), Guests: guestsOf("db", "web")})
	require.NoError(t, second.Err)
	byName := func(r Report) map[string]GuestStatus {
		m := map[string]GuestStatus{}
		for _, g := range r.Guests {
			m[g.Name] = g
		}
		return m
	}
	assert.Equal(t, byName(first), byName(second), "same addresses and MACs after a restart")

	third := p2.Converge(context.Background(), Desired{Network: network(), Guests: guestsOf("db")})
	require.NoError(t, third.Err)
	_, err := ns.Run("ip", "link", "show", "brk-web")
	assert.Error(t, err, "the tap goes with the VM")
	b, err := os.ReadFile(filepath.Join(dir, "netplane", "leases.json"))
	require.NoError(t, err)
	assert.NotContains(t, string(b), `"web"`, "the address goes with the VM")
	assert.Contains(t, string(b), `"db"`)
}

func TestBadSpecsAreRejectedAndNothingApplied(t *testing.T) {
	ns := nstest.New(t, "host")
	ns.MustRun(t, "ip", "link", "add", "uplink0", "type", "bridge")
	ns.MustRun(t, "ip", "addr", "add", "10.213.0.200/16", "dev", "uplink0")
	ns.MustRun(t, "ip", "link", "add", "brk-db", "type", "bridge")
	dir := t.TempDir()
	p, _ := newPlane(t, ns, dir)
	before := ns.MustRun(t, "ip", "-d", "addr", "show")

	overlap := network()
	clash := network()
	clash.CIDR = netip.MustParsePrefix("10.50.0.1/24")
	tapIsBridge := clash
	tapIsBridge.Bridge = "brk-web"
	cases := map[string]struct {
		d     Desired
		field string
	}{
		"overlapping subnet":  {Desired{Network: overlap}, "network.cidr: 10.213.0.0/24 overlaps 10.213.0.200/16 on uplink0"},
		"tap clashes foreign": {Desired{Network: clash, Guests: guestsOf("db")}, "guests[0].name"},
		"tap clashes bridge":  {Desired{Network: tapIsBridge, Guests: guestsOf("web")}, "guests[0].name: tap name \"brk-web\""},
	}
	for name, c := range cases {
		errs := p.Validate(c.d)
		require.NotEmpty(t, errs, name)
		joined := ""
		for _, e := range errs {
			joined += e.Error() + "\n"
		}
		assert.Contains(t, joined, c.field, name)
		rep := p.Converge(context.Background(), c.d)
		require.Error(t, rep.Err, name)
		assert.Contains(t, rep.Err.Error(), c.field, name)
	}
	assert.Equal(t, before, ns.MustRun(t, "ip", "-d", "addr", "show"), "nothing applied")
	_, err := os.Stat(filepath.Join(dir, "netplane", "leases.json"))
	assert.ErrorIs(t, err, os.ErrNotExist, "no lease taken")
}

func TestTeardownRemovesOnlyWhatBrokkrMade(t *testing.T) {
	ns := nstest.New(t, "host")
	ns.MustRun(t, "ip", "link", "add", "uplink0", "type", "bridge")
	ns.MustRun(t, "ip", "link", "add", "ve-a", "type", "veth", "peer", "name", "ve-b")
	ns.MustRun(t, "ip", "link", "set", "ve-a", "master", "uplink0")
	p, _ := newPlane(t, ns, t.TempDir())
	require.NoError(t, p.Converge(context.Background(), Desired{Network: network(), Guests: guestsOf("web", "db")}).Err)
	require.NoError(t, p.Teardown())
	out := ns.MustRun(t, "ip", "-o", "link", "show")
	for _, gone := range []string{"brokkr0", "brk-web", "brk-db"} {
		assert.NotContains(t, out, gone+":")
	}
	for _, kept := range []string{"uplink0", "ve-a@ve-b", "ve-b@ve-a", "lo"} {
		assert.Contains(t, out, kept+":")
	}
	assert.Contains(t, ns.MustRun(t, "ip", "-o", "link", "show", "ve-a"), "master uplink0")
}

func TestGuestsGetAddressesByDHCPOrAreSeenStatically(t *testing.T) {
	ns := nstest.New(t, "host")
	leased := make(chan string, 4)
	p, err := New(Options{NetNS: ns.Path, StateDir: t.TempDir(), OnLease: func(vm string, _ netip.Addr) { leased <- vm }})
	require.NoError(t, err)
	defer p.Close()
	d := Desired{Network: network(), Guests: guestsOf("dyn", "static")}
	rep := p.Converge(context.Background(), d)
	require.NoError(t, rep.Err)
	st := map[string]GuestStatus{}
	for _, g := range rep.Guests {
		st[g.Name] = g
	}

	// Guests are namespaces whose veth carries the guest's MAC, on the bridge.
	attach := func(role, vm string) *nstest.NS {
		g := nstest.New(t, role)
		ns.MustRun(t, "ip", "link", "add", "vh-"+role, "type", "veth", "peer", "name", "eth0",
			"address", st[vm].MAC.String(), "netns", g.Name)
		ns.MustRun(t, "ip", "link", "set", "vh-"+role, "master", "brokkr0", "up")
		g.MustRun(t, "ip", "link", "set", "eth0", "up")
		return g
	}
	dyn := attach("dyn", "dyn")
	out, err := dyn.Run("busybox", "udhcpc", "-i", "eth0", "-n", "-q", "-f", "-t", "5", "-T", "1", "-s", "/bin/true")
	require.NoError(t, err, out)
	assert.Contains(t, out, "lease of "+st["dyn"].Address.String()+" obtained")
	select {
	case vm := <-leased:
		assert.Equal(t, "dyn", vm)
	case <-time.After(5 * time.Second):
		t.Fatal("OnLease not called")
	}

	static := attach("static", "static")
	static.MustRun(t, "ip", "addr", "add", st["static"].Address.String()+"/24", "dev", "eth0")
	// Host isolation drops its pings; its ARP for the gateway is what the host sees.
	static.MustRun(t, "busybox", "arping", "-f", "-c", "5", "-w", "5", "-I", "eth0", "10.213.0.1")

	rep = p.Converge(context.Background(), d)
	require.NoError(t, rep.Err)
	for _, g := range rep.Guests {
		assert.True(t, g.Leased, "%s has its address", g.Name)
	}

	// The bridge is deleted and re-made: the DHCP socket, bound to the old
	// device, must follow to the new one.
	ns.MustRun(t, "ip", "link", "del", "brokkr0")
	rep = p.Converge(context.Background(), d)
	require.NoError(t, rep.Err)
	ns.MustRun(t, "ip", "link", "set", "vh-dyn", "master", "brokkr0", "up")
	out, err = dyn.Run("busybox", "udhcpc", "-i", "eth0", "-n", "-q", "-f", "-t", "5", "-T", "1", "-s", "/bin/true")
	require.NoError(t, err, "DHCP after the bridge was re-made: %s", out)
	assert.Contains(t, out, "lease of "+st["dyn"].Address.String()+" obtained")
}

// A guest that answers ARP only after a while (a VM being resumed from
// disk, slower than the kernel's three probes on a loaded host) is waited
// for: the caller's SYNs wait in the neighbour entry and it is served,
// instead of failing with "no route to host" after about 3 s. (Fails with
// EnsureBridge's call of patientNeighbours removed: connect: no route to host.)
func TestACallerWaitsForAGuestSlowToAnswerARP(t *testing.T) {
	ns := nstest.New(t, "host")
	p, _ := newPlane(t, ns, t.TempDir())
	d := Desired{Network: network(), Guests: guestsOf("slow")}
	rep := p.Converge(context.Background(), d)
	require.NoError(t, rep.Err)
	require.Len(t, rep.Guests, 1)
	g := rep.Guests[0]
	assert.Equal(t, strconv.Itoa(link.NeighbourProbes), strings.TrimSpace(ns.MustRun(t, "cat", "/proc/sys/net/ipv4/neigh/brokkr0/mcast_solicit")))

	guest := attachGuest(t, ns, g)
	guest.MustRun(t, "ip", "link", "set", "eth0", "arp", "off")
	guest.MustRun(t, "ip", "addr", "add", g.Address.String()+"/24", "dev", "eth0")
	guest.ServeTCP(t, "tcp4", ":80", nstest.AnswerPort)

	const silent = 6 * time.Second // twice what the kernel's default probes wait
	go func() {
		time.Sleep(silent)
		_, _ = guest.Run("ip", "link", "set", "eth0", "arp", "on")
	}()
	t0 := time.Now()
	var line string
	err := ns.Do(func() error {
		c, err := net.DialTimeout("tcp4", netip.AddrPortFrom(g.Address, 80).String(), 30*time.Second)
		if err != nil {
			return err
		}
		defer c.Close()
		_ = c.SetDeadline(time.Now().Add(10 * time.Second))
		b := make([]byte, 8)
		n, err := c.Read(b)
		line = string(b[:n])
		return err
	})
	require.NoError(t, err, "after %v", time.Since(t0))
	assert.Equal(t, "80\n", line)
	assert.GreaterOrEqual(t, time.Since(t0), silent-time.Second, "the guest answered no ARP before")
	t.Logf("served %v after the first SYN", time.Since(t0).Round(time.Millisecond))
}
