package nft

import (
	"fmt"
	"testing"

	"github.com/brokkr/brokkr/netplane/nft/compile"

	"github.com/google/nftables"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	"golang.org/x/sys/unix"
)

// A batch sent without per-message ACKs still reports the kernel's error
// for the message that failed, applies nothing of it, and leaves the socket
// clean for the next batch.
func TestBatchCommitReportsErrorsWithoutAcks(t *testing.T) {
	tp := newTopo(t, 0)
	tab := &nftables.Table{Name: "brk-batch-test", Family: nftables.TableFamilyINet}

	bad, err := newBatchConn()
	require.NoError(t, err)
	bad.AddTable(tab)
	bad.AddChain(&nftables.Chain{Table: tab, Name: "a"})
	bad.DelChain(&nftables.Chain{Table: tab, Name: "missing"})
	bad.AddChain(&nftables.Chain{Table: tab, Name: "b"})
	err = bad.commit(tp.table.nl.raw)
	require.Error(t, err)
	assert.ErrorIs(t, err, unix.ENOENT)
	assert.NotContains(t, tp.host.MustRun(t, "nft", "list", "tables"), "brk-batch-test", "an aborted batch applies nothing")

	good, err := newBatchConn()
	require.NoError(t, err)
	good.AddTable(tab)
	for _, n := range []string{"a", "b", "c"} {
		good.AddChain(&nftables.Chain{Table: tab, Name: n})
	}
	require.NoError(t, good.commit(tp.table.nl.raw))
	out := tp.host.MustRun(t, "nft", "list", "table", "inet", "brk-batch-test")
	for _, n := range []string{"chain a", "chain b", "chain c"} {
		assert.Contains(t, out, n)
	}
	// The socket holds no stale reply: a plain request right after works.
	_, err = genID(tp.table.nl.raw)
	require.NoError(t, err)
	tp.host.MustRun(t, "nft", "delete", "table", "inet", "brk-batch-test")
}

// verify's digest counts what google/nftables decodes, for a set larger
// than one batch chunk, matches the state's, and sees an element deleted
// behind our back.
func TestDigestMatchesKernel(t *testing.T) {
	tp := newTopo(t, 1)
	var exps []Exposure
	for i := 0; i < 1500; i++ {
		exps = append(exps, Exposure{Name: fmt.Sprintf("c%04d", i), Protocol: "tcp", HostPort: uint16(30000 + i), GuestAddr: guestAddr(0), GuestPort: 80})
	}
	tp.converge(t, tp.rules(exps...))
	d, err := tp.table.nl.digest(famInet, compile.MapExpAny)
	require.NoError(t, err)
	assert.Equal(t, 1500, d.Count)
	assert.Equal(t, tp.table.state.Digest(compile.MapExpAny), d)
	var got []nftables.SetElement
	err = tp.table.nl.nl(func() (err error) {
		got, err = tp.table.nl.conn.GetSetElements(&nftables.Set{Table: &nftables.Table{Name: compile.TableName, Family: nftables.TableFamilyINet}, Name: compile.MapExpAny})
		return err
	})
	require.NoError(t, err)
	assert.Len(t, got, d.Count)
	tp.host.MustRun(t, "nft", "delete", "element", "inet", "brokkr", compile.MapExpAny, "{ tcp . 30007 }")
	d, err = tp.table.nl.digest(famInet, compile.MapExpAny)
	require.NoError(t, err)
	assert.Equal(t, 1499, d.Count)
	assert.NotEqual(t, tp.table.state.Digest(compile.MapExpAny), d)
}
