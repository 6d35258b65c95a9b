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

// The kernel applies the host-side filter: a filtered dump returns only the
// entries to delete (the flag word is in host byte order; a wrong one makes
// the kernel refuse or return everything).
func TestFilteredDumpReturnsOnlyTheHostSide(t *testing.T) {
	ns := nstest.New(t, "ct")
	insert(t, ns, "udp", "10.99.0.2", "10.99.0.1", "40000", "5353", "1")
	insert(t, ns, "udp", "10.99.0.3", "10.98.0.1", "40001", "5353", "1")
	insert(t, ns, "udp", "10.99.0.2", "10.99.0.1", "40002", "53", "1")
	insert(t, ns, "tcp", "10.99.0.2", "10.99.0.1", "40003", "5353", "1")
	c, err := Dial(ns.Path)
	require.NoError(t, err)
	defer c.Close()
	dumped := func(h HostSide) []uint16 {
		req, err := filteredDump(h)
		require.NoError(t, err)
		msgs, err := c.nf.Query(req)
		require.NoError(t, err)
		var ports []uint16
		for _, m := range msgs {
			tp, ok := origTuple(m)
			require.True(t, ok)
			ports = append(ports, tp.src.Port())
		}
		return ports
	}
	assert.ElementsMatch(t, []uint16{40000, 40001}, dumped(HostSide{Proto: unix.IPPROTO_UDP, Port: 5353}))
	assert.ElementsMatch(t, []uint16{40001}, dumped(HostSide{Proto: unix.IPPROTO_UDP, Addr: netip.MustParseAddr("10.98.0.1"), Port: 5353}))
	assert.ElementsMatch(t, []uint16{40003}, dumped(HostSide{Proto: unix.IPPROTO_TCP, Port: 5353}))
	assert.Empty(t, dumped(HostSide{Proto: unix.IPPROTO_TCP, Port: 53}))
}

// Several host sides at once are deleted the same whether they share one
// full dump (a first converge) or get one filtered dump each.
func TestDeleteSeveralHostSidesBothWays(t *testing.T) {
	for _, tc := range []struct {
		name    string
		perWalk int
	}{{"one filtered dump per side", 0}, {"one shared dump", 1 << 30}} {
		t.Run(tc.name, func(t *testing.T) {
			defer func(old int) { entriesPerWalk = old }(entriesPerWalk)
			entriesPerWalk = tc.perWalk
			ns := nstest.New(t, "ct")
			insert(t, ns, "udp", "10.99.0.2", "10.99.0.1", "40000", "5353", "1")
			insert(t, ns, "udp", "10.99.0.3", "10.98.0.1", "40001", "5353", "1")
			insert(t, ns, "udp", "10.99.0.2", "10.99.0.1", "40002", "53", "1")
			insert(t, ns, "tcp", "10.99.0.2", "10.99.0.1", "40003", "5353", "1")
			insert(t, ns, "tcp", "10.99.0.2", "10.99.0.1", "40004", "8080", "1")
			insert(t, ns, "tcp", "10.99.0.3", "10.99.0.1", "40005", "5353", "1")
			c, err := Dial(ns.Path)
			require.NoError(t, err)
			defer c.Close()
			n, err := c.DeleteHostSides([]HostSide{
				{Proto: unix.IPPROTO_UDP, Addr: netip.MustParseAddr("10.98.0.1"), Port: 5353},
				{Proto: unix.IPPROTO_TCP, Port: 5353},
				{Proto: unix.IPPROTO_TCP, Addr: netip.MustParseAddr("10.97.0.1"), Port: 8080}, // other address: kept
				{Proto: unix.IPPROTO_UDP, Port: 9},
			})
			require.NoError(t, err)
			assert.Equal(t, []int{1, 2, 0, 0}, n)
			assert.Equal(t, 3, count(t, ns))
		})
	}
}

func TestFilteredWhenAWalkPerSideCostsLessThanEveryEntry(t *testing.T) {
	assert.True(t, filtered(1, 1), "one side: always filtered")
	assert.False(t, filtered(10_000, 20_000), "a first converge of 10,000 on a quiet host: one dump")
	assert.True(t, filtered(3, 100_000), "a few sides on a busy host: filtered")
}

// With no entries in the namespace nothing is dumped and nothing fails.
func TestDeleteHostSidesWithNoEntries(t *testing.T) {
	ns := nstest.New(t, "ct")
	c, err := Dial(ns.Path)
	require.NoError(t, err)
	defer c.Close()
	n, err := c.DeleteHostSides([]HostSide{{Proto: unix.IPPROTO_TCP, Port: 80}})
	require.NoError(t, err)
	assert.Equal(t, []int{0}, n)
}
