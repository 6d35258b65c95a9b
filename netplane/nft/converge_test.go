package nft

import (
	"errors"
	"fmt"
	"log/slog"
	"net/netip"
	"slices"
	"sync"
	"testing"
	"time"

	"github.com/brokkr/brokkr/netplane/nft/compile"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	"golang.org/x/sys/unix"
)

// Converge's decisions against the in-process fake kernel: what it reads,
// sends and flushes. No root, no namespace: these run in make test-unit.

func withFake(t *testing.T) (*Table, *fakeKernel) {
	t.Helper()
	k := newFakeKernel()
	tb := newTable(k, slog.New(slog.DiscardHandler))
	t.Cleanup(func() { _ = tb.Close() })
	return tb, k
}

// An exposure withdrawn by an Update and published again on its host side
// by the next one is flushed before that batch, never after it (which
// would cut the new exposure's first flows), also while the flusher is
// in the middle of that flush; Close stops the flusher's goroutine.
func TestAWithdrawnSideIsFlushedBeforeItIsPublishedAgain(t *testing.T) {
	tb, k := withFake(t)
	_, err := tb.Converge(unitRules(many(3)...))
	require.NoError(t, err)
	gate := make(chan struct{})
	var open sync.Once
	t.Cleanup(func() { open.Do(func() { close(gate) }) })
	k.mu.Lock()
	k.flushGate = gate // the removal's flush waits inside the kernel
	k.mu.Unlock()
	_, err = tb.Update(nil, []string{"x00001"}, nil)
	require.NoError(t, err)
	done := make(chan error)
	go func() {
		_, err := tb.Update([]Exposure{tcpExp("again", 10001, 77)}, nil, nil)
		done <- err
	}()
	select {
	case <-done:
		t.Fatal("the side was published again while its flush was under way")
	case <-time.After(100 * time.Millisecond):
	}
	open.Do(func() { close(gate) })
	require.NoError(t, <-done)
	k.mu.Lock()
	events := slices.Clone(k.events)
	k.mu.Unlock()
	assert.Equal(t, []string{"apply", "apply", "flush", "apply"}, events, "converge, removal, its flush, the new exposure")
	require.NoError(t, tb.Close())
}

func unitRules(exps ...Exposure) Rules {
	for i := range exps {
		if exps[i].MarkID == 0 {
			exps[i].MarkID = uint32(i + 1)
		}
	}
	return Rules{Bridge: "br0", Subnet: netip.MustParsePrefix("10.213.0.1/24"), Masquerade: true, DHCP: true,
		Cap: MarksOnly{}, Exposures: exps}
}

func tcpExp(name string, port uint16, mark uint32) Exposure {
	return Exposure{Name: name, Protocol: "tcp", HostPort: port, GuestAddr: netip.MustParseAddr("10.213.0.11"), GuestPort: 80, MarkID: mark}
}

func many(n int) []Exposure {
	out := make([]Exposure, n)
	for i := range out {
		out[i] = tcpExp(fmt.Sprintf("x%05d", i), uint16(10000+i), uint32(i+1))
	}
	return out
}

func flushed(k *fakeKernel) []string {
	k.mu.Lock()
	defer k.mu.Unlock()
	var out []string
	for _, b := range k.flushes {
		for _, s := range b {
			out = append(out, s.String())
		}
	}
	return out
}

func elemsIn(ops []compile.Op) int {
	n := 0
	for _, o := range ops {
		switch x := o.(type) {
		case compile.AddElems:
			n += len(x.Elems)
		case compile.DelElems:
			n += len(x.Elems)
		}
	}
	return n
}

func TestConvergeFirstAppliesOnceThenTrustsTheGeneration(t *testing.T) {
	tb, k := withFake(t)
	r := unitRules(many(3)...)
	res, err := tb.Converge(r)
	require.NoError(t, err)
	assert.Equal(t, 2, k.reads, "the first pass reads both tables")
	require.Len(t, k.batches, 1)
	assert.Len(t, res.Changes, 3)
	assert.Empty(t, flushed(k), "new TCP host sides have no flows to move")

	k.flushes = nil
	res, err = tb.Converge(r)
	require.NoError(t, err)
	assert.Equal(t, 2, k.reads, "the generation is unchanged: nothing is read")
	assert.Len(t, k.batches, 1, "nothing to send")
	assert.Empty(t, res.Changes)
	assert.Empty(t, k.flushes)
}

// An Update at 5,000 exposures sends the one exposure's elements, reads
// nothing, and flushes the removed one's host side alone.
func TestUpdateIsOneExposuresWork(t *testing.T) {
	tb, k := withFake(t)
	_, err := tb.Converge(unitRules(many(5000)...))
	require.NoError(t, err)
	reads := k.reads
	k.flushes = nil
	res, err := tb.Update([]Exposure{tcpExp("new", 9000, 9000)}, []string{"x00042"}, nil)
	require.NoError(t, err)
	assert.Equal(t, reads, k.reads)
	require.Len(t, k.batches, 2)
	assert.LessOrEqual(t, elemsIn(k.batches[1]), 4, "%v", k.batches[1])
	assert.Empty(t, res.Flushed, "flushed after the Update returns")
	assert.Eventually(t, func() bool { return slices.Equal([]string{"tcp *:10042"}, flushed(k)) }, 5*time.Second, time.Millisecond,
		"the removed side; a new TCP one has nothing to flush")
	assert.Len(t, res.Changes, 2)
	// The whole desired state, converged afterwards, agrees.
	exps := append(many(5000), tcpExp("new", 9000, 9000))
	exps = append(exps[:42], exps[43:]...)
	_, err = tb.Converge(unitRules(exps...))
	require.NoError(t, err)
	assert.Len(t, k.batches, 2)
}

func TestUpdateBeforeConvergeIsRefused(t *testing.T) {
	tb, _ := withFake(t)
	_, err := tb.Update([]Exposure{tcpExp("new", 9000, 1)}, nil, nil)
	assert.ErrorContains(t, err, "no whole desired state")
}

// Another program's commit to a table of its own costs a pass nothing: the
// change notifications show it left brokkr's tables alone.
func TestForeignCommitElsewhereIsNotRead(t *testing.T) {
	tb, k := withFake(t)
	r := unitRules(many(100)...)
	_, err := tb.Converge(r)
	require.NoError(t, err)
	reads := k.reads
	k.elsewhere()
	res, err := tb.Converge(r)
	require.NoError(t, err)
	assert.Equal(t, reads, k.reads)
	assert.Len(t, k.batches, 1)
	assert.Empty(t, res.Repaired)
}

// Without notifications (lost, or not listened to) a moved generation
// reads both tables, but a map whose digest is what brokkr applied is not
// decoded, and nothing is sent.
func TestWithoutNotificationsMatchingMapsAreNotDecoded(t *testing.T) {
	tb, k := withFake(t)
	r := unitRules(many(100)...)
	_, err := tb.Converge(r)
	require.NoError(t, err)
	k.deaf = true
	_, err = tb.Converge(r)
	require.NoError(t, err)
	reads := k.reads
	assert.Empty(t, k.decoded, "the generation did not move: nothing read")
	k.elsewhere()
	res, err := tb.Converge(r)
	require.NoError(t, err)
	assert.Equal(t, reads+2, k.reads)
	assert.NotContains(t, k.decoded, compile.MapExpAny)
	assert.Len(t, k.batches, 1)
	assert.Empty(t, res.Repaired)
	assert.Empty(t, res.Changes)
}

// Another program touching one of brokkr's maps: only that map is read,
// and its drift repaired.
func TestForeignElementChangeReadsOnlyThatMap(t *testing.T) {
	tb, k := withFake(t)
	r := unitRules(many(5)...)
	_, err := tb.Converge(r)
	require.NoError(t, err)
	k.decoded = nil
	k.edit(famInet, func(ft *fakeTable) {
		for key, e := range ft.sets[compile.MapExpTarget].elems {
			if e.Comment == "x00003" {
				delete(ft.sets[compile.MapExpTarget].elems, key)
			}
		}
	}, compile.MapExpTarget)
	res, err := tb.Converge(r)
	require.NoError(t, err)
	assert.Equal(t, []string{"element exp-target[x00003] missing"}, repaired(res))
	assert.Contains(t, k.decoded, compile.MapExpTarget)
	assert.NotContains(t, k.decoded, compile.MapExpAny, "untouched: not even dumped")
	assert.Empty(t, flushed(k), "neither the first pass (new TCP sides) nor the repair flushes")
}

// Drift is repaired and reported, and a repair flushes nothing: the flows
// follow what was there.
func TestDriftIsRepairedWithoutFlushing(t *testing.T) {
	tb, k := withFake(t)
	r := unitRules(many(3)...)
	_, err := tb.Converge(r)
	require.NoError(t, err)
	k.flushes = nil
	k.edit(famInet, func(ft *fakeTable) {
		for key, e := range ft.sets[compile.MapExpAny].elems {
			if e.Comment == "x00001" {
				delete(ft.sets[compile.MapExpAny].elems, key)
			}
		}
		ft.chains["prerouting"].rules = nil
	}, compile.MapExpAny)
	k.news.other = true
	res, err := tb.Converge(r)
	require.NoError(t, err)
	assert.Contains(t, repaired(res), "element exp-any[x00001] missing")
	assert.Contains(t, repaired(res), "rules of chain prerouting differ")
	assert.Contains(t, k.decoded, compile.MapExpAny, "its digest differs: read")
	assert.Empty(t, res.Changes)
	assert.Empty(t, k.flushes)
	inet, _, err := compile.Whole(r)
	require.NoError(t, err)
	assert.Equal(t, compile.ObservedFrom(inet), k.spec(famInet), "the kernel holds the desired table again")
}

// Drift and a change in the same pass: the repair flushes nothing, the
// change flushes its host side.
func TestDriftAndChangeTogether(t *testing.T) {
	tb, k := withFake(t)
	r := unitRules(many(3)...)
	_, err := tb.Converge(r)
	require.NoError(t, err)
	k.flushes = nil
	k.edit(famInet, func(ft *fakeTable) { delete(ft.chains, "dispatch") })
	r.Exposures[2].GuestPort = 81
	res, err := tb.Converge(r)
	require.NoError(t, err)
	assert.Contains(t, repaired(res), "chain dispatch missing")
	assert.Equal(t, []string{"tcp *:10002"}, flushed(k))
}

// A new process finds its tables as the last one left them: it reads
// them, sends nothing and flushes nothing.
func TestRestartSendsAndFlushesNothing(t *testing.T) {
	tb, k := withFake(t)
	r := unitRules(many(50)...)
	_, err := tb.Converge(r)
	require.NoError(t, err)
	k.flushes = nil
	again := newTable(k, slog.New(slog.DiscardHandler))
	res, err := again.Converge(r)
	require.NoError(t, err)
	assert.Len(t, k.batches, 1)
	assert.Empty(t, k.flushes)
	assert.Empty(t, res.Repaired)
}

// An exposure deleted while no daemon ran left its element: the next
// process deletes it and flushes its host side.
func TestLeftoverOfAnExposureDeletedWhileDownIsFlushed(t *testing.T) {
	tb, k := withFake(t)
	_, err := tb.Converge(unitRules(many(3)...))
	require.NoError(t, err)
	k.flushes = nil
	again := newTable(k, slog.New(slog.DiscardHandler))
	_, err = again.Converge(unitRules(many(2)...))
	require.NoError(t, err)
	assert.Equal(t, []string{"tcp 0.0.0.0:10002"}, flushed(k), "an element of exp-any: IPv4 callers")
}

// When the batch fails, both tables are replaced in one batch that carries
// the counters' values (named and per element); the result says so.
func TestFailedBatchReplacesBothTables(t *testing.T) {
	tb, k := withFake(t)
	r := unitRules(many(3)...)
	r.Cap = SetBasedCap{} // counters in the table
	r.Exposures[0].MaxConns = 4
	_, err := tb.Converge(r)
	require.NoError(t, err)
	target := string(compile.MarkKey(r.Exposures[0].MarkID))
	k.edit(famInet, func(ft *fakeTable) {
		ft.counters["x00000-refused"] = compile.CounterValue{Packets: 5, Bytes: 500}
		e := ft.sets[compile.MapExpTarget].elems[target]
		e.Counter = compile.CounterValue{Packets: 7, Bytes: 700}
		ft.sets[compile.MapExpTarget].elems[target] = e
	})
	boom := errors.New("boom")
	k.failApply = func(ops []compile.Op) error {
		if len(ops) > 4 {
			if _, del := ops[2].(compile.DelTable); del {
				return nil // the replace goes through
			}
		}
		return boom
	}
	r.Exposures = r.Exposures[:2]
	res, err := tb.Converge(r)
	require.NoError(t, err)
	assert.ErrorIs(t, res.Replaced, boom)
	inet, _, err := compile.Whole(r)
	require.NoError(t, err)
	assert.Equal(t, compile.ObservedFrom(inet), k.spec(famInet))
	c, err := k.counts([]string{compile.MapExpTarget})
	require.NoError(t, err)
	assert.Equal(t, uint64(5), c.Named["x00000-refused"].Packets, "a named counter's value survives the replace")
	assert.Equal(t, uint64(7), c.Elems[compile.MapExpTarget][target].Packets, "so does an element's")
	assert.Equal(t, []string{"tcp *:10002"}, flushed(k), "the removed side (the first pass created TCP sides: no flush)")
}

// A batch the kernel stored only in part is caught by the read-back of its
// digest and the tables are replaced.
func TestVerifyCatchesAPartlyStoredBatch(t *testing.T) {
	tb, k := withFake(t)
	k.truncate = true
	res, err := tb.Converge(unitRules(many(200)...))
	require.Error(t, err, "the replace is truncated too")
	assert.ErrorContains(t, res.Replaced, "verify")
	k.truncate = false
	res, err = tb.Converge(unitRules(many(200)...))
	require.NoError(t, err)
	d, err := k.digest(famInet, compile.MapExpAny)
	require.NoError(t, err)
	assert.Equal(t, 200, d.Count)
	assert.NotEmpty(t, res.Repaired, "the missing elements were drift by then")
	_ = k.reads
}

// Input the compiler cannot express sends nothing.
func TestBadRulesSendNothing(t *testing.T) {
	tb, k := withFake(t)
	_, err := tb.Converge(unitRules(tcpExp("a", 80, 1), tcpExp("b", 80, 2)))
	require.ErrorContains(t, err, "exposures[b].hostPort")
	assert.Empty(t, k.batches)
	_, err = tb.Converge(unitRules(tcpExp("a", 80, 1)))
	require.NoError(t, err)
	_, err = tb.Update([]Exposure{tcpExp("b", 81, 1)}, nil, nil)
	require.ErrorContains(t, err, "exposures[b].markID")
	assert.Len(t, k.batches, 1)
}

// Delete removes both tables and forgets them: the next Converge builds
// them again from nothing.
func TestDeleteForgets(t *testing.T) {
	tb, k := withFake(t)
	r := unitRules(many(2)...)
	_, err := tb.Converge(r)
	require.NoError(t, err)
	require.NoError(t, tb.Delete())
	assert.Nil(t, k.tabs[famInet])
	res, err := tb.Converge(r)
	require.NoError(t, err)
	assert.Len(t, res.Changes, 2)
	assert.NotNil(t, k.tabs[famInet])
	_ = unix.ENOENT
}

// An Update's removal of an exposure with no connection open (idle) walks
// no conntrack table; a busy one's is flushed, and so is an idle
// exposure's old side when it moves to another port (its gauge counts
// under the new side).
func TestAnIdleRemovedExposureIsNotFlushed(t *testing.T) {
	tb, k := withFake(t)
	_, err := tb.Converge(unitRules(many(4)...))
	require.NoError(t, err)
	idle := func(n string) bool { return n != "x00002" }
	_, err = tb.Update(nil, []string{"x00001", "x00002"}, idle)
	require.NoError(t, err)
	assert.Eventually(t, func() bool { return slices.Equal([]string{"tcp *:10002"}, flushed(k)) }, 5*time.Second, time.Millisecond,
		"only the busy exposure's side")
	moved := tcpExp("x00003", 19003, 4)
	_, err = tb.Update([]Exposure{moved}, nil, idle)
	require.NoError(t, err)
	assert.Eventually(t, func() bool { return slices.Equal([]string{"tcp *:10002", "tcp *:10003"}, flushed(k)) }, 5*time.Second, time.Millisecond,
		"a move flushes the side it left")
}
