package bpf

import (
	"encoding/binary"
	"errors"
	"fmt"
	"net"
	"net/netip"
	"os"
	"path/filepath"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/brokkr/brokkr/bpf/ctmark"
	"github.com/brokkr/brokkr/internal/nstest"
	"github.com/cilium/ebpf"
	"github.com/cilium/ebpf/link"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	"golang.org/x/sys/unix"
)

// The IPv6 side of natTopo (ULA addresses):
//
//	client fd00:6272:6b72:99::2 -- host fd00:6272:6b72:99::1 (br0
//	fd00:6272:6b72::1/64) -- guest fd00:6272:6b72::11, echo on 7000
//
// and an ip6 nft DNAT of [host]:8080 to the guest with the same ct mark as
// the IPv4 rule: one exposure, one slot, both families.
const (
	host6   = "[fd00:6272:6b72:99::1]:8080"
	guests6 = "fd00:6272:6b72::/64"
)

func newNatTopo6(t *testing.T, cap uint32) *natTopo {
	t.Helper()
	tp := newNatTopo(t, cap)
	addr6 := func(ns *nstest.NS, dev, cidr string) {
		ns.MustRun(t, "ip", "-6", "addr", "add", cidr, "dev", dev, "nodad")
	}
	var out []byte
	tp.host.MustRun(t, "sysctl", "-qw", "net.ipv6.conf.all.forwarding=1")
	addr6(tp.client, "eth0", "fd00:6272:6b72:99::2/64")
	addr6(tp.host, "vh-cli", "fd00:6272:6b72:99::1/64")
	addr6(tp.host, "br0", "fd00:6272:6b72::1/64")
	addr6(tp.guest, "eth0", "fd00:6272:6b72::11/64")
	tp.client.MustRun(t, "ip", "-6", "route", "add", "default", "via", "fd00:6272:6b72:99::1")
	tp.guest.MustRun(t, "ip", "-6", "route", "add", "default", "via", "fd00:6272:6b72::1")
	tp.guest.ServeEcho(t, "[::]:7000")
	// Neighbour discovery done before a test starts: a guest's first
	// answer to a solicitation can take most of a second, longer than the
	// short dials some tests make.
	u, err := dial(t, tp.host, "udp6", "[fd00:6272:6b72::11]:7000") // the guest itself, not DNATed
	require.NoError(t, err)
	roundTrip(t, u, []byte("nd"))
	u.Close()
	mark := fmt.Sprintf("0x%x", ctmark.Of(tp.slot.Index()))
	rule := `fib daddr type local meta l4proto { tcp, udp } th dport 8080 ct mark set ` + mark + ` dnat ip6 to [fd00:6272:6b72::11]:7000`
	script := `table ip6 brktest6 {
  chain pre { type nat hook prerouting priority -100; policy accept;
    ` + rule + `
  }
  chain out { type nat hook output priority -100; policy accept;
    ` + rule + `
  }
  chain post { type nat hook postrouting priority 100; policy accept;
    ct status dnat oifname "br0" ip6 saddr ` + guests6 + ` masquerade
  }
}`
	cmd := tp.host.Command("nft", "-f", "-")
	cmd.Stdin = strings.NewReader(script)
	out, err = cmd.CombinedOutput()
	require.NoError(t, err, string(out))
	return tp
}

func (tp *natTopo) load6(t *testing.T) *NatPath {
	t.Helper()
	np := tp.load(t)
	require.NoError(t, np.SetGuests(netip.MustParsePrefix("10.213.0.0/24"), netip.MustParsePrefix(guests6)))
	return np
}

// An IPv6 exposure is capped, refused by a RST, counted exactly and
// released on close, as an IPv4 one. (Fails with the IPv6 branch of
// brk_nat_reflect removed: the third caller times out instead of being
// refused.)
func TestNatPathIPv6CapsCountsAndReleasesInTheKernel(t *testing.T) {
	tp := newNatTopo6(t, 2)
	np := tp.load6(t)
	defer np.Close()

	a, err := dial(t, tp.client, "tcp6", host6)
	require.NoError(t, err)
	defer a.Close()
	b, err := dial(t, tp.client, "tcp6", host6)
	require.NoError(t, err)
	roundTrip(t, a, []byte("hello"))
	roundTrip(t, b, make([]byte, 100000))

	start := time.Now()
	_, err = dial(t, tp.client, "tcp6", host6)
	require.ErrorIs(t, err, syscall.ECONNREFUSED, "the third caller is refused by a RST")
	assert.Less(t, time.Since(start), time.Second)

	c := tp.slot.Read()
	assert.EqualValues(t, 2, c.Active)
	assert.EqualValues(t, 2, c.Accepted)
	assert.EqualValues(t, 1, c.Refused)
	eventually(t, "the open flows' bytes in the slot", func() bool {
		c := tp.slot.Read()
		return c.BytesIn == 100005 && c.BytesOut == 100005
	})

	require.NoError(t, b.Close())
	eventually(t, "active 1", func() bool { return tp.slot.Read().Active == 1 })
	d, err := dial(t, tp.client, "tcp6", host6)
	require.NoError(t, err, "the closed connection's place is given back")
	roundTrip(t, d, []byte("x"))
	d.Close()
	a.Close()
	eventually(t, "active 0", func() bool { return tp.slot.Read().Active == 0 })
	c = tp.slot.Read()
	assert.EqualValues(t, 3, c.Accepted)
	assert.EqualValues(t, 1, c.Refused)
	assert.EqualValues(t, 100006, c.BytesIn, "exactly")
	assert.EqualValues(t, 100006, c.BytesOut, "exactly")
	assert.Zero(t, c.Dropped)
	k, p := tp.slot.Shares()
	assert.Zero(t, k)
	assert.Zero(t, p)
}

// One cap, one slot: an exposure published on both families admits at
// most cap callers of either.
func TestNatPathOneCapHoldsAcrossBothFamilies(t *testing.T) {
	tp := newNatTopo6(t, 2)
	np := tp.load6(t)
	defer np.Close()

	a, err := dial(t, tp.client, "tcp4", "10.99.0.1:8080")
	require.NoError(t, err)
	defer a.Close()
	b, err := dial(t, tp.client, "tcp6", host6)
	require.NoError(t, err)
	defer b.Close()
	roundTrip(t, a, []byte("four"))
	roundTrip(t, b, []byte("six"))

	_, err = dial(t, tp.client, "tcp4", "10.99.0.1:8080")
	require.ErrorIs(t, err, syscall.ECONNREFUSED, "a third IPv4 caller")
	_, err = dial(t, tp.client, "tcp6", host6)
	require.ErrorIs(t, err, syscall.ECONNREFUSED, "a third IPv6 caller")
	c := tp.slot.Read()
	assert.EqualValues(t, 2, c.Active)
	assert.EqualValues(t, 2, c.Accepted)
	assert.EqualValues(t, 2, c.Refused)

	// The IPv6 place given back goes to an IPv4 caller.
	require.NoError(t, b.Close())
	eventually(t, "active 1", func() bool { return tp.slot.Read().Active == 1 })
	d, err := dial(t, tp.client, "tcp4", "10.99.0.1:8080")
	require.NoError(t, err)
	roundTrip(t, d, []byte("v4"))
	d.Close()
	a.Close()
	eventually(t, "active 0", func() bool { return tp.slot.Read().Active == 0 })
	c = tp.slot.Read()
	assert.EqualValues(t, 3, c.Accepted)
	assert.EqualValues(t, 4+3+2, c.BytesIn)
	assert.EqualValues(t, 4+3+2, c.BytesOut)
}

// IPv6 UDP flows: capped, their payload counted exactly, and a flow
// conntrack forgets gives its place back by the sweep.
func TestNatPathIPv6UDPFlowsAreCappedCountedAndFreedBySweep(t *testing.T) {
	tp := newNatTopo6(t, 1)
	np := tp.load6(t)
	defer np.Close()

	u, err := dial(t, tp.client, "udp6", host6)
	require.NoError(t, err)
	defer u.Close()
	roundTrip(t, u, []byte("ping!"))
	roundTrip(t, u, []byte("again"))

	v, err := dial(t, tp.client, "udp6", host6)
	require.NoError(t, err)
	defer v.Close()
	_, err = v.Write([]byte("nope"))
	require.NoError(t, err)
	require.NoError(t, v.SetReadDeadline(time.Now().Add(300*time.Millisecond)))
	_, err = v.Read(make([]byte, 10))
	require.Error(t, err, "a second flow is over the cap")

	c := tp.slot.Read()
	assert.EqualValues(t, 1, c.Active)
	assert.EqualValues(t, 1, c.Accepted)
	assert.EqualValues(t, 1, c.Refused)
	eventually(t, "the open flow's bytes in the slot", func() bool {
		c := tp.slot.Read()
		return c.BytesIn == 10 && c.BytesOut == 10
	})

	tp.host.MustRun(t, "conntrack", "-D", "-f", "ipv6", "-p", "udp", "--orig-port-dst", "8080")
	eventually(t, "active 0", func() bool { return tp.slot.Read().Active == 0 })
	_, err = v.Write([]byte("now"))
	require.NoError(t, err)
	got := make([]byte, 10)
	require.NoError(t, v.SetReadDeadline(time.Now().Add(3*time.Second)))
	n, err := v.Read(got)
	require.NoError(t, err)
	assert.Equal(t, "now", string(got[:n]))
	c = tp.slot.Read()
	assert.EqualValues(t, 2, c.Accepted)
	assert.Zero(t, c.Dropped, "a UDP flow may be one-way")
}

// dialDenied6 is dialDenied for an IPv6 caller bound to from.
func dialDenied6(t *testing.T, ns *nstest.NS, from string) {
	t.Helper()
	err := ns.Do(func() error {
		d := net.Dialer{Timeout: 500 * time.Millisecond, LocalAddr: &net.TCPAddr{IP: net.ParseIP(from)}}
		c, err := d.Dial("tcp6", host6)
		if err == nil {
			c.Close()
		}
		return err
	})
	require.Error(t, err, "a caller outside allowFrom is not carried")
	var ne net.Error
	require.True(t, errors.As(err, &ne) && ne.Timeout(), "dropped, not reset: %v", err)
}

// allowFrom with an IPv6 prefix: callers inside it get in, an IPv6 caller
// outside it and every IPv4 caller are dropped before admission and
// counted in denied. (Fails with the IPv6 branch of allowed() removed,
// which looks the caller up as a v4-mapped address: the allowed caller is
// dropped too.)
func TestNatPathAllowFromAnIPv6PrefixDropsOthersAndCountsThemDenied(t *testing.T) {
	tp := newNatTopo6(t, 1)
	const other = "fd00:6272:6b72:99:1::3"
	tp.client.MustRun(t, "ip", "-6", "addr", "add", other+"/64", "dev", "eth0", "nodad")
	np := tp.load6(t)
	defer np.Close()
	require.NoError(t, np.SetAllow(tp.slot.Index(), tp.slot.Gen(), []netip.Prefix{netip.MustParsePrefix("fd00:6272:6b72:99::/80")}))

	dialDenied6(t, tp.client, other)
	c := tp.slot.Read()
	assert.EqualValues(t, 1, c.Denied)
	assert.Zero(t, c.Accepted)
	assert.Zero(t, c.Active)
	dialDenied(t, tp.client) // IPv4, from 10.99.0.2
	assert.EqualValues(t, 2, tp.slot.Read().Denied, "an IPv4 caller is outside an IPv6-only list")

	var a net.Conn
	require.NoError(t, tp.client.Do(func() (err error) {
		d := net.Dialer{Timeout: 3 * time.Second, LocalAddr: &net.TCPAddr{IP: net.ParseIP("fd00:6272:6b72:99::2")}}
		a, err = d.Dial("tcp6", host6)
		return err
	}), "a caller inside the prefix")
	defer a.Close()
	roundTrip(t, a, []byte("hello"))
	dialDenied6(t, tp.client, other)
	c = tp.slot.Read()
	assert.EqualValues(t, 3, c.Denied, "denied, not refused, while the place is held")
	assert.EqualValues(t, 1, c.Accepted)
	assert.Zero(t, c.Refused)
	assert.EqualValues(t, 1, c.Active)
	a.Close()
	eventually(t, "active 0", func() bool { return tp.slot.Read().Active == 0 })
}

// The IPv6 links are upgraded as the IPv4 ones: a pinned link running
// another program (here brk_nat_out's, at IPv6 PREROUTING -99, as a previous
// binary's would be) is replaced by one at the other priority, -98, before
// it is dropped (the kernel refuses a second BPF program at one hook and
// priority), while links running the same program are kept. (Fails with the
// priority alternation in loadNatPath's attach removed: the attach gets
// EBUSY and the load falls back to adopting the previous links.)
func TestAChangedIPv6ProgramIsReplacedAtTheOtherPriority(t *testing.T) {
	requireNetfilterHooks(t)
	tp := newNatTopo6(t, 1)
	np1 := tp.load6(t)
	ids := linkIDs(t, np1.links)
	require.NoError(t, np1.Close())

	var prev natpathObjects
	require.NoError(t, loadNatpathObjects(&prev, &ebpf.CollectionOptions{Maps: ebpf.MapOptions{PinPath: tp.pins}}))
	defer prev.Close()
	pin := filepath.Join(tp.pins, pinNatPre6)
	require.NoError(t, os.Remove(pin)) // detaches np1's link
	// The kernel frees a link whose last reference was a pin from a work
	// queue, so its hook and priority are busy for a moment after the
	// unlink (CI saw EBUSY here; 7 runs in 20 did on this machine).
	var l link.Link
	var attachErr error
	eventually(t, "np1's link detached", func() bool {
		attachErr = tp.host.Do(func() (err error) {
			l, err = link.AttachNetfilter(link.NetfilterOptions{Program: prev.BrkNatOut, ProtocolFamily: link.NetfilterProtoIPv6,
				Hook: link.NetfilterInetPreRouting, Priority: NetfilterPriority})
			return err
		})
		return !errors.Is(attachErr, syscall.EBUSY)
	})
	require.NoError(t, attachErr)
	require.NoError(t, l.Pin(pin))
	require.NoError(t, l.Close())

	np2 := tp.load6(t)
	defer np2.Close()
	require.Empty(t, np2.Adopted(), "this binary's programs serve")
	assert.Zero(t, linksOf(t, prev.BrkNatOut), "the previous program is detached")
	info, err := np2.links[pinNatPre6].Info()
	require.NoError(t, err)
	require.NotNil(t, info.Netfilter())
	assert.EqualValues(t, netfilterPriorityAlt, info.Netfilter().Priority)
	assert.Equal(t, link.NetfilterProtoIPv6, info.Netfilter().ProtocolFamily)
	got := linkIDs(t, np2.links)
	for _, p := range []string{pinNatPre, pinNatOut, pinNatOut6, pinNatReflect} {
		assert.Equal(t, ids[p], got[p], "%s: the same program's link is kept", p)
	}

	a, err := dial(t, tp.client, "tcp6", host6)
	require.NoError(t, err)
	defer a.Close()
	roundTrip(t, a, []byte("after"))
	_, err = dial(t, tp.client, "tcp6", host6)
	require.ErrorIs(t, err, syscall.ECONNREFUSED, "the replacement caps")
	a.Close()
	eventually(t, "active 0", func() bool { return tp.slot.Read().Active == 0 })
	c := tp.slot.Read()
	assert.EqualValues(t, 1, c.Accepted)
	assert.EqualValues(t, 5, c.BytesIn)
	assert.EqualValues(t, 5, c.BytesOut)
}

// IPv6 callers admitted but never answered hold their places while
// conntrack holds them, then the sweep gives them back and counts them in
// dropped; over the cap they are refused by a RST even so.
func TestIPv6SYNsNeverAnsweredAreDroppedWhenTheirConntrackEntryExpires(t *testing.T) {
	tp := newNatTopo6(t, 2)
	np := tp.load6(t)
	defer np.Close()
	tp.host.MustRun(t, "sysctl", "-qw", "net.netfilter.nf_conntrack_tcp_timeout_syn_sent=3")
	tp.guest.MustRun(t, "nft", "add table ip6 brkdrop")
	tp.guest.MustRun(t, "nft", "add chain ip6 brkdrop in { type filter hook input priority 0 ; policy accept ; }")
	tp.guest.MustRun(t, "nft", "add rule ip6 brkdrop in tcp dport 7000 drop")

	refused := 0
	for i := 0; i < 3; i++ {
		err := tp.client.Do(func() error {
			c, err := net.DialTimeout("tcp6", host6, 300*time.Millisecond)
			if err == nil {
				c.Close()
			}
			return err
		})
		require.Error(t, err, "the guest answers nothing")
		if errors.Is(err, syscall.ECONNREFUSED) {
			refused++
		}
	}
	assert.Equal(t, 1, refused, "over the cap")
	assert.EqualValues(t, 2, tp.slot.Read().Active, "the unanswered callers hold their places while conntrack holds them")
	untilSweeps(t, np, 4, "nat_flows empty and every place back", func() bool {
		return natFlowCount(t, np) == 0 && tp.slot.Read().Active == 0
	})
	c := tp.slot.Read()
	assert.EqualValues(t, 2, c.Accepted)
	assert.EqualValues(t, 1, c.Refused)
	assert.EqualValues(t, 2, c.Dropped, "admitted, never answered")
}

// synWithDestOpts is an IPv6 TCP SYN from src:sport to dst:dport behind n
// destination-options headers (8 bytes each, a PadN option), checksums
// right: conntrack and nft walk any number of them.
func synWithDestOpts(src, dst netip.Addr, sport, dport uint16, n int) []byte {
	const tcpLen = 20
	ext := 8 * n
	p := make([]byte, 40+ext+tcpLen)
	p[0] = 0x60
	binary.BigEndian.PutUint16(p[4:], uint16(ext+tcpLen))
	p[6] = 6 // TCP, unless a header comes first
	if n > 0 {
		p[6] = 60
	}
	p[7] = 64
	s, d := src.As16(), dst.As16()
	copy(p[8:], s[:])
	copy(p[24:], d[:])
	for i := 0; i < n; i++ {
		h := p[40+8*i:]
		h[0] = 60
		if i == n-1 {
			h[0] = 6
		}
		h[1] = 0          // 8 bytes
		h[2], h[3] = 1, 4 // PadN, 4 bytes of padding
	}
	th := p[40+ext:]
	binary.BigEndian.PutUint16(th[0:], sport)
	binary.BigEndian.PutUint16(th[2:], dport)
	binary.BigEndian.PutUint32(th[4:], 1000)
	th[12] = 5 << 4
	th[13] = 0x02 // SYN
	binary.BigEndian.PutUint16(th[14:], 65535)
	var sum uint32
	add := func(b []byte) {
		for i := 0; i+1 < len(b); i += 2 {
			sum += uint32(binary.BigEndian.Uint16(b[i:]))
		}
	}
	add(s[:])
	add(d[:])
	sum += tcpLen + 6
	add(th[:tcpLen])
	for sum>>16 != 0 {
		sum = sum&0xffff + sum>>16
	}
	binary.BigEndian.PutUint16(th[16:], ^uint16(sum))
	return p
}

// A SYN whose TCP header is behind more extension headers than the
// programs walk is dropped before conntrack confirms it (never admitted,
// never past the cap or allowFrom), while one behind as many as they walk
// is admitted like any. (Fails with read_pkt's PKT_BAD let on instead of
// dropped in account(): the SYN reaches the guest and conntrack keeps its
// entry.)
func TestIPv6SYNsBehindHeadersNotWalkedAreDropped(t *testing.T) {
	tp := newNatTopo6(t, 0)
	np := tp.load6(t)
	defer np.Close()
	src, dst := netip.MustParseAddr("fd00:6272:6b72:99::2"), netip.MustParseAddr("fd00:6272:6b72:99::1")
	send := func(sport uint16, n int) {
		t.Helper()
		require.NoError(t, tp.client.Do(func() error {
			fd, err := unix.Socket(unix.AF_INET6, unix.SOCK_RAW, unix.IPPROTO_RAW)
			if err != nil {
				return err
			}
			defer unix.Close(fd)
			return unix.Sendto(fd, synWithDestOpts(src, dst, sport, 8080, n), 0, &unix.SockaddrInet6{Addr: dst.As16()})
		}))
	}
	entry := func(sport uint16) string {
		out, _ := tp.host.Run("conntrack", "-L", "-f", "ipv6", "-p", "tcp", "--orig-port-src", fmt.Sprint(sport))
		return out
	}
	tracked := func(sport uint16) bool { return strings.Contains(entry(sport), "dport=8080") }

	send(40001, 3) // as many as read_pkt walks
	eventually(t, "the SYN behind 3 headers admitted", func() bool { return tp.slot.Read().Accepted == 1 })
	assert.True(t, tracked(40001), "conntrack confirmed it")

	send(40002, 4) // one more
	time.Sleep(300 * time.Millisecond)
	assert.EqualValues(t, 1, tp.slot.Read().Accepted, "not admitted")
	if np.Hooks() == "tc" {
		// After conntrack, on the bridge: confirmed, and dropped there.
		// (The guest, listening, would have answered: SYN_RECV.)
		assert.Contains(t, entry(40002), "SYN_SENT", "confirmed before the bridge, and dropped there")
	} else {
		assert.False(t, tracked(40002), "dropped before conntrack confirmed it")
	}
	eventually(t, "active 0", func() bool { return tp.slot.Read().Active == 0 })
}

// While an upgrade runs two copies of the programs at the IPv6 hooks, an
// IPv6 connection is admitted once and counted once: the second copy
// knows the first one's new flow by its tuple (first words of both
// addresses and their hash) and initial sequence number. (Fails with
// track() storing no address hash for an IPv6 flow: the second copy takes
// the first one's new flow for a leftover and every connection is
// admitted twice.)
func TestTwoCopiesAtTheIPv6HooksCountEachConnectionOnce(t *testing.T) {
	requireNetfilterHooks(t)
	tp := newNatTopo6(t, 0)
	np := tp.load6(t)
	defer np.Close()
	var second natpathObjects
	require.NoError(t, loadNatpathObjects(&second, &ebpf.CollectionOptions{Maps: ebpf.MapOptions{PinPath: tp.pins}}))
	defer second.Close()
	for _, h := range []struct {
		hook link.NetfilterInetHook
		prog *ebpf.Program
	}{{link.NetfilterInetPreRouting, second.BrkNatPre}, {link.NetfilterInetLocalOut, second.BrkNatOut}} {
		var l link.Link
		require.NoError(t, tp.host.Do(func() (err error) {
			l, err = link.AttachNetfilter(link.NetfilterOptions{Program: h.prog, ProtocolFamily: link.NetfilterProtoIPv6,
				Hook: h.hook, Priority: netfilterPriorityAlt})
			return err
		}))
		defer l.Close()
	}
	for i := 0; i < 5; i++ {
		c, err := dial(t, tp.client, "tcp6", host6)
		require.NoError(t, err)
		roundTrip(t, c, []byte("0123456789"))
		require.NoError(t, c.Close())
	}
	eventually(t, "every place given back", func() bool { return tp.slot.Read().Active == 0 })
	c := tp.slot.Read()
	assert.EqualValues(t, 5, c.Accepted)
	assert.EqualValues(t, 50, c.BytesIn)
	assert.EqualValues(t, 50, c.BytesOut)
	k, p := tp.slot.Shares()
	assert.Zero(t, k)
	assert.Zero(t, p)
}

func TestGuestCfg6IsTheSubnetAndItsMaskInNetworkOrder(t *testing.T) {
	be := func(words ...uint32) [4]uint32 {
		var out [4]uint32
		for i, w := range words {
			var b [4]byte
			binary.BigEndian.PutUint32(b[:], w)
			out[i] = binary.NativeEndian.Uint32(b[:])
		}
		return out
	}
	c := guestCfg6(netip.MustParsePrefix("fd00:6272:6b72::/64"))
	assert.Equal(t, be(0xfd006272, 0x6b720000, 0, 0), c.GuestNet)
	assert.Equal(t, be(0xffffffff, 0xffffffff, 0, 0), c.GuestMask)
	c = guestCfg6(netip.MustParsePrefix("2001:db8:ab00::1/40"))
	assert.Equal(t, be(0x20010db8, 0xab000000, 0, 0), c.GuestNet, "masked")
	assert.Equal(t, be(0xffffffff, 0xff000000, 0, 0), c.GuestMask)
	c = guestCfg6(netip.MustParsePrefix("fd00::1/128"))
	assert.Equal(t, be(0xffffffff, 0xffffffff, 0xffffffff, 0xffffffff), c.GuestMask)
	for _, p := range []netip.Prefix{{}, netip.MustParsePrefix("10.213.0.0/24"), netip.MustParsePrefix("::/0")} {
		assert.Equal(t, natpathNatCfg6{}, guestCfg6(p), "%v: no subnet", p)
	}
}

// A guest calling its own exposure over IPv6 (hairpin) is admitted like any
// caller; over the cap its SYN is dropped, not reflected (a bridged guest
// caller never reaches the reflector), and counted refused. (Fails with the
// IPv6 branch of in_guest_net removed: with br_netfilter, as on this host,
// the refused SYN is bridged to the guest and the caller connects past the
// cap; without, it would get the reflector's RST.)
func TestAnIPv6GuestCallerOverTheCapIsDropped(t *testing.T) {
	requireNetfilterHooks(t)
	tp := newNatTopo6(t, 1)
	np := tp.load6(t)
	defer np.Close()

	g, err := dial(t, tp.guest, "tcp6", host6)
	require.NoError(t, err, "a guest caller under the cap")
	roundTrip(t, g, []byte("self"))
	require.EqualValues(t, 1, tp.slot.Read().Active)
	err = tp.guest.Do(func() error {
		c, err := net.DialTimeout("tcp6", host6, 500*time.Millisecond)
		if err == nil {
			c.Close()
		}
		return err
	})
	var ne net.Error
	require.True(t, errors.As(err, &ne) && ne.Timeout(), "dropped, not reset: %v", err)
	c := tp.slot.Read()
	assert.EqualValues(t, 1, c.Accepted)
	assert.EqualValues(t, 1, c.Refused)
	g.Close()
	eventually(t, "active 0", func() bool { return tp.slot.Read().Active == 0 })
	assert.EqualValues(t, 4, tp.slot.Read().BytesIn)
}

// An IPv6 connection reset by the caller gives its place back at once,
// while conntrack still holds it (in CLOSE, a minute here): not by the
// sweep. (Fails with the TH_RST release in account() removed.)
func TestAResetIPv6ConnectionGivesItsPlaceBackAtOnce(t *testing.T) {
	tp := newNatTopo6(t, 1)
	tp.host.MustRun(t, "sysctl", "-qw", "net.netfilter.nf_conntrack_tcp_timeout_close=60")
	np := tp.load6(t)
	defer np.Close()
	a, err := dial(t, tp.client, "tcp6", host6)
	require.NoError(t, err)
	roundTrip(t, a, []byte("abc"))
	require.NoError(t, a.(*net.TCPConn).SetLinger(0))
	require.NoError(t, a.Close()) // a RST, not a FIN
	eventually(t, "the RST gives the place back", func() bool { return tp.slot.Read().Active == 0 })
	out, _ := tp.host.Run("conntrack", "-L", "-f", "ipv6", "-p", "tcp", "--orig-port-dst", "8080")
	assert.Contains(t, out, "CLOSE ", "conntrack still holds the reset connection: the sweep did not free it")
	b, err := dial(t, tp.client, "tcp6", host6)
	require.NoError(t, err, "the next caller is admitted at once")
	roundTrip(t, b, []byte("x"))
	require.NoError(t, b.Close())
	eventually(t, "active 0", func() bool { return tp.slot.Read().Active == 0 })
	c := tp.slot.Read()
	assert.EqualValues(t, 2, c.Accepted)
	assert.EqualValues(t, 4, c.BytesIn)
	assert.Zero(t, c.Dropped)
}
