package nft

import (
	"testing"

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
	err = bad.commit(tp.table.raw)
	require.Error(t, err)
	assert.ErrorIs(t, err, unix.ENOENT)
	assert.NotContains(t, tp.host.MustRun(t, "nft", "list", "tables"), "brk-batch-test", "an aborted batch applies nothing")

	good, err := newBatchConn()
	require.NoError(t, err)
	good.AddTable(tab)
	for _, n := range []string{"a", "b", "c"} {
		good.AddChain(&nftables.Chain{Table: tab, Name: n})
	}
	require.NoError(t, good.commit(tp.table.raw))
	out := tp.host.MustRun(t, "nft", "list", "table", "inet", "brk-batch-test")
	for _, n := range []string{"chain a", "chain b", "chain c"} {
		assert.Contains(t, out, n)
	}
	// The socket holds no stale reply: a plain request right after works.
	_, err = genID(tp.table.raw)
	require.NoError(t, err)
	tp.host.MustRun(t, "nft", "delete", "table", "inet", "brk-batch-test")
}
