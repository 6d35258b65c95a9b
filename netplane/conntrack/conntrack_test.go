package conntrack

import (
	"github.com/ti-mo/netfilter"
	"net/netip"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/brokkr/brokkr/internal/nstest"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	ct "github.com/ti-mo/conntrack"
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

// insertHostSideFixture makes six entries for the host-side tests: UDP to
// 5353 on two host addresses, UDP to 53, TCP to 5353 from two callers, TCP
// to 8080 (source ports 40000-40005 in that order).
func insertHostSideFixture(t *testing.T, ns *nstest.NS) {
	t.Helper()
	insert(t, ns, "udp", "10.99.0.2", "10.99.0.1", "40000", "5353", "1")
	insert(t, ns, "udp", "10.99.0.3", "10.98.0.1", "40001", "5353", "1")
	insert(t, ns, "udp", "10.99.0.2", "10.99.0.1", "40002", "53", "1")
	insert(t, ns, "tcp", "10.99.0.2", "10.99.0.1", "40003", "5353", "1")
	insert(t, ns, "tcp", "10.99.0.2", "10.99.0.1", "40004", "8080", "1")
	insert(t, ns, "tcp", "10.99.0.3", "10.99.0.1", "40005", "5353", "1")
}

// owned is the mark bit the watcher tests filter on.
const owned = 1 << 29

// endUnownedThenOwned makes an entry marked 9 (not owned) and one marked
// owned|9, and deletes them in that order: a watcher that let the first
// through would see its event first.
func endUnownedThenOwned(t *testing.T, ns *nstest.NS) {
	t.Helper()
	insert(t, ns, "udp", "10.99.0.2", "10.99.0.1", "40000", "5353", "9")
	insert(t, ns, "udp", "10.99.0.2", "10.99.0.1", "40001", "5354", strconv.Itoa(owned|9))
	ns.MustRun(t, "conntrack", "-D", "-p", "udp", "--orig-port-dst", "5353")
	ns.MustRun(t, "conntrack", "-D", "-p", "udp", "--orig-port-dst", "5354")
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

// The watcher reports the end of entries whose mark matches, and the kernel
// keeps every other entry's events from the socket: the unmatched entry is
// deleted first, so its event, had it passed, would arrive first.
func TestWatchDestroyOfMarkedEntriesOnly(t *testing.T) {
	ns := nstest.New(t, "ct")
	w, err := Watch(ns.Path, owned, owned)
	require.NoError(t, err)
	defer w.Close()
	endUnownedThenOwned(t, ns)
	deadline := time.After(3 * time.Second)
	for {
		select {
		case e := <-w.C():
			require.Equal(t, uint32(owned|9), e.Mark, "only marked entries reach the watcher: %+v", e)
			if e.Destroyed {
				assert.Equal(t, uint16(5354), e.OrigDst.Port())
				return
			}
		case <-deadline:
			t.Fatal("no destroy event")
		}
	}
}

// Close ends a watcher blocked in its read at once.
func TestWatcherCloseEndsItsReader(t *testing.T) {
	ns := nstest.New(t, "ct")
	w, err := Watch(ns.Path, 1, 1)
	require.NoError(t, err)
	done := make(chan struct{})
	go func() { w.Close(); close(done) }()
	select {
	case <-done:
	case <-time.After(3 * time.Second):
		t.Fatal("Close did not return")
	}
}

// The kernel applies the host-side filter: a filtered dump returns only the
// entries to delete (the flag word is in host byte order; a wrong one makes
// the kernel refuse or return everything).
func TestFilteredDumpReturnsOnlyTheHostSide(t *testing.T) {
	ns := nstest.New(t, "ct")
	insertHostSideFixture(t, ns)
	c, err := Dial(ns.Path)
	require.NoError(t, err)
	defer c.Close()
	dumped := func(h HostSide) []uint16 {
		req, err := filteredDump(h, netfilter.ProtoIPv4)
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
	assert.ElementsMatch(t, []uint16{40003, 40005}, dumped(HostSide{Proto: unix.IPPROTO_TCP, Port: 5353}))
	assert.Empty(t, dumped(HostSide{Proto: unix.IPPROTO_TCP, Port: 53}))
}

// bothWays runs f with one filtered dump per host side (and family) and
// with one shared dump of every entry: the two correct ways DeleteHostSides
// picks between.
func bothWays(t *testing.T, f func(t *testing.T)) {
	for _, tc := range []struct {
		name    string
		perWalk int
	}{{"one filtered dump per side", 0}, {"one shared dump", 1 << 30}} {
		t.Run(tc.name, func(t *testing.T) {
			defer func(old int) { entriesPerWalk = old }(entriesPerWalk)
			entriesPerWalk = tc.perWalk
			f(t)
		})
	}
}

// Several host sides at once are deleted the same whether they share one
// full dump (a first converge) or get one filtered dump each.
func TestDeleteSeveralHostSidesBothWays(t *testing.T) {
	bothWays(t, func(t *testing.T) {
		ns := nstest.New(t, "ct")
		insertHostSideFixture(t, ns)
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

// IPv6 entries are deleted by their host side too, and a family's
// unspecified address names that family's entries only ("" both), with a
// filtered dump per side and family or with one shared dump of every
// family.
func TestDeleteHostSidesByFamily(t *testing.T) {
	bothWays(t, func(t *testing.T) {
		ns := nstest.New(t, "ct")
		insert6 := func(src, dst, sport string) {
			ns.MustRun(t, "conntrack", "-I", "-p", "udp", "-s", src, "-d", dst, "--sport", sport, "--dport", "5353",
				"-t", "120", "--mark", "1")
		}
		insert6("fd00:99::2", "fd00:99::1", "40010")
		insert6("fd00:99::3", "fd00:98::1", "40011")
		insert6("fd00:99::3", "fd00:98::1", "40012")
		insert(t, ns, "udp", "10.99.0.2", "10.99.0.1", "40000", "5353", "1")
		insert(t, ns, "udp", "10.99.0.3", "10.99.0.1", "40001", "5353", "1")
		require.Equal(t, 5, count(t, ns))
		c, err := Dial(ns.Path)
		require.NoError(t, err)
		defer c.Close()
		n, err := c.DeleteHostSides([]HostSide{{Proto: unix.IPPROTO_UDP, Addr: netip.MustParseAddr("fd00:98::1"), Port: 5353}})
		require.NoError(t, err)
		assert.Equal(t, []int{2}, n, "one IPv6 host address")
		n, err = c.DeleteHostSides([]HostSide{{Proto: unix.IPPROTO_UDP, Addr: netip.IPv4Unspecified(), Port: 5353}})
		require.NoError(t, err)
		assert.Equal(t, []int{2}, n, "0.0.0.0: IPv4 only")
		insert(t, ns, "udp", "10.99.0.2", "10.99.0.1", "40000", "5353", "1")
		n, err = c.DeleteHostSides([]HostSide{{Proto: unix.IPPROTO_UDP, Addr: netip.IPv6Unspecified(), Port: 5353}})
		require.NoError(t, err)
		assert.Equal(t, []int{1}, n, ":: IPv6 only")
		assert.Equal(t, 1, count(t, ns))
		insert6("fd00:99::2", "fd00:99::1", "40010")
		n, err = c.DeleteHostSides([]HostSide{{Proto: unix.IPPROTO_UDP, Port: 5353}})
		require.NoError(t, err)
		assert.Equal(t, []int{2}, n, "every address of both families")
		assert.Equal(t, 0, count(t, ns))
	})
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

// The socket filter itself drops the events of unmatched entries: read the
// filtered socket raw, without the watcher's own check.
func TestSocketFilterDropsUnmatchedEvents(t *testing.T) {
	ns := nstest.New(t, "ct")
	w := &Watcher{nsPath: ns.Path, mark: owned, mask: owned}
	c, err := w.listen()
	require.NoError(t, err)
	defer c.Close()
	endUnownedThenOwned(t, ns)
	require.NoError(t, c.SetReadDeadline(time.Now().Add(3*time.Second)))
	for {
		msgs, err := c.Receive()
		require.NoError(t, err, "no event for the marked entry")
		for _, m := range msgs {
			var ev ct.Event
			require.NoError(t, ev.Unmarshal(m))
			require.NotNil(t, ev.Flow)
			require.Equal(t, uint32(owned|9), ev.Flow.Mark, "an unmatched entry's event passed the filter")
			if ev.Type == ct.EventDestroy {
				return
			}
		}
	}
}

// A range's entries are deleted by the range: every port of it, none
// beside it, filtered or from one shared dump.
func TestDeleteAHostSideRange(t *testing.T) {
	for _, tc := range []struct {
		name    string
		perWalk int
	}{{"one filtered dump per side", 0}, {"one shared dump", 1 << 30}} {
		t.Run(tc.name, func(t *testing.T) {
			defer func(old int) { entriesPerWalk = old }(entriesPerWalk)
			entriesPerWalk = tc.perWalk
			ns := nstest.New(t, "ct")
			for i, port := range []string{"29999", "30000", "30050", "30099", "30100"} {
				insert(t, ns, "udp", "10.99.0.2", "10.99.0.1", strconv.Itoa(40000+i), port, "1")
			}
			insert(t, ns, "tcp", "10.99.0.2", "10.99.0.1", "40010", "30050", "1") // other protocol: kept
			insert(t, ns, "udp", "10.99.0.2", "10.99.0.1", "40011", "5353", "1")
			c, err := Dial(ns.Path)
			require.NoError(t, err)
			defer c.Close()
			n, err := c.DeleteHostSides([]HostSide{
				{Proto: unix.IPPROTO_UDP, Port: 5353},
				{Proto: unix.IPPROTO_UDP, Addr: netip.MustParseAddr("10.99.0.1"), Port: 30000, PortLast: 30099},
			})
			require.NoError(t, err)
			assert.Equal(t, []int{1, 3}, n)
			out, _ := ns.Run("conntrack", "-L")
			assert.Equal(t, 3, strings.Count(out, " mark="), out)
			for _, kept := range []string{"dport=29999", "dport=30100", "tcp"} {
				assert.Contains(t, out, kept)
			}
		})
	}
}
