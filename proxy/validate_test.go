package proxy

import (
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/brokkr/brokkr/bpf"
	"github.com/brokkr/brokkr/internal/nstest"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

func TestValidateNamesTheFieldOfEveryBadSpec(t *testing.T) {
	good := Spec{ID: "web", VM: "vm1", Protocol: "tcp", HostAddress: "0.0.0.0", HostPort: 8080, GuestPort: 80}
	with := func(f func(*Spec)) Spec { s := good; f(&s); return s }
	cases := []struct {
		spec Spec
		want string
	}{
		{with(func(s *Spec) { s.GuestPort = 70000 }), "guestPort: 70000 is out of range 1..65535"},
		{with(func(s *Spec) { s.GuestPort = 0 }), "guestPort: 0 is out of range"},
		{with(func(s *Spec) { s.HostPort = 65536 }), "hostPort: 65536 is out of range"},
		{with(func(s *Spec) { s.HostPort = -1 }), "hostPort: -1 is out of range"},
		{with(func(s *Spec) { s.Protocol = "sctp" }), `protocol: "sctp" is not tcp or udp`},
		{with(func(s *Spec) { s.Protocol = "" }), "protocol: empty"},
		{with(func(s *Spec) { s.HostAddress = "localhost" }), `hostAddress: "localhost" is not an IP address`},
		{with(func(s *Spec) { s.HostAddress = "fe80::1%eth0" }), "hostAddress:"},
		{with(func(s *Spec) { s.ID = "" }), "name: empty"},
		{with(func(s *Spec) { s.ID = strings.Repeat("x", 64) }), "name:"},
		{with(func(s *Spec) { s.VM = "" }), "vm: empty"},
		{with(func(s *Spec) { s.MaxConns = -1 }), "maxConns: -1 is negative"},
		{with(func(s *Spec) { s.UDPIdle = -time.Second }), "udpIdle:"},
	}
	for _, c := range cases {
		_, err := validate(c.spec)
		if assert.Error(t, err, "%+v", c.spec) {
			assert.Contains(t, err.Error(), c.want)
		}
	}
	c, err := validate(with(func(s *Spec) { s.Protocol = "UDP"; s.HostAddress = ""; s.HostPort = 0 }))
	require.NoError(t, err, "HostPort 0 means any free port; an empty address means any IPv4")
	assert.Equal(t, "udp", c.Protocol)
	assert.Equal(t, "0.0.0.0:0", c.hostAddrPort())
	assert.Equal(t, DefaultUDPIdle, c.idle)
}

func TestValidateAllFailsDuplicatesAfterTheFirst(t *testing.T) {
	a := Spec{ID: "a", VM: "vm1", Protocol: "tcp", HostAddress: "127.0.0.1", HostPort: 8080, GuestPort: 80}
	dupID := a
	dupID.HostPort = 8081
	dupBind := Spec{ID: "b", VM: "vm1", Protocol: "tcp", HostAddress: "127.0.0.1", HostPort: 8080, GuestPort: 81}
	otherProto := dupBind
	otherProto.ID, otherProto.Protocol = "c", "udp"
	mapped := Spec{ID: "d", VM: "vm1", Protocol: "tcp", HostAddress: "::ffff:127.0.0.1", HostPort: 8080, GuestPort: 82}
	_, errs, owners := validateAll([]Spec{a, dupID, dupBind, otherProto, mapped})
	assert.NoError(t, errs[0])
	assert.ErrorContains(t, errs[1], `name: "a" is used by an earlier exposure`)
	assert.ErrorContains(t, errs[2], `hostPort: tcp 127.0.0.1:8080 is already published by exposure "a"`)
	assert.NoError(t, errs[3], "the same port over another protocol is another socket")
	assert.ErrorContains(t, errs[4], "already published", "an IPv4-mapped address is the IPv4 address")
	assert.Equal(t, []bool{true, false, true, true, true}, owners)
}

func TestABadSpecFailsAloneAndTheOthersConverge(t *testing.T) {
	m, _ := newManager(t)
	port := echoServer(t, "g:")
	good := tcpSpec("good", port)
	bad := tcpSpec("bad", 70000)
	twin := tcpSpec("good", port)
	st := m.Converge([]Spec{bad, good, twin, {ID: "odd", VM: "vm1", Protocol: "sctp", GuestPort: 1}})
	require.Len(t, st, 4)
	assert.Equal(t, StateFailed, st[0].State)
	assert.Equal(t, "guestPort: 70000 is out of range 1..65535", st[0].Reason)
	assert.Equal(t, StateActive, st[1].State, st[1].Reason)
	assert.Equal(t, StateFailed, st[2].State)
	assert.Contains(t, st[2].Reason, "name:")
	assert.Equal(t, StateFailed, st[3].State)
	assert.Contains(t, st[3].Reason, "protocol:")
	assert.Equal(t, "g:ok", roundTrip(t, dial(t, st[1].BoundAddr), "g:", "ok"))

	// An exposure whose spec turns bad stops serving but keeps its counters.
	good.GuestPort = 0
	again := only(t, m, good)
	assert.Equal(t, StateFailed, again.State)
	assert.Contains(t, again.Reason, "guestPort: 0")
	assert.EqualValues(t, 1, again.Counters.Accepted)
	assert.Nil(t, listenerOf(m, "good"))
}

func FuzzValidate(f *testing.F) {
	f.Add("web", "vm1", "tcp", "0.0.0.0", 8080, 80, 256, int64(0))
	f.Add("", "", "udp", "::", 0, 0, 0, int64(-1))
	f.Add("x", "y", "TCP", "::ffff:10.0.0.1", 65535, 65536, -1, int64(time.Second))
	f.Add("a\x00b", "v", "sctp", "1.2.3.4.5", -1, 1, 1, int64(1))
	f.Fuzz(func(t *testing.T, id, vm, proto, addr string, hostPort, guestPort, maxConns int, idle int64) {
		s := Spec{ID: id, VM: vm, Protocol: proto, HostAddress: addr, HostPort: hostPort, GuestPort: guestPort,
			MaxConns: maxConns, UDPIdle: time.Duration(idle)}
		c, err := validate(s)
		if err != nil {
			field, _, ok := strings.Cut(err.Error(), ":")
			if !ok || !strings.Contains("name vm protocol hostAddress hostPort guestPort maxConns udpIdle", field) {
				t.Fatalf("error does not start with a field name: %v", err)
			}
			return
		}
		if c.HostPort < 0 || c.HostPort > 65535 || c.GuestPort < 1 || c.GuestPort > 65535 {
			t.Fatalf("accepted out-of-range ports: %+v", s)
		}
		if c.Protocol != "tcp" && c.Protocol != "udp" {
			t.Fatalf("accepted protocol %q", c.Protocol)
		}
		if !c.host.IsValid() || c.idle <= 0 || bpf.ValidName(c.ID) != nil {
			t.Fatalf("accepted %+v", s)
		}
	})
}

func TestCountersLandInThePinnedMap(t *testing.T) {
	dir := nstest.PrivateBPFFS(t)
	store, err := bpf.Open(dir)
	require.NoError(t, err)
	defer store.Close()
	g := &guests{addrs: map[string]string{"vm1": "127.0.0.1"}}
	m := NewManager(g.resolve, store)
	assert.Empty(t, m.CountersReason(), "pinned: nothing to warn about")

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
