package daemon

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"net/http"
	"reflect"
	"slices"
	"strings"
	"sync"

	"github.com/brokkr/brokkr/daemon/api"
	"github.com/brokkr/brokkr/daemon/config"
	"github.com/brokkr/brokkr/internal/spec"
	"github.com/brokkr/brokkr/netplane"
)

// One exposure at a time: PUT /v1/exposures/{name} creates or replaces one,
// DELETE /v1/exposures/{name} removes one (brokkr expose add|rm). The change
// is made on the desired state in memory (no other exposure is read from
// text again) and checked against an index of the others
// (config.LiveExposures: exactly what a whole config.Compile would accept;
// what is wrong with a refused one is said by the whole Compile, as an
// apply says it) and by the network plane's Validate; then one record is
// appended to the journal beside desired.json (journal.go), and the change
// is acknowledged once the record is on disk (concurrent changes share one
// fsync). It is published: the kernel part at once through the network
// plane's UpdateExposures, the rest (proxy, socket path, status) by the
// pass it wakes, within changePassGap of the last one.

// ErrNoSuchExposure is returned for an exposure name not in the desired state.
var ErrNoSuchExposure = errors.New("no such exposure")

// exposureUpdater is a Network that changes exposures one at a time
// (netplane.Plane): a change reaches the kernel without waiting for a pass,
// and costs what changed, not what there is.
type exposureUpdater interface {
	UpdateExposures(ctx context.Context, set []netplane.Exposure, remove []string) netplane.Report
}

// PutExposure makes e (named e.Name) one of the desired exposures, in place
// of the one of that name or added after the others. On a validation error
// nothing is changed; a config.Errors names e's own fields without a path
// prefix ("hostPort: ...").
func (d *Daemon) PutExposure(e config.Exposure) (api.Plan, error) {
	if d.opts.Source != nil {
		return api.Plan{}, ErrRemoteSource{d.opts.Source.Report()}
	}
	d.applyMu.Lock()
	unlock := sync.OnceFunc(d.applyMu.Unlock)
	defer unlock()
	head, headModel := d.heads()
	pos := slices.IndexFunc(head.Exposures, func(x config.Exposure) bool { return x.Name == e.Name })
	replaced := pos >= 0
	plan := api.Plan{Exposures: api.Changes{Added: []string{}, Changed: []string{}, Removed: []string{}},
		VMs: api.Changes{Added: []string{}, Changed: []string{}, Removed: []string{}}}
	var was *spec.Exposure
	switch {
	case !replaced:
		plan.Exposures.Added = []string{e.Name}
	case !reflect.DeepEqual(head.Exposures[pos], e):
		plan.Exposures.Changed = []string{e.Name}
		old := headModel.Exposures[pos]
		was = &old
	default:
		plan.Applied = true // already so: nothing to persist or publish
		return plan, nil
	}
	live := d.liveExposures(head, headModel)
	me, ok := live.Check(e)
	if ok {
		// The network plane's checks of one exposure (its target against
		// the guests' addresses) and of the network, which the change
		// leaves as it is.
		if errs := d.validateExposure(&spec.Desired{Network: headModel.Network, VMs: headModel.VMs, Exposures: []spec.Exposure{me}}); len(errs) > 0 {
			ok = false
		}
	}
	if !ok {
		// Refused: the whole state is compiled and validated, as an apply
		// is, for what is wrong, named by position as an apply names it.
		cur := d.headCopy()
		next, npos, _ := cur.WithExposure(e)
		var explain func() config.Errors
		if replaced {
			explain = func() config.Errors { return explainReplace(cur, npos, e) }
		}
		m, err := d.validateWhole(next, npos, explain)
		if err != nil {
			return api.Plan{}, err
		}
		// Not reached while LiveExposures agrees with Compile (its
		// property test): go by the whole check.
		d.log.Error("the exposure index refused a change that the whole desired state accepts; going by the whole", "exposure", e.Name)
		me, d.live = m.Exposures[npos], nil
	}
	plan.Warnings = append(plan.Warnings, d.portWarnings(&spec.Desired{Exposures: []spec.Exposure{me}})...)
	body, err := json.Marshal(e)
	if err != nil {
		return api.Plan{}, err
	}
	seq, err := d.record(journalRecord{Put: body})
	if err != nil {
		return api.Plan{}, err
	}
	d.mu.Lock()
	if replaced {
		head.Exposures[pos], headModel.Exposures[pos] = e, me
	} else {
		head.Exposures, headModel.Exposures = append(head.Exposures, e), append(headModel.Exposures, me)
	}
	d.dirty = true
	d.gen++
	d.mu.Unlock()
	if d.live != nil {
		d.live.Put(e, me)
	}
	if w := d.budgetAfter(headModel, was, &me); w != "" {
		plan.Warnings = append(plan.Warnings, w)
	}
	d.compactIfFull()
	unlock()
	if err := d.journal.wait(seq); err != nil {
		return api.Plan{}, notPersisted(err)
	}
	plan.Applied = true
	d.log.Info("exposure set", "exposure", e.Name, "added", len(plan.Exposures.Added) > 0)
	d.publishExposure(e.Name, was)
	d.wakeAfterChange()
	return plan, nil
}

// explainReplace says what is wrong with cur with e in place of exposure
// pos, naming e's fields. The errors name e's fields only when they are
// reported at e, and a clash is reported at the later of the two
// exposures; so e is checked last, with a hole in its place that claims
// nothing, and the other exposures keep their positions (which the
// messages cite). Validity does not depend on the order: the list
// persisted keeps e in place.
func explainReplace(cur *config.Config, pos int, e config.Exposure) config.Errors {
	probe := *cur
	probe.Exposures = make([]config.Exposure, len(cur.Exposures)+1)
	copy(probe.Exposures, cur.Exposures)
	none := 0
	probe.Exposures[pos] = config.Exposure{MaxConns: &none}
	probe.Exposures[len(cur.Exposures)] = e
	_, errs := config.Compile(&probe)
	hole := fmt.Sprintf("exposures[%d]", pos)
	errs = slices.DeleteFunc(errs, func(fe config.FieldError) bool {
		// The hole's own errors, and the count (one more than there is).
		return fe.Path == hole || strings.HasPrefix(fe.Path, hole+".") || fe.Path == "exposures"
	})
	return ownFields(errs, len(cur.Exposures))
}

// DeleteExposure removes the named exposure from the desired state;
// ErrNoSuchExposure when there is none. Removing an exposure from a desired
// state that compiles leaves one that compiles (config.LiveExposures), and
// frees what it claimed in the network plane: nothing is checked again.
func (d *Daemon) DeleteExposure(name string) (api.Plan, error) {
	if d.opts.Source != nil {
		return api.Plan{}, ErrRemoteSource{d.opts.Source.Report()}
	}
	d.applyMu.Lock()
	unlock := sync.OnceFunc(d.applyMu.Unlock)
	defer unlock()
	head, headModel := d.heads()
	pos := slices.IndexFunc(head.Exposures, func(x config.Exposure) bool { return x.Name == name })
	if pos < 0 {
		return api.Plan{}, fmt.Errorf("%w: %q", ErrNoSuchExposure, name)
	}
	was := headModel.Exposures[pos]
	seq, err := d.record(journalRecord{Remove: name})
	if err != nil {
		return api.Plan{}, err
	}
	d.mu.Lock()
	head.Exposures = slices.Delete(head.Exposures, pos, pos+1)
	headModel.Exposures = slices.Delete(headModel.Exposures, pos, pos+1)
	d.dirty = true
	d.gen++
	d.mu.Unlock()
	if d.live != nil {
		d.live.Remove(name)
	}
	if len(was.ProxyBinds(false, false)) > 0 {
		d.budgetKnown = false // its share of the descriptor budget went with it
	}
	d.compactIfFull()
	unlock()
	if err := d.journal.wait(seq); err != nil {
		return api.Plan{}, notPersisted(err)
	}
	plan := api.Plan{Applied: true, Exposures: api.Changes{Added: []string{}, Changed: []string{}, Removed: []string{name}},
		VMs: api.Changes{Added: []string{}, Changed: []string{}, Removed: []string{}}}
	d.log.Info("exposure removed", "exposure", name)
	d.publishExposure(name, &was)
	d.wakeAfterChange()
	return plan, nil
}

// The desired state as changed one exposure at a time lives in the heads
// (d.head, d.headModel): lists of their own, changed in place under applyMu
// (and mu, for the readers copying them), so a change costs what changed.
// Readers take snapshots (snapLocked), copied from the heads once after
// any number of changes: a pass copies them once, not every change.

// heads are the desired state and its model to change in place, made from
// the snapshot after a whole change. applyMu is held.
func (d *Daemon) heads() (*config.Config, *spec.Desired) {
	d.mu.Lock()
	defer d.mu.Unlock()
	if d.head == nil {
		c, m := *d.desired, *d.model
		c.Exposures, m.Exposures = slices.Clone(c.Exposures), slices.Clone(m.Exposures)
		d.head, d.headModel = &c, &m
	}
	return d.head, d.headModel
}

// headCopy is the desired state as it is now, a copy the caller may keep.
// applyMu is held.
func (d *Daemon) headCopy() *config.Config {
	c, _ := d.snapshot()
	cp := *c
	return &cp
}

// snapshot is the desired state and its model as they are now: immutable,
// the caller may keep them.
func (d *Daemon) snapshot() (*config.Config, *spec.Desired) {
	d.mu.Lock()
	defer d.mu.Unlock()
	return d.snapLocked()
}

// snapLocked is snapshot with mu held: the heads copied when they changed
// since the last one.
func (d *Daemon) snapLocked() (*config.Config, *spec.Desired) {
	if d.dirty {
		c, m := *d.head, *d.headModel
		c.Exposures, m.Exposures = slices.Clone(c.Exposures), slices.Clone(m.Exposures)
		d.desired, d.model, d.dirty = &c, &m, false
	}
	return d.desired, d.model
}

// setWhole makes next (compiled: model) the desired state, replaced whole
// (apply, power): the heads are made again from it at the next change.
// applyMu is held.
func (d *Daemon) setWhole(next *config.Config, model *spec.Desired) {
	d.mu.Lock()
	d.desired, d.model = next, model
	d.head, d.headModel, d.dirty = nil, nil, false
	d.gen++
	d.mu.Unlock()
	d.live, d.budgetKnown = nil, false
}

// liveExposures is the index of cur's exposures, built when the desired
// state was last replaced whole. applyMu is held.
func (d *Daemon) liveExposures(cur *config.Config, model *spec.Desired) *config.LiveExposures {
	if d.live == nil {
		d.live = config.NewLiveExposures(cur, model)
	}
	return d.live
}

// budgetAfter is budgetWarning of model (the heads' model, just changed
// from was to now): the last one again when neither version is proxied,
// for the descriptor budget counts the proxied exposures alone. applyMu is
// held.
func (d *Daemon) budgetAfter(model *spec.Desired, was, now *spec.Exposure) string {
	proxied := func(e *spec.Exposure) bool { return e != nil && len(e.ProxyBinds(false, false)) > 0 }
	if !d.budgetKnown || proxied(was) || proxied(now) {
		d.budget, d.budgetKnown = budgetWarning(model), true
	}
	return d.budget
}

// exposureValidator is a Network that checks exposures alone, for a
// change that leaves the network and the guests as they are
// (netplane.Plane): no kernel read, and no wait for a pass in flight.
type exposureValidator interface {
	ValidateExposures(d netplane.Desired) []error
}

// validateExposure is the network plane's check of the exposures of m, a
// change of exposures only; validateNet where the plane has no such check.
func (d *Daemon) validateExposure(m *spec.Desired) config.Errors {
	if v, ok := d.net.(exposureValidator); ok {
		return netErrors(v.ValidateExposures(netDesired(m)))
	}
	return d.validateNet(m)
}

// validateNet is the network plane's Validate of m, as config errors.
func (d *Daemon) validateNet(m *spec.Desired) config.Errors {
	if !d.lockNet(d.opts.Timeout) {
		return config.Errors{{Msg: ErrBusy.Error()}}
	}
	defer d.netMu.Unlock()
	return netErrors(d.net.Validate(netDesired(m)))
}

// netErrors are the network plane's Validate errors as config errors: the
// namespace's facts (foreign links, clashing subnets), whose text names
// their field.
func netErrors(errs []error) config.Errors {
	if len(errs) == 0 {
		return nil
	}
	ce := make(config.Errors, 0, len(errs))
	for _, e := range errs {
		ce = append(ce, config.FieldError{Msg: e.Error()})
	}
	return ce
}

// validateWhole compiles and validates next (the desired state with the
// exposure at pos set) whole, as an apply does. explain, when set, says
// what is wrong with a next that does not compile.
func (d *Daemon) validateWhole(next *config.Config, pos int, explain func() config.Errors) (*spec.Desired, error) {
	model, cerrs := config.Compile(next)
	if len(cerrs) > 0 {
		if explain != nil {
			if errs := explain(); len(errs) > 0 {
				return nil, errs
			}
		}
		return nil, ownFields(cerrs, pos)
	}
	if !d.lockNet(d.opts.Timeout) {
		return nil, ErrBusy
	}
	ce := netErrors(d.net.Validate(netDesired(model)))
	d.netMu.Unlock()
	if len(ce) > 0 {
		return nil, ce
	}
	return model, nil
}

// record appends rec to the journal; a journal that cannot take it (a
// write or an fsync failed before) is first replaced by writing the desired
// state whole. applyMu is held.
func (d *Daemon) record(rec journalRecord) (uint64, error) {
	if d.journal.broken() != nil {
		if err := d.persistWhole(d.headCopy()); err != nil {
			return 0, err
		}
	}
	seq, err := d.journal.append(rec)
	if err != nil {
		return 0, fmt.Errorf("persisting the change: %w", err)
	}
	return seq, nil
}

// compactIfFull writes the desired state whole when the journal is past
// its bound, which empties it. A failure is logged: the journal still holds
// every change. applyMu is held.
func (d *Daemon) compactIfFull() {
	if !d.journal.full() {
		return
	}
	if err := d.persistWhole(d.headCopy()); err != nil {
		d.log.Warn("compacting the desired-state journal", "err", err)
	}
}

// notPersisted is the answer to a change whose record could not be synced:
// it is made in memory (later changes were checked against it) but may not
// survive a restart; the next change writes the whole desired state.
func notPersisted(err error) error {
	return fmt.Errorf("the change is made but may not survive a restart: %w (the next change writes the whole desired state again)", err)
}

// publisher batches the changes of one exposure on their way to the
// network plane: a change waits for the next round that starts after it,
// and one round hands every change pending to one UpdateExposures (one
// nft commit, one conntrack walk), so concurrent changes share the kernel's
// cost as they share the journal's fsync.
type publisher struct {
	mu   sync.Mutex
	cond *sync.Cond
	// pending maps each exposure changed since the last round began to
	// what it was before its first pending change (nil: none), what the
	// kernel had then.
	pending map[string]*spec.Exposure
	// started and finished count rounds; busy is a round in flight.
	started, finished uint64
	busy              bool
}

// publishExposure hands the named exposure, as the desired state has it
// when its round runs (removed, or changed again by a later change), to
// the network plane, when it can take one (exposureUpdater), and returns
// once that round is done; was is the exposure before the change (nil:
// none). The pass
// woken after it converges the whole state as always, and finds the kernel
// already so; if this fails, that pass does it.
func (d *Daemon) publishExposure(name string, was *spec.Exposure) {
	if _, ok := d.net.(exposureUpdater); !ok {
		return
	}
	p := &d.pub
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.cond == nil {
		p.cond = sync.NewCond(&p.mu)
		p.pending = map[string]*spec.Exposure{}
	}
	if _, ok := p.pending[name]; !ok {
		p.pending[name] = was
	}
	mine := p.started + 1 // a round in flight began before this change
	for p.finished < mine {
		if p.busy {
			p.cond.Wait()
			continue
		}
		p.busy = true
		p.started++
		batch := p.pending
		p.pending = map[string]*spec.Exposure{}
		p.mu.Unlock()
		d.publishRound(batch)
		p.mu.Lock()
		p.busy = false
		p.finished = p.started
		p.cond.Broadcast()
	}
}

// publishRound publishes the exposures of batch (name → what each was
// before its first change) as the desired state has them now, in one
// UpdateExposures; when it refuses them together, one at a time, so one
// refused does not hold back the others.
func (d *Daemon) publishRound(batch map[string]*spec.Exposure) {
	up := d.net.(exposureUpdater)
	if !d.lockNet(d.opts.Timeout) {
		return // a pass overran; the next one publishes them
	}
	defer d.netMu.Unlock()
	now := make(map[string]spec.Exposure, len(batch))
	d.mu.Lock()
	exps, network := d.model.Exposures, d.model.Network
	if d.headModel != nil {
		exps = d.headModel.Exposures // changed in place under mu
	}
	for _, e := range exps {
		if _, ok := batch[e.Name]; ok {
			now[e.Name] = e
		}
	}
	d.mu.Unlock()
	var set []netplane.Exposure
	var remove []string
	for name, old := range batch {
		if cur, ok := now[name]; ok {
			if e, ok := d.kernelCarried(cur, network); ok {
				if err := d.takePorts(e); err != nil {
					// A host program holds its port: not published (the
					// pass reports it failed, naming the holder).
					d.log.Info("exposure not published: its port is in use", "exposure", name, "err", err)
				} else {
					set = append(set, e)
					continue
				}
			}
		}
		// Gone from the kernel: removed, or now carried by the proxy alone.
		if old != nil {
			if _, was := d.kernelCarried(*old, network); was {
				remove = append(remove, name)
			}
		}
	}
	if len(set) == 0 && len(remove) == 0 {
		return
	}
	update := func(set []netplane.Exposure, remove []string) error {
		ctx, cancel := context.WithTimeout(context.Background(), d.opts.Timeout)
		defer cancel()
		return up.UpdateExposures(ctx, set, remove).Err
	}
	err := update(set, remove)
	if err == nil || len(set)+len(remove) == 1 {
		if err != nil {
			d.log.Info("exposure not published at once; the pass will", "exposures", len(set)+len(remove), "err", err)
		}
		return
	}
	for _, e := range set {
		if err := update([]netplane.Exposure{e}, nil); err != nil {
			d.log.Info("exposure not published at once; the pass will", "exposure", e.Name, "err", err)
		}
	}
	for _, name := range remove {
		if err := update(nil, []string{name}); err != nil {
			d.log.Info("exposure not withdrawn at once; the pass will", "exposure", name, "err", err)
		}
	}
}

// kernelCarried is e as the pass hands it to the network plane, and
// whether it does (translate.go: the kernel's exposures, after byProxy).
func (d *Daemon) kernelCarried(e spec.Exposure, network spec.Network) (spec.Exposure, bool) {
	m := &spec.Desired{Network: network, Exposures: []spec.Exposure{e}}
	if d.natFallback() != "" {
		m, _ = onFallback(m)
	}
	return m.Exposures[0], m.Exposures[0].UsesKernel()
}

// ownFields makes the errors about the exposure at pos name its fields
// alone ("hostPort: ..."): the request was that one exposure. Errors about
// the others keep their paths.
func ownFields(errs config.Errors, pos int) config.Errors {
	if pos < 0 {
		return errs
	}
	prefix := fmt.Sprintf("exposures[%d]", pos)
	out := make(config.Errors, len(errs))
	for i, e := range errs {
		if e.Path == prefix {
			e.Path = ""
		} else if rest, ok := strings.CutPrefix(e.Path, prefix+"."); ok {
			e.Path = rest
		}
		out[i] = e
	}
	return out
}

// handlePutExposure is PUT /v1/exposures/{name}: the body is one exposure
// in the config file's shape (YAML or JSON); its name, if given, must be
// the URL's.
func (d *Daemon) handlePutExposure(w http.ResponseWriter, r *http.Request) {
	if d.opts.Source != nil {
		writeError(w, http.StatusConflict, ErrRemoteSource{d.opts.Source.Report()}.Error(), nil)
		return
	}
	name := r.PathValue("name")
	body, ok := readBody(w, r)
	if !ok {
		return
	}
	d.parseGate.Lock()
	e, err := config.DecodeExposure(body)
	d.parseGate.Unlock()
	if err == nil {
		switch {
		case e.Name == "":
			e.Name = name
		case e.Name != name:
			err = config.Errors{{Path: "name", Msg: fmt.Sprintf("%q is not the name in the URL (%q)", e.Name, name)}}
		}
	}
	var plan api.Plan
	if err == nil {
		plan, err = d.PutExposure(e)
	}
	d.answerExposure(w, plan, err, "exposure rejected; nothing was changed")
}

// handleDeleteExposure is DELETE /v1/exposures/{name}.
func (d *Daemon) handleDeleteExposure(w http.ResponseWriter, r *http.Request) {
	if d.opts.Source != nil {
		writeError(w, http.StatusConflict, ErrRemoteSource{d.opts.Source.Report()}.Error(), nil)
		return
	}
	plan, err := d.DeleteExposure(r.PathValue("name"))
	d.answerExposure(w, plan, err, "removing it would leave a desired state that does not validate; nothing was changed")
}

func (d *Daemon) answerExposure(w http.ResponseWriter, plan api.Plan, err error, rejected string) {
	var ce config.Errors
	var rs ErrRemoteSource
	switch {
	case err == nil:
		writeJSON(w, http.StatusOK, plan)
	case errors.As(err, &ce):
		fields := make([]string, len(ce))
		for i, e := range ce {
			fields[i] = e.Error()
		}
		writeError(w, http.StatusUnprocessableEntity, rejected, fields)
	case errors.Is(err, ErrNoSuchExposure):
		writeError(w, http.StatusNotFound, err.Error(), nil)
	case errors.As(err, &rs):
		writeError(w, http.StatusConflict, err.Error(), nil)
	case errors.Is(err, ErrBusy):
		writeError(w, http.StatusServiceUnavailable, err.Error(), nil)
	default:
		writeError(w, http.StatusInternalServerError, err.Error(), nil)
	}
}
