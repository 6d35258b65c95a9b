package bpf

import (
	"fmt"
	"io"
	"net"
	"net/netip"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/brokkr/brokkr/internal/kernelfeat"
	"github.com/brokkr/brokkr/internal/nstest"
	"github.com/brokkr/brokkr/internal/spec"
	"github.com/cilium/ebpf"
	"github.com/cilium/ebpf/link"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	"golang.org/x/sys/unix"
)

// joinCgroup creates a child cgroup of the test's own under the cgroup v2
// hierarchy (mounting one on a temp dir if the host has none), moves this
// test process into it, and at cleanup moves it back and removes the child.
// The socket path attaches there, never at the root.
func joinCgroup(t *testing.T) string {
	t.Helper()
	root, err := cgroup2Mount()
	require.NoError(t, err)
	if root == "" {
		root = t.TempDir()
		require.NoError(t, unix.Mount("cgroup2", root, "cgroup2", 0, ""))
		t.Cleanup(func() { _ = unix.Unmount(root, unix.MNT_DETACH) })
	}
	return nstest.JoinCgroup(t, root)
}

// sockTopo: a host namespace (the managed one) with bridge br0
// 10.213.0.1/24 and two guest namespaces, g1 (10.213.0.11) and g2
// (10.213.0.12), each running TCP and UDP echo servers on 7000 and a TCP
// server on 7001 that writes its name. The test process is in a child
// cgroup; the socket path attaches there.
type sockTopo struct {
	host, g1, g2 *nstest.NS
	store        *Store
	slot         *Slot
	pins, cgroup string
}

func newSockTopo(t *testing.T, proto uint32, cap uint32) *sockTopo {
	t.Helper()
	pins := nstest.PrivateBPFFS(t)
	tp := &sockTopo{host: nstest.New(t, "host"), g1: nstest.New(t, "g1"), g2: nstest.New(t, "g2"), pins: pins}
	tp.host.MustRun(t, "ip", "link", "add", "br0", "type", "bridge")
	tp.host.MustRun(t, "ip", "addr", "add", "10.213.0.1/24", "dev", "br0")
	tp.host.MustRun(t, "ip", "link", "set", "br0", "up")
	for i, g := range []*nstest.NS{tp.g1, tp.g2} {
		port := fmt.Sprintf("g%dp", i+1)
		addr := fmt.Sprintf("10.213.0.%d", 11+i)
		nstest.Link(t, tp.host, port, "", g, "eth0", addr+"/24")
		tp.host.MustRun(t, "ip", "link", "set", port, "master", "br0")
		g.ServeEcho(t, addr+":7000")
		serveName(t, g, addr+":7001", fmt.Sprintf("g%d", i+1))
	}
	s, err := Open(pins)
	require.NoError(t, err)
	t.Cleanup(func() { s.Close() })
	tp.store = s
	tp.slot, err = s.Attach("web", proto, 8080)
	require.NoError(t, err)
	tp.slot.SetCap(cap)
	t.Cleanup(func() { tp.slot.Release(false) })
	tp.cgroup = joinCgroup(t)
	return tp
}

func (tp *sockTopo) load(t *testing.T) *SockLB {
	t.Helper()
	return loadSockLB(t, tp.pins, tp.cgroup, tp.host)
}

func loadSockLB(t *testing.T, pins, cgroup string, host *nstest.NS) *SockLB {
	t.Helper()
	kernelfeat.Require(t, kernelfeat.SocketPath...)
	s, err := LoadSockLB(SockLBConfig{PinDir: pins, Cgroup: cgroup, InNS: host.Do})
	require.NoError(t, err)
	return s
}

var anyHost = netip.IPv4Unspecified()

func guest(s string) netip.AddrPort { return netip.MustParseAddrPort(s) }

// serveName runs a TCP server inside ns that writes name and closes.
func serveName(t *testing.T, ns *nstest.NS, addr, name string) {
	t.Helper()
	var ln net.Listener
	require.NoError(t, ns.Do(func() (err error) { ln, err = net.Listen("tcp4", addr); return err }))
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
			_, _ = c.Write([]byte(name))
			c.Close()
		}
	}()
}

func readAll(t *testing.T, c net.Conn) string {
	t.Helper()
	require.NoError(t, c.SetDeadline(time.Now().Add(5*time.Second)))
	b, err := io.ReadAll(c)
	require.NoError(t, err)
	return string(b)
}

// peerOf is what getpeername(2) says on c's socket.
func peerOf(t *testing.T, c net.Conn) netip.AddrPort {
	t.Helper()
	rc, err := c.(syscall.Conn).SyscallConn()
	require.NoError(t, err)
	var sa unix.Sockaddr
	var gerr error
	require.NoError(t, rc.Control(func(fd uintptr) { sa, gerr = unix.Getpeername(int(fd)) }))
	require.NoError(t, gerr)
	switch a := sa.(type) {
	case *unix.SockaddrInet4:
		return netip.AddrPortFrom(netip.AddrFrom4(a.Addr), uint16(a.Port))
	case *unix.SockaddrInet6:
		return netip.AddrPortFrom(netip.AddrFrom16(a.Addr), uint16(a.Port))
	}
	t.Fatalf("getpeername: %T", sa)
	return netip.AddrPort{}
}

func TestSockLBTranslatesTCPv4AndV6AndShowsTheDialledPeer(t *testing.T) {
	tp := newSockTopo(t, ProtoTCP, 0)
	lb := tp.load(t)
	defer lb.Close()
	require.NoError(t, lb.SetTarget(anyHost, ProtoTCP, 8080, SockTarget{Guest: guest("10.213.0.11:7000"), Slot: tp.slot.Index()}))
	require.NoError(t, lb.SetLocalAddrs([]netip.Addr{netip.MustParseAddr("10.213.0.1")}))

	var conns []net.Conn
	sent := 0
	for i, dst := range []string{"127.0.0.1:8080", "10.213.0.1:8080", "[::1]:8080"} {
		c, err := dial(t, tp.host, "tcp", dst)
		require.NoError(t, err, dst)
		conns = append(conns, c)
		assert.Equal(t, netip.MustParseAddrPort(dst), peerOf(t, c), "getpeername shows the address dialled")
		assert.Equal(t, dst, c.RemoteAddr().String())
		p := make([]byte, 1000*(i+1)+7)
		roundTrip(t, c, p)
		sent += len(p)
	}
	c := tp.slot.Read()
	assert.EqualValues(t, 3, c.Active)
	assert.EqualValues(t, 3, c.Accepted)
	k, p := tp.slot.Shares()
	assert.EqualValues(t, 3, k)
	assert.Zero(t, p)

	// A port that is no exposure, on the same addresses, is left alone.
	_, err := dial(t, tp.host, "tcp", "127.0.0.1:8081")
	require.ErrorIs(t, err, syscall.ECONNREFUSED)
	// So is an IPV6_V6ONLY socket (Go's "tcp6"): it cannot reach an IPv4
	// guest through a v4-mapped address, and takes no place.
	_, err = dial(t, tp.host, "tcp6", "[::1]:8080")
	require.ErrorIs(t, err, syscall.ECONNREFUSED)
	assert.EqualValues(t, 3, tp.slot.Read().Accepted)

	for _, c := range conns {
		require.NoError(t, c.Close())
	}
	eventually(t, "active 0", func() bool { return tp.slot.Read().Active == 0 })
	eventually(t, "bytes counted when the connections end", func() bool {
		c := tp.slot.Read()
		return c.BytesIn == uint64(sent) && c.BytesOut == uint64(sent)
	})
	c = tp.slot.Read()
	assert.EqualValues(t, 3, c.Accepted)
	assert.Zero(t, c.Refused)
	assert.Zero(t, c.Dropped)
	k, _ = tp.slot.Shares()
	assert.Zero(t, k)
}

func TestSockLBTranslatesUDPv4AndV6RepliesComeFromTheDialledAddress(t *testing.T) {
	tp := newSockTopo(t, ProtoUDP, 0)
	lb := tp.load(t)
	defer lb.Close()
	require.NoError(t, lb.SetTarget(anyHost, ProtoUDP, 8080, SockTarget{Guest: guest("10.213.0.11:7000"), Slot: tp.slot.Index()}))

	// Unconnected IPv4 (sendmsg4/recvmsg4).
	var u4 *net.UDPConn
	require.NoError(t, tp.host.Do(func() (err error) { u4, err = net.ListenUDP("udp4", nil); return err }))
	defer u4.Close()
	dst := net.UDPAddrFromAddrPort(netip.MustParseAddrPort("127.0.0.1:8080"))
	for _, msg := range []string{"hello", "again!"} {
		_, err := u4.WriteTo([]byte(msg), dst)
		require.NoError(t, err)
		buf := make([]byte, 100)
		require.NoError(t, u4.SetReadDeadline(time.Now().Add(5*time.Second)))
		n, from, err := u4.ReadFromUDPAddrPort(buf)
		require.NoError(t, err)
		assert.Equal(t, msg, string(buf[:n]))
		assert.Equal(t, "127.0.0.1:8080", from.String(), "the reply comes from the address sent to")
	}

	// Connected IPv6 (connect6, v4-mapped to the guest; recvmsg6).
	c6, err := dial(t, tp.host, "udp", "[::1]:8080")
	require.NoError(t, err)
	defer c6.Close()
	u6 := c6.(*net.UDPConn)
	_, err = u6.Write([]byte("six"))
	require.NoError(t, err)
	buf := make([]byte, 100)
	require.NoError(t, u6.SetReadDeadline(time.Now().Add(5*time.Second)))
	n, from, err := u6.ReadFromUDPAddrPort(buf)
	require.NoError(t, err)
	assert.Equal(t, "six", string(buf[:n]))
	assert.Equal(t, "[::1]:8080", from.String())
	assert.Equal(t, netip.MustParseAddrPort("[::1]:8080"), peerOf(t, c6))

	c := tp.slot.Read()
	assert.EqualValues(t, 2, c.Active, "one place per socket")
	assert.EqualValues(t, 2, c.Accepted)
	assert.EqualValues(t, 14, c.BytesIn)
	assert.EqualValues(t, 14, c.BytesOut)
	require.NoError(t, u4.Close())
	require.NoError(t, c6.Close())
	eventually(t, "active 0", func() bool { return tp.slot.Read().Active == 0 })
}

func TestSockLBLeavesCallersInOtherNamespacesAlone(t *testing.T) {
	tp := newSockTopo(t, ProtoTCP, 0)
	lb := tp.load(t)
	defer lb.Close()
	require.NoError(t, lb.SetTarget(anyHost, ProtoTCP, 8080, SockTarget{Guest: guest("10.213.0.11:7001"), Slot: tp.slot.Index()}))
	other := nstest.New(t, "other")
	serveName(t, other, "127.0.0.1:8080", "other")

	c, err := dial(t, other, "tcp4", "127.0.0.1:8080")
	require.NoError(t, err)
	assert.Equal(t, "other", readAll(t, c))
	c.Close()
	c, err = dial(t, tp.host, "tcp4", "127.0.0.1:8080")
	require.NoError(t, err)
	assert.Equal(t, "g1", readAll(t, c))
	c.Close()
	assert.EqualValues(t, 1, tp.slot.Read().Accepted)
}

func TestSockLBCapRefusesWithECONNREFUSEDAndReleasesOnClose(t *testing.T) {
	tp := newSockTopo(t, ProtoTCP, 2)
	lb := tp.load(t)
	defer lb.Close()
	require.NoError(t, lb.SetTarget(anyHost, ProtoTCP, 8080, SockTarget{Guest: guest("10.213.0.11:7000"), Slot: tp.slot.Index()}))
	a, err := dial(t, tp.host, "tcp4", "127.0.0.1:8080")
	require.NoError(t, err)
	defer a.Close()
	b, err := dial(t, tp.host, "tcp", "[::1]:8080")
	require.NoError(t, err)
	_, err = dial(t, tp.host, "tcp4", "127.0.0.1:8080")
	require.ErrorIs(t, err, syscall.ECONNREFUSED)
	assert.False(t, tp.slot.TryOpen(), "the proxy shares the cap")
	c := tp.slot.Read()
	assert.EqualValues(t, 2, c.Active)
	assert.EqualValues(t, 1, c.Refused)
	require.NoError(t, b.Close())
	eventually(t, "active 1", func() bool { return tp.slot.Read().Active == 1 })
	d, err := dial(t, tp.host, "tcp4", "127.0.0.1:8080")
	require.NoError(t, err)
	roundTrip(t, d, []byte("x"))
	d.Close()
}

func TestSockLBKeepsWorkingWithoutTheDaemonAndIsAdoptedNotDoubled(t *testing.T) {
	tp := newSockTopo(t, ProtoTCP, 0)
	lb := tp.load(t)
	require.NoError(t, lb.SetTarget(anyHost, ProtoTCP, 8080, SockTarget{Guest: guest("10.213.0.11:7000"), Slot: tp.slot.Index()}))
	ids := linkIDs(t, lb.links)
	require.NoError(t, lb.Close()) // the daemon is gone; the pins stay

	a, err := dial(t, tp.host, "tcp4", "127.0.0.1:8080")
	require.NoError(t, err)
	roundTrip(t, a, []byte("abc"))
	require.NoError(t, a.Close())
	eventually(t, "counted with no daemon", func() bool {
		c := tp.slot.Read()
		return c.Active == 0 && c.Accepted == 1 && c.BytesIn == 3 && c.BytesOut == 3
	})

	lb2 := tp.load(t)
	defer lb2.Close()
	assert.Equal(t, ids, linkIDs(t, lb2.links), "a restarted daemon adopts the pinned links")
	for _, h := range lb2.hooks() {
		assert.Equal(t, 1, cgroupLinksRunning(t, tp.cgroup, h.prog, h.attach), "one copy of %s", h.pin)
	}
	b, err := dial(t, tp.host, "tcp4", "127.0.0.1:8080")
	require.NoError(t, err, "the translation survived the restart")
	roundTrip(t, b, []byte("de"))
	b.Close()
	eventually(t, "counted", func() bool { c := tp.slot.Read(); return c.Active == 0 && c.BytesIn == 5 })
	assert.EqualValues(t, 2, tp.slot.Read().Accepted)
}

func TestSockLBExposureRemovedOrMovedAffectsNewConnectsOnly(t *testing.T) {
	tp := newSockTopo(t, ProtoTCP, 0)
	lb := tp.load(t)
	defer lb.Close()
	require.NoError(t, lb.SetTarget(anyHost, ProtoTCP, 8080, SockTarget{Guest: guest("10.213.0.11:7000"), Slot: tp.slot.Index()}))
	require.NoError(t, lb.SetTarget(anyHost, ProtoTCP, 8081, SockTarget{Guest: guest("10.213.0.11:7001"), Slot: tp.slot.Index()}))
	c, err := dial(t, tp.host, "tcp4", "127.0.0.1:8081")
	require.NoError(t, err)
	assert.Equal(t, "g1", readAll(t, c))
	c.Close()

	// Moved to another guest: new connects go there.
	require.NoError(t, lb.SetTarget(anyHost, ProtoTCP, 8081, SockTarget{Guest: guest("10.213.0.12:7001"), Slot: tp.slot.Index()}))
	c, err = dial(t, tp.host, "tcp4", "127.0.0.1:8081")
	require.NoError(t, err)
	assert.Equal(t, "g2", readAll(t, c))
	c.Close()

	// Removed: an established connection keeps flowing, new ones are
	// not translated (nothing listens on the host's port).
	a, err := dial(t, tp.host, "tcp4", "127.0.0.1:8080")
	require.NoError(t, err)
	roundTrip(t, a, []byte("before"))
	require.NoError(t, lb.DeleteTarget(anyHost, ProtoTCP, 8080))
	_, err = dial(t, tp.host, "tcp4", "127.0.0.1:8080")
	require.ErrorIs(t, err, syscall.ECONNREFUSED)
	roundTrip(t, a, []byte("after"))
	assert.Equal(t, netip.MustParseAddrPort("127.0.0.1:8080"), peerOf(t, a))
	accepted := tp.slot.Read().Accepted
	require.NoError(t, a.Close())
	eventually(t, "active 0", func() bool { return tp.slot.Read().Active == 0 })
	assert.EqualValues(t, 3, accepted)
}

func TestSockLBGuestDownIsAPromptErrorCountedAsDropped(t *testing.T) {
	tp := newSockTopo(t, ProtoTCP, 0)
	lb := tp.load(t)
	defer lb.Close()
	// The guest is there but nothing listens: its RST.
	require.NoError(t, lb.SetTarget(anyHost, ProtoTCP, 8080, SockTarget{Guest: guest("10.213.0.11:7999"), Slot: tp.slot.Index()}))
	start := time.Now()
	_, err := dial(t, tp.host, "tcp4", "127.0.0.1:8080")
	require.ErrorIs(t, err, syscall.ECONNREFUSED)
	assert.Less(t, time.Since(start), time.Second)
	eventually(t, "dropped 1", func() bool { c := tp.slot.Read(); return c.Dropped == 1 && c.Active == 0 })

	// The daemon knows the guest is down: refused in the connect itself.
	require.NoError(t, lb.SetTarget(anyHost, ProtoTCP, 8080, SockTarget{Guest: guest("10.213.0.11:7000"), Slot: tp.slot.Index(), Down: true}))
	start = time.Now()
	_, err = dial(t, tp.host, "tcp4", "127.0.0.1:8080")
	require.ErrorIs(t, err, syscall.ECONNREFUSED)
	assert.Less(t, time.Since(start), 100*time.Millisecond)
	c := tp.slot.Read()
	assert.EqualValues(t, 2, c.Dropped)
	assert.EqualValues(t, 1, c.Accepted)
	assert.Zero(t, c.Active)

	// No guest at the address at all: the neighbour lookup fails.
	require.NoError(t, lb.SetTarget(anyHost, ProtoTCP, 8080, SockTarget{Guest: guest("10.213.0.99:7000"), Slot: tp.slot.Index()}))
	var d net.Conn
	start = time.Now()
	err = tp.host.Do(func() (err error) { d, err = net.DialTimeout("tcp4", "127.0.0.1:8080", 10*time.Second); return err })
	if d != nil {
		d.Close()
	}
	require.ErrorIs(t, err, syscall.EHOSTUNREACH)
	assert.Less(t, time.Since(start), 5*time.Second)
	eventually(t, "dropped 3", func() bool { c := tp.slot.Read(); return c.Dropped == 3 && c.Active == 0 })
}

// The nat path and the socket path admit against one cap.
func TestSockLBAndNatPathShareOneCap(t *testing.T) {
	tp := newNatTopo(t, 2)
	np := tp.load(t)
	defer np.Close()
	cg := joinCgroup(t)
	lb := loadSockLB(t, tp.pins, cg, tp.host)
	defer lb.Close()
	require.NoError(t, lb.SetTarget(anyHost, ProtoTCP, 8080, SockTarget{Guest: guest("10.213.0.11:7000"), Slot: tp.slot.Index()}))
	require.NoError(t, lb.SetLocalAddrs([]netip.Addr{netip.MustParseAddr("10.99.0.1"), netip.MustParseAddr("10.213.0.1")}))
	natDial := func() (net.Conn, error) { return dial(t, tp.client, "tcp4", "10.99.0.1:8080") }
	localDial := func(dst string) (net.Conn, error) { return dial(t, tp.host, "tcp", dst) }

	// Two through nat: loopback and host-address callers are refused.
	n1, err := natDial()
	require.NoError(t, err)
	defer n1.Close()
	n2, err := natDial()
	require.NoError(t, err)
	roundTrip(t, n2, []byte("nat"))
	for _, dst := range []string{"127.0.0.1:8080", "[::1]:8080", "10.99.0.1:8080"} {
		_, err = localDial(dst)
		require.ErrorIs(t, err, syscall.ECONNREFUSED, dst)
	}
	assert.EqualValues(t, 3, tp.slot.Read().Refused)

	// One of each: either kind is refused.
	require.NoError(t, n2.Close())
	eventually(t, "active 1", func() bool { return tp.slot.Read().Active == 1 })
	l1, err := localDial("127.0.0.1:8080")
	require.NoError(t, err)
	roundTrip(t, l1, []byte("local"))
	_, err = natDial()
	require.ErrorIs(t, err, syscall.ECONNREFUSED)
	_, err = localDial("[::1]:8080")
	require.ErrorIs(t, err, syscall.ECONNREFUSED)
	assert.False(t, tp.slot.TryOpen())

	// Close the local one: a nat caller is admitted; close a nat one: a
	// local caller is.
	require.NoError(t, l1.Close())
	eventually(t, "active 1", func() bool { return tp.slot.Read().Active == 1 })
	n3, err := natDial()
	require.NoError(t, err)
	roundTrip(t, n3, []byte("n3"))
	require.NoError(t, n1.Close())
	eventually(t, "active 1", func() bool { return tp.slot.Read().Active == 1 })
	l2, err := localDial("[::1]:8080")
	require.NoError(t, err)
	roundTrip(t, l2, []byte("l2"))
	n3.Close()
	l2.Close()
	eventually(t, "active 0", func() bool { return tp.slot.Read().Active == 0 })
	c := tp.slot.Read()
	assert.EqualValues(t, 5, c.Accepted)
	assert.EqualValues(t, 5, c.Refused)
	k, p := tp.slot.Shares()
	assert.Zero(t, k)
	assert.Zero(t, p)
}

// cgroupLinksRunning counts the links on cgroup at attach that run prog
// (by tag; recvmsg and getpeername share code, so their tags match).
func cgroupLinksRunning(t *testing.T, cgroup string, prog *ebpf.Program, attach ebpf.AttachType) int {
	t.Helper()
	cgid, err := cgroupID(cgroup)
	require.NoError(t, err)
	pi, err := prog.Info()
	require.NoError(t, err)
	it := new(link.Iterator)
	defer it.Close()
	n := 0
	for it.Next() {
		info, err := it.Link.Info()
		if err != nil || info.Cgroup() == nil || info.Cgroup().CgroupId != cgid || ebpf.AttachType(info.Cgroup().AttachType) != attach {
			continue
		}
		p, err := ebpf.NewProgramFromID(info.Program)
		if err != nil {
			continue
		}
		if i, err := p.Info(); err == nil && i.Tag == pi.Tag {
			n++
		}
		p.Close()
	}
	require.NoError(t, it.Err())
	return n
}

// What byte counting costs per packet: the cgroup_skb programs run on every
// packet of every socket in the cgroup; a TCP packet leaves after the
// protocol test (TCP is counted once, at close), a translated UDP datagram
// is counted. The figures are logged (go test -v); the counts are checked.
func TestSockLBCountingCostPerPacket(t *testing.T) {
	kernelfeat.Require(t, kernelfeat.RunTimeStats)
	stats, err := ebpf.EnableStats(uint32(unix.BPF_STATS_RUN_TIME))
	require.NoError(t, err)
	defer stats.Close()
	tp := newSockTopo(t, ProtoUDP, 0)
	lb := tp.load(t)
	defer lb.Close()
	require.NoError(t, lb.SetTarget(anyHost, ProtoUDP, 8080, SockTarget{Guest: guest("10.213.0.11:7000"), Slot: tp.slot.Index()}))
	require.NoError(t, lb.SetTarget(anyHost, ProtoTCP, 8080, SockTarget{Guest: guest("10.213.0.11:7000"), Slot: tp.slot.Index()}))

	cost := func(p *ebpf.Program) (time.Duration, uint64) {
		st, err := p.Stats()
		require.NoError(t, err)
		return st.Runtime, st.RunCount
	}
	measure := func(what string, run func()) {
		e0, en0 := cost(lb.objs.BrkSockEgress)
		i0, in0 := cost(lb.objs.BrkSockIngress)
		run()
		e1, en1 := cost(lb.objs.BrkSockEgress)
		i1, in1 := cost(lb.objs.BrkSockIngress)
		require.Greater(t, en1, en0, what)
		require.Greater(t, in1, in0, what)
		t.Logf("%s: egress %d packets, %.1f ns each; ingress %d packets, %.1f ns each", what,
			en1-en0, float64(e1-e0)/float64(en1-en0), in1-in0, float64(i1-i0)/float64(in1-in0))
	}

	const n = 2000
	c, err := dial(t, tp.host, "udp", "127.0.0.1:8080")
	require.NoError(t, err)
	defer c.Close()
	msg := make([]byte, 100)
	measure("UDP, counted", func() {
		for i := 0; i < n; i++ {
			roundTrip(t, c, msg)
		}
	})
	eventually(t, "UDP bytes", func() bool {
		r := tp.slot.Read()
		return r.BytesIn == n*100 && r.BytesOut == n*100
	})

	tc, err := dial(t, tp.host, "tcp", "127.0.0.1:8080")
	require.NoError(t, err)
	big := make([]byte, 1<<20)
	measure("TCP, passed over", func() {
		for i := 0; i < 16; i++ {
			roundTrip(t, tc, big)
		}
	})
	require.NoError(t, tc.Close())
	eventually(t, "TCP bytes at close", func() bool {
		r := tp.slot.Read()
		return r.BytesIn == n*100+16<<20 && r.BytesOut == n*100+16<<20
	})
}

// The socket path's bound in the model is its map's size: the config
// refuses a state with more host ports to translate than sock_targets (and
// sock_targets6) hold.
func TestSockTargetsHoldMaxSocketPathPorts(t *testing.T) {
	cs, err := loadSocklb()
	require.NoError(t, err)
	for _, m := range []string{"sock_targets", "sock_targets6"} {
		assert.EqualValues(t, spec.MaxSocketPathPorts, cs.Maps[m].MaxEntries, m)
	}
}
