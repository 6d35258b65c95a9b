package e2e

import (
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
	"golang.org/x/sys/unix"
)

// The kernel matrix's daemon-level tests (make test-kernels runs them in a
// VM per kernel, and on the host): whatever path the kernel allows, every
// exposure keeps its cap, counters never go backwards across a restart,
// and status and the log name each fallback and why. No VM: the guest is a
// namespace on brokkr's bridge at an address brokkr does not run.
const kernelConfig = `
stateDir: {{state}}
runDir: {{run}}
bpfDir: {{bpf}}
network:
  bridge: brk-e2k0
  cidr: 10.213.9.1/24
hypervisor:
  kind: qemu
exposures:
  - {name: capped-nat, target: 10.213.9.200, guestPort: 7000, hostPort: 7000, mode: nat, maxConns: 2}
  - {name: capped-auto, target: 10.213.9.200, guestPort: 7000, hostPort: 7002, mode: auto, maxConns: 2}
`

// newKernelEnv is a daemon whose socket path attaches to a child cgroup
// that this test process (the host-local caller) is moved into.
func newKernelEnv(t *testing.T) *env {
	t.Helper()
	nstest.RequireRoot(t)
	// The cgroup first: cleanups run last-in first-out, and the child can
	// be removed only once the fixture has stopped the daemon in it.
	mnt := filepath.Join(t.TempDir(), "cgroup2")
	root, err := bpf.CgroupV2Root(mnt)
	require.NoError(t, err)
	if root == mnt {
		t.Cleanup(func() { _ = unix.Unmount(mnt, unix.MNT_DETACH) })
	}
	cg := nstest.JoinCgroup(t, root)
	e := &env{t: t, fixture: newFixture(t, "e2k")}
	e.cgroup = cg
	cfg := strings.NewReplacer("{{state}}", e.state, "{{run}}", e.run, "{{bpf}}", e.bpfDir).Replace(kernelConfig)
	require.NoError(t, os.WriteFile(e.cfgPath, []byte(cfg), 0o600))
	t.Cleanup(e.logOnFailure)
	return e
}

func (e *env) attachGuest(bridge, addr, gw string) *nstest.NS {
	t := e.t
	g := nstest.New(t, "guest")
	e.host.MustRun(t, "ip", "link", "add", "brk-e2k-g", "type", "veth", "peer", "name", "eth0", "netns", g.Name)
	e.host.MustRun(t, "ip", "link", "set", "brk-e2k-g", "master", bridge, "up")
	g.MustRun(t, "ip", "addr", "add", addr, "dev", "eth0")
	g.MustRun(t, "ip", "link", "set", "eth0", "up")
	g.MustRun(t, "ip", "route", "add", "default", "via", gw)
	g.ServeEcho(t, "0.0.0.0:7000")
	return g
}

// holdLocal opens a connection from the host namespace itself (a host-local
// caller: this process, in the socket path's cgroup).
func (e *env) holdLocal(addr string) net.Conn {
	return hold(e.t, e.host, addr)
}

// fallbackNamed checks that status has a warning starting with prefix and
// naming what the kernel lacks exactly when want is non-nil, and that the
// daemon's log says the same.
func (e *env) fallbackNamed(st api.Status, path string, missing error) {
	t := e.t
	t.Helper()
	var got []string
	for _, w := range st.Warnings {
		if strings.HasPrefix(w, path+": fallback") {
			got = append(got, w)
		}
	}
	if missing == nil {
		assert.Empty(t, got, "kernel %s has what the %s needs: no fallback", kernelfeat.Running().Release, path)
		return
	}
	want := path + ": fallback (" + missing.Error() + ")"
	require.Len(t, got, 1, "status names the %s's fallback: %v", path, st.Warnings)
	assert.True(t, strings.HasPrefix(got[0], want), "status says %q, want it to start %q", got[0], want)
	log, err := os.ReadFile(e.logPath)
	require.NoError(t, err)
	assert.Contains(t, string(log), want, "brokkrd's log names the %s's fallback", path)
}

// Every exposure keeps its cap on every path the kernel gives it: a capped
// nat exposure holds two callers and refuses a third; an auto exposure's
// one cap is shared by its outside callers (nat path or its fallback) and
// its host-local ones (socket path or the proxy): one of each holds it
// full, and a third is refused from either side. Counters never go
// backwards across a SIGKILL and a restart, and calls made while the daemon
// is down are counted once it is back.
func TestKernelMatrixEveryPathKeepsItsCapAndItsCountersAcrossARestart(t *testing.T) {
	e := newKernelEnv(t)
	k := kernelfeat.Running()
	e.startDaemon()
	st := e.waitStatus("both exposures active", 20*time.Second, func(st api.Status) bool {
		a, ok1 := exposure(st, "capped-nat")
		b, ok2 := exposure(st, "capped-auto")
		return ok1 && ok2 && a.State == "active" && b.State == "active"
	})
	e.fallbackNamed(st, "nat path", k.Missing(kernelfeat.NatPath...))
	e.fallbackNamed(st, "socket path", k.Missing(kernelfeat.SocketPath...))
	e.attachGuest("brk-e2k0", "10.213.9.200/24", "10.213.9.1")
	natAddr, autoOut, autoLocal := hostIP+":7000", hostIP+":7002", "127.0.0.1:7002"

	// nat: two held, the third refused.
	a, b := hold(t, e.client, natAddr), hold(t, e.client, natAddr)
	assert.True(t, refused(e.client, natAddr), "capped-nat: a third caller is refused at maxConns 2")
	// auto: one outside and one local caller fill the one cap.
	o := hold(t, e.client, autoOut)
	l := e.holdLocal(autoLocal)
	assert.True(t, refused(e.client, autoOut), "capped-auto: an outside caller is refused while a local one and an outside one hold the cap")
	assert.True(t, refused(e.host, autoLocal), "capped-auto: a local caller is refused while the cap is full")
	for _, c := range []net.Conn{a, b, o, l} {
		got, err := echo(c, "still")
		require.NoError(t, err)
		assert.Equal(t, "still", got, "the held connections still carry bytes")
		c.Close()
	}
	st = e.waitStatus("the places given back", 10*time.Second, func(st api.Status) bool {
		x, _ := exposure(st, "capped-nat")
		y, _ := exposure(st, "capped-auto")
		return x.Active == 0 && y.Active == 0 && x.Accepted == 2 && y.Accepted == 2
	})
	x, _ := exposure(st, "capped-nat")
	y, _ := exposure(st, "capped-auto")
	assert.EqualValues(t, 1, x.Refused, "capped-nat refused")
	assert.EqualValues(t, 2, y.Refused, "capped-auto refused, both sides")

	// Calls before, during and after a SIGKILL: counters never go backwards,
	// and what the kernel admitted while no daemon ran is counted.
	e.shortCalls(natAddr, 5, "0123456789")
	before := e.waitStatus("five calls counted", 10*time.Second, func(st api.Status) bool {
		x, _ := exposure(st, "capped-nat")
		return x.Accepted == 7 && x.Active == 0
	})
	e.stopDaemon(syscall.SIGKILL)
	// The nat path admits, releases and counts with no daemon. The
	// fallback's places are given back by the daemon's conntrack watcher
	// (README, "Counters"): with none, its cap still holds, so maxConns
	// short calls are served and the next is turned away until the daemon
	// is back; what it admitted is counted then.
	fallback := k.Missing(kernelfeat.NatPath...) != nil
	down := 3
	if fallback {
		down = 2
	}
	e.shortCalls(natAddr, down, "0123456789")
	if fallback {
		assert.True(t, refused(e.client, natAddr), "the fallback's cap holds with no daemon")
	}
	e.startDaemon()
	after := e.waitStatus("the restarted daemon's pass", 20*time.Second, func(st api.Status) bool {
		x, ok := exposure(st, "capped-nat")
		return ok && x.State == "active" && x.Active == 0
	})
	for _, name := range []string{"capped-nat", "capped-auto"} {
		p, _ := exposure(before, name)
		q, _ := exposure(after, name)
		assert.GreaterOrEqual(t, q.Accepted, p.Accepted, "%s accepted went backwards", name)
		assert.GreaterOrEqual(t, q.Refused, p.Refused, "%s refused went backwards", name)
		assert.GreaterOrEqual(t, q.BytesIn, p.BytesIn, "%s bytesIn went backwards", name)
		assert.GreaterOrEqual(t, q.BytesOut, p.BytesOut, "%s bytesOut went backwards", name)
	}
	// What the calls made while no daemon ran carried is counted by the
	// next one, on either path (the nat path counts payload, 10 bytes a
	// call; the fallback IP packets, more).
	p, _ := exposure(before, "capped-nat")
	q, _ := exposure(after, "capped-nat")
	assert.GreaterOrEqual(t, q.BytesIn-p.BytesIn, uint64(10*down), "capped-nat: the bytes of the calls made while no daemon ran")
	e.shortCalls(natAddr, 2, "0123456789")
	want := uint64(7 + down + 2)
	got := e.waitStatus("every call counted", 10*time.Second, func(st api.Status) bool {
		x, _ := exposure(st, "capped-nat")
		return x.Accepted >= want && x.Active == 0
	})
	x, _ = exposure(got, "capped-nat")
	assert.EqualValues(t, want, x.Accepted, "7 before, %d while down, 2 after: none lost, none doubled", down)
	// On the fallback the caller turned away with no daemon is redirected
	// to the slow path's listener, which died with the daemon: the kernel
	// resets it there, past the rule that counts refusals, so it is not
	// counted (the nat path counts it; it never turns one away here).
	assert.EqualValues(t, 1, x.Refused)
	// A second cap check after the restart: still two, never three.
	a, b = hold(t, e.client, natAddr), hold(t, e.client, natAddr)
	assert.True(t, refused(e.client, natAddr), "capped-nat after the restart: a third caller is refused")
	a.Close()
	b.Close()
}

// kernelConfig6 is kernelConfig's capped nat exposure with the guest's
// IPv6 address too, and no hostAddress: both families.
const kernelConfig6 = `
stateDir: {{state}}
runDir: {{run}}
bpfDir: {{bpf}}
network:
  bridge: brk-e2k0
  cidr: 10.213.9.1/24
hypervisor:
  kind: qemu
exposures:
  - {name: capped-nat, target: 10.213.9.200, target6: "fd00:6272:6b72::c8", guestPort: 7000, hostPort: 7000, mode: nat, maxConns: 2}
  - {name: open-auto, target: 10.213.9.200, target6: "fd00:6272:6b72::c8", guestPort: 7000, hostPort: 7001, maxConns: 0}
`

// IPv6 callers on each kernel of the matrix: where the nat path runs, an
// exposure of both families serves them to the guest's IPv6 address under
// the one cap (one IPv4 and one IPv6 caller fill a cap of 2, a third of
// either family is refused); on the fallback a nat exposure serves IPv4
// alone and status says so, and an uncapped auto one serves its IPv6
// callers by the proxy, counted in its slot (a capped auto exposure, the
// default, is the proxy's for every caller there: the test above).
func TestKernelMatrixIPv6CallersShareTheOneCap(t *testing.T) {
	e := newKernelEnv(t)
	cfg := strings.NewReplacer("{{state}}", e.state, "{{run}}", e.run, "{{bpf}}", e.bpfDir).Replace(kernelConfig6)
	require.NoError(t, os.WriteFile(e.cfgPath, []byte(cfg), 0o600))
	e.startDaemon()
	st := e.waitStatus("the exposures active", 20*time.Second, func(st api.Status) bool {
		a, ok := exposure(st, "capped-nat")
		b, ok2 := exposure(st, "open-auto")
		return ok && ok2 && a.State == "active" && b.State == "active"
	})
	guest := e.attachGuest("brk-e2k0", "10.213.9.200/24", "10.213.9.1")
	guest.MustRun(t, "ip", "-6", "addr", "add", "fd00:6272:6b72::c8/64", "dev", "eth0", "nodad")
	guest.MustRun(t, "ip", "-6", "route", "add", "default", "via", "fd00:6272:6b72::1")
	guest.ServeEcho(t, "[::]:7000")
	v4, v6 := hostIP+":7000", "["+hostIP6+"]:7000"
	auto4, auto6 := hostIP+":7001", "["+hostIP6+"]:7001"
	if k := kernelfeat.Running(); k.Missing(kernelfeat.NatPath...) != nil {
		var found, byProxy bool
		for _, w := range st.Warnings {
			found = found || strings.Contains(w, "IPv6 callers are not published")
			byProxy = byProxy || strings.Contains(w, "IPv6 callers of auto exposures [open-auto] are carried by the proxy")
		}
		assert.True(t, found, "status says the fallback publishes IPv4 only: %v", st.Warnings)
		assert.True(t, byProxy, "status says who carries the auto exposure's IPv6 callers: %v", st.Warnings)
		c := hold(t, e.client, v4)
		c.Close()
		assert.True(t, refused(e.client, v6), "no IPv6 DNAT on the fallback")
		before, _ := exposure(st, "open-auto")
		c = hold(t, e.client, auto4)
		c.Close()
		// The proxy dials the guest from the bridge's IPv6 address, which
		// is tentative for a moment (duplicate address detection).
		require.Eventually(t, func() bool {
			return !refused(e.client, auto6)
		}, 20*time.Second, 200*time.Millisecond, "an IPv6 caller of the auto exposure reaches the guest")
		e.waitStatus("the auto exposure's callers counted in its slot", 10*time.Second, func(st api.Status) bool {
			x, _ := exposure(st, "open-auto")
			return x.Accepted-before.Accepted == 2 // a call the guest did not answer is not accepted
		})
		return
	}
	// The bridge has its carrier from the guest just attached, and its IPv6
	// addresses are tentative for a moment (duplicate address detection):
	// a caller then gets "no route to host" (once in the host's leg). The
	// path is up before the cap is tried, and the probe's place given back.
	require.Eventually(t, func() bool {
		c, err := dial(e.client, v6, 2*time.Second)
		if err == nil {
			c.Close()
		}
		return err == nil
	}, 20*time.Second, 200*time.Millisecond, "an IPv6 caller reaches the guest")
	for _, addr := range []string{auto4, auto6} { // the nat path carries both
		c := hold(t, e.client, addr)
		c.Close()
	}
	st = e.waitStatus("the probe's place given back", 10*time.Second, func(st api.Status) bool {
		x, _ := exposure(st, "capped-nat")
		return x.Active == 0
	})
	before, _ := exposure(st, "capped-nat") // the probe's callers are counted too
	a := hold(t, e.client, v4)
	b := hold(t, e.client, v6)
	assert.True(t, refused(e.client, v4), "a third caller over IPv4 is refused")
	assert.True(t, refused(e.client, v6), "a third caller over IPv6 is refused")
	a.Close()
	b.Close()
	st = e.waitStatus("the places given back", 10*time.Second, func(st api.Status) bool {
		x, _ := exposure(st, "capped-nat")
		return x.Active == 0
	})
	x, _ := exposure(st, "capped-nat")
	assert.EqualValues(t, 2, x.Accepted-before.Accepted, "one IPv4 and one IPv6 caller, in the one slot")
	assert.EqualValues(t, 2, x.Refused-before.Refused, "one refused of each family")
}
