package bpf

import (
	"fmt"
	"io"
	"net"
	"net/netip"
	"os"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/brokkr/brokkr/bpf/ctmark"
	"github.com/brokkr/brokkr/internal/kernelfeat"
	"github.com/brokkr/brokkr/internal/nstest"
	"github.com/cilium/ebpf"
	"github.com/cilium/ebpf/link"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

// natTopo: client ns (10.99.0.2) -- veth -- host ns (10.99.0.1; bridge br0
// 10.213.0.1/24) -- veth port -- guest ns (10.213.0.11) running TCP and UDP
// echo servers on 7000. A plain nft DNAT rule publishes host:8080 (TCP and
// UDP) and marks the connection for the exposure in slot, as netplane/nft
// does.
type natTopo struct {
	client, host, guest *nstest.NS
	store               *Store
	slot                *Slot
	pins                string
	bridge              int
}

func newNatTopo(t *testing.T, cap uint32) *natTopo {
	t.Helper()
	pins := nstest.PrivateBPFFS(t)
	s, err := Open(pins)
	require.NoError(t, err)
	t.Cleanup(func() { s.Close() })
	sl, err := s.Attach("web", ProtoTCP, 8080)
	require.NoError(t, err)
	sl.SetCap(cap)
	t.Cleanup(func() { sl.Release(false) })
	tp := newNatNet(t, pins, sl.Index())
	tp.store, tp.slot = s, sl
	return tp
}

// newNatNet is newNatTopo's network alone: the caller, the host and the
// guest, and the DNAT to the guest that marks connections with slot's id.
func newNatNet(t *testing.T, pins string, slot int) *natTopo {
	t.Helper()
	tp := &natTopo{client: nstest.New(t, "cli"), host: nstest.New(t, "host"), guest: nstest.New(t, "g1"), pins: pins}
	nstest.Link(t, tp.client, "eth0", "10.99.0.2/24", tp.host, "vh-cli", "10.99.0.1/24")
	tp.client.MustRun(t, "ip", "route", "add", "default", "via", "10.99.0.1")
	tp.host.MustRun(t, "ip", "link", "add", "br0", "type", "bridge")
	tp.host.MustRun(t, "ip", "addr", "add", "10.213.0.1/24", "dev", "br0")
	tp.host.MustRun(t, "ip", "link", "set", "br0", "up")
	tp.host.MustRun(t, "sysctl", "-qw", "net.ipv4.ip_forward=1")
	nstest.Link(t, tp.host, "g1p", "", tp.guest, "eth0", "10.213.0.11/24")
	tp.host.MustRun(t, "ip", "link", "set", "g1p", "master", "br0")
	tp.host.MustRun(t, "ip", "link", "set", "dev", "g1p", "type", "bridge_slave", "hairpin", "on")
	tp.guest.MustRun(t, "ip", "route", "add", "default", "via", "10.213.0.1")
	tp.guest.ServeEcho(t, "0.0.0.0:7000")

	mark := fmt.Sprintf("0x%x", ctmark.Of(slot))
	script := `table ip brktest {
  chain pre { type nat hook prerouting priority -100; policy accept;
    fib daddr type local meta l4proto { tcp, udp } th dport 8080 ct mark set ` + mark + ` dnat to 10.213.0.11:7000
  }
  chain out { type nat hook output priority -100; policy accept;
    fib daddr type local meta l4proto { tcp, udp } th dport 8080 ct mark set ` + mark + ` dnat to 10.213.0.11:7000
  }
  chain post { type nat hook postrouting priority 100; policy accept;
    ct status dnat oifname "br0" ip saddr 10.213.0.0/24 masquerade
  }
}`
	cmd := tp.host.Command("nft", "-f", "-")
	cmd.Stdin = strings.NewReader(script)
	out, err := cmd.CombinedOutput()
	require.NoError(t, err, string(out))
	tp.bridge = ifindex(t, tp.host, "br0")
	return tp
}

func ifindex(t *testing.T, n *nstest.NS, name string) int {
	t.Helper()
	var idx int
	require.NoError(t, n.Do(func() error {
		i, err := net.InterfaceByName(name)
		if err != nil {
			return err
		}
		idx = i.Index
		return nil
	}))
	return idx
}

func (tp *natTopo) load(t *testing.T) *NatPath {
	t.Helper()
	kernelfeat.Require(t, kernelfeat.NatPath...)
	np, err := LoadNatPath(NatPathConfig{PinDir: tp.pins, Bridge: tp.bridge, Guests: netip.MustParsePrefix("10.213.0.0/24"), InNS: tp.host.Do})
	require.NoError(t, err)
	return np
}

// testTCHooks: the nat path's tests run on its tc programs where the
// netfilter hooks' load too (HooksEnv=tc, as make test does in a second
// run); a kernel before 6.4 runs them whatever the variable says.
var testTCHooks = os.Getenv(HooksEnv) == "tc"

// requireNetfilterHooks skips a test of what only the netfilter hooks'
// programs have (their links, priorities, two copies at one hook) where
// the tc programs run.
func requireNetfilterHooks(t *testing.T) {
	t.Helper()
	if testTCHooks {
		t.Skip("a test of the netfilter hooks' programs; the tc programs run (" + HooksEnv + "=tc)")
	}
	kernelfeat.Require(t, kernelfeat.NatPathNetfilter...)
}

func dial(t *testing.T, ns *nstest.NS, network, addr string) (net.Conn, error) {
	t.Helper()
	var c net.Conn
	err := ns.Do(func() (err error) {
		c, err = net.DialTimeout(network, addr, 3*time.Second)
		return err
	})
	return c, err
}

// roundTrip writes payload and reads it back.
func roundTrip(t *testing.T, c net.Conn, payload []byte) {
	t.Helper()
	require.NoError(t, c.SetDeadline(time.Now().Add(5*time.Second)))
	_, err := c.Write(payload)
	require.NoError(t, err)
	got := make([]byte, len(payload))
	_, err = io.ReadFull(c, got)
	require.NoError(t, err)
	require.Equal(t, payload, got)
}

func eventually(t *testing.T, what string, cond func() bool) {
	t.Helper()
	deadline := time.Now().Add(5 * time.Second)
	for !cond() {
		if time.Now().After(deadline) {
			t.Fatalf("timed out waiting for %s", what)
		}
		time.Sleep(5 * time.Millisecond)
	}
}

func TestNatPathCapsCountsAndReleasesInTheKernel(t *testing.T) {
	tp := newNatTopo(t, 2)
	np := tp.load(t)
	defer np.Close()

	a, err := dial(t, tp.client, "tcp4", "10.99.0.1:8080")
	require.NoError(t, err)
	defer a.Close()
	b, err := dial(t, tp.client, "tcp4", "10.99.0.1:8080")
	require.NoError(t, err)
	roundTrip(t, a, []byte("hello"))
	roundTrip(t, b, make([]byte, 100000))

	// The third caller is refused at once, by a RST.
	start := time.Now()
	_, err = dial(t, tp.client, "tcp4", "10.99.0.1:8080")
	require.ErrorIs(t, err, syscall.ECONNREFUSED)
	assert.Less(t, time.Since(start), time.Second)

	c := tp.slot.Read()
	assert.EqualValues(t, 2, c.Active)
	assert.EqualValues(t, 2, c.Accepted)
	assert.EqualValues(t, 1, c.Refused)
	// Open flows' bytes reach the slot at the flow timer's next tick.
	eventually(t, "the open flows' bytes in the slot", func() bool {
		c := tp.slot.Read()
		return c.BytesIn == 100005 && c.BytesOut == 100005
	})

	// Closing one gives its place back, in the kernel.
	require.NoError(t, b.Close())
	eventually(t, "active 1", func() bool { return tp.slot.Read().Active == 1 })
	d, err := dial(t, tp.client, "tcp4", "10.99.0.1:8080")
	require.NoError(t, err)
	roundTrip(t, d, []byte("x"))
	d.Close()
	a.Close()
	eventually(t, "active 0", func() bool { return tp.slot.Read().Active == 0 })
	c = tp.slot.Read()
	assert.EqualValues(t, 3, c.Accepted)
	assert.EqualValues(t, 1, c.Refused)
	assert.EqualValues(t, 100006, c.BytesIn)
	assert.EqualValues(t, 100006, c.BytesOut)
	k, p := tp.slot.Shares()
	assert.Zero(t, k)
	assert.Zero(t, p)
}

func TestNatPathKeepsWorkingWithoutTheDaemonAndIsAdoptedNotDoubled(t *testing.T) {
	tp := newNatTopo(t, 1)
	np := tp.load(t)
	ids := linkIDs(t, np.links)
	require.NoError(t, np.Close()) // the daemon is gone; the pins stay

	a, err := dial(t, tp.client, "tcp4", "10.99.0.1:8080")
	require.NoError(t, err)
	roundTrip(t, a, []byte("abc"))
	_, err = dial(t, tp.client, "tcp4", "10.99.0.1:8080")
	require.ErrorIs(t, err, syscall.ECONNREFUSED, "the cap holds with no daemon")
	a.Close()
	eventually(t, "the place given back with no daemon", func() bool { return tp.slot.Read().Active == 0 })

	np2 := tp.load(t)
	defer np2.Close()
	if np2.Hooks() == "tc" {
		assert.Equal(t, []ebpf.ProgramID{progID(t, np2.tc.BrkNattcEgress), progID(t, np2.tc.BrkNattcIngress)}, tcPrograms(t, tp),
			"a restarted daemon's programs replace the earlier ones in place, one at each hook")
	} else {
		assert.Equal(t, ids, linkIDs(t, np2.links), "a restarted daemon adopts the pinned links")
		p := np2.objs.natpathPrograms
		assert.Zero(t, linksOf(t, p.BrkNatPre, p.BrkNatOut, p.BrkNatReflect), "and attaches no second copy of its programs")
	}

	b, err := dial(t, tp.client, "tcp4", "10.99.0.1:8080")
	require.NoError(t, err)
	roundTrip(t, b, []byte("de"))
	b.Close()
	eventually(t, "active 0", func() bool { return tp.slot.Read().Active == 0 })
	c := tp.slot.Read()
	assert.EqualValues(t, 2, c.Accepted)
	assert.EqualValues(t, 1, c.Refused)
	assert.EqualValues(t, 5, c.BytesIn)
	assert.EqualValues(t, 5, c.BytesOut)
}

func TestNatPathUDPFlowsAreCappedAndCountedAndFreedWhenConntrackForgetsThem(t *testing.T) {
	tp := newNatTopo(t, 1)
	np := tp.load(t)
	defer np.Close()

	u, err := dial(t, tp.client, "udp4", "10.99.0.1:8080")
	require.NoError(t, err)
	defer u.Close()
	roundTrip(t, u, []byte("ping!"))
	roundTrip(t, u, []byte("again"))

	// A second flow is over the cap: dropped and counted.
	v, err := dial(t, tp.client, "udp4", "10.99.0.1:8080")
	require.NoError(t, err)
	defer v.Close()
	_, err = v.Write([]byte("nope"))
	require.NoError(t, err)
	require.NoError(t, v.SetReadDeadline(time.Now().Add(300*time.Millisecond)))
	_, err = v.Read(make([]byte, 10))
	require.Error(t, err)

	c := tp.slot.Read()
	assert.EqualValues(t, 1, c.Active)
	assert.EqualValues(t, 1, c.Accepted)
	assert.EqualValues(t, 1, c.Refused)
	eventually(t, "the open flow's bytes in the slot", func() bool {
		c := tp.slot.Read()
		return c.BytesIn == 10 && c.BytesOut == 10
	})
	c = tp.slot.Read()
	assert.EqualValues(t, 10, c.BytesIn, "exactly")
	assert.EqualValues(t, 10, c.BytesOut, "exactly")

	// conntrack forgetting the flow (as a timeout does) gives its place back.
	tp.host.MustRun(t, "conntrack", "-D", "-p", "udp", "--orig-port-dst", "8080")
	eventually(t, "active 0", func() bool { return tp.slot.Read().Active == 0 })
	_, err = v.Write([]byte("now"))
	require.NoError(t, err)
	got := make([]byte, 10)
	require.NoError(t, v.SetReadDeadline(time.Now().Add(3*time.Second)))
	n, err := v.Read(got)
	require.NoError(t, err)
	assert.Equal(t, "now", string(got[:n]))
}

// linksOf counts the BPF links in the system that run one of progs. Only
// these programs' links, not every link: other tests and other users of
// the machine attach and detach links of their own meanwhile.
func linksOf(t *testing.T, progs ...*ebpf.Program) int {
	t.Helper()
	want := map[ebpf.ProgramID]bool{}
	for _, p := range progs {
		info, err := p.Info()
		require.NoError(t, err)
		id, ok := info.ID()
		require.True(t, ok, "program ID")
		want[id] = true
	}
	it := new(link.Iterator)
	defer it.Close()
	n := 0
	for it.Next() {
		info, err := it.Link.Info()
		if err != nil {
			continue // detached meanwhile
		}
		if want[info.Program] {
			n++
		}
	}
	require.NoError(t, it.Err())
	return n
}

// linkIDs is the ID of each of a path's links, by pin name.
func linkIDs(t *testing.T, links map[string]link.Link) map[string]uint32 {
	t.Helper()
	out := map[string]uint32{}
	for name, l := range links {
		info, err := l.Info()
		require.NoError(t, err)
		out[name] = uint32(info.ID)
	}
	return out
}

func TestANewExposureInAReusedSlotStartsAtZeroWhileOldFlowsLinger(t *testing.T) {
	tp := newNatTopo(t, 4)
	np := tp.load(t)
	defer np.Close()

	old, err := dial(t, tp.client, "tcp4", "10.99.0.1:8080")
	require.NoError(t, err)
	defer old.Close()
	roundTrip(t, old, []byte("before"))
	require.EqualValues(t, 1, tp.slot.Read().Active)

	// The exposure is deleted and a new one takes its slot; the old flow's
	// conntrack entry (and with it its mark) is still there.
	idx := tp.slot.Index()
	tp.slot.Release(true)
	fresh, err := tp.store.Attach("other", ProtoTCP, 8080)
	require.NoError(t, err)
	defer fresh.Release(false)
	require.Equal(t, idx, fresh.Index(), "the freed slot is reused")
	fresh.SetCap(4)
	assert.Equal(t, Counters{}, fresh.Read())

	roundTrip(t, old, []byte("after the slot changed hands"))
	require.NoError(t, old.Close())
	time.Sleep(200 * time.Millisecond)
	assert.Equal(t, Counters{}, fresh.Read(), "the old exposure's flow neither counts nor frees a place in the new one")

	c, err := dial(t, tp.client, "tcp4", "10.99.0.1:8080")
	require.NoError(t, err)
	roundTrip(t, c, []byte("new"))
	c.Close()
	eventually(t, "the new flow's place given back", func() bool { return fresh.Read().Active == 0 })
	got := fresh.Read()
	assert.EqualValues(t, 1, got.Accepted)
	assert.EqualValues(t, 3, got.BytesIn)
	assert.EqualValues(t, 3, got.BytesOut)
}

// An established connection reset by either side gives its place back at
// once, while conntrack still holds the entry (in CLOSE for
// nf_conntrack_tcp_timeout_close, set to a minute here): the sweep, which
// waits for conntrack to forget it, is not what frees it. (Fails with the
// TH_RST release in account() removed.)
func TestAResetEstablishedConnectionGivesItsPlaceBackAtOnce(t *testing.T) {
	tp := newNatTopo(t, 1)
	tp.host.MustRun(t, "sysctl", "-qw", "net.netfilter.nf_conntrack_tcp_timeout_close=60")
	// A second published port to a guest server that resets what it
	// accepts once it has echoed a line: the guest's RST.
	mark := "0x" + strconv.FormatUint(uint64(ctmark.Of(tp.slot.Index())), 16)
	script := `table ip brkrst {
  chain pre { type nat hook prerouting priority -100; policy accept;
    fib daddr type local tcp dport 8081 ct mark set ` + mark + ` dnat to 10.213.0.11:7002
  }
}`
	cmd := tp.host.Command("nft", "-f", "-")
	cmd.Stdin = strings.NewReader(script)
	out, err := cmd.CombinedOutput()
	require.NoError(t, err, string(out))
	serveReset(t, tp)
	np := tp.load(t)
	defer np.Close()

	closeState := func(port string) bool {
		out, _ := tp.host.Run("conntrack", "-L", "-p", "tcp", "--orig-port-dst", port)
		return strings.Contains(out, "CLOSE ")
	}
	for _, c := range []struct{ who, port string }{{"caller", "8080"}, {"guest", "8081"}} {
		conn, err := dial(t, tp.client, "tcp4", "10.99.0.1:"+c.port)
		require.NoError(t, err, c.who)
		roundTrip(t, conn, []byte("abc\n"))
		require.EqualValues(t, 1, tp.slot.Read().Active, c.who)
		if c.who == "caller" {
			require.NoError(t, conn.(*net.TCPConn).SetLinger(0))
			require.NoError(t, conn.Close()) // a RST, not a FIN
		} else {
			// The guest resets after its echo: the next read says so.
			_ = conn.SetReadDeadline(time.Now().Add(5 * time.Second))
			_, err := conn.Read(make([]byte, 1))
			require.ErrorIs(t, err, syscall.ECONNRESET, "the guest reset the connection")
			conn.Close()
		}
		eventually(t, c.who+"'s RST gives the place back", func() bool { return tp.slot.Read().Active == 0 })
		assert.True(t, closeState(c.port), "%s: conntrack still holds the reset connection: the sweep did not free it", c.who)
		next, err := dial(t, tp.client, "tcp4", "10.99.0.1:8080")
		require.NoError(t, err, "%s: the next caller is admitted at once", c.who)
		roundTrip(t, next, []byte("x"))
		require.NoError(t, next.Close())
		eventually(t, "active 0", func() bool { return tp.slot.Read().Active == 0 })
	}
	st := tp.slot.Read()
	assert.EqualValues(t, 4, st.Accepted)
	assert.Zero(t, st.Refused)
	assert.Zero(t, st.Dropped, "a reset after the guest answered is no drop")
}

// serveReset runs a server in the guest on 7002 that echoes one line and
// then resets the connection.
func serveReset(t *testing.T, tp *natTopo) {
	t.Helper()
	var ln *net.TCPListener
	require.NoError(t, tp.guest.Do(func() (err error) {
		ln, err = net.ListenTCP("tcp4", &net.TCPAddr{IP: net.IPv4(10, 213, 0, 11), Port: 7002})
		return err
	}))
	done := make(chan struct{})
	t.Cleanup(func() { ln.Close(); <-done })
	go func() {
		defer close(done)
		for {
			c, err := ln.AcceptTCP()
			if err != nil {
				return // closed at cleanup
			}
			buf := make([]byte, 64)
			n, _ := c.Read(buf)
			_, _ = c.Write(buf[:n])
			time.Sleep(100 * time.Millisecond) // the echo reaches the caller first
			_ = c.SetLinger(0)
			c.Close()
		}
	}()
}
