package fleet

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"slices"
	"sort"
	"strings"

	"github.com/brokkr/brokkr/daemon"
	"github.com/brokkr/brokkr/daemon/api"
	"github.com/brokkr/brokkr/daemon/config"
	"github.com/brokkr/brokkr/internal/spec"
	clientv3 "go.etcd.io/etcd/client/v3"
	"go.yaml.in/yaml/v3"
)

// ParseFleetFile splits a fleet file (`nodes: {NAME: {...}}`) into one
// document per node and validates each as a whole; every problem of every
// node is reported, named nodes.NAME.field.
func ParseFleetFile(data []byte) (map[string][]byte, error) {
	var f struct {
		Nodes map[string]yaml.Node `yaml:"nodes"`
	}
	dec := yaml.NewDecoder(strings.NewReader(string(data)))
	dec.KnownFields(true)
	if err := dec.Decode(&f); err != nil {
		return nil, config.Errors{{Msg: "not a fleet file (nodes: {NAME: {network, vms, exposures}}): " + strings.TrimPrefix(err.Error(), "yaml: ")}}
	}
	if len(f.Nodes) == 0 {
		return nil, config.Errors{{Path: "nodes", Msg: "is required and names at least one node"}}
	}
	docs := map[string][]byte{}
	var errs config.Errors
	for _, name := range sortedKeys(f.Nodes) {
		n := f.Nodes[name]
		p := "nodes." + name
		if !config.NodeNameRE.MatchString(name) {
			errs = append(errs, config.FieldError{Path: p, Msg: fmt.Sprintf("%q is not a node name (1-63 of A-Z a-z 0-9 . _ -)", name)})
			continue
		}
		b, err := yaml.Marshal(&n)
		if err != nil {
			errs = append(errs, config.FieldError{Path: p, Msg: err.Error()})
			continue
		}
		if _, err := config.ParseDocument(b); err != nil {
			for _, m := range fieldErrors(err) {
				m.Path = strings.TrimSuffix(p+"."+m.Path, ".")
				errs = append(errs, m)
			}
			continue
		}
		docs[name] = b
	}
	if len(errs) > 0 {
		return nil, errs
	}
	return docs, nil
}

func fieldErrors(err error) config.Errors {
	var ce config.Errors
	if errors.As(err, &ce) {
		return ce
	}
	return config.Errors{{Msg: err.Error()}}
}

func sortedKeys[V any](m map[string]V) []string {
	out := make([]string, 0, len(m))
	for k := range m {
		out = append(out, k)
	}
	sort.Strings(out)
	return out
}

// NodePlan is what a fleet apply changes on one node.
type NodePlan struct {
	Node string   `json:"node"`
	New  bool     `json:"new"` // the node had no desired document
	Plan api.Plan `json:"plan"`
	// ReadRevision is the desired key's revision the plan was made against
	// (0: absent); the write succeeds only if it is still that.
	ReadRevision int64 `json:"readRevision"`
	Unchanged    bool  `json:"unchanged"` // same bytes: not rewritten
}

// ApplyResult is what ApplyDocs did.
type ApplyResult struct {
	Nodes    []NodePlan `json:"nodes"`
	Revision int64      `json:"revision,omitempty"` // of the transaction (0: dry run or nothing to write)
}

// ConflictError is a lost race: another writer changed a node's document
// between this apply's read and its write. Nothing was written.
type ConflictError struct{ Nodes []string }

func (e *ConflictError) Error() string {
	return fmt.Sprintf("the desired document of %s changed since it was read (another apply won the race); nothing was written: read again and re-run", strings.Join(e.Nodes, ", "))
}

// ApplyDocs is Plan then, unless dryRun, Write.
func ApplyDocs(ctx context.Context, cli *clientv3.Client, prefix string, docs map[string][]byte, dryRun bool) (*ApplyResult, error) {
	res, err := Plan(ctx, cli, prefix, docs, dryRun)
	if err != nil || dryRun {
		return res, err
	}
	return res, Write(ctx, cli, prefix, docs, res)
}

// Plan reads every node's current desired document in one read and says
// what docs would change (+/~/-) against it. Documents must have been
// validated (ParseDocument / ParseFleetFile).
func Plan(ctx context.Context, cli *clientv3.Client, prefix string, docs map[string][]byte, dryRun bool) (*ApplyResult, error) {
	names := sortedKeys(docs)
	gets := make([]clientv3.Op, len(names))
	for i, n := range names {
		gets[i] = clientv3.OpGet(NodeKeys(prefix, n).Desired)
	}
	// One read transaction: every plan is against the same revision.
	read, err := cli.Txn(ctx).Then(gets...).Commit()
	if err != nil {
		return nil, fmt.Errorf("reading the current desired documents: %w", err)
	}
	res := &ApplyResult{}
	for i, n := range names {
		np := NodePlan{Node: n}
		cur := config.Defaults()
		if kvs := read.Responses[i].GetResponseRange().Kvs; len(kvs) > 0 {
			np.ReadRevision = kvs[0].ModRevision
			np.Unchanged = string(kvs[0].Value) == string(docs[n])
			if c, err := config.ParseDocument(kvs[0].Value); err == nil {
				cur = c
			} // an invalid current document: plan against nothing, as the node runs neither
		} else {
			np.New = true
		}
		next, _ := config.ParseDocument(docs[n])
		np.Plan = daemon.Diff(cur, next)
		np.Plan.DryRun = dryRun
		res.Nodes = append(res.Nodes, np)
	}
	return res, nil
}

// Write puts the planned documents in one transaction, guarded by a compare
// on the revision each was read at, so two operators never silently
// overwrite each other: all are written or none (a ConflictError).
func Write(ctx context.Context, cli *clientv3.Client, prefix string, docs map[string][]byte, res *ApplyResult) error {
	var cmps []clientv3.Cmp
	var puts []clientv3.Op
	names := make([]string, 0, len(res.Nodes))
	for _, np := range res.Nodes {
		key := NodeKeys(prefix, np.Node).Desired
		names = append(names, np.Node)
		cmps = append(cmps, clientv3.Compare(clientv3.ModRevision(key), "=", np.ReadRevision))
		if !np.Unchanged {
			puts = append(puts, clientv3.OpPut(key, string(docs[np.Node])))
		}
	}
	if len(puts) == 0 {
		return nil
	}
	w, err := cli.Txn(ctx).If(cmps...).Then(puts...).Commit()
	if err != nil {
		return fmt.Errorf("writing the desired documents: %w", err)
	}
	if !w.Succeeded {
		// Say which ones moved, from a fresh read.
		var moved []string
		for _, np := range res.Nodes {
			r, err := cli.Get(ctx, NodeKeys(prefix, np.Node).Desired)
			if err != nil {
				return &ConflictError{Nodes: names}
			}
			var now int64
			if len(r.Kvs) > 0 {
				now = r.Kvs[0].ModRevision
			}
			if now != np.ReadRevision {
				moved = append(moved, fmt.Sprintf("%s (revision %d, now %d)", np.Node, np.ReadRevision, now))
			}
		}
		return &ConflictError{Nodes: moved}
	}
	res.Revision = w.Header.Revision
	for i := range res.Nodes {
		res.Nodes[i].Plan.Applied = !res.Nodes[i].Unchanged
	}
	return nil
}

// NodeState is one row of `brokkr fleet status`.
type NodeState struct {
	Node       string `json:"node"`
	Alive      bool   `json:"alive"`
	ReportedAt string `json:"reportedAt,omitempty"`
	// DesiredRevision is the revision of the node's desired document (0:
	// none); Revision is the one the node reports running.
	DesiredRevision int64       `json:"desiredRevision"`
	Revision        int64       `json:"revision"`
	Converged       bool        `json:"converged"`
	VMsRunning      int         `json:"vmsRunning"`
	VMs             int         `json:"vms"`
	ExposuresActive int         `json:"exposuresActive"`
	Exposures       int         `json:"exposures"`
	Errors          []string    `json:"errors"`
	Status          *api.Status `json:"status,omitempty"` // with --node
}

// List reads every node's keys under prefix in one consistent read.
func List(ctx context.Context, cli *clientv3.Client, prefix string) ([]NodeState, error) {
	dir := NodesDir(prefix)
	resp, err := cli.Get(ctx, dir, clientv3.WithPrefix())
	if err != nil {
		return nil, fmt.Errorf("reading %s: %w", dir, err)
	}
	rows := map[string]*NodeState{}
	for _, kv := range resp.Kvs {
		rest := strings.TrimPrefix(string(kv.Key), dir)
		node, leaf, ok := strings.Cut(rest, "/")
		if !ok {
			continue
		}
		r := rows[node]
		if r == nil {
			r = &NodeState{Node: node, Errors: []string{}}
			rows[node] = r
		}
		switch leaf {
		case "alive":
			r.Alive = true
		case "desired":
			r.DesiredRevision = kv.ModRevision
		case "status":
			var st api.Status
			if err := json.Unmarshal(kv.Value, &st); err != nil {
				r.Errors = append(r.Errors, "status: not valid JSON: "+err.Error())
				continue
			}
			r.Status = &st
		}
	}
	out := make([]NodeState, 0, len(rows))
	for _, n := range sortedKeys(rows) {
		r := rows[n]
		if st := r.Status; st != nil {
			r.VMs, r.Exposures = len(st.VMs), len(st.Exposures)
			for _, v := range st.VMs {
				if v.Phase == string(spec.PhaseRunning) {
					r.VMsRunning++
				}
				if v.Phase == string(spec.PhaseFailed) {
					r.Errors = append(r.Errors, fmt.Sprintf("vm %s failed: %s", v.Name, v.Detail))
				}
			}
			for _, e := range st.Exposures {
				if e.State == string(spec.StateActive) {
					r.ExposuresActive++
				}
				if e.State == string(spec.StateFailed) {
					r.Errors = append(r.Errors, fmt.Sprintf("exposure %s failed: %s", e.Name, e.Reason))
				}
			}
			if s := st.Source; s != nil {
				r.Revision, r.ReportedAt = s.Revision, s.ReportedAt
				if s.Rejected != 0 && s.Rejected >= r.DesiredRevision {
					for _, e := range s.Errors {
						r.Errors = append(r.Errors, fmt.Sprintf("revision %d rejected: %s", s.Rejected, e))
					}
				}
			}
		}
		r.Converged = r.DesiredRevision != 0 && r.Revision == r.DesiredRevision
		out = append(out, *r)
	}
	return out, nil
}

// Node returns one node's row with its full status; ok is false if the
// node has no keys at all.
func Node(ctx context.Context, cli *clientv3.Client, prefix, node string) (NodeState, bool, error) {
	rows, err := List(ctx, cli, prefix)
	if err != nil {
		return NodeState{}, false, err
	}
	i := slices.IndexFunc(rows, func(r NodeState) bool { return r.Node == node })
	if i < 0 {
		return NodeState{}, false, nil
	}
	return rows[i], true, nil
}

// Remove deletes a node's desired document and status in one transaction.
// The alive key is the node's (under its lease) and expires with it. A node
// still running keeps what it runs (nothing is torn down) and reports again.
func Remove(ctx context.Context, cli *clientv3.Client, prefix, node string) (deleted int64, alive bool, err error) {
	k := NodeKeys(prefix, node)
	resp, err := cli.Txn(ctx).Then(clientv3.OpDelete(k.Desired), clientv3.OpDelete(k.Status), clientv3.OpGet(k.Alive, clientv3.WithCountOnly())).Commit()
	if err != nil {
		return 0, false, fmt.Errorf("removing %s: %w", k.Dir, err)
	}
	for _, r := range resp.Responses[:2] {
		deleted += r.GetResponseDeleteRange().Deleted
	}
	return deleted, resp.Responses[2].GetResponseRange().Count > 0, nil
}
