package netplane

import (
	"context"
	"errors"
	"io"
	"net"
	"net/netip"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/brokkr/brokkr/internal/kernelfeat"
	"github.com/brokkr/brokkr/internal/nstest"
	"github.com/brokkr/brokkr/internal/spec"
)

// allowTopo: the host, a client at 10.99.0.2 (allowed), another at
// 10.98.0.2 (not), and a guest at 10.213.0.250 serving "hello" on :80.
func allowTopo(t *testing.T, pinned bool) (p *Plane, host, client, other *nstest.NS) {
	host, client = hostAndClient(t)
	other = nstest.New(t, "other")
	nstest.Link(t, other, "eth0", "10.98.0.2/24", host, "up1", "10.98.0.1/24")
	other.MustRun(t, "ip", "route", "add", "default", "via", "10.98.0.1")
	if pinned {
		p, _ = newPinnedPlane(t, host, t.TempDir())
	} else {
		p, _ = newPlane(t, host, t.TempDir())
	}
	require.NoError(t, p.Converge(context.Background(), Desired{Network: network()}).Err)
	g := nstest.New(t, "guest")
	host.MustRun(t, "ip", "link", "add", "vh-g", "type", "veth", "peer", "name", "eth0", "netns", g.Name)
	host.MustRun(t, "ip", "link", "set", "vh-g", "master", "brokkr0", "up")
	g.MustRun(t, "ip", "addr", "add", "10.213.0.250/24", "dev", "eth0")
	g.MustRun(t, "ip", "link", "set", "eth0", "up")
	g.MustRun(t, "ip", "route", "add", "default", "via", "10.213.0.1")
	serve(t, g, ":80", "hello")
	return p, host, client, other
}

// dialShort dials with a deadline below TCP's first SYN retransmission:
// one SYN.
func dialShort(ns *nstest.NS, addr string) (net.Conn, error) {
	var c net.Conn
	err := ns.Do(func() (err error) { c, err = net.DialTimeout("tcp4", addr, 500*time.Millisecond); return err })
	return c, err
}

func requireDropped(t *testing.T, ns *nstest.NS) {
	t.Helper()
	c, err := dialShort(ns, "10.99.0.1:8080")
	if err == nil {
		c.Close()
	}
	require.Error(t, err, "a caller outside allowFrom is not carried")
	var ne net.Error
	require.True(t, errors.As(err, &ne) && ne.Timeout(), "dropped, not reset: %v", err)
}

func TestAllowFromOnTheNatPath(t *testing.T) {
	nstest.RequireRoot(t)
	kernelfeat.Require(t, kernelfeat.NatPath...)
	p, _, client, other := allowTopo(t, true)
	e := Exposure{Name: "web", Target: spec.Target{Addr: mustAddr("10.213.0.250")}, Proto: "tcp", HostPort: 8080, GuestPort: 80,
		MaxConns: 1, AllowFrom: []netip.Prefix{netip.MustParsePrefix("10.99.0.0/24"), netip.MustParsePrefix("2001:db8::/32")}}
	d := Desired{Network: network(), Exposures: []Exposure{e}}
	rep := p.Converge(context.Background(), d)
	require.NoError(t, rep.Err)
	require.Equal(t, spec.StateActive, rep.Exposures[0].State, rep.Exposures[0].Reason)

	requireDropped(t, other)
	// The allowed caller holds the cap's one place (the guest wrote and
	// closed its side; the caller keeps its own open).
	held, err := dialShort(client, "10.99.0.1:8080")
	require.NoError(t, err, "the denied caller took no place of the cap of 1")
	_ = held.SetDeadline(time.Now().Add(2 * time.Second))
	b, err := io.ReadAll(held)
	require.NoError(t, err)
	assert.Equal(t, "hello", string(b))
	requireDropped(t, other)
	rep = p.Converge(context.Background(), d)
	require.NoError(t, rep.Err)
	c := rep.Exposures[0].Counters
	assert.EqualValues(t, 2, c.Denied)
	assert.EqualValues(t, 1, c.Accepted)
	assert.EqualValues(t, 0, c.Refused, "denied callers are not refused: they never reach the cap")
	assert.EqualValues(t, 1, c.Active)
	held.Close()

	// The list changes: the other caller is now allowed; the first is not.
	e.AllowFrom = []netip.Prefix{netip.MustParsePrefix("10.98.0.0/16")}
	rep = p.UpdateExposures(context.Background(), []Exposure{e}, nil)
	require.NoError(t, rep.Err)
	require.Eventually(t, func() bool {
		got, err := dial(other, "10.99.0.1:8080")
		return err == nil && got == "hello"
	}, 5*time.Second, 50*time.Millisecond, "the other caller is allowed now")
	requireDropped(t, client)

	// No allowFrom: everyone, as before.
	e.AllowFrom = nil
	d.Exposures = []Exposure{e}
	require.NoError(t, p.Converge(context.Background(), d).Err)
	for _, ns := range []*nstest.NS{client, other} {
		got, err := dial(ns, "10.99.0.1:8080")
		require.NoError(t, err)
		assert.Equal(t, "hello", got)
	}
	rep = p.Converge(context.Background(), d)
	assert.EqualValues(t, 3, rep.Exposures[0].Counters.Denied, "the count never goes back")
}

// Where the BPF nat path is not in use, netplane cannot enforce allowFrom:
// the exposure is failed and not published, never open to everyone (the
// daemon hands such exposures to the proxy where it knows beforehand).
func TestAllowFromIsNeverPublishedWithoutTheNatPath(t *testing.T) {
	p, _, client, _ := allowTopo(t, false)
	e := Exposure{Name: "web", Target: spec.Target{Addr: mustAddr("10.213.0.250")}, Proto: "tcp", HostPort: 8080, GuestPort: 80,
		AllowFrom: []netip.Prefix{netip.MustParsePrefix("10.99.0.0/24")}}
	open := Exposure{Name: "open", Target: spec.Target{Addr: mustAddr("10.213.0.250")}, Proto: "tcp", HostPort: 8081, GuestPort: 80}
	rep := p.Converge(context.Background(), Desired{Network: network(), Exposures: []Exposure{e, open}})
	require.NoError(t, rep.Err)
	assert.Equal(t, spec.StateFailed, rep.Exposures[0].State)
	assert.Contains(t, rep.Exposures[0].Reason, "allowFrom needs the BPF nat path")
	assert.Equal(t, spec.StateActive, rep.Exposures[1].State)
	_, err := dial(client, "10.99.0.1:8080")
	assert.Error(t, err, "not published")
	got, err := dial(client, "10.99.0.1:8081")
	require.NoError(t, err)
	assert.Equal(t, "hello", got)
}
