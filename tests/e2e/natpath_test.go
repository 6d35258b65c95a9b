package e2e

import (
	"io"
	"net"
	"os"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/brokkr/brokkr/daemon/api"
	"github.com/brokkr/brokkr/internal/kernelfeat"
	"github.com/brokkr/brokkr/internal/nstest"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

// The nat path with no VM: a `target:` exposure to a guest namespace on
// brokkr's bridge at an address brokkr does not run.
const natConfig = `
stateDir: {{state}}
runDir: {{run}}
bpfDir: {{bpf}}
network:
  bridge: brk-e2n0
  cidr: 10.213.8.1/24
hypervisor:
  kind: qemu
exposures:
  - {name: echo-nat, target: 10.213.8.200, guestPort: 7000, hostPort: 7000, mode: nat, maxConns: 2}
`

func newNatEnv(t *testing.T) *env {
	t.Helper()
	nstest.RequireRoot(t)
	e := &env{t: t, fixture: newFixture(t, "e2n")}
	cfg := strings.NewReplacer("{{state}}", e.state, "{{run}}", e.run, "{{bpf}}", e.bpfDir).Replace(natConfig)
	require.NoError(t, os.WriteFile(e.cfgPath, []byte(cfg), 0o600))
	t.Cleanup(e.logOnFailure)
	return e
}

// attachEchoGuest puts a guest namespace on the daemon's bridge with an echo
// server on 7000.
func (e *env) attachEchoGuest() {
	t := e.t
	// The daemon's first pass makes the bridge; a test may come here
	// before it (a squatted port's exposure is failed, not waited for).
	require.Eventually(t, func() bool {
		_, err := e.host.Run("ip", "link", "show", "brk-e2n0")
		return err == nil
	}, 20*time.Second, 50*time.Millisecond, "the daemon makes its bridge")
	g := nstest.New(t, "guest")
	e.host.MustRun(t, "ip", "link", "add", "brk-e2n-g", "type", "veth", "peer", "name", "eth0", "netns", g.Name)
	e.host.MustRun(t, "ip", "link", "set", "brk-e2n-g", "master", "brk-e2n0", "up")
	g.MustRun(t, "ip", "addr", "add", "10.213.8.200/24", "dev", "eth0")
	g.MustRun(t, "ip", "link", "set", "eth0", "up")
	g.MustRun(t, "ip", "route", "add", "default", "via", "10.213.8.1")
	g.ServeEcho(t, "0.0.0.0:7000")
}

// shortCalls makes n connections through addr, each echoing msg once and
// closing both ways before the next (a connection holds its place in the cap
// until both sides have closed).
func (e *env) shortCalls(addr string, n int, msg string) {
	e.t.Helper()
	for i := 0; i < n; i++ {
		c, err := dial(e.client, addr, 3*time.Second)
		require.NoError(e.t, err, "call %d", i)
		got, err := echo(c, msg)
		require.NoError(e.t, err)
		require.Equal(e.t, msg, got)
		require.NoError(e.t, c.(*net.TCPConn).CloseWrite())
		_, err = io.Copy(io.Discard, c)
		require.NoError(e.t, err, "the guest closes after the caller")
		c.Close()
	}
}

func (e *env) waitCounters(what string, want func(bpftoolEntry) bool) bpftoolEntry {
	e.t.Helper()
	deadline := time.Now().Add(10 * time.Second)
	for {
		got := e.bpftoolDump(e.t)["echo-nat"]
		if want(got) {
			return got
		}
		if time.Now().After(deadline) {
			e.t.Fatalf("%s: bpftool shows %+v", what, got)
		}
		time.Sleep(20 * time.Millisecond)
	}
}

// The nat path's counters and cap live in the kernel: exact against what the
// client saw, across a SIGKILL of the daemon (while it is down the cap
// holds, closed connections give their place back and counting goes on),
// a restart, and the table deleted under a running daemon with flows open.
func TestNatPathCountersAndCapAreExactAcrossSIGKILLRestartAndTableLoss(t *testing.T) {
	nstest.RequireRoot(t)
	kernelfeat.Require(t, kernelfeat.NatPath...)
	e := newNatEnv(t)
	e.startDaemon()
	e.waitStatus("the exposure active", 20*time.Second, func(st api.Status) bool {
		x, ok := exposure(st, "echo-nat")
		return ok && x.State == "active"
	})
	e.attachEchoGuest()
	addr := hostIP + ":7000"
	const msg = "0123456789" // 10 payload bytes each way per call

	e.shortCalls(addr, 20, msg)
	got := e.waitCounters("20 calls counted", func(b bpftoolEntry) bool { return b.Accepted == 20 && b.Active == 0 })
	assert.EqualValues(t, 0, got.Refused)
	t.Logf("after 20 calls: %+v", got)
	st := e.status()
	x, _ := exposure(st, "echo-nat")
	assert.EqualValues(t, 200, x.BytesIn, "payload bytes, caller to guest")
	assert.EqualValues(t, 200, x.BytesOut, "payload bytes, guest to caller")
	for _, w := range st.Warnings {
		assert.NotContains(t, w, "nat path", "the BPF nat path is in use")
	}

	a := hold(t, e.client, addr)
	b := hold(t, e.client, addr)
	e.stopDaemon(syscall.SIGKILL)

	// No daemon: the cap holds, a closed connection gives its place back,
	// counting goes on.
	assert.True(t, refused(e.client, addr), "a third caller is refused with no daemon")
	a.Close()
	e.waitCounters("the place given back with no daemon", func(b bpftoolEntry) bool { return b.Active == 1 })
	e.shortCalls(addr, 10, msg)
	e.waitCounters("calls counted with no daemon", func(b bpftoolEntry) bool { return b.Accepted == 32 && b.Refused == 1 })

	e.startDaemon()
	st = e.waitStatus("the restarted daemon's pass", 20*time.Second, func(st api.Status) bool {
		x, ok := exposure(st, "echo-nat")
		return ok && x.State == "active"
	})
	x, _ = exposure(st, "echo-nat")
	assert.EqualValues(t, 32, x.Accepted, "a restart neither loses nor doubles")
	assert.EqualValues(t, 1, x.Refused)
	assert.EqualValues(t, 1, x.Active, "the held connection still holds its place")
	// 20+10 calls, 2 holds ("hold" each way), the refused caller carried
	// nothing; the open hold's bytes reach the slot at its flow's next tick.
	got = e.waitCounters("every byte counted", func(b bpftoolEntry) bool { return b.BytesIn >= 300+8 && b.BytesOut >= 300+8 })
	assert.EqualValues(t, 300+8, got.BytesIn)
	assert.EqualValues(t, 300+8, got.BytesOut)

	// The table deleted under the running daemon with a flow open: the
	// daemon puts it back as it was; a repair changes nothing the flows
	// follow, so nothing is flushed: the open flow keeps its place and
	// carries on, and gives its place back when it closes.
	e.host.MustRun(t, "nft", "delete", "table", "inet", "brokkr")
	e.waitStatus("the table repaired", 20*time.Second, func(api.Status) bool {
		out, err := e.host.Run("nft", "list", "table", "inet", "brokkr")
		return err == nil && strings.Contains(out, "echo-nat")
	})
	still, err := echo(b, "still")
	require.NoError(t, err, "the open flow carries on across the repair")
	assert.Equal(t, "still", still)
	got = e.waitCounters("the open flow still holds its place", func(b bpftoolEntry) bool { return b.BytesIn >= 313 })
	assert.EqualValues(t, 1, got.Active)
	b.Close()
	e.waitCounters("the closed flow's place given back", func(b bpftoolEntry) bool { return b.Active == 0 })
	e.shortCalls(addr, 5, msg)
	got = e.waitCounters("calls counted after the repair", func(b bpftoolEntry) bool { return b.Accepted == 37 })
	assert.EqualValues(t, 0, got.Active)
	assert.EqualValues(t, 1, got.Refused)
	x, _ = exposure(e.status(), "echo-nat")
	assert.EqualValues(t, 350+8+5, x.BytesIn)
	assert.EqualValues(t, 350+8+5, x.BytesOut)
}
