package proxy

import (
	"github.com/brokkr/brokkr/internal/spec"
	"net/netip"
	"strconv"
	"strings"
	"testing"

	"github.com/brokkr/brokkr/bpf"
	"github.com/brokkr/brokkr/internal/nstest"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

func TestFillGivesTheDefaults(t *testing.T) {
	c := fill(Spec{Exposure: spec.Exposure{Name: "web", Target: spec.Target{VM: "vm1"}, Proto: spec.UDP, GuestPort: 80}})
	assert.Equal(t, "0.0.0.0:0", c.hostAddrPort(), "HostPort 0 means any free port; no address means any IPv4")
	assert.Equal(t, DefaultUDPIdle, c.idle)
	mapped := fill(Spec{Exposure: spec.Exposure{HostPort: 80}, Listen: netip.MustParseAddr("::ffff:127.0.0.1")})
	assert.Equal(t, "127.0.0.1:80", mapped.hostAddrPort(), "an IPv4-mapped address binds as the IPv4 address")
}

func TestValidateAllFailsDuplicatesAfterTheFirst(t *testing.T) {
	a := Spec{Exposure: spec.Exposure{Name: "a", Target: spec.Target{VM: "vm1"}, Proto: "tcp", HostPort: 8080, GuestPort: 80}, Listen: netip.MustParseAddr("127.0.0.1")}
	dupID := a
	dupID.GuestPort = 81
	dupBind := Spec{Exposure: spec.Exposure{Name: "b", Target: spec.Target{VM: "vm1"}, Proto: "tcp", HostPort: 8080, GuestPort: 81}, Listen: netip.MustParseAddr("127.0.0.1")}
	otherProto := dupBind
	otherProto.Name, otherProto.Proto = "c", "udp"
	mapped := Spec{Exposure: spec.Exposure{Name: "d", Target: spec.Target{VM: "vm1"}, Proto: "tcp", HostPort: 8080, GuestPort: 82}, Listen: netip.MustParseAddr("::ffff:127.0.0.1")}
	// Another port of a's range is a listener of its own.
	ranged := a
	ranged.HostPortLast, ranged.Port = 8082, 8082
	_, errs, owners := validateAll([]Spec{a, dupID, dupBind, otherProto, mapped, ranged})
	assert.NoError(t, errs[0])
	assert.ErrorContains(t, errs[1], `name: "a" on 127.0.0.1:8080 is used by an earlier exposure`)
	assert.ErrorContains(t, errs[2], `hostPort: tcp 127.0.0.1:8080 is already published by exposure "a"`)
	assert.NoError(t, errs[3], "the same port over another protocol is another socket")
	assert.ErrorContains(t, errs[4], "already published", "an IPv4-mapped address is the IPv4 address")
	assert.NoError(t, errs[5])
	assert.Equal(t, []bool{true, false, true, true, true, true}, owners)
}

func TestADuplicateFailsAloneAndTheOthersConverge(t *testing.T) {
	m, _ := newManager(t)
	port := echoServer(t, "g:")
	good := tcpSpec("good", port)
	twin := tcpSpec("good", port)
	to := tcpSpec("to-addr", port)
	to.Target = spec.Target{Addr: netip.MustParseAddr("127.0.0.1")}
	st := m.Converge([]Spec{good, twin, to})
	require.Len(t, st, 3)
	assert.Equal(t, StateActive, st[0].State, st[0].Reason)
	assert.Equal(t, StateFailed, st[1].State)
	assert.Contains(t, st[1].Reason, "name:")
	assert.Equal(t, "g:ok", roundTrip(t, dial(t, st[0].BoundAddr), "g:", "ok"))
	require.Equal(t, StateActive, st[2].State, "a fixed target needs no resolver: %s", st[2].Reason)
	assert.Equal(t, "g:to", roundTrip(t, dial(t, st[2].BoundAddr), "g:", "to"))
}

func TestCountersLandInThePinnedMap(t *testing.T) {
	dir := nstest.PrivateBPFFS(t)
	store, err := bpf.Open(dir)
	require.NoError(t, err)
	defer store.Close()
	g := &guests{addrs: map[string]string{"vm1": "127.0.0.1"}}
	m := NewManager(g.resolve, store)
	assert.Empty(t, m.stats.Reason(), "pinned: nothing to warn about")

	keep, gone := tcpSpec("keep", echoServer(t, "g:")), tcpSpec("gone", echoServer(t, "g:"))
	st := m.Converge([]Spec{keep, gone})
	for _, s := range st {
		require.Equal(t, StateActive, s.State, s.Reason)
	}
	require.NoError(t, hold(t, st[0].BoundAddr).Close())
	eventually(t, "the pipe ends", func() bool { return conns(m, "keep") == 0 })

	entries, err := bpf.Dump(store.Path())
	require.NoError(t, err)
	byName := map[string]bpf.Entry{}
	for _, e := range entries {
		byName[e.Name] = e
	}
	require.Contains(t, byName, "keep")
	require.Contains(t, byName, "gone")
	k := byName["keep"]
	assert.EqualValues(t, bpf.ProtoTCP, k.Protocol)
	assert.Equal(t, st[0].BoundAddr[strings.LastIndex(st[0].BoundAddr, ":")+1:], strconv.Itoa(int(k.HostPort)), "the bound port, not the 0 asked for")
	assert.Equal(t, bpf.Counters{Accepted: 1, BytesIn: 4, BytesOut: 6}, k.Counters)

	m.Converge([]Spec{keep}) // "gone" is deleted: its slot is zeroed and freed
	m.StopAll()              // "keep" is only stopped: its slot stays
	entries, err = bpf.Dump(store.Path())
	require.NoError(t, err)
	require.Len(t, entries, 1)
	assert.Equal(t, "keep", entries[0].Name)
	assert.EqualValues(t, 1, entries[0].Accepted)
}
