package daemon

import (
	"bufio"
	"net"
	"net/netip"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	"golang.org/x/sys/unix"

	"github.com/brokkr/brokkr/bpf"
	"github.com/brokkr/brokkr/internal/kernelfeat"
	"github.com/brokkr/brokkr/internal/nstest"
	"github.com/brokkr/brokkr/internal/spec"
)

// serveLocalPorts answers each TCP connection on every port of ports inside
// ns with the port it came in on, one line, and keeps it until the caller
// closes.
func serveLocalPorts(t *testing.T, ns *nstest.NS, addr string, ports ...int) {
	for _, port := range ports {
		ns.ServeTCP(t, "tcp4", addr+":"+strconv.Itoa(port), nstest.AnswerPort)
	}
}

// An auto port range on the socket path: a host-local caller of the first,
// a middle and the last port goes to the guest on that port, a port beside
// it is not translated, and the range's one cap of 2, held on two of its
// ports, refuses a third caller on a third port (ECONNREFUSED); every
// caller counts in the one slot. The programs attach to a child cgroup
// this test process is moved into; the callers are in a namespace of the
// test's own.
func TestPortRangeOnTheSocketPath(t *testing.T) {
	nstest.RequireRoot(t)
	kernelfeat.Require(t, kernelfeat.SocketPath...)
	pins := nstest.PrivateBPFFS(t)
	host, g := nstest.New(t, "host"), nstest.New(t, "g1")
	host.MustRun(t, "ip", "link", "set", "lo", "up")
	host.MustRun(t, "ip", "link", "add", "br0", "type", "bridge")
	host.MustRun(t, "ip", "addr", "add", "10.213.0.1/24", "dev", "br0")
	host.MustRun(t, "ip", "link", "set", "br0", "up")
	nstest.Link(t, host, "g1p", "", g, "eth0", "10.213.0.11/24")
	host.MustRun(t, "ip", "link", "set", "g1p", "master", "br0")
	serveLocalPorts(t, g, "10.213.0.11", 29999, 30000, 30050, 30099, 30100)

	store, err := bpf.Open(pins)
	require.NoError(t, err)
	t.Cleanup(func() { store.Close() })
	root := ""
	for _, p := range []string{"/sys/fs/cgroup/unified", "/sys/fs/cgroup"} {
		var st unix.Statfs_t
		if unix.Statfs(p, &st) == nil && st.Type == unix.CGROUP2_SUPER_MAGIC {
			root = p
			break
		}
	}
	if root == "" {
		t.Skip("no cgroup v2 hierarchy mounted")
	}
	cg := nstest.JoinCgroup(t, root)
	lb, err := bpf.LoadSockLB(bpf.SockLBConfig{PinDir: pins, Cgroup: cg, InNS: host.Do})
	require.NoError(t, err)
	t.Cleanup(func() { lb.Close() })

	sp := newSockPath(lb, store)
	sp.localAddr = func() ([]netip.Addr, error) {
		return []netip.Addr{netip.MustParseAddr("127.0.0.1"), netip.MustParseAddr("10.213.0.1"), netip.IPv6Loopback()}, nil
	}
	m := &spec.Desired{Exposures: []spec.Exposure{{Name: "games", Mode: spec.ModeAuto, Proto: spec.TCP,
		Target: spec.Target{Addr: netip.MustParseAddr("10.213.0.11")}, HostPort: 30000, HostPortLast: 30099,
		GuestPort: 30000, GuestPortLast: 30099, MaxConns: 2},
		{Name: "shifted", Mode: spec.ModeAuto, Proto: spec.TCP, Target: spec.Target{Addr: netip.MustParseAddr("10.213.0.11")},
			HostPort: 33000, HostPortLast: 33049, GuestPort: 30050, GuestPortLast: 30099}}}
	none := func(string) (netip.Addr, bool) { return netip.Addr{}, false }
	parts, err := sp.converge(m, none, none)
	require.NoError(t, err)
	assert.Equal(t, spec.StateActive, parts["games"].state, parts["games"].reason)
	t.Cleanup(func() {
		_, _ = sp.converge(&spec.Desired{}, none, none) // the translations and the slot go
	})

	call := func(port int) (net.Conn, string, error) {
		var c net.Conn
		if err := host.Do(func() (err error) {
			c, err = net.DialTimeout("tcp4", "127.0.0.1:"+strconv.Itoa(port), 2*time.Second)
			return err
		}); err != nil {
			return nil, "", err
		}
		_ = c.SetDeadline(time.Now().Add(3 * time.Second))
		line, err := bufio.NewReader(c).ReadString('\n')
		if err != nil {
			c.Close()
			return nil, "", err
		}
		return c, strings.TrimSpace(line), nil
	}
	for _, port := range []int{30000, 30050, 30099} {
		c, seen, err := call(port)
		require.NoError(t, err, port)
		c.Close()
		assert.Equal(t, strconv.Itoa(port), seen)
	}
	for port, guestPort := range map[int]string{33000: "30050", 33049: "30099"} {
		c, seen, err := call(port)
		require.NoError(t, err, port)
		c.Close()
		assert.Equal(t, guestPort, seen, "a shifted range: each port to its own")
	}
	for _, port := range []int{29999, 30100} {
		_, _, err := call(port)
		assert.ErrorIs(t, err, syscall.ECONNREFUSED, "port %d beside the range is not translated (nothing listens on the host)", port)
	}
	eventually := func(what string, ok func() bool) {
		t.Helper()
		require.Eventually(t, ok, 5*time.Second, 20*time.Millisecond, what)
	}
	_, ok := store.Lookup("games")
	require.True(t, ok)
	eventually("the closed callers gave their places back", func() bool { c, _ := store.Lookup("games"); return c.Active == 0 })

	a, _, err := call(30000)
	require.NoError(t, err)
	defer a.Close()
	b, _, err := call(30099)
	require.NoError(t, err)
	defer b.Close()
	_, _, err = call(30050)
	assert.ErrorIs(t, err, syscall.ECONNREFUSED, "a third caller is past the range's one cap")
	c, _ := store.Lookup("games")
	assert.EqualValues(t, 2, c.Active)
	assert.EqualValues(t, 5, c.Accepted, "every port's callers count in the one slot")
	assert.EqualValues(t, 1, c.Refused)
}
