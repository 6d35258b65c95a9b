package netplane

import (
	"context"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/brokkr/brokkr/internal/nstest"
	"github.com/brokkr/brokkr/internal/spec"
)

// UpdateExposures publishes and withdraws single exposures against what the
// last Converge learned: a caller reaches the one added, no longer the one
// removed; the report has a row for each exposure set and nothing else;
// a removed exposure's slot goes; nothing is applied before a Converge, or
// for an update that sets and removes the same exposure.
func TestUpdateExposuresAddsAndRemovesOne(t *testing.T) {
	for _, pinned := range []bool{false, true} {
		name := map[bool]string{false: "event-fed fallback", true: "nat path"}[pinned]
		t.Run(name, func(t *testing.T) {
			host, client := hostAndClient(t)
			var p *Plane
			if pinned {
				p, _ = newPinnedPlane(t, host, t.TempDir())
			} else {
				p, _ = newPlane(t, host, t.TempDir())
			}
			target := spec.Target{Addr: mustAddr("10.213.0.250")}
			a := Exposure{Name: "a", Target: target, Proto: "tcp", HostPort: 8081, GuestPort: 80}
			b := Exposure{Name: "b", Target: target, Proto: "tcp", HostPort: 8082, GuestPort: 80, MaxConns: 4}

			rep := p.UpdateExposures(context.Background(), []Exposure{b}, nil)
			require.ErrorContains(t, rep.Err, "no full pass yet")

			d := Desired{Network: network(), Exposures: []Exposure{a}}
			require.NoError(t, p.Converge(context.Background(), d).Err)
			g := nstest.New(t, "guest")
			host.MustRun(t, "ip", "link", "add", "vh-g", "type", "veth", "peer", "name", "eth0", "netns", g.Name)
			host.MustRun(t, "ip", "link", "set", "vh-g", "master", "brokkr0", "up")
			g.MustRun(t, "ip", "addr", "add", "10.213.0.250/24", "dev", "eth0")
			g.MustRun(t, "ip", "link", "set", "eth0", "up")
			g.MustRun(t, "ip", "route", "add", "default", "via", "10.213.0.1")
			serve(t, g, ":80", "hello")
			got, err := dial(client, "10.99.0.1:8081")
			require.NoError(t, err)
			assert.Equal(t, "hello", got)

			rep = p.UpdateExposures(context.Background(), []Exposure{b}, nil)
			require.NoError(t, rep.Err)
			require.Len(t, rep.Exposures, 1)
			assert.Equal(t, "b", rep.Exposures[0].Name)
			assert.Equal(t, spec.StateActive, rep.Exposures[0].State, rep.Exposures[0].Reason)
			assert.Empty(t, rep.Guests)
			got, err = dial(client, "10.99.0.1:8082")
			require.NoError(t, err)
			assert.Equal(t, "hello", got)

			rep = p.UpdateExposures(context.Background(), nil, []string{"a"})
			require.NoError(t, rep.Err)
			assert.Empty(t, rep.Exposures)
			_, err = dial(client, "10.99.0.1:8081")
			assert.Error(t, err, "a is withdrawn")
			_, err = dial(client, "10.99.0.1:8082")
			assert.NoError(t, err, "b stays")

			rep = p.UpdateExposures(context.Background(), []Exposure{a}, []string{"a"})
			require.ErrorContains(t, rep.Err, "both set and removed")

			// A VM the last pass did not know: failed, and not published.
			c := Exposure{Name: "c", Target: spec.Target{VM: "nope"}, Proto: "tcp", HostPort: 8083, GuestPort: 80}
			rep = p.UpdateExposures(context.Background(), []Exposure{c}, nil)
			require.NoError(t, rep.Err)
			require.Len(t, rep.Exposures, 1)
			assert.Equal(t, spec.StateFailed, rep.Exposures[0].State)
			assert.NotContains(t, host.MustRun(t, "nft", "list", "table", "inet", "brokkr"), `comment "c"`)

			// The whole desired state, converged again, agrees: nothing to repair.
			d.Exposures = []Exposure{b, c}
			rep = p.Converge(context.Background(), d)
			require.NoError(t, rep.Err)
			assert.Empty(t, rep.Repaired)
		})
	}
}
