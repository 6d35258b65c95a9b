package bpf

import (
	"errors"
	"net"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

// callTally is what a batch of callers saw.
type callTally struct {
	ok, refused, failed int
	lastErr             error
}

// callMany dials addr n times at once from dial, echoes a few bytes on each
// and closes it.
func callMany(n int, dial func() (net.Conn, error)) callTally {
	var mu sync.Mutex
	var wg sync.WaitGroup
	var out callTally
	for i := 0; i < n; i++ {
		wg.Add(1)
		go func() {
			defer wg.Done()
			err := func() error {
				c, err := dial()
				if err != nil {
					return err
				}
				defer c.Close()
				_ = c.SetDeadline(time.Now().Add(5 * time.Second))
				msg := []byte("ping")
				if _, err := c.Write(msg); err != nil {
					return err
				}
				got := make([]byte, len(msg))
				_, err = c.Read(got)
				return err
			}()
			mu.Lock()
			defer mu.Unlock()
			switch {
			case err == nil:
				out.ok++
			case errors.Is(err, syscall.ECONNREFUSED):
				out.refused++
				out.lastErr = err
			default:
				out.failed++
				out.lastErr = err
			}
		}()
	}
	wg.Wait()
	return out
}

// TestSocketPathCallersAreNotRefusedByAStaleNatFlow: a nat-path caller
// refused over the cap leaves a flow whose SYN the reflector answers with a
// RST. When its conntrack entry dies, the memory is reused at once for the
// next connection's entry, and nat_flows is keyed by that address until the
// sweep comes by. A socket-path caller (host → guest, not NATed, not marked;
// the proxy's dial is the same) whose entry lands there must still reach the
// guest, not get the refused flow's RST and be counted as dropped against a
// live guest.
func TestSocketPathCallersAreNotRefusedByAStaleNatFlow(t *testing.T) {
	tp := newNatTopo(t, 1)
	np := tp.load(t)
	defer np.Close()
	sock, err := tp.store.Attach("auto", ProtoTCP, 9090)
	require.NoError(t, err)
	t.Cleanup(func() { sock.Release(false) })
	lb := loadSockLB(t, tp.pins, joinCgroup(t), tp.host)
	defer lb.Close()
	require.NoError(t, lb.SetTarget(anyHost, ProtoTCP, 9090, SockTarget{Guest: guest("10.213.0.11:7000"), Slot: sock.Index()}))

	held, err := dial(t, tp.client, "tcp4", "10.99.0.1:8080")
	require.NoError(t, err)
	defer held.Close()
	roundTrip(t, held, []byte("holds the only place"))

	const rounds, refusedPerRound, callersPerRound = 5, 100, 100
	var sum callTally
	for r := 0; r < rounds; r++ {
		nat := callMany(refusedPerRound, func() (net.Conn, error) { return dial(t, tp.client, "tcp4", "10.99.0.1:8080") })
		require.Equal(t, refusedPerRound, nat.refused, "nat callers over the cap: %+v", nat)
		// conntrack kills an entry whose only reply is a RST at once;
		// the refused flows stay until the next sweep.
		s := callMany(callersPerRound, func() (net.Conn, error) { return dial(t, tp.host, "tcp4", "127.0.0.1:9090") })
		// The proxy's dial to the guest is the same kind of SYN.
		d := callMany(callersPerRound, func() (net.Conn, error) { return dial(t, tp.host, "tcp4", "10.213.0.11:7000") })
		assert.Equal(t, callersPerRound, d.ok, "direct callers from the host reach the guest (round %d: %+v)", r, d)
		sum.ok += s.ok
		sum.refused += s.refused
		sum.failed += s.failed
		if s.lastErr != nil {
			sum.lastErr = s.lastErr
		}
	}
	eventually(t, "the socket path's places given back", func() bool { return sock.Read().Active == 0 })
	c := sock.Read()
	total := rounds * callersPerRound
	assert.Equal(t, total, sum.ok, "every socket-path caller reaches the live guest (refused %d, failed %d, last %v)", sum.refused, sum.failed, sum.lastErr)
	assert.EqualValues(t, sum.ok+sum.refused+sum.failed, c.Accepted, "accepted: every caller (no cap)")
	assert.EqualValues(t, sum.refused+sum.failed, c.Dropped, "dropped: the callers whose connect really failed")
	assert.Zero(t, c.Refused)
	n := tp.slot.Read()
	assert.EqualValues(t, 1, n.Active, "the nat caller still holds its place")
	assert.EqualValues(t, rounds*refusedPerRound, n.Refused)
	assert.Zero(t, n.Dropped)
	t.Logf("socket path: %d callers, %d carried, %d refused, %d failed; dropped %d", total, sum.ok, sum.refused, sum.failed, c.Dropped)
}

// natFlowCount is the number of entries in nat_flows.
func natFlowCount(t *testing.T, np *NatPath) int {
	t.Helper()
	var k uint64
	var v natpathNatFlow
	n := 0
	it := np.objs.NatFlows.Iterate()
	for it.Next(&k, &v) {
		n++
	}
	require.NoError(t, it.Err())
	return n
}

// sweeps is how many times the sweep has run.
func sweeps(t *testing.T, np *NatPath) uint64 {
	t.Helper()
	var s natpathNatSweeper
	require.NoError(t, np.objs.NatSweep.Lookup(uint32(0), &s))
	return s.Sweeps
}

// untilSweeps waits until cond holds, for at most n sweeps after now.
func untilSweeps(t *testing.T, np *NatPath, n uint64, what string, cond func() bool) {
	t.Helper()
	last := sweeps(t, np) + n
	for !cond() {
		if sweeps(t, np) > last {
			t.Fatalf("%s: not within %d sweeps", what, n)
		}
		time.Sleep(20 * time.Millisecond)
	}
}

// TestNatFlowsOfSYNsNeverAnsweredGoWhenTheirConntrackEntryExpires: callers
// admitted whose SYNs the guest never answers hold their places until
// conntrack's SYN_SENT timeout; then the sweep gives each place back once,
// counts the caller dropped and forgets the flow.
func TestNatFlowsOfSYNsNeverAnsweredGoWhenTheirConntrackEntryExpires(t *testing.T) {
	tp := newNatTopo(t, 4)
	np := tp.load(t)
	defer np.Close()
	tp.host.MustRun(t, "sysctl", "-qw", "net.netfilter.nf_conntrack_tcp_timeout_syn_sent=3")
	tp.guest.MustRun(t, "nft", "add table ip brkdrop")
	tp.guest.MustRun(t, "nft", "add chain ip brkdrop in { type filter hook input priority 0 ; policy accept ; }")
	tp.guest.MustRun(t, "nft", "add rule ip brkdrop in tcp dport 7000 drop")

	var wg sync.WaitGroup
	errs := make(chan error, 6)
	for i := 0; i < 6; i++ {
		wg.Add(1)
		go func() {
			defer wg.Done()
			errs <- tp.client.Do(func() error {
				c, err := net.DialTimeout("tcp4", "10.99.0.1:8080", 500*time.Millisecond)
				if err == nil {
					c.Close()
				}
				return err
			})
		}()
	}
	wg.Wait()
	close(errs)
	refused := 0
	for err := range errs {
		require.Error(t, err, "the guest answers nothing")
		if errors.Is(err, syscall.ECONNREFUSED) {
			refused++
		}
	}
	assert.Equal(t, 2, refused, "over the cap")
	c := tp.slot.Read()
	assert.EqualValues(t, 4, c.Active, "the unanswered callers hold their places while conntrack holds them")
	untilSweeps(t, np, 4, "nat_flows empty and every place back", func() bool {
		return natFlowCount(t, np) == 0 && tp.slot.Read().Active == 0
	})
	c = tp.slot.Read()
	assert.EqualValues(t, 4, c.Accepted)
	assert.EqualValues(t, 2, c.Refused)
	assert.EqualValues(t, 4, c.Dropped, "admitted, never answered")
	k, _ := tp.slot.Shares()
	assert.Zero(t, k, "the kernel's share given back exactly once")
}

// TestStaleRefusedFlowsGoWhileTheirMemoryHoldsAnotherConnection: refused
// flows' conntrack entries die at once (their only reply was a RST) and
// their memory goes to the next connections; when those are long-lived and
// not the nat path's (here callers of a plain host service, which never
// pass the reflector), the sweep must still see the refused flows are gone.
func TestStaleRefusedFlowsGoWhileTheirMemoryHoldsAnotherConnection(t *testing.T) {
	tp := newNatTopo(t, 1)
	np := tp.load(t)
	defer np.Close()
	tp.host.ServeEcho(t, "10.99.0.1:9999")

	held, err := dial(t, tp.client, "tcp4", "10.99.0.1:8080")
	require.NoError(t, err)
	defer held.Close()
	roundTrip(t, held, []byte("the only place"))
	const n = 100
	for r := 0; r < 3; r++ {
		nat := callMany(n, func() (net.Conn, error) { return dial(t, tp.client, "tcp4", "10.99.0.1:8080") })
		require.Equal(t, n, nat.refused, "%+v", nat)
		var others []net.Conn
		for i := 0; i < n; i++ {
			c, err := dial(t, tp.client, "tcp4", "10.99.0.1:9999")
			require.NoError(t, err)
			others = append(others, c)
		}
		t.Cleanup(func() {
			for _, c := range others {
				c.Close()
			}
		})
	}
	untilSweeps(t, np, 2, "only the held caller's flow left", func() bool { return natFlowCount(t, np) == 1 })
	c := tp.slot.Read()
	assert.EqualValues(t, 1, c.Active)
	assert.EqualValues(t, 1, c.Accepted)
	assert.EqualValues(t, 3*n, c.Refused)
	held.Close()
	untilSweeps(t, np, 2, "nat_flows empty", func() bool { return natFlowCount(t, np) == 0 && tp.slot.Read().Active == 0 })
}
