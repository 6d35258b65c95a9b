package daemon

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net"
	"net/http"
	"net/http/httptest"
	"net/netip"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/brokkr/brokkr/bpf"
	"github.com/brokkr/brokkr/daemon/api"
	"github.com/brokkr/brokkr/daemon/config"
	"github.com/brokkr/brokkr/internal/spec"
	"github.com/brokkr/brokkr/netplane"
	"github.com/brokkr/brokkr/netplane/ipam"
	"github.com/brokkr/brokkr/proxy"
	"github.com/brokkr/brokkr/supervisor"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	"go.uber.org/goleak"
)

func TestMain(m *testing.M) { goleak.VerifyTestMain(m) }

// The engines below record what the loop hands them and answer with what the
// test scripts; they test the loop's own decisions (order, wiring, merging,
// bounding), not the engines, which have their own kernel tests.

type calls struct {
	mu  sync.Mutex
	log []string
}

func (c *calls) add(s string) { c.mu.Lock(); c.log = append(c.log, s); c.mu.Unlock() }
func (c *calls) get() []string {
	c.mu.Lock()
	defer c.mu.Unlock()
	return append([]string(nil), c.log...)
}

type recSup struct {
	calls    *calls
	mu       sync.Mutex
	last     []supervisor.VMSpec
	restarts []string
	onWake   func(name string) // when set, called by Wake
}

func (s *recSup) Step(_ context.Context, d []supervisor.VMSpec) supervisor.Report {
	s.calls.add("supervisor")
	s.mu.Lock()
	s.last = d
	s.mu.Unlock()
	var r supervisor.Report
	for _, v := range d {
		phase := supervisor.PhaseRunning
		if v.Power == supervisor.PowerStopped {
			phase = supervisor.PhaseStopped
		}
		r.VMs = append(r.VMs, supervisor.VMStatus{Name: v.Name, Phase: phase, PID: 100})
	}
	return r
}
func (s *recSup) Restart(name string) error {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.restarts = append(s.restarts, name)
	return nil
}
func (s *recSup) Stop() { s.calls.add("supervisor.Stop") }
func (s *recSup) Wake(name string) bool {
	s.calls.add("supervisor.Wake " + name)
	if s.onWake != nil {
		s.onWake(name)
	}
	return true
}
func (s *recSup) specs() []supervisor.VMSpec {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.last
}

type recNet struct {
	calls   *calls
	mu      sync.Mutex
	last    netplane.Desired
	leased  bool
	seen6   bool          // guests answer at their IPv6 addresses
	block   chan struct{} // when set, Converge waits on it
	invalid []error
}

func (n *recNet) Converge(ctx context.Context, d netplane.Desired) netplane.Report {
	n.calls.add("netplane")
	n.mu.Lock()
	block := n.block
	n.last = d
	leased, seen6 := n.leased, n.seen6
	n.mu.Unlock()
	if block != nil {
		<-block
	}
	var r netplane.Report
	for i, g := range d.Guests {
		mac := net.HardwareAddr{0x52, 0x54, 0, 0, 0, byte(i + 1)}
		r.Guests = append(r.Guests, netplane.GuestStatus{Name: g.Name, Tap: "brk-" + g.Name,
			MAC: mac, Address: netip.AddrFrom4([4]byte{10, 213, 0, byte(10 + i)}), Leased: leased,
			Address6: ipam.SLAAC(d.Network.CIDR6, mac), Seen6: seen6 && d.Network.CIDR6.IsValid()})
	}
	for _, e := range d.Exposures {
		r.Exposures = append(r.Exposures, netplane.ExposureStatus{Name: e.Name, State: "active"})
	}
	return r
}
func (n *recNet) Validate(netplane.Desired) []error { return n.invalid }
func (n *recNet) Close() error                      { n.calls.add("netplane.Close"); return nil }
func (n *recNet) desired() netplane.Desired {
	n.mu.Lock()
	defer n.mu.Unlock()
	return n.last
}

type recProxy struct {
	calls   *calls
	resolve proxy.Resolver
	mu      sync.Mutex
	last    []proxy.Spec
	seen    map[string]string // spec ID -> what the resolver said during Converge
}

func (p *recProxy) Converge(d []proxy.Spec) []proxy.Status {
	p.calls.add("proxy")
	p.mu.Lock()
	defer p.mu.Unlock()
	p.last = d
	p.seen = map[string]string{}
	var out []proxy.Status
	for _, s := range d {
		addr := s.Target.Addr.String()
		if s.Target.IsVM() {
			addr = p.resolve(s.Target.VM)
		}
		p.seen[s.Name] = addr
		st := proxy.StateActive
		if addr == "" {
			st = proxy.StatePending
		}
		out = append(out, proxy.Status{ID: s.Name, State: st})
	}
	return out
}
func (p *recProxy) StopAll() { p.calls.add("proxy.StopAll") }
func (p *recProxy) specs() ([]proxy.Spec, map[string]string) {
	p.mu.Lock()
	defer p.mu.Unlock()
	return p.last, p.seen
}

type rig struct {
	d     *Daemon
	calls *calls
	sup   *recSup
	net   *recNet
	px    *recProxy
	store *bpf.Store
	host  *config.Config
}

const rigConfig = `
vms:
  - name: web
    kernel: /k
    cpus: 2
    memory: 512M
  - name: db
    kernel: /k
exposures:
  - {name: web-auto, vm: web, guestPort: 80, hostPort: 8080}
  - {name: web-nat, vm: web, guestPort: 80, hostPort: 8081, mode: nat}
  - {name: web-proxy, vm: web, guestPort: 80, hostPort: 8082, mode: proxy, hostAddress: 0.0.0.0}
  - {name: lo-auto, vm: db, guestPort: 5432, hostPort: 5432, hostAddress: 127.0.0.1}
  - {name: ext, target: 10.213.0.200, guestPort: 22, hostPort: 2222, mode: proxy, maxConns: 3}
`

func newRig(t *testing.T, yaml string) *rig {
	t.Helper()
	host, err := config.Parse([]byte(yaml))
	require.NoError(t, err)
	host.StateDir = t.TempDir()
	host.RunDir = shortDir(t)
	return newRigWith(t, host)
}

func newRigWith(t *testing.T, host *config.Config) *rig {
	t.Helper()
	c := &calls{}
	addrs := NewAddressBook()
	r := &rig{calls: c, sup: &recSup{calls: c}, net: &recNet{calls: c}, px: &recProxy{calls: c, resolve: addrs.Resolve},
		store: bpf.NewInMemory("test"), host: host}
	d, err := New(Options{Host: host, Store: r.store, Supervisor: r.sup, Network: r.net, Proxy: r.px, Addresses: addrs,
		Logger: slog.New(slog.NewTextHandler(io.Discard, nil)), Timeout: 200 * time.Millisecond})
	require.NoError(t, err)
	r.d = d
	t.Cleanup(func() { _ = r.store.Close() })
	return r
}

// shortDir is a temp dir with a short path: unix socket paths are capped at
// 108 bytes and runDir at 60.
func shortDir(t *testing.T) string {
	dir, err := os.MkdirTemp("", "brk-dm-")
	require.NoError(t, err)
	t.Cleanup(func() { os.RemoveAll(dir) })
	return dir
}

func TestPassRunsNetplaneThenSupervisorThenProxy(t *testing.T) {
	r := newRig(t, rigConfig)
	r.d.Pass(context.Background())
	assert.Equal(t, []string{"netplane", "supervisor", "proxy"}, r.calls.get())
}

func TestTapsAndMACsFlowFromNetplaneIntoVMSpecs(t *testing.T) {
	r := newRig(t, rigConfig)
	r.d.Pass(context.Background())
	specs := r.sup.specs()
	require.Len(t, specs, 2)
	assert.Equal(t, "web", specs[0].Name)
	assert.Equal(t, "brk-web", specs[0].Tap, "the tap netplane made in this same pass")
	assert.Equal(t, "52:54:00:00:00:01", specs[0].MAC.String())
	assert.Equal(t, 512, specs[0].MemoryMiB)
	assert.Equal(t, 2, specs[0].CPUs)
	assert.Empty(t, specs[0].IP, "with DHCP on, the guest leases its address")
	assert.True(t, r.net.desired().Guests[0].MultiQueue, "2 vCPUs ask for a multi-queue tap")
	assert.False(t, r.net.desired().Guests[1].MultiQueue)
}

// failingNet fails whole passes while fail is set (a broken bridge, a
// netlink error) and reports nothing about the guests.
type failingNet struct {
	*recNet
	fail bool
}

func (n *failingNet) Converge(ctx context.Context, d netplane.Desired) netplane.Report {
	if n.fail {
		n.calls.add("netplane")
		return netplane.Report{Err: errors.New("network.bridge: operation not permitted")}
	}
	return n.recNet.Converge(ctx, d)
}

func TestTheSupervisorIsHeldUntilEveryVMHasItsTap(t *testing.T) {
	host, err := config.Parse([]byte(rigConfig))
	require.NoError(t, err)
	host.StateDir, host.RunDir = t.TempDir(), shortDir(t)
	c := &calls{}
	sup := &recSup{calls: c}
	net := &failingNet{recNet: &recNet{calls: c}, fail: true}
	store := bpf.NewInMemory("test")
	defer store.Close()
	d, err := New(Options{Host: host, Store: store, Supervisor: sup, Network: net, Proxy: &recProxy{calls: c, resolve: NewAddressBook().Resolve},
		Logger: slog.New(slog.NewTextHandler(io.Discard, nil))})
	require.NoError(t, err)

	d.Pass(context.Background())
	assert.Equal(t, []string{"netplane", "proxy"}, c.get(), "no Step with specs that lack their taps: an adopted VM would look like another machine")
	assert.Contains(t, strings.Join(d.Status().Warnings, "\n"), "supervisor: held this pass")

	net.fail = false
	d.Pass(context.Background())
	require.Len(t, sup.specs(), 2)
	assert.Equal(t, "brk-web", sup.specs()[0].Tap)

	// Once known, a tap and MAC survive a failed netplane pass.
	net.fail = true
	d.Pass(context.Background())
	assert.Equal(t, "brk-web", sup.specs()[0].Tap)
	assert.Equal(t, "52:54:00:00:00:01", sup.specs()[0].MAC.String())
}

// launchRecorder is a supervisor.Hypervisor that records each launch config
// and refuses to start: what the test looks at is the launch.
type launchRecorder struct {
	mu  sync.Mutex
	got []supervisor.LaunchConfig
}

func (h *launchRecorder) Kind() string { return "recorder" }
func (h *launchRecorder) Start(_ context.Context, lc supervisor.LaunchConfig) (supervisor.Instance, error) {
	h.mu.Lock()
	h.got = append(h.got, lc)
	h.mu.Unlock()
	return supervisor.Instance{}, errors.New("recorded, not started")
}
func (h *launchRecorder) Adopt(context.Context, supervisor.Instance) error { return errors.New("none") }
func (h *launchRecorder) Info(context.Context, supervisor.Instance) (supervisor.VMState, error) {
	return supervisor.VMShutdown, nil
}
func (h *launchRecorder) Stop(context.Context, supervisor.Instance, time.Duration) error { return nil }
func (h *launchRecorder) Suspend(context.Context, supervisor.Instance, string, func() error) error {
	return errors.New("none")
}
func (h *launchRecorder) Restore(context.Context, supervisor.LaunchConfig, string) (supervisor.Instance, error) {
	return supervisor.Instance{}, errors.New("none")
}
func (h *launchRecorder) Continue(context.Context, supervisor.Instance) error {
	return errors.New("none")
}
func (h *launchRecorder) launches() []supervisor.LaunchConfig {
	h.mu.Lock()
	defer h.mu.Unlock()
	return append([]supervisor.LaunchConfig(nil), h.got...)
}

// With DHCP off, the address netplane assigned reaches the hypervisor's
// launch command line as the kernel's ip= parameter, after the user's
// cmdline; with DHCP on, nothing is added. The real supervisor sits between
// the daemon and the launch, so a value computed but never passed on fails.
func TestWithoutDHCPTheAddressReachesTheLaunchCommandLine(t *testing.T) {
	kernel := filepath.Join(t.TempDir(), "vmlinuz")
	require.NoError(t, os.WriteFile(kernel, []byte("k"), 0o600))
	for _, tc := range []struct {
		dhcp bool
		want string
	}{
		{false, "console=ttyS0 quiet ip=10.213.0.10::10.213.0.1:255.255.255.0:web:eth0:off brokkr.ip6=fd00:6272:6b72:0:5054:ff:fe00:1/64"},
		{true, "console=ttyS0 quiet"},
	} {
		host, err := config.Parse([]byte(fmt.Sprintf("network: {dhcp: %v}\nvms: [{name: web, kernel: %s, cmdline: \"console=ttyS0 quiet\"}]\n", tc.dhcp, kernel)))
		require.NoError(t, err)
		host.StateDir, host.RunDir = t.TempDir(), shortDir(t)
		hv := &launchRecorder{}
		sup, err := supervisor.NewEngine(supervisor.Config{StateDir: host.StateDir, RunDir: host.RunDir, Hypervisor: hv})
		require.NoError(t, err)
		c := &calls{}
		addrs := NewAddressBook()
		store := bpf.NewInMemory("test")
		d, err := New(Options{Host: host, Store: store, Supervisor: sup, Network: &recNet{calls: c}, Proxy: &recProxy{calls: c, resolve: addrs.Resolve},
			Addresses: addrs, Logger: slog.New(slog.NewTextHandler(io.Discard, nil))})
		require.NoError(t, err)
		d.Pass(context.Background())
		require.Eventually(t, func() bool { return len(hv.launches()) > 0 }, 10*time.Second, 10*time.Millisecond)
		sup.Stop()
		_ = store.Close()
		assert.Equal(t, tc.want, hv.launches()[0].Cmdline, "dhcp: %v", tc.dhcp)
	}
}

func TestModesSplitBetweenKernelAndProxy(t *testing.T) {
	r := newRig(t, rigConfig)
	r.d.Pass(context.Background())
	var kernel []string
	for _, e := range r.net.desired().Exposures {
		kernel = append(kernel, e.Name)
	}
	assert.Equal(t, []string{"web-auto", "web-nat"}, kernel, "auto on 0.0.0.0 and nat go to nftables; auto on loopback cannot")
	specs, _ := r.px.specs()
	got := map[string]string{}
	for _, s := range specs {
		got[s.Name] = s.Listen.String()
	}
	assert.Equal(t, map[string]string{
		"web-auto":  "127.0.0.1", // loopback callers, which DNAT cannot serve
		"web-proxy": "0.0.0.0",
		"lo-auto":   "127.0.0.1",
		"ext":       "0.0.0.0",
	}, got)
	for _, s := range specs {
		if s.Name == "ext" {
			assert.Equal(t, 3, s.MaxConns)
		} else {
			assert.Equal(t, 256, s.MaxConns)
		}
	}
}

func TestAutoAlsoListensOnIPv6LoopbackUnderTheSameName(t *testing.T) {
	host, err := config.Parse([]byte(rigConfig))
	require.NoError(t, err)
	host.StateDir, host.RunDir = t.TempDir(), shortDir(t)
	c := &calls{}
	addrs := NewAddressBook()
	px := &recProxy{calls: c, resolve: addrs.Resolve}
	store := bpf.NewInMemory("test")
	defer store.Close()
	d, err := New(Options{Host: host, Store: store, Supervisor: &recSup{calls: c}, Network: &recNet{calls: c, leased: true},
		Proxy: px, Addresses: addrs, IPv6Loopback: true,
		Logger: slog.New(slog.NewTextHandler(io.Discard, nil))})
	require.NoError(t, err)
	d.Pass(context.Background())
	specs, _ := px.specs()
	var got []string
	for _, s := range specs {
		got = append(got, s.Name+"@"+s.Listen.String())
	}
	assert.Equal(t, []string{"web-auto@127.0.0.1", "web-auto@::1", "web-proxy@0.0.0.0", "lo-auto@127.0.0.1", "ext@0.0.0.0", "ext@::"}, got,
		"only auto on an unspecified address adds ::1, proxy on every address binds both families, to the one Manager, under the exposure's name")
	assert.Equal(t, "active", expo(d.Status(), "web-auto").State, "the two listeners merge into one row")
}

func TestProxyResolvesOnlyLeasedAddresses(t *testing.T) {
	r := newRig(t, rigConfig)
	r.d.Pass(context.Background())
	_, seen := r.px.specs()
	assert.Equal(t, "", seen["web-proxy"], "no lease yet: the proxy must not dial an address the guest has not taken")
	assert.Equal(t, "10.213.0.200", seen["ext"], "an explicit target needs no lease")
	st := r.d.Status()
	assert.Equal(t, "pending", expo(st, "web-proxy").State)

	r.net.mu.Lock()
	r.net.leased = true
	r.net.mu.Unlock()
	r.d.Pass(context.Background())
	_, seen = r.px.specs()
	assert.Equal(t, "10.213.0.10", seen["web-proxy"], "the lease flows to the proxy in the same pass")
	assert.Equal(t, "10.213.0.11", seen["lo-auto"])
	st = r.d.Status()
	assert.Equal(t, "active", expo(st, "web-proxy").State)
	vm := st.VMs[0]
	assert.Equal(t, api.VM{Name: "web", Phase: "running", Address: "10.213.0.10", Address6: "fd00:6272:6b72:0:5054:ff:fe00:1",
		MAC: "52:54:00:00:00:01", Tap: "brk-web", PID: 100, Power: "running"}, vm)
}

// A guest's IPv6 address is in status from the start (it follows from its
// MAC); the proxy's IPv6 callers and the socket path are sent there only
// once the guest answers at it. IPv6 off: no address6.
func TestTheIPv6AddressIsShownAtOnceAndDialledOnceSeen(t *testing.T) {
	r := newRig(t, rigConfig)
	r.net.mu.Lock()
	r.net.leased = true
	r.net.mu.Unlock()
	r.d.Pass(context.Background())
	assert.Equal(t, "fd00:6272:6b72:0:5054:ff:fe00:1", r.d.Status().VMs[0].Address6)
	assert.Equal(t, "", r.d.addrs.Resolve6("web"), "not seen there yet: IPv6 callers go to its IPv4 address")
	assert.Equal(t, "10.213.0.10", r.d.addrs.Resolve("web"))

	r.net.mu.Lock()
	r.net.seen6 = true
	r.net.mu.Unlock()
	r.d.Pass(context.Background())
	assert.Equal(t, "fd00:6272:6b72:0:5054:ff:fe00:1", r.d.addrs.Resolve6("web"))
	a, ok := r.d.addrs.lookup6("db")
	assert.True(t, ok)
	assert.Equal(t, netip.MustParseAddr("fd00:6272:6b72:0:5054:ff:fe00:2"), a)

	off := newRig(t, "network: {cidr6: ''}\n"+rigConfig)
	off.net.mu.Lock()
	off.net.leased, off.net.seen6 = true, true
	off.net.mu.Unlock()
	off.d.Pass(context.Background())
	assert.Equal(t, "", off.d.Status().VMs[0].Address6)
	assert.Equal(t, "", off.d.addrs.Resolve6("web"))
}

func expo(st api.Status, name string) api.Exposure {
	for _, e := range st.Exposures {
		if e.Name == name {
			return e
		}
	}
	return api.Exposure{}
}

func TestAStalledEngineDoesNotStallTheOthers(t *testing.T) {
	r := newRig(t, rigConfig)
	r.d.Pass(context.Background()) // taps known
	block := make(chan struct{})
	r.net.mu.Lock()
	r.net.block = block
	r.net.mu.Unlock()
	defer close(block)

	start := time.Now()
	r.d.Pass(context.Background())
	assert.Less(t, time.Since(start), 2*time.Second)
	pass := []string{"netplane", "supervisor", "proxy"}
	assert.Equal(t, append(pass, pass...), r.calls.get())
	st := r.d.Status()
	assert.Contains(t, strings.Join(st.Warnings, "\n"), "netplane: pass took longer than")

	r.d.Pass(context.Background())
	assert.Equal(t, append(append(pass, pass...), "supervisor", "proxy"), r.calls.get(),
		"the stalled engine is skipped, not called again behind itself")
	assert.Contains(t, strings.Join(r.d.Status().Warnings, "\n"), "netplane: still busy")
}

func TestCountersComeFromTheSharedSlot(t *testing.T) {
	r := newRig(t, rigConfig)
	slot, err := r.store.Attach("web-auto", bpf.ProtoTCP, 8080)
	require.NoError(t, err)
	slot.Opened()
	slot.AddRefused(4)
	slot.AddBytes(10, 20)
	r.d.Pass(context.Background())
	e := expo(r.d.Status(), "web-auto")
	assert.Equal(t, uint64(1), e.Accepted)
	assert.Equal(t, uint64(1), e.Active)
	assert.Equal(t, uint64(4), e.Refused)
	assert.Equal(t, uint64(10), e.BytesIn)
	assert.Equal(t, uint64(20), e.BytesOut)
	slot.Release(false)
}

func TestCountersInMemoryAreAWarningInStatus(t *testing.T) {
	r := newRig(t, rigConfig) // its store is in memory, with reason "test"
	r.d.Pass(context.Background())
	assert.Contains(t, r.d.Status().Warnings, "test")
}

func TestSlotsOfRemovedExposuresArePruned(t *testing.T) {
	r := newRig(t, rigConfig)
	s, err := r.store.Attach("gone-before-restart", bpf.ProtoTCP, 1)
	require.NoError(t, err)
	s.AddAccepted(7)
	s.Release(false) // a previous daemon's slot, nobody holds it now
	r.d.Pass(context.Background())
	_, ok := r.store.Lookup("gone-before-restart")
	assert.False(t, ok)
}

func TestActiveGaugesResetAtStart(t *testing.T) {
	host, err := config.Parse([]byte(rigConfig))
	require.NoError(t, err)
	host.StateDir, host.RunDir = t.TempDir(), shortDir(t)
	store := bpf.NewInMemory("test")
	defer store.Close()
	s, err := store.Attach("web-auto", bpf.ProtoTCP, 8080)
	require.NoError(t, err)
	s.Opened()
	s.Release(false)
	c := &calls{}
	_, err = New(Options{Host: host, Store: store, Supervisor: &recSup{calls: c}, Network: &recNet{calls: c},
		Proxy: &recProxy{calls: c}, Logger: slog.New(slog.NewTextHandler(io.Discard, nil))})
	require.NoError(t, err)
	cnt, _ := store.Lookup("web-auto")
	assert.Equal(t, uint64(0), cnt.Active)
	assert.Equal(t, uint64(1), cnt.Accepted, "totals survive")
}

func TestDesiredStateIsPersistedAndWinsAtRestart(t *testing.T) {
	r := newRig(t, rigConfig)
	next, err := config.Parse([]byte("vms: [{name: solo, kernel: /k}]\n"))
	require.NoError(t, err)
	plan, err := r.d.Apply(next, false)
	require.NoError(t, err)
	assert.Equal(t, []string{"solo"}, plan.VMs.Added)
	assert.Equal(t, []string{"web", "db"}, plan.VMs.Removed)
	assert.Len(t, plan.Exposures.Removed, 5)
	require.NoError(t, r.d.SetPower("solo", "stopped"))

	// A new daemon started with the original config resumes from the file.
	again := newRigWith(t, r.host)
	d := again.d.Desired()
	require.Len(t, d.VMs, 1)
	assert.Equal(t, "solo", d.VMs[0].Name)
	assert.Equal(t, "stopped", d.VMs[0].Power, "start/stop persist the desired power")
	assert.Empty(t, d.Exposures)

	entries, err := os.ReadDir(r.host.StateDir)
	require.NoError(t, err)
	for _, e := range entries {
		assert.False(t, strings.HasPrefix(e.Name(), ".desired-"), "no temp file left behind: %s", e.Name())
	}
}

func TestACorruptDesiredFileStopsTheStart(t *testing.T) {
	host, err := config.Parse(nil)
	require.NoError(t, err)
	host.StateDir = t.TempDir()
	require.NoError(t, os.WriteFile(filepath.Join(host.StateDir, DesiredFile), []byte(`{"vms": [{"name": "X"}]}`), 0o600))
	c := &calls{}
	_, err = New(Options{Host: host, Supervisor: &recSup{calls: c}, Network: &recNet{calls: c}, Proxy: &recProxy{calls: c}})
	require.Error(t, err)
	assert.Contains(t, err.Error(), "vms[0].name")
}

func TestARejectedApplyChangesNothing(t *testing.T) {
	r := newRig(t, rigConfig)
	before, err := os.ReadFile(filepath.Join(r.host.StateDir, DesiredFile))
	require.NoError(t, err)
	r.net.invalid = []error{config.FieldError{Path: "network.bridge", Msg: `"eth0" is not a bridge brokkr made`}}
	next, err := config.Parse([]byte("vms: [{name: solo, kernel: /k}]\n"))
	require.NoError(t, err)
	_, err = r.d.Apply(next, false)
	require.Error(t, err)
	assert.Contains(t, err.Error(), "network.bridge")
	after, err := os.ReadFile(filepath.Join(r.host.StateDir, DesiredFile))
	require.NoError(t, err)
	assert.Equal(t, before, after)
	assert.Len(t, r.d.Desired().VMs, 2)
}

func TestApplyWaitsForAPassAndGivesUpOnAStalledOne(t *testing.T) {
	r := newRig(t, rigConfig)
	block := make(chan struct{})
	r.net.mu.Lock()
	r.net.block = block
	r.net.mu.Unlock()
	go r.d.Pass(context.Background())
	for len(r.calls.get()) == 0 {
		time.Sleep(time.Millisecond)
	}
	next, err := config.Parse([]byte("vms: [{name: solo, kernel: /k}]\n"))
	require.NoError(t, err)
	start := time.Now()
	_, err = r.d.Apply(next, false)
	assert.ErrorIs(t, err, ErrBusy, "validation never reads the kernel in the middle of a pass")
	assert.GreaterOrEqual(t, time.Since(start), 200*time.Millisecond)
	assert.Len(t, r.d.Desired().VMs, 2, "nothing applied")
	close(block)
	r.d.netRun.wait(context.Background())
	_, err = r.d.Apply(next, false)
	assert.NoError(t, err, "once the pass is over, apply goes through")
}

func TestDryRunPlansWithoutApplying(t *testing.T) {
	r := newRig(t, rigConfig)
	next, err := config.Parse([]byte(strings.Replace(rigConfig, "memory: 512M", "memory: 1G", 1) +
		"  - {name: new-one, vm: db, guestPort: 1, hostPort: 9999}\n"))
	require.NoError(t, err)
	plan, err := r.d.Apply(next, true)
	require.NoError(t, err)
	assert.True(t, plan.DryRun)
	assert.False(t, plan.Applied)
	assert.Equal(t, []string{"web"}, plan.VMs.Changed)
	assert.Equal(t, []string{"new-one"}, plan.Exposures.Added)
	assert.False(t, plan.NetworkChanged)
	assert.Equal(t, "512M", r.d.Desired().VMs[0].Memory)
}

func TestRestartGoesToTheSupervisor(t *testing.T) {
	r := newRig(t, rigConfig)
	require.NoError(t, r.d.Restart("web"))
	assert.Equal(t, []string{"web"}, r.sup.restarts)
	assert.ErrorIs(t, r.d.Restart("nope"), ErrNoSuchVM)
	require.NoError(t, r.d.SetPower("db", "stopped"))
	assert.ErrorIs(t, r.d.Restart("db"), ErrStopped)
}

func TestCloseLeavesTheKernelAndVMsAlone(t *testing.T) {
	r := newRig(t, rigConfig)
	r.d.Pass(context.Background())
	require.NoError(t, r.d.Close(context.Background()))
	assert.Equal(t, []string{"netplane", "supervisor", "proxy", "proxy.StopAll", "supervisor.Stop", "netplane.Close"}, r.calls.get())
}

func TestMergeParts(t *testing.T) {
	s, why := mergeParts([]part{{"nat", "active", ""}, {"proxy", "failed", "bind: address already in use"}})
	assert.Equal(t, spec.StateFailed, s)
	assert.Equal(t, "proxy: bind: address already in use", why)
	s, _ = mergeParts([]part{{"nat", "pending", "no lease"}, {"proxy", "active", ""}})
	assert.Equal(t, spec.StatePending, s)
	_, why = mergeParts([]part{{"nat", "pending", "no lease"}, {"proxy", "pending", "no address"}, {"proxy", "pending", "no address"}})
	assert.Equal(t, "nat: no lease; proxy: no address", why, "one reason once")
	s, _ = mergeParts([]part{{"nat", "active", ""}})
	assert.Equal(t, spec.StateActive, s)
}

// --- API ---

func serve(t *testing.T, r *rig) *api.Client {
	t.Helper()
	sock := filepath.Join(r.host.RunDir, SocketName)
	ln, err := Listen(r.host.RunDir)
	require.NoError(t, err)
	fi, err := os.Stat(sock)
	require.NoError(t, err)
	assert.Equal(t, os.FileMode(0o600), fi.Mode().Perm())
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan struct{})
	go func() { _ = r.d.Serve(ctx, ln); close(done) }()
	c := api.NewClient(sock)
	t.Cleanup(func() { cancel(); <-done; c.CloseIdle() })
	return c
}

func TestAPIStatusAndApply(t *testing.T) {
	r := newRig(t, rigConfig)
	r.d.Pass(context.Background())
	c := serve(t, r)
	ctx := context.Background()
	st, err := c.Status(ctx)
	require.NoError(t, err)
	assert.Len(t, st.VMs, 2)
	assert.Len(t, st.Exposures, 5)

	plan, err := c.Apply(ctx, []byte(`{"vms":[{"name":"web","kernel":"/k"}]}`), true)
	require.NoError(t, err)
	assert.True(t, plan.DryRun)
	assert.Equal(t, []string{"db"}, plan.VMs.Removed)
	assert.Len(t, r.d.Desired().VMs, 2, "dry run")

	_, err = c.Apply(ctx, []byte("vms:\n  - name: web\n    memory: 12Q\n    kernel: /k\n  - name: Bad\n"), false)
	var he *api.HTTPError
	require.ErrorAs(t, err, &he)
	assert.Equal(t, http.StatusUnprocessableEntity, he.Code)
	assert.True(t, he.UserError())
	assert.Equal(t, []string{`vms[0].memory: "12Q" is not a size (like 256M or 2G)`, `vms[1].name: "Bad" must be 1-32 of a-z 0-9 -`, `vms[1].kernel: is required`}, he.Fields)
	assert.Len(t, r.d.Desired().VMs, 2, "nothing applied")

	_, err = c.Apply(ctx, []byte("vms: [\n"), false)
	require.ErrorAs(t, err, &he)
	assert.Contains(t, strings.Join(he.Fields, ""), "not valid YAML")

	_, err = c.Apply(ctx, []byte(strings.Repeat("# x\n", maxBody/4+1)), false)
	require.ErrorAs(t, err, &he)
	assert.Equal(t, http.StatusRequestEntityTooLarge, he.Code)

	plan, err = c.Apply(ctx, []byte("vms: [{name: web, kernel: /k}]\n"), false)
	require.NoError(t, err)
	assert.True(t, plan.Applied)
	assert.Len(t, r.d.Desired().VMs, 1)
}

func TestAPIVMActions(t *testing.T) {
	r := newRig(t, rigConfig)
	c := serve(t, r)
	ctx := context.Background()
	require.NoError(t, c.VMAction(ctx, "db", "stop"))
	assert.Equal(t, "stopped", r.d.Desired().VMs[1].Power)
	require.NoError(t, c.VMAction(ctx, "db", "start"))
	assert.Equal(t, "running", r.d.Desired().VMs[1].Power)
	require.NoError(t, c.VMAction(ctx, "web", "restart"))
	var he *api.HTTPError
	require.ErrorAs(t, c.VMAction(ctx, "ghost", "start"), &he)
	assert.Equal(t, http.StatusNotFound, he.Code)
	require.ErrorAs(t, c.VMAction(ctx, "web", "explode"), &he)
	assert.Equal(t, http.StatusNotFound, he.Code)
}

func TestAPIRejectsWrongMethodsAndPaths(t *testing.T) {
	r := newRig(t, rigConfig)
	h := r.d.Handler()
	for _, tc := range []struct {
		method, path string
		code         int
	}{
		{"DELETE", "/v1/status", http.StatusMethodNotAllowed},
		{"GET", "/v1/apply", http.StatusMethodNotAllowed},
		{"GET", "/v2/nothing", http.StatusNotFound},
		{"POST", "/v1/apply?dryRun=maybe", http.StatusBadRequest},
	} {
		w := httptest.NewRecorder()
		h.ServeHTTP(w, httptest.NewRequest(tc.method, tc.path, strings.NewReader("")))
		assert.Equal(t, tc.code, w.Code, "%s %s", tc.method, tc.path)
	}
}

// Status answers are compact: indenting a 1,000-exposure answer made it
// several times dearer (BenchmarkStatusRequest), and a status probe has to
// stay cheap while the API is under attack. The CLI indents what it prints.
func TestAPIStatusAnswerIsCompactJSON(t *testing.T) {
	r := newRig(t, rigConfig)
	r.d.Pass(context.Background())
	w := httptest.NewRecorder()
	r.d.Handler().ServeHTTP(w, httptest.NewRequest("GET", "/v1/status", nil))
	require.Equal(t, http.StatusOK, w.Code)
	var st api.Status
	require.NoError(t, json.Unmarshal(w.Body.Bytes(), &st))
	require.NotEmpty(t, st.Exposures)
	assert.Equal(t, 1, bytes.Count(w.Body.Bytes(), []byte("\n")), "one line: no indentation")
}

func TestAPIConsoleFollows(t *testing.T) {
	r := newRig(t, rigConfig)
	c := serve(t, r)
	dir := filepath.Join(r.host.StateDir, "vms", "web")
	require.NoError(t, os.MkdirAll(dir, 0o700))
	log := filepath.Join(dir, "console.log")
	require.NoError(t, os.WriteFile(log, []byte("booting\n"), 0o600))

	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	body, err := c.Console(ctx, "web", true)
	require.NoError(t, err)
	defer body.Close()
	buf := make([]byte, 64)
	n, err := io.ReadAtLeast(body, buf, len("booting\n"))
	require.NoError(t, err)
	assert.Equal(t, "booting\n", string(buf[:n]))

	f, err := os.OpenFile(log, os.O_APPEND|os.O_WRONLY, 0)
	require.NoError(t, err)
	_, _ = f.WriteString("login: ")
	f.Close()
	n, err = io.ReadAtLeast(body, buf, len("login: "))
	require.NoError(t, err)
	assert.Equal(t, "login: ", string(buf[:n]))

	// The supervisor rotates a full log (console.log -> console.log.1, a new
	// console.log): the follower starts again at the new file's top.
	// What the old file got just before the rotation is not lost.
	f, err = os.OpenFile(log, os.O_APPEND|os.O_WRONLY, 0)
	require.NoError(t, err)
	_, _ = f.WriteString("last words\n")
	f.Close()
	require.NoError(t, os.Rename(log, log+".1"))
	require.NoError(t, os.WriteFile(log, []byte("new\n"), 0o600))
	want := "last words\nnew\n"
	got := make([]byte, len(want))
	_, err = io.ReadFull(body, got)
	require.NoError(t, err)
	assert.Equal(t, want, string(got))

	var he *api.HTTPError
	_, err = c.Console(ctx, "ghost", false)
	require.ErrorAs(t, err, &he)
	assert.Equal(t, http.StatusNotFound, he.Code)
}

func TestMetricsCarryExposuresVMsAndTheLoop(t *testing.T) {
	r := newRig(t, rigConfig)
	slot, err := r.store.Attach("ext", bpf.ProtoTCP, 2222)
	require.NoError(t, err)
	defer slot.Release(false)
	slot.AddRefused(2)
	r.d.Pass(context.Background())
	c := serve(t, r)
	text, err := c.Metrics(context.Background())
	require.NoError(t, err)
	for _, want := range []string{
		`brokkr_exposure_refused_total{exposure="ext"} 2`,
		`brokkr_exposure_max_connections{exposure="ext"} 3`,
		`brokkr_exposure_state{exposure="web-auto",state="pending"} 1`,
		`brokkr_vm_phase{phase="running",vm="web"} 1`,
		`brokkr_vm_restarts_total{vm="db"} 0`,
		`brokkr_converge_duration_seconds_count{engine="netplane"} 1`,
		`brokkr_converge_errors_total{engine="proxy"} 0`,
	} {
		assert.Contains(t, text, want)
	}
}

func TestListenRefusesASecondDaemon(t *testing.T) {
	dir := shortDir(t)
	ln, err := Listen(dir)
	require.NoError(t, err)
	defer ln.Close()
	go func() {
		for {
			c, err := ln.Accept()
			if err != nil {
				return
			}
			c.Close()
		}
	}()
	_, err = Listen(dir)
	require.Error(t, err)
	assert.Contains(t, err.Error(), "another brokkrd")
}

func TestStatusJSONShape(t *testing.T) {
	r := newRig(t, rigConfig)
	r.d.Pass(context.Background())
	b, err := json.Marshal(r.d.Status())
	require.NoError(t, err)
	var m map[string][]map[string]any
	var raw map[string]json.RawMessage
	require.NoError(t, json.Unmarshal(b, &raw))
	require.NoError(t, json.Unmarshal(append(append([]byte(`{"vms":`), raw["vms"]...), append([]byte(`,"exposures":`), append(raw["exposures"], '}')...)...), &m))
	for _, k := range []string{"name", "phase", "detail", "address", "address6", "mac", "tap", "pid", "restarts"} {
		assert.Contains(t, m["vms"][0], k)
	}
	for _, k := range []string{"name", "vm", "state", "mode", "reason", "hostAddress", "hostPort", "protocol",
		"active", "accepted", "refused", "dropped", "bytesIn", "bytesOut"} {
		assert.Contains(t, m["exposures"][0], k)
	}
	_ = errors.New
}

// Hostile configs cost a core each to parse; the API parses one at a time so
// a handful of such callers cannot take every core from status and passes.
func TestAPIParsesOneConfigAtATime(t *testing.T) {
	r := newRig(t, rigConfig)
	h := r.d.Handler()
	var now, most atomic.Int32
	parseConfig = func(b []byte) (*config.Config, error) {
		n := now.Add(1)
		for m := most.Load(); n > m && !most.CompareAndSwap(m, n); m = most.Load() {
		}
		time.Sleep(20 * time.Millisecond)
		now.Add(-1)
		return nil, config.Errors{{Path: "vms", Msg: "rejected by the test"}}
	}
	t.Cleanup(func() { parseConfig = config.Decode })
	var wg sync.WaitGroup
	for range 4 {
		wg.Go(func() {
			w := httptest.NewRecorder()
			h.ServeHTTP(w, httptest.NewRequest("POST", "/v1/apply", strings.NewReader("vms: []\n")))
			assert.Equal(t, http.StatusUnprocessableEntity, w.Code)
		})
	}
	wg.Wait()
	assert.Equal(t, int32(1), most.Load(), "configs parsed at once")
}

// A log line names up to 20 changes and then how many more, as a list
// either way.
func TestFewNames(t *testing.T) {
	assert.Equal(t, []string{"a", "b"}, fewNames([]string{"a", "b"}))
	many := make([]string, 25)
	for i := range many {
		many[i] = fmt.Sprint(i)
	}
	got := fewNames(many)
	assert.Len(t, got, 21)
	assert.Equal(t, "19", got[19])
	assert.Equal(t, "... (5 more)", got[20])
	assert.Equal(t, "20", many[20], "the plan's own list is left as it was")
}
