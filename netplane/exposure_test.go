package netplane

import (
	"context"
	"io"
	"net"
	"net/netip"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/brokkr/brokkr/bpf"
	"github.com/brokkr/brokkr/internal/kernelfeat"
	"github.com/brokkr/brokkr/internal/nstest"
	"github.com/brokkr/brokkr/internal/spec"
)

// serve answers every TCP connection on addr inside ns with tag, until the
// test ends.
func serve(t *testing.T, ns *nstest.NS, addr, tag string) {
	var ln net.Listener
	require.NoError(t, ns.Do(func() (err error) { ln, err = net.Listen("tcp4", addr); return err }))
	done := make(chan struct{})
	go func() {
		defer close(done)
		for {
			c, err := ln.Accept()
			if err != nil {
				return
			}
			_, _ = c.Write([]byte(tag))
			_ = c.Close()
		}
	}()
	t.Cleanup(func() { _ = ln.Close(); <-done })
}

// dial connects from inside ns and returns what the server said.
func dial(ns *nstest.NS, addr string) (string, error) {
	var c net.Conn
	if err := ns.Do(func() (err error) { c, err = net.DialTimeout("tcp4", addr, 2*time.Second); return err }); err != nil {
		return "", err
	}
	defer c.Close()
	_ = c.SetDeadline(time.Now().Add(2 * time.Second))
	b, err := io.ReadAll(c)
	return string(b), err
}

// A published port goes from pending (guest has no address yet) to active
// once the guest leased its address by DHCP; a client outside reaches the
// guest through the host address; the kernel counters land in the slot;
// an external flush of the nft table is repaired and reported; Teardown
// removes the table with the links.
func TestExposureFromPendingToActiveWithCounters(t *testing.T) {
	t.Run("nat path", func(t *testing.T) {
		nstest.RequireRoot(t)
		kernelfeat.Require(t, kernelfeat.NatPath...)
		exposureFromPendingToActive(t, true)
	})
	t.Run("event-fed fallback", func(t *testing.T) { exposureFromPendingToActive(t, false) })
}

func exposureFromPendingToActive(t *testing.T, natPath bool) {
	host, client := hostAndClient(t)
	var p *Plane
	var store *bpf.Store
	if natPath {
		p, store = newPinnedPlane(t, host, t.TempDir())
	} else {
		p, store = newPlane(t, host, t.TempDir())
	}

	d := Desired{
		Network: network(),
		Guests:  guestsOf("web"),
		Exposures: []Exposure{{Name: "web-http", Target: spec.Target{VM: "web"}, Proto: "tcp", HostPort: 8080, GuestPort: 80, MaxConns: 4},
			{Name: "outside", Target: spec.Target{Addr: mustAddr("10.213.0.250")}, Proto: "tcp", HostPort: 8081, GuestPort: 80}},
	}
	rep := p.Converge(context.Background(), d)
	require.NoError(t, rep.Err)
	require.Len(t, rep.Exposures, 2)
	assert.Equal(t, spec.StatePending, rep.Exposures[0].State, rep.Exposures[0].Reason)
	assert.Equal(t, spec.StateActive, rep.Exposures[1].State, "an explicit target has its address by definition")
	web := rep.Guests[0]
	assert.NotEqual(t, mustAddr("10.213.0.250"), web.Address, "a target address is never assigned")

	g := nstest.New(t, "guest")
	host.MustRun(t, "ip", "link", "add", "vh-web", "type", "veth", "peer", "name", "eth0", "address", web.MAC.String(), "netns", g.Name)
	host.MustRun(t, "ip", "link", "set", "vh-web", "master", "brokkr0", "up")
	g.MustRun(t, "ip", "link", "set", "eth0", "up")
	script := filepath.Join(t.TempDir(), "udhcpc.script")
	b, err := os.ReadFile("../tests/guest/udhcpc.script")
	require.NoError(t, err)
	require.NoError(t, os.WriteFile(script, b, 0o755))
	out, err := g.Run("busybox", "udhcpc", "-i", "eth0", "-n", "-q", "-f", "-t", "5", "-T", "1", "-s", script)
	require.NoError(t, err, out)
	assert.Contains(t, g.MustRun(t, "ip", "-4", "addr", "show", "eth0"), web.Address.String()+"/24")
	serve(t, g, ":80", "hello from web")

	rep = p.Converge(context.Background(), d)
	require.NoError(t, rep.Err)
	assert.True(t, rep.Guests[0].Leased)
	assert.Equal(t, spec.StateActive, rep.Exposures[0].State, rep.Exposures[0].Reason)
	table := host.MustRun(t, "nft", "list", "table", "inet", "brokkr")
	if natPath {
		assert.Empty(t, p.NatPathReason())
		assert.NotContains(t, table, "conns-web-http", "the cap is the BPF nat path's, not a set's")
	} else {
		assert.Contains(t, table, "conns-web-http")
	}

	for i := 0; i < 3; i++ {
		got, err := dial(client, "10.99.0.1:8080")
		require.NoError(t, err)
		assert.Equal(t, "hello from web", got)
	}
	rep = p.Converge(context.Background(), d)
	require.NoError(t, rep.Err)
	assert.Equal(t, uint64(3), rep.Exposures[0].Counters.Accepted, "kernel counter fed into the slot")
	c, ok := store.Lookup("web-http")
	require.True(t, ok)
	assert.Equal(t, uint64(3), c.Accepted, "the same slot the proxy adds into")

	host.MustRun(t, "nft", "flush", "table", "inet", "brokkr")
	rep = p.Converge(context.Background(), d)
	require.NoError(t, rep.Err)
	assert.Contains(t, strings.Join(rep.Repaired, "\n"), "nft ")
	got, err := dial(client, "10.99.0.1:8080")
	require.NoError(t, err, "works again after the repair")
	assert.Equal(t, "hello from web", got)
	rep = p.Converge(context.Background(), d)
	require.NoError(t, rep.Err)
	assert.Equal(t, uint64(4), rep.Exposures[0].Counters.Accepted, "counting goes on across the repair")

	// Four connections held open fill the cap of 4: the fifth caller is
	// refused (by the cap's slow path, in userspace) and that refusal
	// reaches the slot, which bpftool reads, like the kernel's own.
	var held []net.Conn
	defer func() {
		for _, c := range held {
			c.Close()
		}
	}()
	require.NoError(t, client.Do(func() error {
		for i := 0; i < 4; i++ {
			c, err := net.DialTimeout("tcp4", "10.99.0.1:8080", 2*time.Second)
			if err != nil {
				return err
			}
			held = append(held, c)
			_ = c.SetDeadline(time.Now().Add(2 * time.Second))
			if _, err := io.ReadFull(c, make([]byte, len("hello from web"))); err != nil {
				return err
			}
		}
		return nil
	}))
	_, err = dial(client, "10.99.0.1:8080")
	assert.Error(t, err, "the fifth caller is refused")
	rep = p.Converge(context.Background(), d)
	require.NoError(t, rep.Err)
	assert.Equal(t, uint64(1), rep.Exposures[0].Counters.Refused)
	c, ok = store.Lookup("web-http")
	require.True(t, ok)
	assert.Equal(t, uint64(1), c.Refused, "the refusal is in the shared slot")

	// The exposure leaves: its slot is released as deleted.
	d.Exposures = d.Exposures[1:]
	require.NoError(t, p.Converge(context.Background(), d).Err)
	_, ok = store.Lookup("web-http")
	assert.False(t, ok)
	_, err = dial(client, "10.99.0.1:8080")
	assert.Error(t, err)

	require.NoError(t, p.Teardown())
	assert.NotContains(t, host.MustRun(t, "nft", "list", "tables"), "brokkr")
	assert.NotContains(t, host.MustRun(t, "ip", "-o", "link"), "brokkr0")
	assert.Contains(t, host.MustRun(t, "ip", "-o", "link"), "up0@")
}

func mustAddr(s string) netip.Addr { return netip.MustParseAddr(s) }
