package bpf

import (
	"encoding/binary"
	"encoding/json"
	"errors"
	"net"
	"net/netip"
	"os/exec"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/brokkr/brokkr/internal/nstest"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

func TestAllowKeysRoundTripBothFamilies(t *testing.T) {
	for _, s := range []string{"10.0.0.0/8", "192.0.2.7/32", "0.0.0.0/0", "2001:db8::/32", "::/0", "fd00::1/128"} {
		p := netip.MustParsePrefix(s)
		k := allowKeyOf(7, p)
		assert.EqualValues(t, 7, k.Slot)
		back, ok := prefixOf(k)
		require.True(t, ok, s)
		assert.Equal(t, p, back, s)
	}
	assert.EqualValues(t, 32+96+8, allowKeyOf(0, netip.MustParsePrefix("10.0.0.0/8")).Prefixlen)
	assert.EqualValues(t, 32+32, allowKeyOf(0, netip.MustParsePrefix("2001:db8::/32")).Prefixlen)
}

// dialDenied dials once with a deadline shorter than TCP's first SYN
// retransmission (1 s): a caller the nat path drops sees a timeout, never
// a refusal, and sends one SYN.
func dialDenied(t *testing.T, ns *nstest.NS) {
	t.Helper()
	err := ns.Do(func() error {
		c, err := net.DialTimeout("tcp4", "10.99.0.1:8080", 500*time.Millisecond)
		if err == nil {
			c.Close()
		}
		return err
	})
	require.Error(t, err, "a caller outside allowFrom is not carried")
	var ne net.Error
	require.True(t, errors.As(err, &ne) && ne.Timeout(), "dropped, not reset: %v", err)
}

func TestNatPathAllowFromDropsOthersBeforeAdmissionAndCountsThemDenied(t *testing.T) {
	tp := newNatTopo(t, 1)
	other := nstest.New(t, "cli2")
	nstest.Link(t, other, "eth0", "10.98.0.2/24", tp.host, "vh-cli2", "10.98.0.1/24")
	other.MustRun(t, "ip", "route", "add", "default", "via", "10.98.0.1")
	np := tp.load(t)
	defer func() { np.Close() }()
	require.NoError(t, np.SetAllow(tp.slot.Index(), tp.slot.Gen(),
		[]netip.Prefix{netip.MustParsePrefix("10.99.0.0/24"), netip.MustParsePrefix("2001:db8::/32")}))

	// A denied caller first: dropped, counted, no place taken.
	dialDenied(t, other)
	c := tp.slot.Read()
	assert.EqualValues(t, 1, c.Denied)
	assert.Zero(t, c.Accepted)
	assert.Zero(t, c.Refused)
	assert.Zero(t, c.Active)

	// The allowed caller gets the cap's one place.
	a, err := dial(t, tp.client, "tcp4", "10.99.0.1:8080")
	require.NoError(t, err, "the cap of 1 was not consumed by the denied caller")
	roundTrip(t, a, []byte("hello"))
	// While it holds the place, a denied caller is still denied, not
	// refused: allowFrom comes before the cap.
	dialDenied(t, other)
	c = tp.slot.Read()
	assert.EqualValues(t, 2, c.Denied)
	assert.EqualValues(t, 1, c.Accepted)
	assert.Zero(t, c.Refused)
	assert.EqualValues(t, 1, c.Active)
	a.Close()
	eventually(t, "active 0", func() bool { return tp.slot.Read().Active == 0 })

	// Host-local callers (LOCAL_OUT) are not restricted.
	h, err := dial(t, tp.host, "tcp4", "10.99.0.1:8080")
	require.NoError(t, err, "a host-local caller is the host's own process")
	roundTrip(t, h, []byte("x"))
	h.Close()
	eventually(t, "active 0", func() bool { return tp.slot.Read().Active == 0 })

	// With no daemon the pinned maps go on denying and counting, and a
	// new process reads every count.
	require.NoError(t, np.Close())
	dialDenied(t, other)
	store2, err := Open(tp.pins)
	require.NoError(t, err)
	defer store2.Close()
	got, ok := store2.Lookup("web")
	require.True(t, ok)
	assert.EqualValues(t, 3, got.Denied, "counted with no daemon, kept across the restart")
	entries, err := Dump(tp.pins + "/" + MapName)
	require.NoError(t, err)
	require.Len(t, entries, 1)
	assert.EqualValues(t, 3, entries[0].Denied, "brokkr stats reads exposure_denied_v2")
	if _, err := exec.LookPath("bpftool"); err == nil {
		i := tp.slot.Index()
		out, err := exec.Command("bpftool", "-j", "map", "lookup", "pinned", tp.pins+"/"+DeniedMapName, "key",
			strconv.Itoa(i&0xff), strconv.Itoa(i>>8&0xff), "0", "0").CombinedOutput()
		require.NoError(t, err, string(out))
		var v struct {
			Formatted struct {
				Value struct {
					Denied uint64 `json:"denied"`
				} `json:"value"`
			} `json:"formatted"`
		}
		require.NoError(t, json.Unmarshal(out, &v), string(out))
		assert.EqualValues(t, 3, v.Formatted.Value.Denied, "bpftool prints the named field: %s", out)
	}

	// A new process learns what the trie holds: lifting the restriction
	// admits everyone again.
	np = tp.load(t)
	require.NoError(t, np.SetAllow(tp.slot.Index(), tp.slot.Gen(), nil))
	b, err := dial(t, other, "tcp4", "10.99.0.1:8080")
	require.NoError(t, err, "no allowFrom: everyone")
	roundTrip(t, b, []byte("y"))
	b.Close()
	assert.EqualValues(t, 3, tp.slot.Read().Denied)
	var k natpathAllowKey
	var gen uint32
	assert.False(t, np.objs.AllowFrom.Iterate().Next(&k, &gen), "the prefixes are deleted")
}

func TestAllowFromOfADeletedExposureDoesNotRestrictTheSlotsNextOwner(t *testing.T) {
	tp := newNatTopo(t, 0)
	other := nstest.New(t, "cli2")
	nstest.Link(t, other, "eth0", "10.98.0.2/24", tp.host, "vh-cli2", "10.98.0.1/24")
	other.MustRun(t, "ip", "route", "add", "default", "via", "10.98.0.1")
	np := tp.load(t)
	defer np.Close()
	require.NoError(t, np.SetAllow(tp.slot.Index(), tp.slot.Gen(), []netip.Prefix{netip.MustParsePrefix("10.99.0.0/24")}))
	dialDenied(t, other)
	assert.EqualValues(t, 1, tp.slot.Read().Denied)

	// The exposure is deleted and its slot given to a new one, while no
	// one pruned the trie: the generation tells them apart.
	tp.slot.Release(true)
	slot2, err := tp.store.Attach("web2", ProtoTCP, 8080)
	require.NoError(t, err)
	defer slot2.Release(false)
	require.Equal(t, tp.slot.Index(), slot2.Index(), "the slot is reused")
	assert.Zero(t, slot2.Read().Denied, "a new exposure starts at zero")
	b, err := dial(t, other, "tcp4", "10.99.0.1:8080")
	require.NoError(t, err, "the old exposure's allowFrom does not restrict the new one")
	roundTrip(t, b, []byte("z"))
	b.Close()
	require.NoError(t, np.PruneAllow(func(int) bool { return false }))
	var k natpathAllowKey
	var gen uint32
	assert.False(t, np.objs.AllowFrom.Iterate().Next(&k, &gen), "pruned")
}

// sendBareACK sends one TCP segment with only ACK set (no connection) from
// src to dst:port, from inside ns, by a raw socket: what conntrack's loose
// mode picks up as a new entry mid-stream.
func sendBareACK(t *testing.T, ns *nstest.NS, src, dst netip.Addr, sport, dport uint16) {
	t.Helper()
	pkt := make([]byte, 40)
	pkt[0] = 0x45
	binary.BigEndian.PutUint16(pkt[2:], 40)
	pkt[8] = 64
	pkt[9] = syscall.IPPROTO_TCP
	s4, d4 := src.As4(), dst.As4()
	copy(pkt[12:16], s4[:])
	copy(pkt[16:20], d4[:])
	tcp := pkt[20:]
	binary.BigEndian.PutUint16(tcp[0:], sport)
	binary.BigEndian.PutUint16(tcp[2:], dport)
	binary.BigEndian.PutUint32(tcp[4:], 1000)
	binary.BigEndian.PutUint32(tcp[8:], 2000)
	tcp[12] = 5 << 4
	tcp[13] = 0x10 // ACK
	binary.BigEndian.PutUint16(tcp[14:], 65535)
	var sum uint32
	pseudo := append(append(append([]byte{}, s4[:]...), d4[:]...), 0, syscall.IPPROTO_TCP, 0, 20)
	for _, b := range [][]byte{pseudo, tcp} {
		for i := 0; i+1 < len(b); i += 2 {
			sum += uint32(binary.BigEndian.Uint16(b[i:]))
		}
	}
	for sum>>16 != 0 {
		sum = sum&0xffff + sum>>16
	}
	binary.BigEndian.PutUint16(tcp[16:], ^uint16(sum))
	require.NoError(t, ns.Do(func() error {
		fd, err := syscall.Socket(syscall.AF_INET, syscall.SOCK_RAW, syscall.IPPROTO_RAW)
		if err != nil {
			return err
		}
		defer syscall.Close(fd)
		return syscall.Sendto(fd, pkt, 0, &syscall.SockaddrInet4{Addr: d4})
	}))
}

// A denied source cannot reach the guest with packets of no connection
// either (a mid-stream ACK, which conntrack takes as a new entry): only an
// admitted flow's packets pass.
func TestNatPathAllowFromDropsEveryPacketOfADeniedSourceNotOnlySYNs(t *testing.T) {
	tp := newNatTopo(t, 0)
	other := nstest.New(t, "cli2")
	nstest.Link(t, other, "eth0", "10.98.0.2/24", tp.host, "vh-cli2", "10.98.0.1/24")
	other.MustRun(t, "ip", "route", "add", "default", "via", "10.98.0.1")
	np := tp.load(t)
	defer np.Close()
	require.NoError(t, np.SetAllow(tp.slot.Index(), tp.slot.Gen(), []netip.Prefix{netip.MustParsePrefix("10.99.0.0/24")}))
	// The guest counts what reaches its port 7000 that is not a SYN.
	cmd := tp.guest.Command("nft", "-f", "-")
	cmd.Stdin = strings.NewReader("table inet brkcount {\n chain in {\n  type filter hook input priority 0;\n  tcp dport 7000 tcp flags & (syn|ack) == ack counter\n }\n}\n")
	out, err := cmd.CombinedOutput()
	require.NoError(t, err, string(out))
	arrived := func() int {
		out := tp.guest.MustRun(t, "nft", "-j", "list", "table", "inet", "brkcount")
		i := strings.Index(out, `"packets": `)
		require.Positive(t, i, out)
		n, err := strconv.Atoi(strings.TrimSpace(strings.SplitN(out[i+len(`"packets": `):], ",", 2)[0]))
		require.NoError(t, err, out)
		return n
	}
	host := netip.MustParseAddr("10.99.0.1")
	sendBareACK(t, tp.client, netip.MustParseAddr("10.99.0.2"), host, 40001, 8080)
	require.Eventually(t, func() bool { return arrived() == 1 }, 3*time.Second, 20*time.Millisecond,
		"an allowed source's stray ACK reaches the guest (as without allowFrom)")
	sendBareACK(t, other, netip.MustParseAddr("10.98.0.2"), host, 40002, 8080)
	time.Sleep(300 * time.Millisecond)
	assert.Equal(t, 1, arrived(), "a denied source's stray ACK does not")
	assert.EqualValues(t, 1, tp.slot.Read().Denied, "and counts once, as a new conntrack entry")
}
