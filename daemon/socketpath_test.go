package daemon

import (
	"context"
	"fmt"
	"io"
	"log/slog"
	"net/netip"
	"sync"
	"testing"
	"time"

	"github.com/brokkr/brokkr/bpf"
	"github.com/brokkr/brokkr/daemon/config"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

// recSock records the socket path's translations.
type recSock struct {
	mu      sync.Mutex
	targets map[string]bpf.SockTarget
	local   []netip.Addr
	stale   int // CloseStale calls
}

func (s *recSock) CloseStale() (int, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.stale++
	return 0, nil
}

func (s *recSock) staleCalls() int {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.stale
}

func sockName(host netip.Addr, proto uint32, port uint16) string {
	return fmt.Sprintf("%s/%s:%d", bpf.ProtoName(proto), host, port)
}

func (s *recSock) SetTarget(host netip.Addr, proto uint32, port uint16, t bpf.SockTarget) error {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.targets[sockName(host, proto, port)] = t
	return nil
}

func (s *recSock) DeleteTarget(host netip.Addr, proto uint32, port uint16) error {
	s.mu.Lock()
	defer s.mu.Unlock()
	delete(s.targets, sockName(host, proto, port))
	return nil
}

func (s *recSock) SetLocalAddrs(a []netip.Addr) error {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.local = a
	return nil
}

func (s *recSock) get() map[string]bpf.SockTarget {
	s.mu.Lock()
	defer s.mu.Unlock()
	out := map[string]bpf.SockTarget{}
	for k, v := range s.targets {
		out[k] = v
	}
	return out
}

func newSockRig(t *testing.T, sock SocketPath, reason string) *rig {
	t.Helper()
	host, err := config.Parse([]byte(rigConfig))
	require.NoError(t, err)
	host.StateDir, host.RunDir = t.TempDir(), shortDir(t)
	c := &calls{}
	addrs := NewAddressBook()
	r := &rig{calls: c, sup: &recSup{calls: c}, net: &recNet{calls: c}, px: &recProxy{calls: c, resolve: addrs.Resolve},
		store: bpf.NewInMemory("test"), host: host}
	d, err := New(Options{Host: host, Store: r.store, Supervisor: r.sup, Network: r.net, Proxy: r.px, Addresses: addrs,
		Logger: slog.New(slog.NewTextHandler(io.Discard, nil)), Timeout: 200 * time.Millisecond,
		IPv6Loopback: true, SocketPath: sock, SocketPathReason: reason})
	require.NoError(t, err)
	r.d = d
	t.Cleanup(func() { _ = r.store.Close() })
	return r
}

func TestAutoServesLocalCallersThroughTheSocketPathNotLoopbackProxies(t *testing.T) {
	sock := &recSock{targets: map[string]bpf.SockTarget{}}
	r := newSockRig(t, sock, "")
	r.d.Pass(context.Background())

	specs, _ := r.px.specs()
	var ids []string
	for _, s := range specs {
		ids = append(ids, s.Name+"@"+s.Listen.String())
	}
	assert.Equal(t, []string{"web-proxy@0.0.0.0", "ext@0.0.0.0", "ext@::"}, ids, "no loopback listeners for auto exposures")
	got := sock.get()
	require.Len(t, got, 2)
	web, lo := got["tcp/0.0.0.0:8080"], got["tcp/127.0.0.1:5432"]
	assert.True(t, web.Down, "no lease yet: callers are refused at once")
	assert.True(t, lo.Down)
	assert.Equal(t, "pending", expo(r.d.Status(), "web-auto").State)
	assert.NotEmpty(t, sock.local, "the namespace's own addresses are listed")

	r.net.mu.Lock()
	r.net.leased = true
	r.net.mu.Unlock()
	r.d.Pass(context.Background())
	got = sock.get()
	web, lo = got["tcp/0.0.0.0:8080"], got["tcp/127.0.0.1:5432"]
	assert.Equal(t, bpf.SockTarget{Guest: netip.MustParseAddrPort("10.213.0.10:80"), Slot: web.Slot}, web)
	assert.Equal(t, bpf.SockTarget{Guest: netip.MustParseAddrPort("10.213.0.11:5432"), Slot: lo.Slot}, lo)
	assert.NotEqual(t, web.Slot, lo.Slot)
	st := r.d.Status()
	assert.Equal(t, "active", expo(st, "web-auto").State)
	assert.Equal(t, "active", expo(st, "lo-auto").State)
	assert.Equal(t, "auto", expo(st, "web-auto").Mode)
	// The translations changed (to the leased guests): their callers'
	// sockets are looked at once; a pass that changes nothing closes none.
	assert.Equal(t, 1, sock.staleCalls(), "a changed translation's sockets are closed")
	r.d.Pass(context.Background())
	assert.Equal(t, 1, sock.staleCalls(), "nothing changed, nothing to close")

	// The guest answers at its IPv6 address: IPv6 callers go there.
	r.net.mu.Lock()
	r.net.seen6 = true
	r.net.mu.Unlock()
	r.d.Pass(context.Background())
	web = sock.get()["tcp/0.0.0.0:8080"]
	assert.Equal(t, bpf.SockTarget{Guest: netip.MustParseAddrPort("10.213.0.10:80"),
		Guest6: netip.MustParseAddr("fd00:6272:6b72:0:5054:ff:fe00:1"), Slot: web.Slot}, web)
	// A changed translation, so its sockets are looked at (the iterator
	// keeps those still sent where the exposure sends them: here all).
	assert.Equal(t, 2, sock.staleCalls(), "a translation that gained an IPv6 address is looked at")

	// An exposure removed: its translation goes.
	next := *r.d.Desired()
	next.Exposures = nil
	for _, e := range r.d.Desired().Exposures {
		if e.Name != "lo-auto" {
			next.Exposures = append(next.Exposures, e)
		}
	}
	_, err := r.d.Apply(&next, false)
	require.NoError(t, err)
	r.d.Pass(context.Background())
	got = sock.get()
	assert.Contains(t, got, "tcp/0.0.0.0:8080")
	assert.NotContains(t, got, "tcp/127.0.0.1:5432")
	_, held := r.store.Lookup("lo-auto")
	assert.False(t, held, "its counter slot is freed")
	assert.Equal(t, 3, sock.staleCalls(), "a removed translation's sockets are closed")
}

func TestWithoutTheSocketPathAutoFallsBackToLoopbackProxiesAndSaysWhy(t *testing.T) {
	r := newSockRig(t, nil, "socket path unavailable: attaching to /sys/fs/cgroup: boom")
	r.d.Pass(context.Background())
	specs, _ := r.px.specs()
	var ids []string
	for _, s := range specs {
		ids = append(ids, s.Name+"@"+s.Listen.String())
	}
	assert.Contains(t, ids, "web-auto@127.0.0.1")
	assert.Contains(t, ids, "web-auto@::1")
	assert.Contains(t, r.d.Status().Warnings, "socket path unavailable: attaching to /sys/fs/cgroup: boom")
}

// A guest seen at its IPv6 address before it leased its IPv4 one: IPv6
// callers go through, IPv4 ones are refused at once (the translation is not
// Down, its IPv4 guest address is unspecified).
func TestTheSocketPathServesIPv6CallersOfAGuestWithoutIPv4Yet(t *testing.T) {
	sock := &recSock{targets: map[string]bpf.SockTarget{}}
	r := newSockRig(t, sock, "")
	r.net.mu.Lock()
	r.net.seen6 = true
	r.net.mu.Unlock()
	r.d.Pass(context.Background())
	web := sock.get()["tcp/0.0.0.0:8080"]
	assert.Equal(t, bpf.SockTarget{Guest: netip.MustParseAddrPort("0.0.0.0:80"),
		Guest6: netip.MustParseAddr("fd00:6272:6b72:0:5054:ff:fe00:1"), Slot: web.Slot}, web)
}
