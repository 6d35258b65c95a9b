package proxy

import (
	"errors"
	"fmt"
	"github.com/brokkr/brokkr/bpf"
	"github.com/brokkr/brokkr/internal/spec"
	"io"
	"net"
	"net/netip"
	"os"
	"runtime"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	"go.uber.org/goleak"
	"golang.org/x/sys/unix"
)

func TestMain(m *testing.M) {
	// The descriptor-shortage and splice tests re-run this binary as a child
	// that plays one part; see child_test.go.
	if role := os.Getenv(childEnv); role != "" {
		os.Exit(runChild(role))
	}
	goleak.VerifyTestMain(m)
}

// guests is the test's resolver: VM name to address, changeable mid-test.
type guests struct {
	mu    sync.Mutex
	addrs map[string]string
}

func (g *guests) set(vm, addr string) {
	g.mu.Lock()
	defer g.mu.Unlock()
	g.addrs[vm] = addr
}

func (g *guests) resolve(vm string) string {
	g.mu.Lock()
	defer g.mu.Unlock()
	return g.addrs[vm]
}

// newManager returns a Manager whose guest "vm1" lives on loopback, stopped
// when the test ends.
func newManager(t *testing.T) (*Manager, *guests) {
	t.Helper()
	g := &guests{addrs: map[string]string{"vm1": "127.0.0.1"}}
	m := NewManager(g.resolve, nil)
	t.Cleanup(m.StopAll)
	return m, g
}

// echoServer is a stand-in for a service in a guest: it sends back what it
// reads, prefixed by tag, until the caller closes its write side.
func echoServer(t *testing.T, tag string) int {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	require.NoError(t, err)
	var wg sync.WaitGroup
	t.Cleanup(func() { ln.Close(); wg.Wait() })
	wg.Add(1)
	go func() {
		defer wg.Done()
		for {
			c, err := ln.Accept()
			if err != nil {
				return
			}
			wg.Add(1)
			go func() {
				defer wg.Done()
				defer c.Close()
				buf := make([]byte, 4096)
				for {
					n, err := c.Read(buf)
					if n > 0 {
						if _, werr := c.Write(append([]byte(tag), buf[:n]...)); werr != nil {
							return
						}
					}
					if err != nil {
						return
					}
				}
			}()
		}
	}()
	return ln.Addr().(*net.TCPAddr).Port
}

func tcpSpec(id string, guestPort int) Spec {
	return Spec{Exposure: spec.Exposure{Name: id, Target: spec.Target{VM: "vm1"}, Proto: "tcp", GuestPort: uint16(guestPort)}, Listen: netip.MustParseAddr("127.0.0.1")}
}

// only converges and returns the single status, asserting there is one.
func only(t *testing.T, m *Manager, specs ...Spec) Status {
	t.Helper()
	st := m.Converge(specs)
	require.Len(t, st, len(specs))
	return st[0]
}

// dial opens a connection to addr that fails the test instead of hanging.
func dial(t *testing.T, addr string) *net.TCPConn {
	t.Helper()
	c, err := net.Dial("tcp", addr)
	require.NoError(t, err)
	t.Cleanup(func() { c.Close() })
	require.NoError(t, c.SetDeadline(time.Now().Add(5*time.Second)))
	return c.(*net.TCPConn)
}

// roundTrip writes msg and reads back exactly the reply an echoServer with
// tag sends.
func roundTrip(t *testing.T, c net.Conn, tag, msg string) string {
	t.Helper()
	_, err := c.Write([]byte(msg))
	require.NoError(t, err)
	buf := make([]byte, len(tag)+len(msg))
	_, err = io.ReadFull(c, buf)
	require.NoError(t, err)
	return string(buf)
}

// requireReset dials addr and asserts that the proxy turned the caller away
// with a RST: the connect or the first read fails with ECONNRESET, instead of
// returning data or a clean EOF. (On loopback the RST can beat the dialer's
// check of its own connect.)
func requireReset(t *testing.T, addr string) {
	t.Helper()
	c, err := net.Dial("tcp", addr)
	if err == nil {
		defer c.Close()
		require.NoError(t, c.SetDeadline(time.Now().Add(5*time.Second)))
		var n int
		n, err = c.Read(make([]byte, 16))
		assert.Zero(t, n)
	}
	require.Error(t, err)
	assert.True(t, errors.Is(err, syscall.ECONNRESET), "want a reset, got %v", err)
}

// eventually polls cond every 10 ms for up to 5 s.
func eventually(t *testing.T, what string, cond func() bool) {
	t.Helper()
	deadline := time.Now().Add(5 * time.Second)
	for !cond() {
		if time.Now().After(deadline) {
			t.Fatalf("timed out waiting: %s", what)
		}
		time.Sleep(10 * time.Millisecond)
	}
}

// liveOf is the running listener of exposure id (m.mu held); the tests
// that use it give each exposure one host address.
func liveOf(m *Manager, id string) *exposure {
	for k, ex := range m.live {
		if k.id == id {
			return ex
		}
	}
	return nil
}

// listenerOf reads an exposure's current listener under the lock the accept
// loop writes it under.
func listenerOf(m *Manager, id string) net.Listener {
	m.mu.Lock()
	defer m.mu.Unlock()
	if ex := liveOf(m, id); ex != nil {
		return ex.ln
	}
	return nil
}

func conns(m *Manager, id string) int64 {
	m.mu.Lock()
	defer m.mu.Unlock()
	if ex := liveOf(m, id); ex != nil {
		return ex.conns.Load()
	}
	return -1
}

func TestConvergePublishesThePortAndCarriesBothWays(t *testing.T) {
	m, _ := newManager(t)
	port := echoServer(t, "g:")
	st := only(t, m, tcpSpec("web", port))
	assert.Equal(t, "web", st.ID)
	assert.Equal(t, StateActive, st.State)
	assert.Empty(t, st.Reason)
	require.NotEmpty(t, st.BoundAddr)

	c := dial(t, st.BoundAddr)
	assert.Equal(t, "g:hello", roundTrip(t, c, "g:", "hello"))
	require.NoError(t, c.Close())

	eventually(t, "the connection's bytes are counted", func() bool {
		cs := only(t, m, tcpSpec("web", port)).Counters
		return cs.Active == 0 && cs.BytesIn == 5 && cs.BytesOut == 7
	})
	assert.EqualValues(t, 1, only(t, m, tcpSpec("web", port)).Counters.Accepted)
}

func TestConvergingTheSameSpecAgainKeepsItsListenerAndConnections(t *testing.T) {
	m, _ := newManager(t)
	port := echoServer(t, "g:")
	first := only(t, m, tcpSpec("web", port))
	ln := listenerOf(m, "web")
	c := dial(t, first.BoundAddr)
	assert.Equal(t, "g:a", roundTrip(t, c, "g:", "a"))

	again := only(t, m, tcpSpec("web", port))
	assert.Equal(t, first.BoundAddr, again.BoundAddr)
	assert.True(t, ln == listenerOf(m, "web"), "an unchanged spec keeps its very listener")
	assert.Equal(t, "g:b", roundTrip(t, c, "g:", "b"), "and its connections")
}

func TestAnExposureLeftOutOfDesiredStopsListening(t *testing.T) {
	m, _ := newManager(t)
	st := only(t, m, tcpSpec("web", echoServer(t, "g:")))
	assert.Empty(t, m.Converge(nil))
	_, err := net.Dial("tcp", st.BoundAddr)
	assert.ErrorIs(t, err, syscall.ECONNREFUSED)
}

func TestAChangedSpecClosesAndRebinds(t *testing.T) {
	m, _ := newManager(t)
	one, two := echoServer(t, "one:"), echoServer(t, "two:")
	before := only(t, m, tcpSpec("web", one))
	oldLn := listenerOf(m, "web")

	after := only(t, m, tcpSpec("web", two))
	assert.Equal(t, StateActive, after.State)
	assert.True(t, oldLn != listenerOf(m, "web"), "a changed guest port is a new listener")
	if before.BoundAddr != after.BoundAddr { // port 0: the old one is free now
		_, err := net.Dial("tcp", before.BoundAddr)
		assert.Error(t, err, "the old listener is closed")
	}
	assert.Equal(t, "two:x", roundTrip(t, dial(t, after.BoundAddr), "two:", "x"))
}

func TestABindFailureCarriesTheOSErrorAndHealsWhenThePortFrees(t *testing.T) {
	m, _ := newManager(t)
	guest := echoServer(t, "g:")
	squat, err := net.Listen("tcp", "127.0.0.1:0")
	require.NoError(t, err)
	port := squat.Addr().(*net.TCPAddr).Port
	spec := tcpSpec("web", guest)
	spec.HostPort = uint16(port)

	st := only(t, m, spec)
	assert.Equal(t, StateFailed, st.State)
	assert.Contains(t, st.Reason, "address already in use")
	assert.Empty(t, st.BoundAddr)

	require.NoError(t, squat.Close())
	st = only(t, m, spec)
	require.Equal(t, StateActive, st.State, st.Reason)
	assert.Empty(t, st.Reason)
	addr := net.JoinHostPort("127.0.0.1", strconv.Itoa(port))
	assert.Equal(t, addr, st.BoundAddr)
	assert.Equal(t, "g:back", roundTrip(t, dial(t, addr), "g:", "back"))
}

// With WithHolders a port in use names who holds it (brokkrd asks
// netplane/hold, which reads /proc); another bind error asks nothing.
func TestABindFailureNamesThePortsHolder(t *testing.T) {
	var asked []string
	m := NewManager((&guests{addrs: map[string]string{"vm1": "127.0.0.1"}}).resolve, nil,
		WithHolders(func(proto string, a netip.AddrPort) string {
			asked = append(asked, proto+" "+a.String())
			return "pid 812 (nginx)"
		}))
	t.Cleanup(m.StopAll)
	squat, err := net.Listen("tcp", "127.0.0.1:0")
	require.NoError(t, err)
	defer squat.Close()
	spec := tcpSpec("web", echoServer(t, "g:"))
	spec.HostPort = uint16(squat.Addr().(*net.TCPAddr).Port)
	st := only(t, m, spec)
	assert.Equal(t, StateFailed, st.State)
	assert.Contains(t, st.Reason, "address already in use: held by pid 812 (nginx)")
	assert.Equal(t, []string{"tcp " + squat.Addr().String()}, asked)

	asked = nil
	spec.Listen = netip.MustParseAddr("192.0.2.77") // not this host's: EADDRNOTAVAIL
	st = only(t, m, spec)
	assert.Equal(t, StateFailed, st.State)
	assert.NotContains(t, st.Reason, "held by")
	assert.Empty(t, asked)
}

func TestAListenerWhoseAcceptLoopDiedIsRebound(t *testing.T) {
	m, _ := newManager(t)
	port := echoServer(t, "g:")
	only(t, m, tcpSpec("web", port))

	// Close the socket behind the manager's back: the loop was not asked to
	// stop, so it must hand the exposure back as unbound and say why.
	broken := listenerOf(m, "web")
	require.IsType(t, &rawListener{}, broken, "a TCP listener is accepted from on raw descriptors")
	require.NoError(t, broken.Close())
	var reason string
	eventually(t, "the dead loop gives its listener back", func() bool {
		m.mu.Lock()
		defer m.mu.Unlock()
		ex := liveOf(m, "web")
		reason = ex.reason
		return ex.ln == nil
	})
	assert.Contains(t, reason, "accept:")

	st := only(t, m, tcpSpec("web", port))
	require.Equal(t, StateActive, st.State)
	assert.Contains(t, st.Reason, "rebound after accept:", "the converge that healed it says what it healed")
	assert.True(t, listenerOf(m, "web") != broken)
	assert.Equal(t, "g:again", roundTrip(t, dial(t, st.BoundAddr), "g:", "again"))
	assert.Empty(t, only(t, m, tcpSpec("web", port)).Reason, "and the next one is clean")
}

func TestACallerIsResetAtOnceWhenTheGuestHasNoAddress(t *testing.T) {
	m, g := newManager(t)
	g.set("vm1", "") // still leasing
	spec := tcpSpec("web", 8080)
	st := only(t, m, spec)
	assert.Equal(t, StatePending, st.State)
	assert.Contains(t, st.Reason, "no address")
	require.NotEmpty(t, st.BoundAddr, "the port is published while the guest leases")

	start := time.Now()
	requireReset(t, st.BoundAddr)
	assert.Less(t, time.Since(start), time.Second, "closed at once, not after a timeout")
	eventually(t, "counted as dropped", func() bool { return only(t, m, spec).Counters.Dropped == 1 })
	cs := only(t, m, spec).Counters
	assert.Zero(t, cs.Accepted, "a caller that was never carried is not accepted")
	assert.Zero(t, cs.Refused, "the cap refused nobody: the guest was missing")

	g.set("vm1", "127.0.0.1")
	assert.Equal(t, StateActive, only(t, m, spec).State, "an address turns it active")
}

func TestACallerIsResetWhenTheGuestRefusesTheDial(t *testing.T) {
	m, _ := newManager(t)
	closed, err := net.Listen("tcp", "127.0.0.1:0")
	require.NoError(t, err)
	port := closed.Addr().(*net.TCPAddr).Port
	require.NoError(t, closed.Close()) // nothing listens on the guest port
	spec := tcpSpec("web", port)
	st := only(t, m, spec)
	requireReset(t, st.BoundAddr)
	eventually(t, "counted as dropped", func() bool { return only(t, m, spec).Counters.Dropped == 1 })
	assert.Zero(t, only(t, m, spec).Counters.Accepted, "success is declared only after the guest answered")
}

func TestHalfCloseIsCarriedToTheGuestAndTheReplyStillComesBack(t *testing.T) {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	require.NoError(t, err)
	done := make(chan struct{})
	t.Cleanup(func() { ln.Close(); <-done })
	go func() {
		defer close(done)
		c, err := ln.Accept()
		if err != nil {
			return
		}
		defer c.Close()
		body, _ := io.ReadAll(c) // ends only when the caller's FIN arrives
		c.Write(append([]byte("got:"), body...))
	}()
	m, _ := newManager(t)
	st := only(t, m, tcpSpec("web", ln.Addr().(*net.TCPAddr).Port))
	c := dial(t, st.BoundAddr)
	_, err = c.Write([]byte("request"))
	require.NoError(t, err)
	require.NoError(t, c.CloseWrite())
	out, err := io.ReadAll(c)
	require.NoError(t, err)
	assert.Equal(t, "got:request", string(out))
}

func TestRevokingAnExposureDrainsItsConnections(t *testing.T) {
	m, _ := newManager(t)
	st := only(t, m, tcpSpec("web", echoServer(t, "g:")))
	c := dial(t, st.BoundAddr)
	require.Equal(t, "g:before", roundTrip(t, c, "g:", "before"))

	require.Empty(t, m.Converge(nil))
	_, err := net.Dial("tcp", st.BoundAddr)
	require.Error(t, err, "new dials die")
	assert.Equal(t, "g:after", roundTrip(t, c, "g:", "after"), "the established pipe keeps flowing")
}

// hold opens a connection through the proxy and proves it reached the guest,
// which is also when the exposure has certainly counted it.
func hold(t *testing.T, addr string) *net.TCPConn {
	t.Helper()
	c := dial(t, addr)
	require.Equal(t, "g:ping", roundTrip(t, c, "g:", "ping"))
	return c
}

func TestTheCapResetsCallersPastItAndLeavesTheOthersAlone(t *testing.T) {
	m, _ := newManager(t)
	spec := tcpSpec("web", echoServer(t, "g:"))
	spec.MaxConns = 2
	st := only(t, m, spec)
	a, b := hold(t, st.BoundAddr), hold(t, st.BoundAddr)

	requireReset(t, st.BoundAddr)
	assert.Equal(t, "g:still", roundTrip(t, a, "g:", "still"))
	assert.Equal(t, "g:here", roundTrip(t, b, "g:", "here"))
	cs := only(t, m, spec).Counters
	assert.EqualValues(t, 1, cs.Refused)
	assert.EqualValues(t, 2, cs.Active)
	assert.EqualValues(t, 2, cs.Accepted)
	assert.Zero(t, cs.Dropped)
}

// The place an ended connection held is given back, exactly once: before
// it ends a second caller is refused, after it a new one is carried, and the
// cap still holds behind that one.
func TestTheCapIsReleasedWhenAConnectionEnds(t *testing.T) {
	m, _ := newManager(t)
	spec := tcpSpec("web", echoServer(t, "g:"))
	spec.MaxConns = 1
	st := only(t, m, spec)
	first := hold(t, st.BoundAddr)
	requireReset(t, st.BoundAddr)
	require.NoError(t, first.Close())
	eventually(t, "the ended connection gives its place back", func() bool { return conns(m, "web") == 0 })
	hold(t, st.BoundAddr)
	requireReset(t, st.BoundAddr)
	assert.EqualValues(t, 2, only(t, m, spec).Counters.Refused)
}

func TestConnectionsDrainingThroughARebindStillCountTowardTheCap(t *testing.T) {
	m, _ := newManager(t)
	one, two := echoServer(t, "g:"), echoServer(t, "g:")
	spec := tcpSpec("web", one)
	spec.MaxConns = 1
	held := hold(t, only(t, m, spec).BoundAddr)

	spec.GuestPort = uint16(two)
	st := only(t, m, spec) // rebinds
	assert.EqualValues(t, 1, conns(m, "web"))
	requireReset(t, st.BoundAddr)
	assert.Equal(t, "g:drain", roundTrip(t, held, "g:", "drain"), "the old connection is still carried")

	require.NoError(t, held.Close())
	eventually(t, "the drained connection gives its place back", func() bool { return conns(m, "web") == 0 })
	hold(t, st.BoundAddr)
}

func TestAChangedCapAppliesWithoutARebind(t *testing.T) {
	m, _ := newManager(t)
	spec := tcpSpec("web", echoServer(t, "g:"))
	spec.MaxConns = 1
	st := only(t, m, spec)
	ln := listenerOf(m, "web")
	hold(t, st.BoundAddr)
	requireReset(t, st.BoundAddr)

	spec.MaxConns = 2
	only(t, m, spec)
	assert.True(t, ln == listenerOf(m, "web"))
	hold(t, st.BoundAddr)
}

// MaxConns 0 refuses nobody, also past the daemon's default of 256. The
// callers and the guest service live in a child process, so this process
// spends two descriptors per connection (accepted, guest dial) and the test
// fits a default `ulimit -n 1024`.
func TestMaxConnsZeroIsUnlimited(t *testing.T) {
	const n = 300
	ensureNoFile(t, 2*n+256)
	lines, stdin := child(t, "callers")
	port, err := strconv.Atoi(expectLine(t, lines, "echo "))
	require.NoError(t, err)
	m, _ := newManager(t)
	spec := tcpSpec("web", port)
	st := only(t, m, spec)
	_, err = fmt.Fprintf(stdin, "hold %s %d\n", st.BoundAddr, n)
	require.NoError(t, err)
	assert.Equal(t, strconv.Itoa(n), expectLine(t, lines, "held "))
	cs := only(t, m, spec).Counters
	assert.Zero(t, cs.Refused)
	assert.EqualValues(t, n, cs.Active)
}

// ensureNoFile raises RLIMIT_NOFILE to at least want for the rest of the
// test (root may raise the hard limit too), restoring it afterwards; it
// skips the test when the limit cannot be raised.
func ensureNoFile(t *testing.T, want uint64) {
	t.Helper()
	var old syscall.Rlimit
	require.NoError(t, syscall.Getrlimit(syscall.RLIMIT_NOFILE, &old))
	if old.Cur >= want {
		return
	}
	raised := syscall.Rlimit{Cur: want, Max: max(old.Max, want)}
	if err := syscall.Setrlimit(syscall.RLIMIT_NOFILE, &raised); err != nil {
		t.Skipf("needs %d descriptors, RLIMIT_NOFILE is %d/%d and cannot be raised: %v", want, old.Cur, old.Max, err)
	}
	// Registered before the connections' own cleanups, so it runs after them.
	t.Cleanup(func() { _ = syscall.Setrlimit(syscall.RLIMIT_NOFILE, &old) })
}

func TestActiveIsAGaugeWhileRefusedAndDroppedAreTotals(t *testing.T) {
	m, g := newManager(t)
	spec := tcpSpec("web", echoServer(t, "g:"))
	spec.MaxConns = 1
	st := only(t, m, spec)
	held := hold(t, st.BoundAddr)
	requireReset(t, st.BoundAddr)
	cs := only(t, m, spec).Counters
	assert.EqualValues(t, 1, cs.Active)
	assert.EqualValues(t, 1, cs.Refused)

	require.NoError(t, held.Close())
	eventually(t, "active comes back down", func() bool { return only(t, m, spec).Counters.Active == 0 })
	g.set("vm1", "")
	requireReset(t, st.BoundAddr)
	eventually(t, "a drop is counted", func() bool { return only(t, m, spec).Counters.Dropped == 1 })
	cs = only(t, m, spec).Counters
	assert.EqualValues(t, 1, cs.Refused, "a refusal, once counted, stays counted")
	assert.EqualValues(t, 1, cs.Accepted)
	assert.Zero(t, cs.Active)
}

func TestAFailedExposureStillReportsItsCounters(t *testing.T) {
	m, _ := newManager(t)
	spec := tcpSpec("web", echoServer(t, "g:"))
	require.NoError(t, hold(t, only(t, m, spec).BoundAddr).Close())
	eventually(t, "the connection ends", func() bool { return conns(m, "web") == 0 })

	squat, err := net.Listen("tcp", "127.0.0.1:0")
	require.NoError(t, err)
	defer squat.Close()
	spec.HostPort = uint16(squat.Addr().(*net.TCPAddr).Port)
	st := only(t, m, spec)
	require.Equal(t, StateFailed, st.State)
	assert.EqualValues(t, 1, st.Counters.Accepted, "what it carried before the failure is still reported")
	assert.EqualValues(t, len("ping"), st.Counters.BytesIn)
	assert.EqualValues(t, len("g:ping"), st.Counters.BytesOut)
}

func TestStopAllClosesEveryListenerAndKeepsTheCounters(t *testing.T) {
	m, _ := newManager(t)
	port := echoServer(t, "g:")
	udp := Spec{Exposure: spec.Exposure{Name: "dns", Target: spec.Target{VM: "vm1"}, Proto: "udp", GuestPort: 53}, Listen: netip.MustParseAddr("127.0.0.1")}
	st := m.Converge([]Spec{tcpSpec("a", port), tcpSpec("b", port), udp})
	for _, s := range st {
		require.Equal(t, StateActive, s.State, s.Reason)
	}
	require.NoError(t, hold(t, st[0].BoundAddr).Close())
	held := hold(t, st[1].BoundAddr)

	m.StopAll()
	n, err := held.Read(make([]byte, 1))
	assert.Zero(t, n)
	assert.Error(t, err, "a stopping daemon ends the connections it carried")
	for _, s := range st[:2] {
		_, err := net.Dial("tcp", s.BoundAddr)
		assert.ErrorIs(t, err, syscall.ECONNREFUSED, "%s survived StopAll", s.ID)
	}
	// The UDP port is free again: binding it proves its socket is closed.
	var pc net.PacketConn
	pc, err = net.ListenPacket("udp4", st[2].BoundAddr)
	require.NoError(t, err)
	pc.Close()
	cs, ok := m.stats.Lookup("a")
	require.True(t, ok, "a stopping daemon keeps its counters")
	assert.EqualValues(t, 1, cs.Accepted)
}

func TestADeletedExposureFreesItsCounterSlotOnceItsConnectionsEnd(t *testing.T) {
	m, _ := newManager(t)
	st := only(t, m, tcpSpec("web", echoServer(t, "g:")))
	c := hold(t, st.BoundAddr)
	m.Converge(nil)
	_, ok := m.stats.Lookup("web")
	assert.True(t, ok, "a draining connection still counts into the slot")
	require.NoError(t, c.Close())
	eventually(t, "the slot is freed", func() bool { _, ok := m.stats.Lookup("web"); return !ok })
}

func TestWithoutAStoreCountersStayInMemoryAndTheManagerSaysSo(t *testing.T) {
	m, _ := newManager(t)
	assert.Contains(t, m.stats.Reason(), "in memory")
	assert.False(t, m.stats.Pinned())
}

func TestIPv6HostAddress(t *testing.T) {
	probe, err := net.Listen("tcp6", "[::1]:0")
	if err != nil {
		t.Skipf("no IPv6 loopback here: %v", err)
	}
	probe.Close()
	m, _ := newManager(t)
	spec := tcpSpec("web6", echoServer(t, "g:"))
	spec.Listen = netip.MustParseAddr("::1")
	st := only(t, m, spec)
	require.Equal(t, StateActive, st.State, st.Reason)
	assert.Equal(t, "g:six", roundTrip(t, dial(t, st.BoundAddr), "g:", "six"))
}

// The proxy sets keepalive once, on the listener, and relies on accepted
// sockets inheriting it; this checks that they do.
func TestAcceptedCallersInheritKeepaliveFromTheListener(t *testing.T) {
	ln, err := listenTCP(fill(tcpSpec("web", 80)))
	require.NoError(t, err)
	defer ln.Close()
	caller := dial(t, ln.Addr().String())
	defer caller.Close()
	accepted, err := ln.Accept()
	require.NoError(t, err)
	defer accepted.Close()
	rc, err := accepted.(*net.TCPConn).SyscallConn()
	require.NoError(t, err)
	var on, idle, cnt int
	require.NoError(t, rc.Control(func(fd uintptr) {
		on, _ = unix.GetsockoptInt(int(fd), unix.SOL_SOCKET, unix.SO_KEEPALIVE)
		idle, _ = unix.GetsockoptInt(int(fd), unix.IPPROTO_TCP, unix.TCP_KEEPIDLE)
		cnt, _ = unix.GetsockoptInt(int(fd), unix.IPPROTO_TCP, unix.TCP_KEEPCNT)
	}))
	assert.Equal(t, 1, on)
	assert.Equal(t, int(keepIdle/time.Second), idle)
	assert.Equal(t, keepCount, cnt)
}

// Both ends of a carried connection send small writes at once (TCP_NODELAY:
// set on the caller's socket at accept, the guest's is dialled with it),
// and the guest's end has keepalive with the proxy's idle time, so a guest
// that vanished gives its place under the cap back.
func TestCarriedSocketsHaveNoDelayAndTheGuestKeepalive(t *testing.T) {
	m, _ := newManager(t)
	st := only(t, m, tcpSpec("web", echoServer(t, "g:")))
	c := dial(t, st.BoundAddr)
	defer c.Close()
	assert.Equal(t, "g:hi", roundTrip(t, c, "g:", "hi"))
	var p *pair
	m.carriedMu.Lock()
	for q := range m.pairs {
		p = q
	}
	m.carriedMu.Unlock()
	require.NotNil(t, p, "the carried pair")
	opt := func(s sock, level, name int) (v int) {
		require.NoError(t, control(s, func(fd int) (err error) { v, err = unix.GetsockoptInt(fd, level, name); return err }))
		return v
	}
	assert.NotZero(t, opt(p.client, unix.IPPROTO_TCP, unix.TCP_NODELAY), "caller's socket without TCP_NODELAY")
	assert.NotZero(t, opt(p.guest, unix.IPPROTO_TCP, unix.TCP_NODELAY), "guest's socket without TCP_NODELAY")
	assert.Equal(t, 1, opt(p.guest, unix.SOL_SOCKET, unix.SO_KEEPALIVE))
	assert.Equal(t, int(keepIdle/time.Second), opt(p.guest, unix.IPPROTO_TCP, unix.TCP_KEEPIDLE))
	assert.Equal(t, 1, opt(p.client, unix.SOL_SOCKET, unix.SO_KEEPALIVE))
}

// openFDs counts this process's descriptors, after a few GCs so that
// anything the runtime frees by finalizer is gone.
func openFDs(t *testing.T) int {
	t.Helper()
	for i := 0; i < 3; i++ {
		runtime.GC()
		time.Sleep(10 * time.Millisecond)
	}
	ents, err := os.ReadDir("/proc/self/fd")
	require.NoError(t, err)
	return len(ents)
}

// An idle carried connection costs the proxy its two sockets and nothing
// more: no splice pipe is held while a direction waits for data.
func TestAnIdleConnectionHoldsOnlyItsTwoSockets(t *testing.T) {
	m, _ := newManager(t)
	st := only(t, m, tcpSpec("web", echoServer(t, "g:")))
	hold(t, st.BoundAddr) // warm up: the listener, the guest, the pipe pool
	before := openFDs(t)
	const n = 20
	for i := 0; i < n; i++ {
		hold(t, st.BoundAddr)
	}
	// In this process each connection is four sockets: the caller's, the
	// proxy's two, and the guest's.
	grown := openFDs(t) - before
	if grown > 4*n+6 {
		t.Logf("descriptors by kind: %v", fdKinds())
	}
	assert.GreaterOrEqual(t, grown, 4*n)
	assert.LessOrEqual(t, grown, 4*n+6, "idle connections hold splice pipes")
}

// A TCP listener costs the proxy one descriptor, as the descriptor budget
// counts it (daemon/config.DescriptorBudget: one per listener of a port
// range): the raw accept path waits on the listener's own descriptor, not
// on a duplicate beside it.
func TestAListenerHoldsOneDescriptor(t *testing.T) {
	m, _ := newManager(t)
	only(t, m, tcpSpec("warm", 9)) // the poller's own descriptors
	before := openFDs(t)
	const n = 16
	specs := []Spec{tcpSpec("warm", 9)}
	for i := range n {
		specs = append(specs, tcpSpec(fmt.Sprintf("web%d", i), 9))
	}
	for _, st := range m.Converge(specs) {
		require.Equal(t, StateActive, st.State, st.Reason)
	}
	// Room for a descriptor an earlier test's leftovers close or open
	// meanwhile; a duplicate per listener would be 2n.
	grown := openFDs(t) - before
	assert.GreaterOrEqual(t, grown, n-2)
	assert.Less(t, grown, n+n/2, "descriptors by kind: %v", fdKinds())
}

// A listener handed out for systemd's fd store (or a hand-over) is a
// duplicate whose Fd leaves the socket non-blocking. A blocking listening
// socket would make the accept loop's raw accept4 block holding its
// processor, and the next garbage collection wait for it forever.
func TestAHandedOutListenerLeavesTheSocketNonBlocking(t *testing.T) {
	m, _ := newManager(t)
	st := only(t, m, tcpSpec("web", echoServer(t, "g:")))
	added, _ := m.ListenerFiles(nil)
	require.Len(t, added, 1)
	for _, f := range added {
		_ = f.Fd()
		f.Close()
	}
	rl, ok := listenerOf(m, "web").(*rawListener)
	require.True(t, ok, "a TCP listener is accepted from on raw descriptors")
	var flags int
	var ferr error
	require.NoError(t, rl.rc.Control(func(fd uintptr) { flags, ferr = unix.FcntlInt(fd, unix.F_GETFL, 0) }))
	require.NoError(t, ferr)
	require.NotZero(t, flags&unix.O_NONBLOCK, "the listening socket was switched to blocking mode")
	c := dial(t, st.BoundAddr)
	assert.Equal(t, "g:hi", roundTrip(t, c, "g:", "hi"))
}

func fdKinds() map[string]int {
	ents, _ := os.ReadDir("/proc/self/fd")
	kinds := map[string]int{}
	for _, e := range ents {
		l, _ := os.Readlink("/proc/self/fd/" + e.Name())
		if i := strings.IndexByte(l, '['); i > 0 {
			l = l[:i]
		}
		kinds[l]++
	}
	return kinds
}

// After a connection ends its carrier parks and carries the next caller, at
// most maxIdleCarriers park after a burst, and StopAll ends the parked ones
// (goleak in TestMain fails the package if any is left).
func TestCarriersAreReusedBoundedAndEndedByStopAll(t *testing.T) {
	m, _ := newManager(t)
	st := only(t, m, tcpSpec("a", echoServer(t, "g:")))
	require.Equal(t, StateActive, st.State, st.Reason)

	for range 3 {
		require.NoError(t, hold(t, st.BoundAddr).Close())
		eventually(t, "the carrier to park", func() bool { return m.idleCarriers.Load() == 1 })
	}

	burst := make([]*net.TCPConn, maxIdleCarriers+8)
	for i := range burst {
		burst[i] = hold(t, st.BoundAddr)
	}
	assert.Zero(t, m.idleCarriers.Load(), "every parked carrier was handed a caller")
	for _, c := range burst {
		require.NoError(t, c.Close())
	}
	eventually(t, "the burst's carriers to finish", func() bool { return conns(m, "a") == 0 })
	eventually(t, "maxIdleCarriers to park", func() bool { return m.idleCarriers.Load() == maxIdleCarriers })

	m.StopAll()
	assert.Zero(t, m.idleCarriers.Load(), "StopAll ends the parked carriers")
}

// The cap is the exposure's one cap, shared with its other paths: a place
// another path holds in the slot (the kernel's nat or socket path) counts
// against the proxy's callers too.
func TestTheCapIsSharedWithTheExposuresOtherPaths(t *testing.T) {
	m, _ := newManager(t)
	spec := tcpSpec("web", echoServer(t, "g:"))
	spec.MaxConns = 2
	st := only(t, m, spec)
	other, err := m.stats.Attach("web", bpf.ProtoTCP, 0)
	require.NoError(t, err)
	defer other.Release(false)
	require.True(t, other.Reserve(), "another path takes one place")

	a := hold(t, st.BoundAddr)
	requireReset(t, st.BoundAddr)
	cs := only(t, m, spec).Counters
	assert.EqualValues(t, 2, cs.Active)
	assert.EqualValues(t, 1, cs.Refused)

	other.Closed() // the other path's connection ends
	b := hold(t, st.BoundAddr)
	requireReset(t, st.BoundAddr)
	require.NoError(t, a.Close())
	require.NoError(t, b.Close())
	eventually(t, "both places given back", func() bool { return only(t, m, spec).Counters.Active == 0 })
}

// After a burst, the parked carriers and the pooled splice pipes go once the
// proxy has been idle a while: a daemon at rest holds no goroutine or
// descriptor for connections that have ended.
func TestABurstLeavesNoCarrierOrPipeBehindOnceIdle(t *testing.T) {
	carrierIdle, pipeIdle = 300*time.Millisecond, 300*time.Millisecond
	t.Cleanup(func() { carrierIdle, pipeIdle = 30*time.Second, 30*time.Second })
	// Earlier tests' pipes wait on a trim armed with the old pipeIdle.
	pipePool.mu.Lock()
	if pipePool.trim != nil {
		pipePool.trim.Reset(0)
	}
	pipePool.mu.Unlock()
	m, _ := newManager(t)
	st := only(t, m, tcpSpec("burst", echoServer(t, "g:")))
	require.Equal(t, StateActive, st.State, st.Reason)
	before := openFDs(t)
	burst := make([]*net.TCPConn, 40)
	for i := range burst {
		burst[i] = hold(t, st.BoundAddr)
		_, err := burst[i].Write([]byte("ping\n"))
		require.NoError(t, err)
	}
	for _, c := range burst {
		_ = c.SetReadDeadline(time.Now().Add(5 * time.Second))
		_, err := c.Read(make([]byte, 16))
		require.NoError(t, err, "the echo came back through a pipe")
	}
	for _, c := range burst {
		require.NoError(t, c.Close())
	}
	eventually(t, "the burst's connections to end", func() bool { return conns(m, "burst") == 0 })
	eventually(t, "the parked carriers to exit", func() bool { return m.idleCarriers.Load() == 0 })
	eventually(t, "the pooled pipes to close", func() bool {
		pipePool.mu.Lock()
		defer pipePool.mu.Unlock()
		return len(pipePool.free) == 0
	})
	eventually(t, "the descriptors to be back", func() bool { return openFDs(t) <= before })
}

// An auto exposure's loopback listeners (127.0.0.1 and ::1) live in one
// Manager under one name: both carry, both count into the one slot, and the
// cap holds across them. Dropping one address keeps the exposure's counters;
// dropping the name deletes them.
func TestOneExposureListensOnTwoAddressesUnderOneName(t *testing.T) {
	probe, err := net.Listen("tcp6", "[::1]:0")
	if err != nil {
		t.Skipf("no IPv6 loopback here: %v", err)
	}
	probe.Close()
	m, _ := newManager(t)
	port := echoServer(t, "g:")
	v4 := tcpSpec("web", port)
	v4.MaxConns = 1
	v6 := v4
	v6.Listen = netip.IPv6Loopback()
	st := m.Converge([]Spec{v4, v6})
	require.Len(t, st, 2)
	for _, s := range st {
		require.Equal(t, StateActive, s.State, s.Reason)
	}
	require.NotEqual(t, st[0].BoundAddr, st[1].BoundAddr)

	c4 := dial(t, st[0].BoundAddr)
	assert.Equal(t, "g:four", roundTrip(t, c4, "g:", "four"))
	requireReset(t, st[1].BoundAddr) // the one place is taken through 127.0.0.1
	require.NoError(t, c4.Close())
	eventually(t, "the place is given back", func() bool { c, _ := m.stats.Lookup("web"); return c.Active == 0 })
	c6 := dial(t, st[1].BoundAddr)
	assert.Equal(t, "g:six", roundTrip(t, c6, "g:", "six"))
	require.NoError(t, c6.Close())
	eventually(t, "the place is given back", func() bool { c, _ := m.stats.Lookup("web"); return c.Active == 0 })

	c, ok := m.stats.Lookup("web")
	require.True(t, ok)
	assert.EqualValues(t, 2, c.Accepted, "both listeners count into the one slot")
	assert.EqualValues(t, 1, c.Refused)

	only(t, m, v4) // ::1 goes; the exposure stays
	c, ok = m.stats.Lookup("web")
	require.True(t, ok, "the exposure is still desired: its slot stays")
	assert.EqualValues(t, 2, c.Accepted)
	m.Converge(nil)
	_, ok = m.stats.Lookup("web")
	assert.False(t, ok, "the exposure is gone: its slot is deleted")
}

// A listener that moves to another address is a new (name, address) key,
// but the same exposure: its counters carry on.
func TestAMovedListenerKeepsItsExposuresCounters(t *testing.T) {
	m, _ := newManager(t)
	port := echoServer(t, "g:")
	a := tcpSpec("web", port)
	st := only(t, m, a)
	require.Equal(t, StateActive, st.State, st.Reason)
	c := dial(t, st.BoundAddr)
	assert.Equal(t, "g:x", roundTrip(t, c, "g:", "x"))
	require.NoError(t, c.Close())

	b := a
	b.Listen = netip.MustParseAddr("127.0.0.2")
	st = only(t, m, b)
	require.Equal(t, StateActive, st.State, st.Reason)
	assert.True(t, strings.HasPrefix(st.BoundAddr, "127.0.0.2:"), st.BoundAddr)
	assert.EqualValues(t, 1, st.Counters.Accepted, "the exposure's slot was kept across the move")
}
