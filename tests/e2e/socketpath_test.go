package e2e

import (
	"net"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/brokkr/brokkr/daemon/api"
	"github.com/brokkr/brokkr/internal/nstest"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

// sockExposures: auto exposures of the VM, as production runs them (the
// default mode), one capped at 2 for callers of both paths.
const sockExposures = `  - {name: sp-echo, vm: e2e, guestPort: 7000, hostPort: 7090, mode: auto, maxConns: 2}
  - {name: sp-udp, vm: e2e, protocol: udp, guestPort: 7001, hostPort: 7091, mode: auto}
`

// listening is how many sockets listen on port in ns (ss, as an operator
// would look).
func listening(t *testing.T, ns *nstest.NS, port string) []string {
	t.Helper()
	out := ns.MustRun(t, "ss", "-Htln", "sport = :"+port)
	return strings.Fields(strings.TrimSpace(out))
}

// holdHere holds a connection from the test process itself, in ns: outside
// the child cgroup, where the socket path translates nothing.
func holdHere(t *testing.T, ns *nstest.NS, addr string) (nstest.Held, error) {
	var c net.Conn
	err := ns.Do(func() (err error) { c, err = nstest.DialEcho(addr, "hold"); return err })
	if err != nil {
		return nstest.Held{}, err
	}
	t.Cleanup(func() { c.Close() })
	return nstest.Held{Conn: c}, nil
}

// The socket path through the real brokkrd, attached to a child cgroup of
// the test's own (BROKKR_CGROUP), with the callers inside it: first the
// warning and the loopback proxy when the attach fails, then an auto
// exposure's host-local callers translated with no proxy listening, its
// one cap shared with nat callers, and the translation, the cap and the
// counting going on while the daemon is SIGKILLed.
func TestTheSocketPathThroughTheRealDaemon(t *testing.T) {
	guest := requireVM(t)
	e := &env{t: t, fixture: newFixture(t, "e2s")}
	e.guest = guest
	e.writeConfig(e.cfgPath, sockExposures)
	t.Cleanup(e.logOnFailure)
	cgroup := nstest.ChildCgroup(t)
	local := nstest.StartCaller(t, e.host, cgroup)
	echo := func(st api.Status) api.Exposure { x, _ := exposure(st, "sp-echo"); return x }

	// The attach fails (BROKKR_CGROUP is no cgroup v2 directory): status
	// says why, and the loopback proxy serves host-local callers.
	e.cgroup = t.TempDir()
	e.startDaemon()
	out, errs, code := e.brokkr("apply", "-f", e.cfgPath, "--wait", "--timeout", "4m")
	require.Equal(t, 0, code, "apply --wait: %s %s", out, errs)
	st := e.status()
	assert.Contains(t, strings.Join(st.Warnings, "\n"), "socket path: fallback", "status warns that the attach failed")
	assert.NotEmpty(t, listening(t, e.host, "7090"), "the loopback proxy listens")
	var h nstest.Held
	require.Eventually(t, func() bool { // the guest's echo service may not be up yet
		var err error
		h, err = holdHere(t, e.host, "127.0.0.1:7090")
		return err == nil
	}, 90*time.Second, 250*time.Millisecond, "a host-local caller reaches the guest through the proxy")
	h.Close(t)
	e.stopDaemon(syscall.SIGTERM)

	// Attached to the child cgroup: a caller there is sent to the guest as
	// it connects; nothing listens on the host port, and a caller outside
	// the cgroup (this test process) finds nothing there.
	e.cgroup = cgroup
	e.startDaemon()
	st = e.waitStatus("sp-echo on the socket path", 60*time.Second, func(st api.Status) bool {
		return vm(st, vmName).Phase == "running" && echo(st).State == "active" && len(listening(t, e.host, "7090")) == 0
	})
	for _, w := range st.Warnings {
		assert.NotContains(t, w, "socket path", "the socket path attached")
	}
	base := echo(st)
	require.Zero(t, base.Active)
	a := local.Hold("127.0.0.1:7090")
	a.Echo(t, "translated")
	_, err := holdHere(t, e.host, "127.0.0.1:7090")
	require.ErrorIs(t, err, syscall.ECONNREFUSED, "outside the cgroup nothing translates and nothing listens")
	assert.Empty(t, listening(t, e.host, "7090"), "no proxy listens: the connection is the guest's")

	// One cap across paths: a nat caller from outside takes the second
	// place; a third caller is refused on either path.
	b, err := holdHere(t, e.client, hostIP+":7090")
	require.NoError(t, err, "a nat caller")
	refused, why := local.Probe("127.0.0.1:7090")
	assert.True(t, refused, "a third caller on the socket path is refused")
	assert.Contains(t, why, "connection refused", "with ECONNREFUSED, as the README says")
	_, err = holdHere(t, e.client, hostIP+":7090")
	assert.Error(t, err, "a third caller on the nat path is refused")
	st = e.waitStatus("two held, two refused", 10*time.Second, func(st api.Status) bool {
		x := echo(st)
		return x.Active == 2 && x.Accepted == base.Accepted+2 && x.Refused == base.Refused+2
	})
	dump := e.bpftoolDump(t)["sp-echo"]
	assert.EqualValues(t, 2, dump.Active, "bpftool: one count for both paths")

	// SIGKILL: the kernel paths go on without the daemon. The socket-path
	// connection's close gives its place back and counts its bytes; a new
	// local caller is translated and admitted; the cap still refuses.
	e.stopDaemon(syscall.SIGKILL)
	a.Close(t)
	require.Eventually(t, func() bool { return e.bpftoolDump(t)["sp-echo"].Active == 1 }, 10*time.Second, 50*time.Millisecond,
		"the closed connection's place given back with no daemon")
	c := local.Hold("127.0.0.1:7090")
	c.Echo(t, "nodaemon")
	refused, _ = local.Probe("127.0.0.1:7090")
	assert.True(t, refused, "the cap holds with no daemon")
	// Bytes: the nat caller's "hold" (its flow's bytes reach the slot at
	// the next sweep), and the closed one's "hold" and "translated",
	// counted as it ended.
	want := bpftoolEntry{Name: "sp-echo", HostPort: 7090, Active: 2, Accepted: base.Accepted + 3, Refused: base.Refused + 3,
		BytesIn: base.BytesIn + 4 + 14, BytesOut: base.BytesOut + 4 + 14}
	if !assert.Eventually(t, func() bool { dump = e.bpftoolDump(t)["sp-echo"]; return dump == want }, 10*time.Second, 50*time.Millisecond) {
		t.Fatalf("bpftool with no daemon: %+v, want %+v (base %+v)\n%+v", dump, want, base, e.bpftoolDump(t))
	}

	e.startDaemon()
	st = e.waitStatus("the restarted daemon", 30*time.Second, func(st api.Status) bool { return echo(st).State == "active" })
	x := echo(st)
	assert.EqualValues(t, 2, x.Active, "the places held across the SIGKILL")
	assert.EqualValues(t, base.Accepted+3, x.Accepted, "a restart neither loses nor doubles")
	assert.EqualValues(t, base.Refused+3, x.Refused)
	c.Close(t)
	b.Close(t)
	e.waitStatus("every place given back", 10*time.Second, func(st api.Status) bool { return echo(st).Active == 0 })

	// A connected UDP socket of a host-local caller follows its exposure:
	// deleted, the daemon closes it (in its namespace) and gives its place
	// back, rather than leave it sending to the guest (cilium/cilium#12859).
	u := local.UDP("127.0.0.1:7091")
	require.Empty(t, local.UDPEcho(u, "still"))
	x, _ = exposure(e.status(), "sp-udp")
	require.EqualValues(t, 1, x.Active)
	smaller := e.state + "/no-udp.yaml"
	e.writeConfig(smaller, strings.SplitAfter(sockExposures, "\n")[0])
	_, errs, code = e.brokkr("apply", "-f", smaller)
	require.Equal(t, 0, code, errs)
	require.Eventually(t, func() bool { why = local.UDPEcho(u, "gone"); return why != "" }, 10*time.Second, 100*time.Millisecond,
		"the deleted exposure's connected UDP socket still reaches the guest")
	assert.Contains(t, why, "connection abort", "closed by the socket path, as the README says")
	// The pass closes the socket first and frees the slot at its end.
	assert.Eventually(t, func() bool { dump = e.bpftoolDump(t)["sp-udp"]; return dump.Active+dump.Accepted == 0 },
		5*time.Second, 50*time.Millisecond, "its slot freed with the exposure: %+v", dump)
}
