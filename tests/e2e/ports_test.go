package e2e

import (
	"bufio"
	"context"
	"fmt"
	"io"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	"golang.org/x/sys/unix"

	"github.com/brokkr/brokkr/daemon/api"
	"github.com/brokkr/brokkr/internal/nstest"
)

const portsConfig = `
stateDir: {{state}}
runDir: {{run}}
bpfDir: {{bpf}}
network:
  bridge: brk-e2n0
  cidr: 10.213.8.1/24
hypervisor:
  kind: qemu
exposures:
  - {name: echo-nat, target: 10.213.8.200, guestPort: 7000, hostPort: 7000, mode: nat}
  - {name: echo-udp, target: 10.213.8.200, protocol: udp, guestPort: 7000, hostPort: 7001, mode: nat}
`

// squatter is a host program serving a port brokkr is asked to publish:
// socat answering every caller "squatter".
func squatter(t *testing.T, ns *nstest.NS, spec string) (pid int, stop func()) {
	t.Helper()
	// The shell reads what the caller sends: one that exited first would
	// make socat's write to it fail and the answer be lost.
	cmd := ns.Command("socat", spec, "SYSTEM:echo squatter; exec cat >/dev/null")
	require.NoError(t, cmd.Start())
	var once bool
	stop = func() {
		if !once {
			once = true
			_ = cmd.Process.Kill()
			_ = cmd.Wait()
		}
	}
	t.Cleanup(stop)
	// Listening once /proc/net shows it (socat binds right after exec).
	port := spec[strings.Index(spec, ":")+1:]
	port = strings.SplitN(port, ",", 2)[0]
	require.Eventually(t, func() bool {
		out, _ := ns.Run("ss", "-Htauln", "sport", "= :"+port)
		return strings.TrimSpace(out) != ""
	}, 5*time.Second, 20*time.Millisecond, "socat %s listening", spec)
	return cmd.Process.Pid, stop
}

// bindInHost binds 0.0.0.0:port in ns the way a server does (SO_REUSEADDR,
// then listen for TCP).
func bindInHost(ns *nstest.NS, typ, port int) error {
	return ns.Do(func() error {
		fd, err := unix.Socket(unix.AF_INET, typ|unix.SOCK_CLOEXEC, 0)
		if err != nil {
			return err
		}
		defer unix.Close(fd)
		if err := unix.SetsockoptInt(fd, unix.SOL_SOCKET, unix.SO_REUSEADDR, 1); err != nil {
			return err
		}
		if err := unix.Bind(fd, &unix.SockaddrInet4{Port: port}); err != nil {
			return err
		}
		if typ == unix.SOCK_STREAM {
			return unix.Listen(fd, 1)
		}
		return nil
	})
}

// A port a host program listens on is not taken from it: the nat exposure
// is failed naming the program, its callers still reach the program (no
// DNAT), and on the first pass after the program exits the exposure is
// active and reaches the guest. While active, a host program's bind of the
// port fails (TCP and UDP). apply --dry-run warns of a port in use.
func TestASquattedPortFailsTheExposureWithoutHijackAndHealsWhenItFrees(t *testing.T) {
	nstest.RequireRoot(t)
	e := &env{t: t, fixture: newFixture(t, "e2n")}
	cfg := strings.NewReplacer("{{state}}", e.state, "{{run}}", e.run, "{{bpf}}", e.bpfDir).Replace(portsConfig)
	require.NoError(t, os.WriteFile(e.cfgPath, []byte(cfg), 0o600))
	t.Cleanup(e.logOnFailure)

	pid, stop := squatter(t, e.host, "TCP4-LISTEN:7000,fork,reuseaddr")
	e.startDaemon()
	e.attachEchoGuest()
	why := fmt.Sprintf("0.0.0.0:7000/tcp is in use by pid %d (socat)", pid)
	require.Eventually(t, func() bool {
		st, err := api.NewClient(e.sock).Status(context.Background())
		if err != nil {
			return false
		}
		x, ok := exposure(*st, "echo-nat")
		y, _ := exposure(*st, "echo-udp")
		return ok && x.State == "failed" && strings.Contains(x.Reason, why) && y.State == "active"
	}, 20*time.Second, 100*time.Millisecond, "the squatted exposure failed naming its holder, the other active")
	_, _, code := e.brokkr("status")
	var stdout, stderr string
	assert.Equal(t, 3, code, "brokkr status exits 3 while an exposure is failed")
	got := callOnce(t, e, hostIP+":7000", "hello")
	assert.Equal(t, "squatter\n", got, "the squatter keeps its callers")
	out := e.host.MustRun(t, "nft", "list", "table", "inet", "brokkr")
	assert.NotContains(t, out, "echo-nat", "no element for the failed exposure")
	assert.Contains(t, out, "echo-udp")

	// A dry run of a config with another squatted port says so.
	pid2, stop2 := squatter(t, e.host, "TCP4-LISTEN:7002,fork,reuseaddr")
	more := filepath.Join(e.state, "more.yaml")
	require.NoError(t, os.WriteFile(more, []byte(cfg+"  - {name: echo-more, target: 10.213.8.200, guestPort: 7000, hostPort: 7002, mode: nat}\n"), 0o600))
	stdout, stderr, code = e.brokkr("apply", "-f", more, "--dry-run")
	require.Equal(t, 0, code, stderr)
	assert.Contains(t, stdout+stderr, fmt.Sprintf("exposure echo-more: 0.0.0.0:7002/tcp is in use by pid %d (socat)", pid2))
	assert.NotContains(t, stdout+stderr, "exposure echo-udp", "a port brokkr holds is not in use")

	// One exposure added on its own (the incremental API) is not
	// published over the program either: warned, failed, no hijack.
	stdout, stderr, code = e.brokkr("expose", "add", "echo-more", "--target", "10.213.8.200", "--guest-port", "7000", "--host-port", "7002", "--mode", "nat")
	require.Equal(t, 0, code, stderr)
	assert.Contains(t, stdout+stderr, fmt.Sprintf("0.0.0.0:7002/tcp is in use by pid %d (socat)", pid2))
	assert.Equal(t, "squatter\n", callOnce(t, e, hostIP+":7002", "hello"), "the program keeps its callers")
	require.Eventually(t, func() bool {
		st, err := api.NewClient(e.sock).Status(context.Background())
		if err != nil {
			return false
		}
		x, ok := exposure(*st, "echo-more")
		return ok && x.State == "failed" && strings.Contains(x.Reason, fmt.Sprintf("in use by pid %d (socat)", pid2))
	}, 10*time.Second, 100*time.Millisecond, "the added exposure failed naming the holder")
	assert.Equal(t, "squatter\n", callOnce(t, e, hostIP+":7002", "hello"), "after the pass too")
	_, stderr, code = e.brokkr("expose", "rm", "echo-more")
	require.Equal(t, 0, code, stderr)
	stop2()

	stop()
	require.Eventually(t, func() bool {
		st, err := api.NewClient(e.sock).Status(context.Background())
		if err != nil {
			return false
		}
		x, ok := exposure(*st, "echo-nat")
		return ok && x.State == "active"
	}, 20*time.Second, 100*time.Millisecond, "active once the port freed")
	assert.Equal(t, "hello", callOnce(t, e, hostIP+":7000", "hello"), "the guest answers now")
	assert.ErrorIs(t, bindInHost(e.host, unix.SOCK_STREAM, 7000), unix.EADDRINUSE, "a host program cannot bind an active exposure's TCP port")
	assert.ErrorIs(t, bindInHost(e.host, unix.SOCK_DGRAM, 7001), unix.EADDRINUSE, "nor its UDP port")
	assert.NoError(t, bindInHost(e.host, unix.SOCK_STREAM, 7003), "a port no exposure has is free")
}

// callOnce dials addr from the client, sends msg and returns what came back
// before the far side closed or a second passed.
func callOnce(t *testing.T, e *env, addr, msg string) string {
	t.Helper()
	c, err := dial(e.client, addr, 3*time.Second)
	require.NoError(t, err, addr)
	defer c.Close()
	_, err = io.WriteString(c, msg)
	require.NoError(t, err)
	// socat forks a shell per caller: seconds on a loaded machine.
	_ = c.SetReadDeadline(time.Now().Add(5 * time.Second))
	b, _ := bufio.NewReader(c).ReadString('\n')
	if b == "" {
		buf := make([]byte, len(msg))
		n, _ := io.ReadFull(c, buf)
		b = string(buf[:n])
	}
	return b
}
