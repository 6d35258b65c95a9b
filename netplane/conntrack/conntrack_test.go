package conntrack

import (
	"net/netip"
	"strings"
	"testing"
	"time"

	"github.com/brokkr/brokkr/internal/nstest"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	"go.uber.org/goleak"
	"golang.org/x/sys/unix"
)

func TestMain(m *testing.M) { goleak.VerifyTestMain(m) }

// insert makes a conntrack entry in ns with the conntrack CLI.
func insert(t *testing.T, ns *nstest.NS, proto, src, dst string, sport, dport, mark string) {
	t.Helper()
	args := []string{"-I", "-p", proto, "-s", src, "-d", dst, "--sport", sport, "--dport", dport,
		"-t", "120", "--mark", mark}
	if proto == "tcp" {
		args = append(args, "--state", "ESTABLISHED")
	}
	ns.MustRun(t, "conntrack", args...)
}

func count(t *testing.T, ns *nstest.NS) int {
	t.Helper()
	out, _ := ns.Run("conntrack", "-L")
	return strings.Count(out, " mark=")
}

// Entries are deleted by the host side (protocol, host address, host port
// = the original destination); other entries stay.
func TestDeleteHostSides(t *testing.T) {
	ns := nstest.New(t, "ct")
	insert(t, ns, "udp", "10.99.0.2", "10.99.0.1", "40000", "5353", "1")
	insert(t, ns, "udp", "10.99.0.3", "10.98.0.1", "40000", "5353", "1")
	insert(t, ns, "udp", "10.99.0.2", "10.99.0.1", "40000", "53", "1")   // the guest port: kept
	insert(t, ns, "tcp", "10.99.0.2", "10.99.0.1", "40000", "5353", "1") // other protocol: kept
	require.Equal(t, 4, count(t, ns))
	c, err := Dial(ns.Path)
	require.NoError(t, err)
	defer c.Close()

	n, err := c.DeleteHostSides([]HostSide{{Proto: unix.IPPROTO_UDP, Addr: netip.MustParseAddr("10.98.0.1"), Port: 5353}})
	require.NoError(t, err)
	assert.Equal(t, []int{1}, n, "only the bound address")
	n, err = c.DeleteHostSides([]HostSide{{Proto: unix.IPPROTO_UDP, Port: 5353}})
	require.NoError(t, err)
	assert.Equal(t, []int{1}, n, "any address")
	assert.Equal(t, 2, count(t, ns))
}

func TestGetAndByMark(t *testing.T) {
	ns := nstest.New(t, "ct")
	insert(t, ns, "tcp", "10.99.0.2", "10.99.0.1", "40000", "8080", "5")
	insert(t, ns, "tcp", "10.99.0.2", "10.99.0.1", "40001", "8080", "7")
	c, err := Dial(ns.Path)
	require.NoError(t, err)
	defer c.Close()
	e, ok, err := c.Get(unix.IPPROTO_TCP, netip.MustParseAddrPort("10.99.0.2:40000"), netip.MustParseAddrPort("10.99.0.1:8080"))
	require.NoError(t, err)
	require.True(t, ok)
	assert.Equal(t, uint32(5), e.Mark)
	_, ok, err = c.Get(unix.IPPROTO_TCP, netip.MustParseAddrPort("10.99.0.2:49999"), netip.MustParseAddrPort("10.99.0.1:8080"))
	require.NoError(t, err)
	assert.False(t, ok)
	es, err := c.ByMark(7, 0xff)
	require.NoError(t, err)
	require.Len(t, es, 1)
	assert.Equal(t, uint16(40001), es[0].Orig.Port())
}

// The watcher reports an entry's end.
func TestWatchDestroy(t *testing.T) {
	ns := nstest.New(t, "ct")
	w, err := Watch(ns.Path)
	require.NoError(t, err)
	defer w.Close()
	insert(t, ns, "udp", "10.99.0.2", "10.99.0.1", "40000", "5353", "9")
	ns.MustRun(t, "conntrack", "-D", "-p", "udp", "--orig-port-dst", "5353")
	deadline := time.After(3 * time.Second)
	for {
		select {
		case e := <-w.C():
			if e.Destroyed && e.Mark == 9 {
				assert.Equal(t, uint16(5353), e.OrigDst.Port())
				return
			}
		case <-deadline:
			t.Fatal("no destroy event")
		}
	}
}
