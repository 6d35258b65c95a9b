package daemon

import (
	"bufio"
	"bytes"
	"context"
	"encoding/binary"
	"encoding/json"
	"errors"
	"fmt"
	"hash/crc32"
	"io"
	"log/slog"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/brokkr/brokkr/bpf"
	"github.com/brokkr/brokkr/daemon/config"
	"github.com/brokkr/brokkr/netplane"
)

func put(t *testing.T, r *rig, name, body string) {
	t.Helper()
	w := do(t, r.d.Handler(), "PUT", "/v1/exposures/"+name, body)
	require.Equal(t, http.StatusOK, w.Code, w.Body.String())
}

func rm(t *testing.T, r *rig, name string) {
	t.Helper()
	w := do(t, r.d.Handler(), "DELETE", "/v1/exposures/"+name, "")
	require.Equal(t, http.StatusOK, w.Code, w.Body.String())
}

func natOn(port int) string {
	return fmt.Sprintf(`{"vm": "db", "guestPort": 80, "hostPort": %d, "mode": "nat"}`, port)
}

func journalPath(r *rig) string { return filepath.Join(r.host.StateDir, JournalFile) }

func readFile(t *testing.T, path string) []byte {
	t.Helper()
	b, err := os.ReadFile(path)
	require.NoError(t, err)
	return b
}

// frame is one journal record as append writes it.
func frame(payload string) []byte {
	f := make([]byte, 8, 8+len(payload))
	binary.BigEndian.PutUint32(f[0:4], uint32(len(payload)))
	binary.BigEndian.PutUint32(f[4:8], crc32.Checksum([]byte(payload), crc32c))
	return append(f, payload...)
}

// newDaemonOn is New on host's stateDir, for a start that may fail.
func newDaemonOn(host *config.Config) (*Daemon, error) {
	c := &calls{}
	addrs := NewAddressBook()
	store := bpf.NewInMemory("test")
	defer store.Close()
	return New(Options{Host: host, Store: store, Supervisor: &recSup{calls: c}, Network: &recNet{calls: c},
		Proxy: &recProxy{calls: c, resolve: addrs.Resolve}, Addresses: addrs,
		Logger: slog.New(slog.NewTextHandler(io.Discard, nil)), Timeout: 200 * time.Millisecond})
}

// A change of one exposure leaves desired.json as it is and appends a
// record; a daemon started again replays the records in order (a put
// replaces in place, a put after a removal is added at the end), and
// compacts them into desired.json, starting on an empty journal.
func TestJournalReplaysInOrder(t *testing.T) {
	r := newRig(t, rigConfig)
	before := desiredFile(t, r)
	put(t, r, "a", natOn(9001))
	put(t, r, "b", natOn(9002))
	put(t, r, "web-nat", natOn(9003)) // replaced in place
	rm(t, r, "web-auto")
	put(t, r, "web-auto", natOn(9004)) // back, at the end
	rm(t, r, "a")
	assert.Equal(t, before, desiredFile(t, r), "desired.json is not rewritten per change")
	assert.Greater(t, len(readFile(t, journalPath(r))), journalHeaderLen)

	want := []string{"web-nat", "web-proxy", "lo-auto", "ext", "b", "web-auto"}
	require.Equal(t, want, exposureNamesOf(r.d.Desired()))
	again := newRigWith(t, r.host)
	got := again.d.Desired()
	assert.Equal(t, want, exposureNamesOf(got))
	assert.Equal(t, config.P(9003), got.Exposures[0].HostPort)
	assert.Equal(t, "nat", got.Exposures[5].Mode)
	// Compacted at start: the file holds it all, the journal is empty.
	l, _, err := config.Load(desiredFile(t, again))
	require.NoError(t, err)
	assert.Equal(t, want, exposureNamesOf(l))
	assert.Len(t, readFile(t, journalPath(r)), journalHeaderLen)
	assert.Equal(t, 103, journalHeaderLen, "tests/e2e/fixture_test.go counts on it")
}

// A crash in the middle of appending leaves a torn last record, never
// acknowledged: dropped at start, the records before it kept. Torn as a
// cut frame header, a cut payload, a last record whose checksum fails, or
// zeros (pages not written back).
func TestJournalTornLastRecordIsDropped(t *testing.T) {
	whole := frame(`{"put":{"name":"torn","vm":"db","protocol":"tcp","guestPort":80,"hostPort":9100,"hostAddress":"0.0.0.0","mode":"nat","maxConns":256}}`)
	badSum := bytes.Clone(whole)
	badSum[len(badSum)-3] ^= 0x20
	for name, tail := range map[string][]byte{
		"frame header cut": whole[:5],
		"payload cut":      whole[:len(whole)-9],
		"checksum fails":   badSum,
		"zeros":            make([]byte, 700),
		"record then zero": append(bytes.Clone(whole[:30]), make([]byte, 40)...),
	} {
		t.Run(name, func(t *testing.T) {
			r := newRig(t, rigConfig)
			put(t, r, "a", natOn(9001))
			rm(t, r, "ext")
			f, err := os.OpenFile(journalPath(r), os.O_WRONLY|os.O_APPEND, 0)
			require.NoError(t, err)
			_, err = f.Write(tail)
			require.NoError(t, err)
			require.NoError(t, f.Close())
			again := newRigWith(t, r.host)
			assert.Equal(t, []string{"web-auto", "web-nat", "web-proxy", "lo-auto", "a"}, exposureNamesOf(again.d.Desired()))
			assert.Len(t, readFile(t, journalPath(r)), journalHeaderLen, "compacted, the torn bytes gone")
		})
	}
	// The guard: the whole record is no torn one; it is replayed.
	r := newRig(t, rigConfig)
	f, err := os.OpenFile(journalPath(r), os.O_WRONLY|os.O_APPEND, 0)
	require.NoError(t, err)
	_, err = f.Write(whole)
	require.NoError(t, err)
	require.NoError(t, f.Close())
	assert.Contains(t, exposureNamesOf(newRigWith(t, r.host).d.Desired()), "torn")
}

// Anything else in the journal that does not read is an error at start
// naming the file and the record; nothing is dropped silently.
func TestJournalDamageIsAnError(t *testing.T) {
	good := `{"put":{"name":"a","vm":"db","protocol":"tcp","guestPort":80,"hostPort":9001,"hostAddress":"0.0.0.0","mode":"nat","maxConns":256}}`
	flipped := frame(good)
	flipped[20] ^= 0x01
	long := frame(good)
	binary.BigEndian.PutUint32(long[0:4], 5<<20)
	for name, tc := range map[string]struct {
		records [][]byte
		want    string
	}{
		"checksum of a record before the last": {[][]byte{flipped, frame(good)}, fmt.Sprintf("record 1 (at byte %d): checksum mismatch", journalHeaderLen)},
		"a length no record has":               {[][]byte{frame(good), long}, fmt.Sprintf("record 2 (at byte %d): length 5242880 is not a record's", journalHeaderLen+len(frame(good)))},
		"an unknown key":                       {[][]byte{frame(`{"put":{"name":"a"},"also":1}`)}, fmt.Sprintf(`record 1 (at byte %d): not a record: json: unknown field "also"`, journalHeaderLen)},
		"neither put nor remove":               {[][]byte{frame(`{}`)}, fmt.Sprintf("record 1 (at byte %d): a record is exactly one of put or remove", journalHeaderLen)},
		"a removal of what is not there":       {[][]byte{frame(good), frame(`{"remove":"nope"}`)}, `record 2 removes exposure "nope"`},
		"an exposure that is not one":          {[][]byte{frame(`{"put":{"name":"a","hostPort":"x"}}`)}, "record 1: not an exposure"},
		"a state that does not validate": {[][]byte{frame(strings.Replace(good, `"hostPort":9001`, `"hostPort":8081`, 1))},
			JournalFile + " replayed is not a valid desired state (fix or remove the journal, losing its changes; the daemon will not guess):\nexposures[5].hostPort: 8081/tcp on 0.0.0.0 overlaps exposures[1]"},
	} {
		t.Run(name, func(t *testing.T) {
			r := newRig(t, rigConfig)
			f, err := os.OpenFile(journalPath(r), os.O_WRONLY|os.O_APPEND, 0)
			require.NoError(t, err)
			for _, rec := range tc.records {
				_, err = f.Write(rec)
				require.NoError(t, err)
			}
			require.NoError(t, f.Close())
			_, err = newDaemonOn(r.host)
			require.Error(t, err)
			assert.Contains(t, err.Error(), tc.want)
			assert.Contains(t, err.Error(), journalPath(r))
		})
	}
	t.Run("not a journal", func(t *testing.T) {
		r := newRig(t, rigConfig)
		require.NoError(t, os.WriteFile(journalPath(r), []byte("hello\n"), 0o600))
		_, err := newDaemonOn(r.host)
		require.Error(t, err)
		assert.Contains(t, err.Error(), journalPath(r)+": not a brokkr desired-state journal")
	})
}

// Past its bound the journal is compacted into desired.json by the change
// that crossed it; an apply and a power change write the whole state and
// empty the journal too.
func TestJournalCompaction(t *testing.T) {
	r := newRig(t, rigConfig)
	r.d.journal.maxRecords = 3
	before := desiredFile(t, r)
	put(t, r, "a", natOn(9001))
	put(t, r, "b", natOn(9002))
	assert.Equal(t, before, desiredFile(t, r))
	put(t, r, "c", natOn(9003))
	l, _, err := config.Load(desiredFile(t, r))
	require.NoError(t, err)
	assert.Equal(t, []string{"web-auto", "web-nat", "web-proxy", "lo-auto", "ext", "a", "b", "c"}, exposureNamesOf(l), "compacted at the third")
	assert.Len(t, readFile(t, journalPath(r)), journalHeaderLen)
	rm(t, r, "a")
	assert.Greater(t, len(readFile(t, journalPath(r))), journalHeaderLen)
	assert.Equal(t, []string{"web-auto", "web-nat", "web-proxy", "lo-auto", "ext", "b", "c"}, exposureNamesOf(newRigWith(t, r.host).d.Desired()))

	r = newRig(t, rigConfig)
	put(t, r, "a", natOn(9001))
	require.NoError(t, r.d.SetPower("db", "stopped"))
	assert.Len(t, readFile(t, journalPath(r)), journalHeaderLen, "a power change writes the whole state")
	assert.Contains(t, string(desiredFile(t, r)), `"name": "a"`)
	put(t, r, "b", natOn(9002))
	cfg, err := config.Parse([]byte(rigConfig))
	require.NoError(t, err)
	_, err = r.d.Apply(cfg, false)
	require.NoError(t, err)
	assert.Len(t, readFile(t, journalPath(r)), journalHeaderLen, "an apply replaces the state whole")
	assert.Equal(t, []string{"web-auto", "web-nat", "web-proxy", "lo-auto", "ext"}, exposureNamesOf(newRigWith(t, r.host).d.Desired()))
}

// A compaction cut short between its two writes (desired.json written
// whole, the journal not yet reset) leaves a journal whose records are in
// desired.json already: it names the old desired.json, so it is set aside,
// not replayed again over the new one (where its removal of web-auto would
// find nothing to remove).
func TestJournalCompactionCutShort(t *testing.T) {
	r := newRig(t, rigConfig)
	rm(t, r, "web-auto")
	put(t, r, "a", natOn(9001))
	want := exposureNamesOf(r.d.Desired())
	// The first write of the compaction, and then the crash.
	_, err := saveDesired(r.host.StateDir, r.d.Desired())
	require.NoError(t, err)
	again := newRigWith(t, r.host)
	assert.Equal(t, want, exposureNamesOf(again.d.Desired()))
	assert.Len(t, readFile(t, journalPath(r)), journalHeaderLen)
}

// Concurrent changes share fsyncs, and none is acknowledged before its
// record is on disk: each answer comes after a sync that covered its
// record's bytes.
func TestJournalGroupCommit(t *testing.T) {
	r := newRig(t, rigConfig)
	var syncs atomic.Int64
	var durable atomic.Int64 // bytes of the journal known on disk
	r.d.journal.sync = func(f *os.File) error {
		fi, err := f.Stat()
		if err != nil {
			return err
		}
		time.Sleep(2 * time.Millisecond) // an fsync of a slow disk
		if err := f.Sync(); err != nil {
			return err
		}
		syncs.Add(1)
		for {
			old := durable.Load()
			if fi.Size() <= old || durable.CompareAndSwap(old, fi.Size()) {
				break
			}
		}
		return nil
	}
	const clients, each = 8, 10
	var wg sync.WaitGroup
	for c := range clients {
		wg.Go(func() {
			for i := range each {
				name := fmt.Sprintf("g%d-%d", c, i)
				w := do(t, r.d.Handler(), "PUT", "/v1/exposures/"+name, natOn(10000+100*c+i))
				if !assert.Equal(t, http.StatusOK, w.Code, w.Body.String()) {
					return
				}
				b := readFile(t, journalPath(r))
				key := []byte(`"name":"` + name + `"`)
				end := bytes.Index(b, key) + len(key)
				if assert.Greater(t, end, len(key), name) {
					assert.LessOrEqual(t, int64(end), durable.Load(), "%s acknowledged before its record was synced", name)
				}
			}
		})
	}
	wg.Wait()
	t.Logf("%d changes, %d fsyncs", clients*each, syncs.Load())
	assert.Less(t, syncs.Load(), int64(clients*each*3/4), "changes arriving during an fsync share the next")
	assert.Len(t, newRigWith(t, r.host).d.Desired().Exposures, 5+clients*each)
}

// A failed fsync is no acknowledgement: the answer says the change may not
// survive a restart, and the next change writes the whole state (so both
// are persisted) before its record.
func TestJournalSyncFailure(t *testing.T) {
	r := newRig(t, rigConfig)
	var fail atomic.Bool
	fail.Store(true)
	r.d.journal.sync = func(f *os.File) error {
		if fail.Swap(false) {
			return errors.New("EIO, as a failing disk says")
		}
		return f.Sync()
	}
	w := do(t, r.d.Handler(), "PUT", "/v1/exposures/a", natOn(9001))
	require.Equal(t, http.StatusInternalServerError, w.Code, w.Body.String())
	assert.Contains(t, w.Body.String(), "may not survive a restart")
	assert.Contains(t, w.Body.String(), "EIO")
	put(t, r, "b", natOn(9002))
	assert.Contains(t, string(desiredFile(t, r)), `"name": "a"`, "written whole")
	assert.Equal(t, []string{"web-auto", "web-nat", "web-proxy", "lo-auto", "ext", "a", "b"}, exposureNamesOf(newRigWith(t, r.host).d.Desired()))
}

// killHelperEnv and killHelperRunEnv name the stateDir and the runDir of
// TestJournalKillHelper's daemon.
const (
	killHelperEnv    = "BRK_JOURNAL_KILL_STATE"
	killHelperRunEnv = "BRK_JOURNAL_KILL_RUN"
)

// killOps is client c's changes: put k-c-i, and every other one removed
// right after.
func killOps(c int) [][2]string {
	var ops [][2]string
	for i := range 400 {
		name := fmt.Sprintf("k-%d-%d", c, i)
		ops = append(ops, [2]string{"put", name})
		if i%2 == 0 {
			ops = append(ops, [2]string{"rm", name})
		}
	}
	return ops
}

// TestJournalKillHelper is the daemon TestJournalKilled kills: 4 clients
// changing exposures, compacting every 5 records, each acknowledged change
// printed as "c n" (client c's n-th op answered).
func TestJournalKillHelper(t *testing.T) {
	state := os.Getenv(killHelperEnv)
	if state == "" {
		t.Skip("run by TestJournalKilled")
	}
	host, err := config.Parse([]byte(rigConfig))
	require.NoError(t, err)
	// The run directory is the parent's: the helper is SIGKILLed, so no
	// cleanup of its own would run.
	host.StateDir, host.RunDir = state, os.Getenv(killHelperRunEnv)
	r := newRigWith(t, host)
	r.d.journal.maxRecords = 5
	out := bufio.NewWriter(os.Stdout)
	var mu sync.Mutex
	var wg sync.WaitGroup
	for c := range 4 {
		wg.Go(func() {
			for n, op := range killOps(c) {
				var w = do(t, r.d.Handler(), "DELETE", "/v1/exposures/"+op[1], "")
				if op[0] == "put" {
					w = do(t, r.d.Handler(), "PUT", "/v1/exposures/"+op[1], natOn(10000+1000*c+n))
				}
				if w.Code != http.StatusOK {
					panic(w.Body.String())
				}
				mu.Lock()
				fmt.Fprintf(out, "%d %d\n", c, n)
				_ = out.Flush()
				mu.Unlock()
			}
		})
	}
	wg.Wait()
}

// A daemon killed (SIGKILL) at a random moment, between appends and
// compactions alike, starts again with every acknowledged change: for
// each client, the state is its changes up to the last acknowledged one,
// or up to the one in flight when it was killed.
func TestJournalKilled(t *testing.T) {
	if os.Getenv(killHelperEnv) != "" {
		t.Skip("the helper")
	}
	for round := range 6 {
		state := t.TempDir()
		cmd := exec.Command(os.Args[0], "-test.run=^TestJournalKillHelper$")
		cmd.Env = append(os.Environ(), killHelperEnv+"="+state, killHelperRunEnv+"="+shortDir(t))
		stdout, err := cmd.StdoutPipe()
		require.NoError(t, err)
		require.NoError(t, cmd.Start())
		acked := make([]int, 4)
		for c := range acked {
			acked[c] = -1
		}
		lines := bufio.NewScanner(stdout)
		deadline := time.Now().Add(time.Duration(150+100*round) * time.Millisecond)
		seen := 0
		for lines.Scan() {
			var c, n int
			if _, err := fmt.Sscanf(lines.Text(), "%d %d", &c, &n); err == nil {
				acked[c] = max(acked[c], n)
				seen++
			}
			if seen > 0 && time.Now().After(deadline) {
				break
			}
		}
		require.NoError(t, cmd.Process.Signal(syscall.SIGKILL))
		for lines.Scan() { // what was printed before the kill landed counts too
			var c, n int
			if _, err := fmt.Sscanf(lines.Text(), "%d %d", &c, &n); err == nil {
				acked[c] = max(acked[c], n)
			}
		}
		_ = cmd.Wait()
		require.Positive(t, seen, "the helper acknowledged nothing")

		host, err := config.Parse([]byte(rigConfig))
		require.NoError(t, err)
		host.StateDir, host.RunDir = state, shortDir(t)
		got := map[string]bool{}
		for _, e := range newRigWith(t, host).d.Desired().Exposures {
			got[e.Name] = true
		}
		for c := range 4 {
			ops := killOps(c)
			upTo := func(k int) map[string]bool { // client c's names after its ops 0..k
				m := map[string]bool{}
				for _, op := range ops[:k+1] {
					m[op[1]] = op[0] == "put"
				}
				return m
			}
			mine := map[string]bool{}
			for name := range got {
				if strings.HasPrefix(name, fmt.Sprintf("k-%d-", c)) {
					mine[name] = true
				}
			}
			match := func(k int) bool {
				want := upTo(k)
				for name, in := range want {
					if in != mine[name] {
						return false
					}
				}
				for name := range mine {
					if !want[name] {
						return false
					}
				}
				return true
			}
			inFlight := min(acked[c]+1, len(ops)-1)
			assert.True(t, match(acked[c]) || match(inFlight),
				"round %d client %d: acknowledged up to op %d, the state has %v", round, c, acked[c], mine)
		}
		t.Logf("round %d: killed after %v acknowledged", round, acked)
	}
}

// kernelNet is updNet that keeps what the kernel would hold after each
// UpdateExposures, and takes its time as an nft commit does.
type kernelNet struct {
	*updNet
	mu    sync.Mutex
	held  map[string]int // name → host port
	calls int
}

func (n *kernelNet) UpdateExposures(ctx context.Context, set []netplane.Exposure, remove []string) netplane.Report {
	time.Sleep(3 * time.Millisecond)
	n.mu.Lock()
	defer n.mu.Unlock()
	n.calls++
	for _, name := range remove {
		delete(n.held, name)
	}
	for _, e := range set {
		n.held[e.Name] = int(e.HostPort)
	}
	return netplane.Report{}
}

// Concurrent changes reach the kernel in rounds, each round one
// UpdateExposures for every change pending, and the kernel ends as the
// desired state says, each exposure at its latest (clients change the
// same exposures: the last round publishes the latest).
func TestChangesReachTheKernelInRounds(t *testing.T) {
	var kn *kernelNet
	r, _ := newUpdRig(t, rigConfig, func(o *Options) {
		kn = &kernelNet{updNet: o.Network.(*updNet), held: map[string]int{}}
		o.Network = kn
	})
	r.d.Pass(context.Background())
	const clients, each = 8, 12
	var wg sync.WaitGroup
	stop := make(chan struct{})
	passes := make(chan struct{})
	go func() { // passes read the desired state while it changes
		defer close(passes)
		for {
			select {
			case <-stop:
				return
			default:
				r.d.Pass(context.Background())
				time.Sleep(time.Millisecond)
			}
		}
	}()
	defer func() { close(stop); <-passes }()
	for c := range clients {
		wg.Go(func() {
			for i := range each {
				// Two clients share each name; every change moves it.
				name := fmt.Sprintf("r-%d", c%4)
				w := do(t, r.d.Handler(), "PUT", "/v1/exposures/"+name, natOn(20000+1000*c+i))
				if !assert.Equal(t, http.StatusOK, w.Code, w.Body.String()) {
					return
				}
				if i%4 == 1 {
					w = do(t, r.d.Handler(), "DELETE", "/v1/exposures/"+name, "")
					assert.Contains(t, []int{http.StatusOK, http.StatusNotFound}, w.Code, w.Body.String())
				}
			}
		})
	}
	wg.Wait()
	want := map[string]int{}
	for _, e := range r.d.Desired().Exposures {
		if strings.HasPrefix(e.Name, "r-") {
			want[e.Name] = e.HostPort.First
		}
	}
	kn.mu.Lock()
	defer kn.mu.Unlock()
	for name := range kn.held {
		if !strings.HasPrefix(name, "r-") {
			delete(kn.held, name) // the rig's own (only the changes publish here)
		}
	}
	require.Len(t, want, 4, "every name ends set")
	assert.Equal(t, want, kn.held, "the kernel as the desired state says, each at its latest")
	changes := clients*each + clients*each/4
	t.Logf("%d changes, %d UpdateExposures", changes, kn.calls)
	assert.Less(t, kn.calls, changes*3/4, "changes pending together share a round")
}

// Changes of one exposure are made in place on the daemon's own lists;
// what a reader was given before (a pass's snapshot, Desired) never changes
// under it, and a reader after sees every change.
func TestSnapshotsDoNotChangeUnderTheirReaders(t *testing.T) {
	r := newRig(t, rigConfig)
	put(t, r, "a", natOn(9001)) // the lists are the daemon's own from here
	before := r.d.Desired()
	kept := slices.Clone(before.Exposures)
	_, model := r.d.snapshot()
	keptModel := slices.Clone(model.Exposures)
	put(t, r, "web-nat", natOn(9002)) // in place
	rm(t, r, "web-auto")              // shifts the rest
	put(t, r, "b", natOn(9003))       // appended
	assert.Equal(t, kept, before.Exposures, "a Desired taken before")
	assert.Equal(t, keptModel, model.Exposures, "a model taken before")
	assert.Equal(t, []string{"web-nat", "web-proxy", "lo-auto", "ext", "a", "b"}, exposureNamesOf(r.d.Desired()))
	_, now := r.d.snapshot()
	assert.Equal(t, 9002, int(now.Exposures[0].HostPort))
	assert.Equal(t, "b", now.Exposures[5].Name)
}

// The descriptor budget's warning in a PUT's answer is the whole state's,
// as budgetWarning of the whole model says, though it is computed again
// only when a proxied exposure changed (or went).
func TestPutAnswersTheWholeBudget(t *testing.T) {
	r := newRig(t, rigConfig)
	var prevWarn string
	for i, step := range []struct{ method, name, body string }{
		{"PUT", "u", `{"vm": "db", "guestPort": 80, "hostPort": 9001, "mode": "proxy", "maxConns": 0}`},
		{"PUT", "n", natOn(9002)},
		{"PUT", "n", natOn(9003)},
		{"DELETE", "u", ""},
		{"PUT", "n", natOn(9004)},
		{"PUT", "v", `{"vm": "db", "guestPort": 80, "hostPort": 9005, "mode": "proxy", "maxConns": 0}`},
		{"PUT", "n", natOn(9006)},
	} {
		w := do(t, r.d.Handler(), step.method, "/v1/exposures/"+step.name, step.body)
		require.Equal(t, http.StatusOK, w.Code, w.Body.String())
		if step.method == "DELETE" {
			continue
		}
		var plan struct{ Warnings []string }
		require.NoError(t, json.Unmarshal(w.Body.Bytes(), &plan))
		_, model := r.d.snapshot()
		want := budgetWarning(model)
		got := ""
		for _, x := range plan.Warnings {
			if strings.HasPrefix(x, "descriptor budget") {
				got = x
			}
		}
		assert.Equal(t, want, got, "step %d", i)
		if i == 4 {
			assert.NotEqual(t, prevWarn, got, "u's share went with it")
		}
		prevWarn = got
	}
}
