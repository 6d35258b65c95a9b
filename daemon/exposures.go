package daemon

import (
	"context"
	"errors"
	"fmt"
	"net/http"
	"reflect"
	"slices"
	"strings"

	"github.com/brokkr/brokkr/daemon/api"
	"github.com/brokkr/brokkr/daemon/config"
	"github.com/brokkr/brokkr/internal/spec"
	"github.com/brokkr/brokkr/netplane"
)

// One exposure at a time: PUT /v1/exposures/{name} creates or replaces one,
// DELETE /v1/exposures/{name} removes one (brokkr expose add|rm). The change
// is made on the desired state in memory (no other exposure is read from
// text again), validated against the whole of it by config.Compile and the
// network plane's Validate, as an apply is, persisted with it in
// desired.json, and then published: the kernel part at once through the
// network plane's UpdateExposures, the rest (proxy, socket path, status) by
// the pass it wakes.

// ErrNoSuchExposure is returned for an exposure name not in the desired state.
var ErrNoSuchExposure = errors.New("no such exposure")

// exposureUpdater is a Network that changes exposures one at a time
// (netplane.Plane): a change reaches the kernel without waiting for a pass,
// and costs what changed, not what there is.
type exposureUpdater interface {
	UpdateExposures(ctx context.Context, set []netplane.Exposure, remove []string) netplane.Report
}

// PutExposure makes e (named e.Name) one of the desired exposures, in place
// of the one of that name or added after the others. On any error nothing
// is changed; a config.Errors names e's own fields without a path prefix
// ("hostPort: ...").
func (d *Daemon) PutExposure(e config.Exposure) (api.Plan, error) {
	if d.opts.Source != nil {
		return api.Plan{}, ErrRemoteSource{d.opts.Source.Report()}
	}
	d.applyMu.Lock()
	defer d.applyMu.Unlock()
	cur := d.Desired()
	next, pos, replaced := cur.WithExposure(e)
	plan := api.Plan{Exposures: api.Changes{Added: []string{}, Changed: []string{}, Removed: []string{}},
		VMs: api.Changes{Added: []string{}, Changed: []string{}, Removed: []string{}}}
	switch {
	case !replaced:
		plan.Exposures.Added = []string{e.Name}
	case !reflect.DeepEqual(cur.Exposures[pos], e):
		plan.Exposures.Changed = []string{e.Name}
	default:
		plan.Applied = true // already so: nothing to persist or publish
		return plan, nil
	}
	var explain func() config.Errors
	if replaced {
		explain = func() config.Errors { return explainReplace(cur, pos, e) }
	}
	return d.commitExposure(next, pos, e.Name, true, plan, explain)
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
// ErrNoSuchExposure when there is none.
func (d *Daemon) DeleteExposure(name string) (api.Plan, error) {
	if d.opts.Source != nil {
		return api.Plan{}, ErrRemoteSource{d.opts.Source.Report()}
	}
	d.applyMu.Lock()
	defer d.applyMu.Unlock()
	next, found := d.Desired().WithoutExposure(name)
	if !found {
		return api.Plan{}, fmt.Errorf("%w: %q", ErrNoSuchExposure, name)
	}
	plan := api.Plan{Exposures: api.Changes{Added: []string{}, Changed: []string{}, Removed: []string{name}},
		VMs: api.Changes{Added: []string{}, Changed: []string{}, Removed: []string{}}}
	return d.commitExposure(next, -1, name, false, plan, nil)
}

// commitExposure validates next (the desired state with exposure name set
// at pos, or removed), persists it, swaps it in and publishes the change.
// explain, when set, says what is wrong with a next that does not validate.
// applyMu is held.
func (d *Daemon) commitExposure(next *config.Config, pos int, name string, set bool, plan api.Plan, explain func() config.Errors) (api.Plan, error) {
	model, cerrs := config.Compile(next)
	if len(cerrs) > 0 {
		if explain != nil {
			if errs := explain(); len(errs) > 0 {
				return api.Plan{}, errs
			}
		}
		return api.Plan{}, ownFields(cerrs, pos)
	}
	if !d.lockNet(d.opts.Timeout) {
		return api.Plan{}, ErrBusy
	}
	errs := d.net.Validate(netDesired(model))
	d.netMu.Unlock()
	if len(errs) > 0 {
		ce := make(config.Errors, 0, len(errs))
		for _, e := range errs {
			ce = append(ce, config.FieldError{Msg: e.Error()})
		}
		return api.Plan{}, ce
	}
	if w := budgetWarning(model); w != "" {
		plan.Warnings = append(plan.Warnings, w)
	}
	if set {
		plan.Warnings = append(plan.Warnings, d.portWarnings(&spec.Desired{Exposures: model.Exposures[pos : pos+1]})...)
	}
	if err := saveDesired(d.host.StateDir, next); err != nil {
		return api.Plan{}, err
	}
	d.mu.Lock()
	old := d.model
	d.desired, d.model = next, model
	d.gen++
	d.mu.Unlock()
	plan.Applied = true
	if set {
		d.log.Info("exposure set", "exposure", name, "added", len(plan.Exposures.Added) > 0)
		d.publishExposure(old, &model.Exposures[pos], name)
	} else {
		d.log.Info("exposure removed", "exposure", name)
		d.publishExposure(old, nil, name)
	}
	d.Wake()
	return plan, nil
}

// publishExposure hands the one changed exposure (now: nil when removed) to
// the network plane at once, when it can take one (exposureUpdater). The
// pass woken after it converges the whole state as always, and finds the
// kernel already so; if this fails, that pass does it.
func (d *Daemon) publishExposure(old *spec.Desired, now *spec.Exposure, name string) {
	up, ok := d.net.(exposureUpdater)
	if !ok {
		return
	}
	var set []netplane.Exposure
	var remove []string
	if now != nil {
		if e, ok := d.kernelCarried(*now); ok {
			if err := d.takePorts(e); err != nil {
				// A host program holds its port: not published (the pass
				// reports it failed, naming the holder).
				d.log.Info("exposure not published: its port is in use", "exposure", name, "err", err)
			} else {
				set = []netplane.Exposure{e}
			}
		}
	}
	if set == nil {
		// Gone from the kernel: removed, or now carried by the proxy alone.
		i := slices.IndexFunc(old.Exposures, func(e spec.Exposure) bool { return e.Name == name })
		if i < 0 {
			return
		}
		if _, was := d.kernelCarried(old.Exposures[i]); !was {
			return
		}
		remove = []string{name}
	}
	if !d.lockNet(d.opts.Timeout) {
		return // a pass overran; the next one publishes it
	}
	defer d.netMu.Unlock()
	ctx, cancel := context.WithTimeout(context.Background(), d.opts.Timeout)
	defer cancel()
	if rep := up.UpdateExposures(ctx, set, remove); rep.Err != nil {
		d.log.Info("exposure not published at once; the pass will", "exposure", name, "err", rep.Err)
	}
}

// kernelCarried is e as the pass hands it to the network plane, and
// whether it does (translate.go: the kernel's exposures, after byProxy).
func (d *Daemon) kernelCarried(e spec.Exposure) (spec.Exposure, bool) {
	m := &spec.Desired{Exposures: []spec.Exposure{e}}
	if d.natFallback() != "" {
		m, _ = byProxy(m)
		m, _ = restrictedByProxy(m)
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
