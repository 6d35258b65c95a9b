package e2e

import (
	"context"
	"os"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	"golang.org/x/sys/unix"

	"github.com/brokkr/brokkr/daemon/api"
	"github.com/brokkr/brokkr/internal/nstest"
)

const rangesConfig = `
stateDir: {{state}}
runDir: {{run}}
bpfDir: {{bpf}}
network:
  bridge: brk-e2r0
  cidr: 10.213.9.1/24
hypervisor:
  kind: qemu
exposures:
  - {name: fan-nat, target: 10.213.9.200, guestPort: 7000, hostPort: "30000-30009", mode: nat, maxConns: 2}
  - {name: fan-proxy, target: 10.213.9.200, guestPort: 7000, hostPort: "31000-31004", mode: proxy}
`

// Port ranges through the real daemon and CLI (no VM: a namespace on the
// bridge is the guest): a nat range and a proxy range reach the guest on
// their first, a middle and their last port, not beside them; the nat
// range's one cap of 2, held on two ports, refuses a third caller on a
// third; status shows the range (hostPort the first port, hostPortLast),
// expose ls prints *:30000-30009/tcp; a range added with expose add is
// published; one overlapping a range is refused naming the field; a host
// program cannot bind a middle port.
func TestPortRangesThroughTheRealDaemon(t *testing.T) {
	nstest.RequireRoot(t)
	e := &env{t: t, fixture: newFixture(t, "e2r")}
	cfg := strings.NewReplacer("{{state}}", e.state, "{{run}}", e.run, "{{bpf}}", e.bpfDir).Replace(rangesConfig)
	require.NoError(t, os.WriteFile(e.cfgPath, []byte(cfg), 0o600))
	t.Cleanup(e.logOnFailure)
	e.startDaemon()
	require.Eventually(t, func() bool { _, err := e.host.Run("ip", "link", "show", "brk-e2r0"); return err == nil },
		20*time.Second, 50*time.Millisecond, "the daemon made the bridge")
	g := nstest.New(t, "guest")
	e.host.MustRun(t, "ip", "link", "add", "brk-e2r-g", "type", "veth", "peer", "name", "eth0", "netns", g.Name)
	e.host.MustRun(t, "ip", "link", "set", "brk-e2r-g", "master", "brk-e2r0", "up")
	g.MustRun(t, "ip", "addr", "add", "10.213.9.200/24", "dev", "eth0")
	g.MustRun(t, "ip", "link", "set", "eth0", "up")
	g.MustRun(t, "ip", "route", "add", "default", "via", "10.213.9.1")
	g.ServeEcho(t, "0.0.0.0:7000")

	active := func(names ...string) func() bool {
		return func() bool {
			st, err := api.NewClient(e.sock).Status(context.Background())
			if err != nil {
				return false
			}
			for _, n := range names {
				if x, ok := exposure(*st, n); !ok || x.State != "active" {
					return false
				}
			}
			return true
		}
	}
	require.Eventually(t, active("fan-nat", "fan-proxy"), 30*time.Second, 100*time.Millisecond, "both ranges active")
	reaches := func(port int) {
		t.Helper()
		var err error
		for deadline := time.Now().Add(5 * time.Second); time.Now().Before(deadline); time.Sleep(100 * time.Millisecond) {
			c, derr := dial(e.client, hostIP+":"+strconv.Itoa(port), 2*time.Second)
			if err = derr; err == nil {
				got, eerr := echo(c, "hi")
				c.Close()
				if err = eerr; err == nil {
					assert.Equal(t, "hi", got, "port %d", port)
					return
				}
			}
		}
		t.Errorf("port %d: %v", port, err)
	}
	notPublished := func(port int) {
		t.Helper()
		c, err := dial(e.client, hostIP+":"+strconv.Itoa(port), 2*time.Second)
		if err == nil {
			c.Close()
		}
		assert.Error(t, err, "port %d is not published", port)
	}
	for _, p := range []int{30000, 30005, 30009, 31000, 31002, 31004} {
		reaches(p)
	}
	for _, p := range []int{29999, 30010, 30999, 31005} {
		notPublished(p)
	}

	// One cap of 2 across the nat range.
	a := hold(t, e.client, hostIP+":30001")
	defer a.Close()
	b := hold(t, e.client, hostIP+":30008")
	defer b.Close()
	notPublished(30004) // refused: past the cap
	st := e.status()
	x, _ := exposure(st, "fan-nat")
	assert.Equal(t, [2]int{30000, 30009}, [2]int{x.HostPort, x.HostPortLast})
	assert.Equal(t, [2]int{7000, 0}, [2]int{x.GuestPort, x.GuestPortLast})
	require.Eventually(t, func() bool { x, _ := exposure(e.status(), "fan-nat"); return x.Refused >= 1 && x.Active == 2 },
		5*time.Second, 100*time.Millisecond, "the third caller refused, two active, in the one slot")
	out, _, code := e.brokkr("expose", "ls")
	require.Equal(t, 0, code)
	assert.Contains(t, out, "*:30000-30009/tcp")
	assert.Contains(t, out, "*:31000-31004/tcp")

	// Port ownership: a middle port cannot be bound by a host program.
	assert.ErrorIs(t, bindInHost(e.host, unix.SOCK_STREAM, 30005), unix.EADDRINUSE)

	// One more range, added alone, and one that overlaps a range.
	_, errs, code := e.brokkr("expose", "add", "more", "--target", "10.213.9.200", "--guest-port", "7000", "--host-port", "32000-32002", "--mode", "nat")
	require.Equal(t, 0, code, errs)
	require.Eventually(t, active("more"), 10*time.Second, 100*time.Millisecond, "the added range active")
	reaches(32001)
	_, errs, code = e.brokkr("expose", "add", "bad", "--target", "10.213.9.200", "--guest-port", "7000", "--host-port", "30005", "--mode", "nat")
	assert.Equal(t, 1, code)
	assert.Contains(t, errs, `hostPort: 30005/tcp on every address overlaps exposures[0] ("30000-30009"/tcp on every address)`)
}
