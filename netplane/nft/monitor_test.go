package nft

import (
	"fmt"
	"testing"

	"github.com/brokkr/brokkr/netplane/nft/compile"
	"github.com/google/nftables"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

// counting counts a kernel's reads.
type counting struct {
	kernel
	observed int
}

func (c *counting) observe(fam nftables.TableFamily, trusted func(string) bool, read func(string, compile.Digest) bool) (*compile.Observed, error) {
	c.observed++
	return c.kernel.observe(fam, trusted, read)
}

// The notification socket hears other programs' commits and not brokkr's
// own: a commit to another table is nothing to a pass, an element another
// program adds to brokkr's map is news of that map, and brokkr's own
// batches and cap-set changes are not heard at all.
func TestNotificationsHearOthersOnly(t *testing.T) {
	tp := newTopo(t, 1)
	require.NotNil(t, tp.table.nl.mon, "the notification socket is open")
	r := tp.rules(web(2))
	tp.converge(t, r)
	f, err := tp.table.nl.foreign()
	require.NoError(t, err)
	assert.False(t, f.lost)
	assert.False(t, f.other, "brokkr's own batch is not heard")
	assert.Empty(t, f.sets)

	tp.host.MustRun(t, "nft", "add", "table", "ip", "someone-else")
	f, err = tp.table.nl.foreign()
	require.NoError(t, err)
	assert.False(t, f.other, "another table")
	assert.Empty(t, f.sets)

	tp.host.MustRun(t, "nft", "add", "element", "inet", "brokkr", compile.MapExpAny, "{ tcp . 9999 : 0x20000063 }")
	f, err = tp.table.nl.foreign()
	require.NoError(t, err)
	assert.Equal(t, map[string]bool{compile.MapExpAny: true}, f.sets)
	assert.False(t, f.other)

	tp.host.MustRun(t, "nft", "add", "chain", "inet", "brokkr", "zz")
	f, err = tp.table.nl.foreign()
	require.NoError(t, err)
	assert.True(t, f.other)
}

// A pass after another program committed elsewhere reads nothing; after it
// touched brokkr's map, the pass repairs it.
func TestPassAfterForeignCommits(t *testing.T) {
	tp := newTopo(t, 1)
	serveTCP(t, tp.guests[0], ":80", "g1")
	c := &counting{kernel: tp.table.k}
	tp.table.k = c
	r := tp.rules(web(0))
	tp.converge(t, r)
	reads := c.observed
	tp.host.MustRun(t, "nft", "add", "table", "ip", "someone-else")
	res := tp.converge(t, r)
	assert.Equal(t, reads, c.observed, "nothing read")
	assert.Empty(t, res.Repaired)
	tp.host.MustRun(t, "nft", "delete", "element", "inet", "brokkr", compile.MapExpAny, "{ tcp . 8080 }")
	res = tp.converge(t, r)
	assert.Equal(t, []string{"element exp-any[web] missing"}, repaired(res))
	tag, err := dialTag(tp.client, "10.99.0.1:8080")
	require.NoError(t, err)
	assert.Equal(t, "g1", tag)
}

// A large batch is committed with the socket out of the group: a commit of
// another program in that window is not heard, and the next drain says
// notifications were lost (the pass then reads everything). (The window
// counts on the batch changing something: it only frames batches of
// thousands of elements.)
func TestQuietWindowCountsForeignCommits(t *testing.T) {
	tp := newTopo(t, 0)
	k := tp.table.nl
	require.NotNil(t, k.mon)
	n := 0
	own := func() error { // a batch of brokkr's own (that changes something: an empty one commits nothing)
		b, err := newBatchConn()
		require.NoError(t, err)
		b.AddTable(table(famInet))
		n++
		b.AddChain(&nftables.Chain{Table: table(famInet), Name: fmt.Sprintf("c%d", n)})
		return k.nl(func() error { return b.commit(k.raw) })
	}
	require.NoError(t, k.mon.quiet(k.generation, own))
	f, err := k.mon.drain()
	require.NoError(t, err)
	assert.False(t, f.lost, "only brokkr's batch in the window")

	require.NoError(t, k.mon.quiet(k.generation, func() error {
		tp.host.MustRun(t, "nft", "add", "table", "ip", "someone-else")
		return own()
	}))
	f, err = k.mon.drain()
	require.NoError(t, err)
	assert.True(t, f.lost, "a commit nobody heard")
	f, err = k.mon.drain()
	require.NoError(t, err)
	assert.False(t, f.lost, "said once")
}
