package fleet

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io/fs"
	"log/slog"
	"os"
	"path/filepath"
	"sync"
	"time"

	"github.com/brokkr/brokkr/daemon"
	"github.com/brokkr/brokkr/daemon/api"
	"github.com/brokkr/brokkr/daemon/config"
	"github.com/brokkr/brokkr/internal/atomicfile"
	"go.etcd.io/etcd/api/v3/mvccpb"
	"go.etcd.io/etcd/api/v3/v3rpc/rpctypes"
	clientv3 "go.etcd.io/etcd/client/v3"
)

// StateFile (under stateDir) remembers which desired revision this node
// runs, so a restarted daemon reports it before etcd answers.
const StateFile = "fleet.json"

// statusInterval is the least time between two status writes.
const statusInterval = time.Second

// Agent is a node in fleet mode: a daemon.Source on etcd.
type Agent struct {
	cfg  config.Fleet
	keys Keys
	cli  *clientv3.Client
	log  *slog.Logger
	ttl  time.Duration
	file string // stateDir/fleet.json

	reconnected chan struct{} // the lease loop saw etcd again: restart the watch
	changed     chan struct{} // the report changed: write the status

	mu  sync.Mutex
	rep api.Source
	// pending is a revision applied but not yet converged by a pass: the
	// report names it only from the first status that reflects it, so a
	// status in etcd never claims a revision its rows do not show yet.
	pending struct {
		rev int64
		gen uint64
	}
}

// New builds the agent for host's fleet section. It does not wait for etcd.
func New(host *config.Config, log *slog.Logger) (*Agent, error) {
	if host.Fleet == nil {
		return nil, errors.New("fleet: no fleet section in the config")
	}
	f := *host.Fleet
	cli, err := Dial(ClientConfig{Endpoints: f.Endpoints, CA: f.CA, Cert: f.Cert, Key: f.Key, User: f.User, Password: f.Password})
	if err != nil {
		return nil, err
	}
	if log == nil {
		log = slog.Default()
	}
	a := &Agent{
		cfg: f, keys: NodeKeys(f.Prefix, f.Node), cli: cli, log: log.With("engine", "fleet", "node", f.Node),
		ttl: time.Duration(*f.LeaseTTL) * time.Second, file: filepath.Join(host.StateDir, StateFile),
		reconnected: make(chan struct{}, 1), changed: make(chan struct{}, 1),
		rep: api.Source{Kind: "etcd", Node: f.Node, State: api.SourceDisconnected, Detail: "connecting"},
	}
	a.rep.Revision = a.loadRevision()
	return a, nil
}

// Close closes the etcd client.
func (a *Agent) Close() error { return a.cli.Close() }

// Report is the source's row in the status.
func (a *Agent) Report() api.Source {
	a.mu.Lock()
	defer a.mu.Unlock()
	r := a.rep
	r.Errors = append([]string(nil), r.Errors...)
	return r
}

// update changes the report under the lock and, when it changed, asks for
// a status write.
func (a *Agent) update(fn func(r *api.Source)) {
	a.mu.Lock()
	before, _ := json.Marshal(a.rep)
	fn(&a.rep)
	after, _ := json.Marshal(a.rep)
	a.mu.Unlock()
	if string(before) != string(after) {
		kick(a.changed)
	}
}

func kick(c chan struct{}) {
	select {
	case c <- struct{}{}:
	default:
	}
}

// Run is daemon.Source.Run: the lease, the watch and the status writer,
// until ctx ends. Nothing here ever removes what the node runs.
func (a *Agent) Run(ctx context.Context, t daemon.Target) {
	var wg sync.WaitGroup
	wg.Go(func() { a.keepAlive(ctx) })
	wg.Go(func() { a.watch(ctx, t) })
	wg.Go(func() { a.writeStatus(ctx, t) })
	wg.Wait()
}

// setConnected records whether etcd answers; on a change back to connected
// the watch is restarted from its last revision (a stream over a connection
// the partition killed may otherwise sit silent until gRPC notices).
func (a *Agent) setConnected(err error) {
	if a.markConnected(err) {
		kick(a.reconnected)
	}
}

// markConnected records whether etcd answers and reports a change back to
// connected. The watch calls it directly: an answer on the watch proves
// that stream alive, so it must not restart itself.
func (a *Agent) markConnected(err error) (back bool) {
	a.mu.Lock()
	was := a.rep.State
	a.mu.Unlock()
	if err == nil {
		a.update(func(r *api.Source) {
			r.State = api.SourceConnected
			if r.Detail == "connecting" || isConnDetail(r.Detail) {
				r.Detail = ""
			}
		})
		if was != api.SourceConnected {
			a.log.Info("etcd reachable")
			return true
		}
		return false
	}
	a.update(func(r *api.Source) {
		r.State = api.SourceDisconnected
		r.Detail = connDetail(err)
	})
	if was == api.SourceConnected {
		a.log.Warn("etcd unreachable; serving the last applied state", "err", err)
	}
	return false
}

const connPrefix = "etcd unreachable: "

func connDetail(err error) string { return connPrefix + err.Error() }
func isConnDetail(s string) bool {
	return len(s) >= len(connPrefix) && s[:len(connPrefix)] == connPrefix
}
func sleepCtx(ctx context.Context, d time.Duration) bool {
	t := time.NewTimer(d)
	defer t.Stop()
	select {
	case <-ctx.Done():
		return false
	case <-t.C:
		return true
	}
}

// keepAlive holds the alive key under a lease of the configured TTL,
// renewing it every third of the TTL. It renews with KeepAliveOnce rather
// than the client's KeepAlive channel because each renewal's answer is also
// the node's measure of being connected (the channel only reports once the
// lease is gone). A lease that expired during a partition is replaced by a
// new one and the alive key written again; that is the only write here.
func (a *Agent) keepAlive(ctx context.Context) {
	every := a.ttl / 3
	var lease clientv3.LeaseID
	alive, _ := json.Marshal(map[string]any{"node": a.cfg.Node, "pid": os.Getpid(), "since": time.Now().UTC().Format(time.RFC3339)})
	for ctx.Err() == nil {
		// A renewal slower than its period (a loaded host, a TLS handshake
		// after a reconnect) is not a partition: wait for the answer up to
		// the TTL, past which the lease would be gone anyway.
		cctx, cancel := context.WithTimeout(ctx, a.ttl)
		var err error
		if lease == 0 {
			var g *clientv3.LeaseGrantResponse
			if g, err = a.cli.Grant(cctx, int64(a.ttl/time.Second)); err == nil {
				if _, err = a.cli.Put(cctx, a.keys.Alive, string(alive), clientv3.WithLease(g.ID)); err == nil {
					lease = g.ID
					a.log.Info("alive", "key", a.keys.Alive, "lease", fmt.Sprintf("%x", int64(lease)), "ttl", a.ttl)
				}
			}
		} else {
			_, err = a.cli.KeepAliveOnce(cctx, lease)
			if errors.Is(err, rpctypes.ErrLeaseNotFound) {
				a.log.Warn("the alive lease expired while etcd was out of reach; taking a new one")
				lease = 0
				cancel()
				continue
			}
		}
		cancel()
		if ctx.Err() != nil {
			return
		}
		a.setConnected(err)
		sleepCtx(ctx, every)
	}
}

// watch follows the desired key: a list (Get) gives the current document
// and a revision, the watch continues from there. A watch that ends (the
// client gave up, the member lost its leader, the connection came back) is
// resumed from the last revision seen; one whose revision was compacted
// away is replaced by a fresh list.
func (a *Agent) watch(ctx context.Context, t daemon.Target) {
	var rev int64 // the last revision whose events for the key have been handled
	relist := true
	for ctx.Err() == nil {
		if relist {
			gctx, cancel := context.WithTimeout(ctx, 5*time.Second)
			resp, err := a.cli.Get(gctx, a.keys.Desired)
			cancel()
			if err != nil {
				if ctx.Err() == nil {
					a.setConnected(err)
					sleepCtx(ctx, time.Second)
				}
				continue
			}
			a.markConnected(nil) // the watch starts afresh below anyway
			if len(resp.Kvs) == 0 {
				a.absent(resp.Header.Revision)
			} else {
				a.handle(t, resp.Kvs[0])
			}
			rev, relist = resp.Header.Revision, false
		}
		// Without a leader a member serves a stale view; WithRequireLeader
		// ends the watch so it is resumed through a member that has one.
		wctx, cancel := context.WithCancel(clientv3.WithRequireLeader(ctx))
		wch := a.cli.Watch(wctx, a.keys.Desired, clientv3.WithRev(rev+1))
	stream:
		for {
			select {
			case <-ctx.Done():
				break stream
			case <-a.reconnected:
				break stream
			case wr, ok := <-wch:
				if !ok {
					break stream
				}
				if wr.CompactRevision != 0 {
					a.log.Info("the watch's revision was compacted; listing again", "had", rev, "compacted", wr.CompactRevision)
					relist = true
					break stream
				}
				if err := wr.Err(); err != nil {
					a.log.Debug("watch ended; resuming", "err", err, "rev", rev)
					break stream
				}
				// An answer on the watch is etcd answering: without this a
				// node whose lease renewals kept timing out stayed
				// "disconnected", and wrote no status, while it applied
				// the documents the watch brought.
				a.markConnected(nil)
				for _, ev := range wr.Events {
					if ev.Type == mvccpb.DELETE {
						a.absent(ev.Kv.ModRevision)
					} else {
						a.handle(t, ev.Kv)
					}
					rev = ev.Kv.ModRevision
				}
			}
		}
		cancel()
		sleepCtx(ctx, 100*time.Millisecond) // no hot loop when the watch ends at once
	}
}

// absent: nobody wants anything of this node (never written, or removed by
// `brokkr fleet rm`). It keeps running what it has: removal is explicit,
// by applying a document without those VMs and exposures.
func (a *Agent) absent(rev int64) {
	a.update(func(r *api.Source) {
		r.Detail = fmt.Sprintf("no desired document at %s (revision %d); keeping the current state", a.keys.Desired, rev)
	})
}

// handle validates one revision of the document and applies it whole
// through the daemon's own Apply (which also runs the network plane's
// validation and persists it), or records why not.
func (a *Agent) handle(t daemon.Target, kv *mvccpb.KeyValue) {
	rev := kv.ModRevision
	cur := a.Report()
	a.mu.Lock()
	pendingRev := a.pending.rev
	a.mu.Unlock()
	if rev == cur.Revision || rev == cur.Rejected || rev == pendingRev {
		return // seen already (a relist after reconnecting)
	}
	doc, err := config.DecodeDocument(kv.Value) // Apply validates it, once
	var plan api.Plan
	if err == nil {
		next := *t.Host()
		next.Network, next.VMs, next.Exposures = doc.Network, doc.VMs, doc.Exposures
		for plan, err = t.Apply(&next, false); errors.Is(err, daemon.ErrBusy); plan, err = t.Apply(&next, false) {
			a.log.Warn("the network plane is busy; retrying the apply", "revision", rev)
			time.Sleep(time.Second)
		}
	}
	if err != nil {
		msgs := fieldMessages(err)
		a.log.Warn("desired document rejected; keeping the previous state", "revision", rev, "errors", msgs)
		a.update(func(r *api.Source) {
			r.Rejected, r.Errors = rev, msgs
			if !isConnDetail(r.Detail) {
				r.Detail = ""
			}
		})
		return
	}
	a.log.Info("desired document applied", "revision", rev, "vmsAdded", plan.VMs.Added, "vmsChanged", plan.VMs.Changed,
		"vmsRemoved", plan.VMs.Removed, "exposuresAdded", plan.Exposures.Added, "exposuresChanged", plan.Exposures.Changed,
		"exposuresRemoved", plan.Exposures.Removed)
	a.saveRevision(rev)
	gen, _ := t.Generations()
	a.mu.Lock()
	a.pending.rev, a.pending.gen = rev, gen
	a.mu.Unlock()
	a.update(func(r *api.Source) {
		r.Rejected, r.Errors = 0, nil
		if !isConnDetail(r.Detail) {
			r.Detail = ""
		}
	})
	a.settle(t)
}

// settle moves a pending revision into the report once a pass has
// converged it.
func (a *Agent) settle(t daemon.Target) {
	_, reported := t.Generations()
	a.mu.Lock()
	p := a.pending
	ready := p.rev != 0 && reported >= p.gen
	if ready {
		a.pending.rev = 0
	}
	a.mu.Unlock()
	if ready {
		a.update(func(r *api.Source) { r.Revision = p.rev })
	}
}

func fieldMessages(err error) []string {
	var ce config.Errors
	if errors.As(err, &ce) {
		out := make([]string, len(ce))
		for i, e := range ce {
			out[i] = e.Error()
		}
		return out
	}
	return []string{err.Error()}
}

// writeStatus puts the daemon's status JSON at the status key when it
// differs from the last one written, at most once per statusInterval; at
// rest (nothing changes) it writes nothing. Passes wake it, and so do
// changes of the source's own report.
func (a *Agent) writeStatus(ctx context.Context, t daemon.Target) {
	var last []byte
	var lastWrite time.Time
	var lastErr string // logged when it changes, not on every retry
	for {
		select {
		case <-ctx.Done():
			return
		case <-t.Passed():
		case <-a.changed:
		}
		a.settle(t)
		if wait := statusInterval - time.Since(lastWrite); wait > 0 && !sleepCtx(ctx, wait) {
			return
		}
		st := t.Status()
		if st.Source == nil || st.Source.State != api.SourceConnected {
			continue // unreachable: reconnecting changes the report, which wakes this again
		}
		b, err := json.Marshal(st)
		if err != nil || string(b) == string(last) {
			continue
		}
		st.Source.ReportedAt = time.Now().UTC().Format(time.RFC3339Nano)
		out, _ := json.Marshal(st)
		pctx, cancel := context.WithTimeout(ctx, 5*time.Second)
		_, err = a.cli.Put(pctx, a.keys.Status, string(out))
		cancel()
		lastWrite = time.Now()
		if err != nil {
			if ctx.Err() == nil && err.Error() != lastErr {
				a.log.Warn("writing status failed; retried on the next pass", "key", a.keys.Status, "err", err)
			}
			lastErr = err.Error()
			continue
		}
		last, lastErr = b, ""
	}
}

type stateFile struct {
	Node     string `json:"node"`
	Revision int64  `json:"revision"`
}

func (a *Agent) loadRevision() int64 {
	b, err := os.ReadFile(a.file)
	if err != nil {
		if !errors.Is(err, fs.ErrNotExist) {
			a.log.Warn("reading the fleet state", "err", err)
		}
		return 0
	}
	var s stateFile
	if json.Unmarshal(b, &s) != nil || s.Node != a.cfg.Node {
		return 0 // another node's (renamed): its revisions mean nothing here
	}
	return s.Revision
}

func (a *Agent) saveRevision(rev int64) {
	b, _ := json.Marshal(stateFile{Node: a.cfg.Node, Revision: rev})
	if err := atomicfile.Write(a.file, append(b, '\n'), 0o600); err != nil {
		a.log.Warn("persisting the fleet revision", "err", err)
	}
}
