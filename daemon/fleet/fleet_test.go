package fleet_test

import (
	"context"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/brokkr/brokkr/daemon/api"
	"github.com/brokkr/brokkr/daemon/fleet"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	clientv3 "go.etcd.io/etcd/client/v3"
)

func put(t testing.TB, cli *clientv3.Client, key, val string) int64 {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	r, err := cli.Put(ctx, key, val)
	require.NoError(t, err)
	return r.Header.Revision
}

func writeFile(t testing.TB, dir, name, body string) string {
	t.Helper()
	p := filepath.Join(dir, name)
	require.NoError(t, os.WriteFile(p, []byte(body), 0o600))
	return p
}

func fleetFile(nodes ...string) string {
	var b strings.Builder
	b.WriteString("nodes:\n")
	for _, n := range nodes {
		b.WriteString(n)
	}
	return b.String()
}

// indent is a node document as a fleet file's nodes.NAME entry.
func indent(name, doc string) string {
	var b strings.Builder
	fmt.Fprintf(&b, "  %s:\n", name)
	for _, l := range strings.Split(strings.TrimRight(doc, "\n"), "\n") {
		fmt.Fprintf(&b, "    %s\n", l)
	}
	return b.String()
}

// TestFleet drives two brokkrd nodes from a three-member etcd cluster
// through the cases, in order (each step starts from the last).
func TestFleet(t *testing.T) {
	needEnv(t)
	c := newCluster(t, 3, nil)
	cli := c.client(t, fleet.ClientConfig{})
	h1 := newNode(t, c, 1, "")
	h2 := newNode(t, c, 2, "")
	h1.serveTarget(9000, 9001, 9002)
	h2.serveTarget(9000, 9001, 9002)
	dir := t.TempDir()

	t.Run("a fleet apply reaches every node and their statuses show it", func(t *testing.T) {
		f := writeFile(t, dir, "fleet.yaml", fleetFile(indent("h1", h1.doc(9000)), indent("h2", h2.doc(9000))))
		out, errs, code := brokkr(t, c, nil, "fleet", "apply", "-f", f, "--dry-run")
		require.Equal(t, 0, code, errs)
		assert.Contains(t, out, "node h1:")
		assert.Contains(t, out, "+ exposure ext-9000")
		assert.NotContains(t, out, "written at revision")
		for _, r := range list(t, cli) {
			assert.Zero(t, r.DesiredRevision, "a dry run writes nothing: %s", r.Node)
		}

		out, errs, code = brokkr(t, c, nil, "fleet", "apply", "-f", f)
		require.Equal(t, 0, code, errs)
		assert.Contains(t, out, "written at revision")
		waitConverged(t, cli, "h1", 1)
		waitConverged(t, cli, "h2", 1)
		for _, n := range []*node{h1, h2} {
			require.NoError(t, n.echo(9000), n.name)
		}
		rows := fleetStatus(t, c, nil)
		assert.Equal(t, rows["h1"].DesiredRevision, rows["h2"].DesiredRevision, "one transaction")
		st := h1.status()
		require.NotNil(t, st.Source)
		assert.Equal(t, api.SourceConnected, st.Source.State)
		assert.Equal(t, rows["h1"].DesiredRevision, st.Source.Revision)

		out, _, code = brokkr(t, c, nil, "fleet", "status")
		require.Equal(t, 0, code)
		assert.Regexp(t, `h1\s+alive\s+\S+\s+\d+\s+0/0\s+1/1\s+-`, out)

		out, _, code = brokkr(t, c, nil, "fleet", "apply", "-f", f)
		require.Equal(t, 0, code)
		assert.Contains(t, out, "unchanged", "the same documents are not rewritten")
	})

	t.Run("at rest a node writes nothing", func(t *testing.T) {
		time.Sleep(2 * time.Second) // the counters of the calls above are reported
		before := currentRevision(t, cli)
		time.Sleep(4 * time.Second) // more than one lease renewal and four passes
		assert.Equal(t, before, currentRevision(t, cli), "no etcd writes at rest (lease renewals are not writes)")
	})

	t.Run("a lost race is a clear error and writes nothing", func(t *testing.T) {
		docs := map[string][]byte{"h1": []byte(h1.doc(9000, 9001))}
		ctx := context.Background()
		plan, err := fleet.Plan(ctx, cli, "/brokkr", docs, false)
		require.NoError(t, err)
		rev := put(t, cli, "/brokkr/nodes/h1/desired", h1.doc(9000, 9002)) // the other operator
		err = fleet.Write(ctx, cli, "/brokkr", docs, plan)
		var ce *fleet.ConflictError
		require.True(t, errors.As(err, &ce), "%v", err)
		assert.Contains(t, err.Error(), fmt.Sprintf("now %d", rev))
		r, err := cli.Get(ctx, "/brokkr/nodes/h1/desired")
		require.NoError(t, err)
		assert.Contains(t, string(r.Kvs[0].Value), "ext-9002", "the winner's document stays")
		waitConverged(t, cli, "h1", 2)
		require.NoError(t, h1.echo(9002))
	})

	t.Run("an invalid document is rejected on its node only, the others converge", func(t *testing.T) {
		before := h2.status()
		// Written behind the CLI's back (it validates first); the node
		// validates again and names the field.
		bad := strings.Replace(h2.doc(9000, 9001), "hostPort: 9001", "hostPort: 70000", 1)
		ctx := context.Background()
		resp, err := cli.Txn(ctx).Then(
			clientv3.OpPut("/brokkr/nodes/h1/desired", h1.doc(9000, 9001)),
			clientv3.OpPut("/brokkr/nodes/h2/desired", bad)).Commit()
		require.NoError(t, err)
		waitConverged(t, cli, "h1", 2)
		waitFor(t, 20*time.Second, "h2 reports the rejection", func() (bool, string) {
			for _, r := range list(t, cli) {
				if r.Node == "h2" {
					return len(r.Errors) > 0, strings.Join(r.Errors, "; ")
				}
			}
			return false, ""
		})
		rows := fleetStatus(t, c, nil)
		assert.Contains(t, strings.Join(rows["h2"].Errors, "\n"), "exposures[1].hostPort")
		assert.Less(t, rows["h2"].Revision, resp.Header.Revision, "h2 stays on its previous revision")
		assert.False(t, rows["h2"].Converged)
		st := h2.status()
		assert.Equal(t, resp.Header.Revision, st.Source.Rejected)
		assert.Equal(t, len(before.Exposures), len(st.Exposures), "h2 keeps its previous state")
		require.NoError(t, h2.echo(9000), "and keeps serving it")
		out, _, _ := brokkr(t, c, nil, "fleet", "status")
		assert.Contains(t, out, "exposures[1].hostPort")

		// Fixed: it converges.
		put(t, cli, "/brokkr/nodes/h2/desired", h2.doc(9000, 9001))
		waitConverged(t, cli, "h2", 2)
	})

	t.Run("one etcd member killed: the fleet keeps working", func(t *testing.T) {
		c.kill(0)
		defer c.restart(0)
		f := writeFile(t, dir, "fleet2.yaml", fleetFile(indent("h1", h1.doc(9001)), indent("h2", h2.doc(9001))))
		out, errs, code := brokkr(t, c, nil, "fleet", "apply", "-f", f)
		require.Equal(t, 0, code, out+errs)
		waitConverged(t, cli, "h1", 1)
		waitConverged(t, cli, "h2", 1)
		require.NoError(t, h1.echo(9001))
		require.NoError(t, h2.echo(9001))
	})

	t.Run("a node cut off keeps serving, is shown lost, and converges when healed (compacted meanwhile)", func(t *testing.T) {
		// Both directions of h1's etcd traffic, in etcd's namespace; the
		// callers on the same veth still get through.
		ports := fmt.Sprintf("%d-%d", clientPort(0), clientPort(c.n-1))
		etcdNS.MustRun(t, "nft", "add table inet fltest")
		t.Cleanup(func() { _, _ = etcdNS.Run("nft", "delete table inet fltest") })
		etcdNS.MustRun(t, "nft", "add chain inet fltest in { type filter hook input priority 0; }")
		etcdNS.MustRun(t, "nft", "add chain inet fltest out { type filter hook output priority 0; }")
		etcdNS.MustRun(t, "nft", "add rule inet fltest in ip saddr "+h1.addr()+" tcp dport "+ports+" drop")
		etcdNS.MustRun(t, "nft", "add rule inet fltest out ip daddr "+h1.addr()+" tcp sport "+ports+" drop")
		cutAt := time.Now()

		waitFor(t, 30*time.Second, "h1 lost (its lease expired)", func() (bool, string) {
			for _, r := range list(t, cli) {
				if r.Node == "h1" {
					return !r.Alive, fmt.Sprint(r.Alive)
				}
			}
			return false, "no row"
		})
		waitFor(t, 20*time.Second, "h1 says it is disconnected", func() (bool, string) {
			st := h1.status()
			return st.Source.State == api.SourceDisconnected, st.Source.State
		})
		out, _, _ := brokkr(t, c, nil, "fleet", "status")
		assert.Regexp(t, `h1\s+lost`, out)
		require.NoError(t, h1.echo(9001), "VMs and exposures keep serving while cut off")

		// Meanwhile: a new document, then enough writes and a compaction
		// that h1's watch revision is gone when it comes back.
		want := put(t, cli, "/brokkr/nodes/h1/desired", h1.doc(9001, 9002))
		for i := 0; i < 5; i++ {
			put(t, cli, "/brokkr/unrelated", fmt.Sprint(i))
		}
		ctx := context.Background()
		_, err := cli.Compact(ctx, currentRevision(t, cli))
		require.NoError(t, err)
		// Long enough for gRPC's pings (10 s + 3 s) to drop the connection,
		// so the watch really is re-established at a compacted revision.
		time.Sleep(time.Until(cutAt.Add(16 * time.Second)))
		require.NoError(t, h1.echo(9001), "still serving the old state")
		assert.Error(t, h1.echo(9002), "and only the old state")

		etcdNS.MustRun(t, "nft", "delete table inet fltest")
		waitConverged(t, cli, "h1", 2)
		st := h1.status()
		assert.Equal(t, want, st.Source.Revision)
		assert.Equal(t, api.SourceConnected, st.Source.State)
		require.NoError(t, h1.echo(9002))
		b, _ := os.ReadFile(h1.logPath)
		assert.Contains(t, string(b), "compacted", "it relisted")
	})

	t.Run("a restarted daemon resumes its revision and applies nothing again", func(t *testing.T) {
		rev := h2.status().Source.Revision
		h2.stop()
		require.NoError(t, h2.echo(9001), "nat exposures serve with the daemon down")
		h2.start()
		st := h2.status()
		assert.Equal(t, rev, st.Source.Revision, "from stateDir/fleet.json before etcd answers")
		waitConverged(t, cli, "h2", 1)
		b, _ := os.ReadFile(h2.logPath)
		assert.Equal(t, 3, strings.Count(string(b), "desired document applied"), "no re-apply on restart:\n%s", lastLines(string(b), 30))
	})

	t.Run("rm removes a node's keys; the node keeps what it runs", func(t *testing.T) {
		out, errs, code := brokkr(t, c, nil, "fleet", "rm", "--node", "h2")
		require.Equal(t, 0, code, errs)
		assert.Contains(t, out, "removed")
		assert.Contains(t, errs, "is alive")
		require.NoError(t, h2.echo(9001))
		waitFor(t, 10*time.Second, "h2 reports no desired document", func() (bool, string) {
			st := h2.status()
			return strings.Contains(st.Source.Detail, "no desired document"), st.Source.Detail
		})
		_, _, code = brokkr(t, c, nil, "fleet", "rm", "--node", "nosuch")
		assert.Equal(t, 1, code)
	})

	t.Run("a local apply is refused in fleet mode", func(t *testing.T) {
		f := writeFile(t, dir, "local.yaml", h1.doc(9000))
		cmd := h1.ns.Command(filepath.Join(bin, "brokkr"), "--socket", h1.sock(), "apply", "-f", f)
		out, err := cmd.CombinedOutput()
		require.Error(t, err)
		assert.Contains(t, string(out), "brokkr fleet apply --node h1")
	})
}

func currentRevision(t testing.TB, cli *clientv3.Client) int64 {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	r, err := cli.Get(ctx, "/brokkr/none")
	require.NoError(t, err)
	return r.Header.Revision
}
