package fleet_test

import (
	"context"
	"encoding/json"
	"fmt"
	"os"
	"runtime"
	"slices"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/brokkr/brokkr/daemon/api"
	"github.com/brokkr/brokkr/daemon/fleet"
	"github.com/prometheus/client_golang/prometheus"
	"github.com/stretchr/testify/require"
	clientv3 "go.etcd.io/etcd/client/v3"
)

// TestBenchFleet is `make bench-fleet`: BROKKR_BENCH_FLEET_NODES brokkrd
// processes (each in its namespace, with a target exposure) on a three-member
// etcd; one fleet change touching every node, timed from its commit until
// each node's status shows it (p50, p99; target p99 < 2 s); etcd writes per
// node per second at rest (target 0); etcd's heap per watching node. Skipped
// unless the variable is set: it is a benchmark, not a test.
func TestBenchFleet(t *testing.T) {
	n, _ := strconv.Atoi(os.Getenv("BROKKR_BENCH_FLEET_NODES"))
	if n <= 0 {
		t.Skip("set BROKKR_BENCH_FLEET_NODES (make bench-fleet)")
	}
	require.LessOrEqual(t, n, 250, "one 10.77.k.0/30 per node")
	needEnv(t)
	c := newCluster(t, 3, nil)
	cli := c.client(t, fleet.ClientConfig{})
	heap0 := etcdHeap(t)
	nodes := make([]*node, n)
	t0 := time.Now()
	for i := range nodes {
		nodes[i] = newNode(t, c, i+1, "")
	}
	t.Logf("%d nodes started in %s", n, time.Since(t0).Round(time.Millisecond))

	apply := func(ports ...int) (int64, map[string]time.Duration) {
		docs := map[string][]byte{}
		for _, nd := range nodes {
			docs[nd.name] = []byte(nd.doc(ports...))
		}
		ctx := context.Background()
		// Watch the statuses before writing, so no report is missed.
		wctx, cancel := context.WithCancel(ctx)
		defer cancel()
		head := currentRevision(t, cli)
		wch := cli.Watch(wctx, fleet.NodesDir("/brokkr"), clientv3.WithPrefix(), clientv3.WithRev(head+1))
		res, err := fleet.ApplyDocs(ctx, cli, "/brokkr", docs, false)
		require.NoError(t, err)
		committed := time.Now()
		got := map[string]time.Duration{}
		deadline := time.After(60 * time.Second)
		for len(got) < n {
			select {
			case wr := <-wch:
				require.NoError(t, wr.Err())
				for _, ev := range wr.Events {
					k := strings.TrimPrefix(string(ev.Kv.Key), fleet.NodesDir("/brokkr"))
					name, leaf, _ := strings.Cut(k, "/")
					if leaf != "status" || got[name] != 0 {
						continue
					}
					var st api.Status
					if json.Unmarshal(ev.Kv.Value, &st) != nil || st.Source == nil || st.Source.Revision < res.Revision {
						continue
					}
					active := 0
					for _, e := range st.Exposures {
						if e.State == "active" {
							active++
						}
					}
					if active == len(ports) && len(st.Exposures) == len(ports) {
						got[name] = time.Since(committed)
					}
				}
			case <-deadline:
				t.Fatalf("only %d of %d nodes reported revision %d within 60 s", len(got), n, res.Revision)
			}
		}
		return res.Revision, got
	}

	apply(9000) // first documents: every node has one
	time.Sleep(3 * time.Second)
	_, lat := apply(9000, 9001) // the measured change
	var ds []time.Duration
	for _, d := range lat {
		ds = append(ds, d)
	}
	slices.Sort(ds)
	p := func(q float64) time.Duration { return ds[min(len(ds)-1, int(q*float64(len(ds))))] }

	time.Sleep(3 * time.Second) // the last counters and reports settle
	rest := 20 * time.Second
	r0 := currentRevision(t, cli)
	time.Sleep(rest)
	writes := currentRevision(t, cli) - r0
	heap := etcdHeap(t)

	t.Logf("BENCH fleet nodes=%d members=3 leaseTTL=3s", n)
	t.Logf("BENCH time-to-status p50=%s p99=%s max=%s (target p99 < 2s)", p(0.50).Round(time.Millisecond), p(0.99).Round(time.Millisecond), ds[len(ds)-1].Round(time.Millisecond))
	t.Logf("BENCH writes at rest: %d in %s = %.4f /node/s (target 0)", writes, rest, float64(writes)/float64(n)/rest.Seconds())
	t.Logf("BENCH etcd heap growth with %d watching nodes: %.1f KiB/node (go_memstats_heap_inuse_bytes of the process holding the 3 members)",
		n, float64(heap-heap0)/1024/float64(n))
	t.Logf("BENCH etcd watchers: %s", etcdMetric(t, "etcd_debugging_mvcc_watcher_total"))
}

// etcdHeap is the in-use heap of this process, where the members run, after
// a GC so the figure is live memory.
func etcdHeap(t testing.TB) float64 {
	runtime.GC()
	v, _ := strconv.ParseFloat(etcdMetric(t, "go_memstats_heap_inuse_bytes"), 64)
	return v
}

// etcdMetric reads one of etcd's own metrics (the members register them in
// this process's default Prometheus registry).
func etcdMetric(t testing.TB, name string) string {
	t.Helper()
	mfs, err := prometheus.DefaultGatherer.Gather()
	require.NoError(t, err)
	for _, mf := range mfs {
		if mf.GetName() != name {
			continue
		}
		var sum float64
		for _, m := range mf.GetMetric() {
			switch {
			case m.GetGauge() != nil:
				sum += m.GetGauge().GetValue()
			case m.GetCounter() != nil:
				sum += m.GetCounter().GetValue()
			}
		}
		return fmt.Sprint(sum)
	}
	return "n/a"
}
