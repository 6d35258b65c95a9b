// Package daemon is brokkrd's core: the desired state (validated, persisted
// atomically), the control loop that drives the supervisor, the network
// plane and the proxy towards it, the merged status, the HTTP API on the
// unix socket and the Prometheus metrics.
package daemon

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"net/netip"
	"reflect"
	"slices"
	"strings"
	"sync"
	"time"

	"github.com/brokkr/brokkr/bpf"
	"github.com/brokkr/brokkr/daemon/api"
	"github.com/brokkr/brokkr/daemon/config"
	"github.com/brokkr/brokkr/internal/spec"
	"github.com/brokkr/brokkr/netplane"
	"github.com/brokkr/brokkr/proxy"
	"github.com/brokkr/brokkr/supervisor"
)

// Options are what New needs. The engines are built by the caller (see
// Open) because the proxy is constructed with the daemon's resolver.
type Options struct {
	// Host is the config brokkrd was started with: its stateDir, runDir,
	// bpfDir and hypervisor are fixed for the life of the process. Its
	// network, VMs and exposures are the desired state unless
	// stateDir/desired.json exists, which wins until the next apply/reload.
	Host       *config.Config
	Store      *bpf.Store
	Supervisor Supervisor
	Network    Network
	Proxy      Proxy
	Addresses  *AddressBook // the resolver the Proxy was built with
	Logger     *slog.Logger
	Tick       time.Duration // default 1 s
	Timeout    time.Duration // per engine pass; default 10 s
	Warnings   []string      // conditions found while opening (shown in status)
	// IPv6Loopback makes auto exposures also listen on ::1 (the Proxy then
	// carries ::1 specs next to 127.0.0.1 ones under the same name).
	IPv6Loopback bool
	// SocketPath, when set, serves auto exposures' host-local callers in
	// the kernel (and the loopback proxies go away); SocketPathReason says
	// why it is not (shown in status, the proxies serve them instead).
	SocketPath       SocketPath
	SocketPathReason string
	// CappedAutoByProxy, when set, says why the kernel's nat cap cannot be
	// one cap with the host-local paths' (the nat path's fallback counts in
	// nft sets, the socket path and the proxy in the shared slot): capped
	// auto exposures are then carried by the proxy for every caller, which
	// admits against the slot (see byProxy).
	CappedAutoByProxy string
	// Source, when set, is where the desired state comes from (fleet mode);
	// Run runs it, and a local apply is refused.
	Source Source
	// KeptProxyActive counts, per exposure, the proxied connections this
	// process took over from the previous one (a hand-over): their places
	// stay in the slots' proxy share instead of being reset at start.
	KeptProxyActive map[string]uint64
	// Wakes is the board of suspended VMs (wake.go); with KernelWake the
	// nat path's and the socket path's callers wake them too.
	Wakes      *Wakes
	KernelWake *bpf.Wake
	// Holds, when set, holds the exposures' host sides (ports.go); nil
	// (tests of the loop with recorders): no port is held or checked.
	Holds Holds
}

// Daemon is one running brokkrd.
type Daemon struct {
	opts  Options
	log   *slog.Logger
	host  *config.Config
	store *bpf.Store
	sup   Supervisor
	net   Network
	px    Proxy
	addrs *AddressBook
	m     *metrics
	sock  *sockPath // nil: the loopback proxies serve host-local callers
	// sockParts is the socket path's last report per exposure, portParts
	// the exposures whose host side could not be held (the loop's
	// goroutine only).
	sockParts map[string]part
	portParts map[string]part
	kw        *kernelWakes // nil: the kernel paths do not wake suspended VMs

	applyMu sync.Mutex // serialises apply/start/stop so each persists a whole state
	// journal holds the changes of one exposure since desired.json was
	// written whole (journal.go); live indexes the desired exposures for
	// checking one of them (nil: built at the next change). applyMu.
	journal *journal
	live    *config.LiveExposures
	pub     publisher // batches single-exposure changes to the kernel
	// budget is the descriptor budget's warning for the heads, when
	// budgetKnown (exposures.go, budgetAfter). applyMu.
	budget      string
	budgetKnown bool
	// parseGate lets one API request at a time parse a config: parsing a
	// hostile body costs a core for tens of milliseconds, and without the
	// gate a few such callers take every core from status and the passes.
	parseGate sync.Mutex
	// netMu keeps netplane's Validate (which reads the kernel) from running
	// in the middle of its Converge (which changes it): a tap created but
	// not yet labelled as brokkr's would look foreign to the validation.
	netMu sync.Mutex

	mu      sync.Mutex
	desired *config.Config
	model   *spec.Desired // desired, compiled (config.Compile) when it entered
	// head and headModel are desired and model as changed one exposure at
	// a time, in place (exposures.go); dirty says they changed since
	// desired and model were copied from them. Read desired and model
	// through snapLocked.
	head      *config.Config
	headModel *spec.Desired
	dirty     bool
	status    api.Status
	facts     map[string]guestFacts
	passes    uint64
	// gen counts changes of desired; statusGen is the gen the current
	// status was converged from (see Generations).
	gen, statusGen uint64

	wake chan struct{}
	// wakeSoon is a wake from a change the API already published to the
	// kernel (PUT/DELETE /v1/exposures): the pass that follows brings the
	// rest (proxy, socket path, status) at most changePassGap after the
	// last pass, so a stream of changes is not a stream of whole passes.
	wakeSoon chan struct{}
	passed   chan struct{}
	logged   map[string]bool // problems of the last pass, logged once

	supRun bounded[supervisor.Report]
	netRun bounded[netplane.Report]
	pxRun  bounded[[]proxy.Status]
}

// New loads the desired state (desired.json, else the host config) and
// prepares the loop. Nothing is converged until Run.
func New(opts Options) (*Daemon, error) {
	if opts.Host == nil {
		return nil, errors.New("daemon: no config")
	}
	if opts.Logger == nil {
		opts.Logger = slog.Default()
	}
	if opts.Tick <= 0 {
		opts.Tick = time.Second
	}
	if opts.Timeout <= 0 {
		opts.Timeout = 10 * time.Second
	}
	if opts.Addresses == nil {
		opts.Addresses = NewAddressBook()
	}
	loaded, err := loadDesired(opts.Host.StateDir)
	if err != nil {
		return nil, err
	}
	desired, model := loaded.c, loaded.model
	jnl := newJournal(opts.Host.StateDir)
	if desired == nil {
		desired = opts.Host
		var errs config.Errors
		if model, errs = config.Compile(desired); len(errs) > 0 {
			return nil, fmt.Errorf("the config does not validate:\n%w", errs)
		}
		b, err := saveDesired(opts.Host.StateDir, desired)
		if err != nil {
			return nil, err
		}
		if err := jnl.reset(b); err != nil {
			return nil, err
		}
	} else {
		opts.Logger.Info("resuming from persisted desired state", "file", opts.Host.StateDir+"/"+DesiredFile,
			"vms", len(desired.VMs), "exposures", len(desired.Exposures), "journalChanges", len(loaded.j.records))
		// With a Source the file's state was only the first one; no warning.
		if p := diff(withHost(desired, opts.Host), withHost(opts.Host, opts.Host)); opts.Source == nil && (p.NetworkChanged || !p.VMs.Empty() || !p.Exposures.Empty()) {
			opts.Logger.Warn("the config file differs from the persisted desired state (unless the file changed since it was last applied, the persisted state wins until the next apply or reload: brokkr apply -f FILE, or SIGHUP)",
				"vmsOnlyInFile", p.VMs.Added, "vmsChangedInFile", p.VMs.Changed, "vmsNotInFile", p.VMs.Removed,
				"exposuresOnlyInFile", p.Exposures.Added, "exposuresChangedInFile", p.Exposures.Changed, "exposuresNotInFile", p.Exposures.Removed)
		}
		if err := openJournal(jnl, opts, desired, loaded); err != nil {
			return nil, err
		}
	}
	// The process-fixed keys are no part of the model.
	desired = withHost(desired, opts.Host)
	d := &Daemon{
		opts: opts, log: opts.Logger, host: opts.Host, store: opts.Store,
		sup: opts.Supervisor, net: opts.Network, px: opts.Proxy, addrs: opts.Addresses,
		desired: desired, model: model, journal: jnl,
		facts:    map[string]guestFacts{},
		wake:     make(chan struct{}, 1),
		wakeSoon: make(chan struct{}, 1),
		passed:   make(chan struct{}, 1),
		supRun:   bounded[supervisor.Report]{name: "supervisor"},
		netRun:   bounded[netplane.Report]{name: "netplane"},
		pxRun:    bounded[[]proxy.Status]{name: "proxy"},
	}
	d.m = newMetrics(d)
	d.kw = newKernelWakes(d, opts.KernelWake, opts.Wakes)
	if opts.SocketPath != nil && opts.Store != nil {
		d.sock = newSockPath(opts.SocketPath, opts.Store)
	}
	if d.store != nil {
		// Connections the previous process proxied died with it; the kernel
		// path re-adds what conntrack still holds.
		d.store.ResetActive(opts.KeptProxyActive)
	}
	d.status = d.mergeStatus(d.desired, d.model, supervisor.Report{}, netplane.Report{}, nil, nil)
	return d, nil
}

// withHost returns c with the process-fixed keys taken from host.
func withHost(c, host *config.Config) *config.Config {
	cp := *c
	cp.StateDir, cp.RunDir, cp.BPFDir, cp.Hypervisor, cp.Metrics = host.StateDir, host.RunDir, host.BPFDir, host.Hypervisor, host.Metrics
	return &cp
}

// Desired returns the current desired state (a copy the caller may keep).
func (d *Daemon) Desired() *config.Config {
	d.mu.Lock()
	defer d.mu.Unlock()
	c, _ := d.snapLocked()
	cp := *c
	return &cp
}

// Status returns the last merged status.
func (d *Daemon) Status() api.Status {
	d.mu.Lock()
	st := d.status
	d.mu.Unlock()
	if d.opts.Source != nil {
		r := d.opts.Source.Report()
		st.Source = &r
	}
	if d.store == nil {
		return st
	}
	// The counters are read now, not at the last pass: the kernel and the
	// proxy write them continuously, and reading the mapped slots is cheap.
	st.Exposures = slices.Clone(st.Exposures)
	for i := range st.Exposures {
		r := &st.Exposures[i]
		if c, ok := d.store.Lookup(r.Name); ok {
			r.Active, r.Accepted, r.Refused, r.Dropped, r.Denied, r.BytesIn, r.BytesOut = c.Active, c.Accepted, c.Refused, c.Dropped, c.Denied, c.BytesIn, c.BytesOut
		}
	}
	return st
}

// Wake asks for a pass now.
func (d *Daemon) Wake() {
	select {
	case d.wake <- struct{}{}:
	default:
	}
}

// wakeAfterChange is Wake for a change whose kernel part is published
// already (see wakeSoon).
func (d *Daemon) wakeAfterChange() {
	select {
	case d.wakeSoon <- struct{}{}:
	default:
	}
}

// changePassGap is the least time between passes woken by exposure
// changes: at 10,000 exposures a pass costs milliseconds of CPU, and 8
// clients changing exposures back to back would otherwise keep one running
// all the time beside the changes (BENCHMARKS.md, "Changes at 10,000").
const changePassGap = 200 * time.Millisecond

// Run converges on every change and every tick until ctx ends.
func (d *Daemon) Run(ctx context.Context) {
	t := time.NewTicker(d.opts.Tick)
	defer t.Stop()
	var wg sync.WaitGroup
	defer wg.Wait()
	if d.opts.Source != nil {
		wg.Go(func() { d.opts.Source.Run(ctx, d) })
	}
	if d.kw != nil {
		wg.Go(func() { d.kw.serve(ctx) })
	}
	for {
		d.Pass(ctx)
		ended := time.Now()
		select {
		case <-ctx.Done():
			return
		case <-d.wake:
		case <-t.C:
		case <-d.wakeSoon:
			if wait := changePassGap - time.Since(ended); wait > 0 {
				gap := time.NewTimer(wait)
				select {
				case <-ctx.Done():
					gap.Stop()
					return
				case <-d.wake:
				case <-gap.C:
				}
				gap.Stop()
			}
		}
	}
}

// Pass is one level-triggered pass over the three engines.
//
// Order: netplane first, then the supervisor, then the proxy. netplane makes
// the taps and assigns MACs and addresses, so a VM is never started before
// its tap exists and the supervisor always gets this pass's facts; the proxy
// runs last so its resolver sees the leases of this pass.
func (d *Daemon) Pass(ctx context.Context) {
	d.mu.Lock()
	c, model := d.snapLocked()
	cp, gen := *c, d.gen
	d.mu.Unlock()
	want := &cp
	var errs []error
	var moved fallbackMoves
	fallback := d.natFallback()
	if fallback != "" {
		model, moved = onFallback(model)
	}
	// The engines see only the exposures that hold their host side; the
	// status and the counter slots keep every exposure.
	all := model
	model, portParts, selfHeld := d.holdPorts(model)
	d.portParts = portParts

	t0 := time.Now()
	nrep, err := d.netRun.run(ctx, d.opts.Timeout, func(ctx context.Context) netplane.Report {
		d.netMu.Lock()
		defer d.netMu.Unlock()
		return d.net.Converge(ctx, d.withSleepers(netDesired(model)))
	})
	d.m.observe("netplane", time.Since(t0), err == nil && nrep.Err == nil)
	errs = append(errs, err)
	if nrep.Err != nil {
		errs = append(errs, netplaneErr(nrep.Err))
	}
	for _, r := range nrep.Repaired {
		d.log.Warn("drift repaired", "what", r)
	}
	facts := d.updateFacts(model, nrep)

	// A VM whose tap netplane has never reported (it failed or stalled
	// since this process started) must not reach the supervisor without
	// one: to the supervisor a spec without the tap is a different machine,
	// and an adopted VM would be recreated. Hold the supervisor for this
	// pass instead; VMs keep running as they are.
	var untapped []string
	for _, v := range model.VMs {
		if f, ok := facts[v.Name]; !ok || f.Tap == "" {
			untapped = append(untapped, v.Name)
		}
	}
	var srep supervisor.Report
	if len(untapped) > 0 {
		srep = d.supRun.lastResult()
		errs = append(errs, fmt.Errorf("supervisor: held this pass: the network plane has not reported the taps of %v", untapped))
	} else {
		t0 = time.Now()
		specs := vmSpecs(model, facts)
		srep, err = d.supRun.run(ctx, d.opts.Timeout, func(ctx context.Context) supervisor.Report {
			return d.sup.Step(ctx, specs)
		})
		d.m.observe("supervisor", time.Since(t0), err == nil)
		errs = append(errs, err)
	}

	t0 = time.Now()
	if d.sock != nil {
		parts, err := d.sock.converge(model, d.addrs.lookup, d.addrs.lookup6)
		d.sockParts = parts
		errs = append(errs, err)
	}
	pspecs := proxySpecs(model, d.opts.IPv6Loopback, d.sock != nil)
	pst, err := d.pxRun.run(ctx, d.opts.Timeout, func(context.Context) []proxy.Status {
		return d.px.Converge(pspecs)
	})
	d.m.observe("proxy", time.Since(t0), err == nil)
	errs = append(errs, err)

	if d.store != nil {
		keep := make(map[string]bool, len(all.Exposures))
		for _, e := range all.Exposures {
			keep[e.Name] = true
		}
		if gone := d.store.Prune(func(n string) bool { return keep[n] }); len(gone) > 0 {
			d.log.Info("counter slots of removed exposures freed", "exposures", gone)
		}
	}

	d.kw.sync()
	st := d.mergeStatus(want, all, srep, nrep, pst, errs)
	st.Warnings = append(st.Warnings, moved.warnings(fallback)...)
	d.mu.Lock()
	d.status = st
	d.statusGen = gen
	d.passes++
	d.mu.Unlock()
	d.m.passDone(errs, len(nrep.Repaired))
	select {
	case d.passed <- struct{}{}:
	default:
	}
	if selfHeld {
		d.Wake() // the proxy closed its listener in this pass: take the port now
	}
	// Log a problem when it appears and when it clears, not every second.
	now := map[string]bool{}
	for _, e := range errs {
		if e != nil {
			now[e.Error()] = true
			if !d.logged[e.Error()] {
				d.log.Warn("converge", "err", e)
			}
		}
	}
	for msg := range d.logged {
		if !now[msg] {
			d.log.Info("converge: cleared", "was", msg)
		}
	}
	d.logged = now
}

// updateFacts records what netplane said about each guest and publishes the
// addresses the proxy may dial: a leased address, or with DHCP off the
// assigned one (the guest takes it from its command line).
func (d *Daemon) updateFacts(want *spec.Desired, rep netplane.Report) map[string]guestFacts {
	d.mu.Lock()
	defer d.mu.Unlock()
	seen := map[string]bool{}
	for _, g := range rep.Guests {
		seen[g.Name] = true
		f := guestFacts{Tap: g.Tap, MAC: g.MAC, Address: g.Address, Leased: g.Leased,
			Address6: g.Address6, Seen6: g.Seen6, Error: g.Error}
		if old, ok := d.facts[g.Name]; ok {
			// A failed pass for this guest keeps its last known tap and MAC
			// rather than telling the supervisor it has none.
			if f.Tap == "" {
				f.Tap = old.Tap
			}
			if f.MAC == nil {
				f.MAC = old.MAC
			}
		}
		d.facts[g.Name] = f
	}
	wanted := map[string]bool{}
	for _, v := range want.VMs {
		wanted[v.Name] = true
	}
	addrs, addrs6 := map[string]netip.Addr{}, map[string]netip.Addr{}
	for name, f := range d.facts {
		if !wanted[name] {
			delete(d.facts, name)
			continue
		}
		if f.Address.IsValid() && (f.Leased || !want.Network.DHCP) {
			addrs[name] = f.Address
		}
		// IPv6 callers go to the guest's IPv6 address once it answers
		// there; before that (or a guest without IPv6) to its IPv4 one.
		if f.Address6.IsValid() && f.Seen6 {
			addrs6[name] = f.Address6
		}
	}
	d.addrs.Set(addrs)
	d.addrs.Set6(addrs6)
	out := make(map[string]guestFacts, len(d.facts))
	for k, v := range d.facts {
		out[k] = v
	}
	return out
}

// netplaneErr names the network plane once: its own errors already start
// with "netplane: ".
func netplaneErr(err error) error {
	if strings.HasPrefix(err.Error(), "netplane: ") {
		return err
	}
	return fmt.Errorf("netplane: %w", err)
}

// AddressBook is the proxy's Resolver: guest addresses by VM name (IPv4,
// and IPv6 for IPv6 callers), swapped whole on each pass, read per
// connection. It keeps each address as text too, so a dial formats nothing.
type AddressBook struct {
	mu     sync.RWMutex
	addrs  map[string]bookEntry
	addrs6 map[string]bookEntry
}

type bookEntry struct {
	addr netip.Addr
	text string
}

// NewAddressBook returns an empty book.
func NewAddressBook() *AddressBook {
	return &AddressBook{addrs: map[string]bookEntry{}, addrs6: map[string]bookEntry{}}
}

func bookOf(addrs map[string]netip.Addr) map[string]bookEntry {
	book := make(map[string]bookEntry, len(addrs))
	for vm, addr := range addrs {
		book[vm] = bookEntry{addr, addr.String()}
	}
	return book
}

// Set replaces every IPv4 address.
func (a *AddressBook) Set(addrs map[string]netip.Addr) {
	book := bookOf(addrs)
	a.mu.Lock()
	a.addrs = book
	a.mu.Unlock()
}

// Set6 replaces every IPv6 address.
func (a *AddressBook) Set6(addrs map[string]netip.Addr) {
	book := bookOf(addrs)
	a.mu.Lock()
	a.addrs6 = book
	a.mu.Unlock()
}

// lookup is the VM's address, if it has one now.
func (a *AddressBook) lookup(vm string) (netip.Addr, bool) {
	a.mu.RLock()
	defer a.mu.RUnlock()
	e, ok := a.addrs[vm]
	return e.addr, ok
}

// lookup6 is the VM's IPv6 address, if it has one now.
func (a *AddressBook) lookup6(vm string) (netip.Addr, bool) {
	a.mu.RLock()
	defer a.mu.RUnlock()
	e, ok := a.addrs6[vm]
	return e.addr, ok
}

// Resolve is a proxy.Resolver.
func (a *AddressBook) Resolve(vm string) string {
	a.mu.RLock()
	defer a.mu.RUnlock()
	return a.addrs[vm].text
}

// Resolve6 is the proxy's Resolver for IPv6 callers ("" = dial IPv4).
func (a *AddressBook) Resolve6(vm string) string {
	a.mu.RLock()
	defer a.mu.RUnlock()
	return a.addrs6[vm].text
}

// Close stops the loop's engines without touching what they made: VMs keep
// running, nft rules and taps stay, listeners close (their counter slots are
// kept for the next daemon).
func (d *Daemon) Close(ctx context.Context) error {
	d.netRun.wait(ctx)
	d.supRun.wait(ctx)
	d.pxRun.wait(ctx)
	d.px.StopAll()
	d.sup.Stop()
	d.journal.close()
	return d.net.Close()
}

// ApplyResult is what Apply did.
type ApplyResult = api.Plan

// Apply validates cfg as a whole (the config rules and the network plane's
// own), computes the plan and, unless dryRun, persists and swaps it in. On
// any error nothing is changed.
func (d *Daemon) Apply(cfg *config.Config, dryRun bool) (api.Plan, error) {
	d.applyMu.Lock()
	defer d.applyMu.Unlock()
	next := withHost(cfg, d.host)
	model, cerrs := config.Compile(next)
	if len(cerrs) > 0 {
		return api.Plan{}, cerrs
	}
	if !d.lockNet(d.opts.Timeout) {
		return api.Plan{}, ErrBusy
	}
	ce := netErrors(d.net.Validate(netDesired(model)))
	d.netMu.Unlock()
	if len(ce) > 0 {
		return api.Plan{}, ce
	}
	cur := d.Desired()
	plan := diff(cur, next)
	plan.DryRun = dryRun
	plan.Warnings = hostWarnings(cfg, d.host)
	if w := budgetWarning(model); w != "" {
		plan.Warnings = append(plan.Warnings, w)
	}
	plan.Warnings = append(plan.Warnings, d.portWarnings(model)...)
	if dryRun {
		return plan, nil
	}
	if err := d.persistWhole(next); err != nil {
		return api.Plan{}, err
	}
	d.setWhole(next, model)
	plan.Applied = true
	d.log.Info("desired state applied", "vmsAdded", fewNames(plan.VMs.Added), "vmsChanged", fewNames(plan.VMs.Changed),
		"vmsRemoved", fewNames(plan.VMs.Removed), "exposuresAdded", fewNames(plan.Exposures.Added),
		"exposuresChanged", fewNames(plan.Exposures.Changed), "exposuresRemoved", fewNames(plan.Exposures.Removed))
	d.Wake()
	return plan, nil
}

// fewNames is names for a log line: all of them up to 20, else the first
// 20 and how many more (an apply of 100,000 exposures would otherwise log
// a line of megabytes; the plan the client gets names them all).
func fewNames(names []string) []string {
	const few = 20
	if len(names) <= few {
		return names
	}
	return append(slices.Clip(names[:few]), fmt.Sprintf("... (%d more)", len(names)-few))
}

// ErrBusy is returned when the network plane stays busy past the deadline.
var ErrBusy = errors.New("the network plane is busy with a pass that overran; nothing was changed, try again")

// lockNet takes netMu, giving up after timeout so a stalled netplane pass
// cannot hang the API.
func (d *Daemon) lockNet(timeout time.Duration) bool {
	deadline := time.Now().Add(timeout)
	for !d.netMu.TryLock() {
		if time.Now().After(deadline) {
			return false
		}
		time.Sleep(5 * time.Millisecond)
	}
	return true
}

func hostWarnings(cfg, host *config.Config) []string {
	var w []string
	for _, k := range []struct{ key, got, have string }{
		{"stateDir", cfg.StateDir, host.StateDir}, {"runDir", cfg.RunDir, host.RunDir},
		{"bpfDir", cfg.BPFDir, host.BPFDir}, {"metrics.listen", cfg.Metrics.Listen, host.Metrics.Listen},
	} {
		if k.got != k.have {
			w = append(w, fmt.Sprintf("%s: %q differs from the running daemon's %q; it takes effect when brokkrd restarts with this file", k.key, k.got, k.have))
		}
	}
	if !reflect.DeepEqual(cfg.Hypervisor, host.Hypervisor) {
		w = append(w, "hypervisor: differs from the running daemon's; it takes effect when brokkrd restarts with this file")
	}
	return w
}

// ErrNoSuchVM is returned for a VM name not in the desired state.
var ErrNoSuchVM = errors.New("no such VM")

// SetPower changes a VM's persisted desired power (start/stop).
func (d *Daemon) SetPower(name string, power spec.Power) error {
	d.applyMu.Lock()
	defer d.applyMu.Unlock()
	cur, found := d.Desired().WithPower(name, power)
	if !found {
		return fmt.Errorf("%w: %q", ErrNoSuchVM, name)
	}
	model, errs := config.Compile(cur)
	if len(errs) > 0 {
		return errs
	}
	if err := d.persistWhole(cur); err != nil {
		return err
	}
	d.setWhole(cur, model)
	d.Wake()
	return nil
}

// ErrStopped is returned when restarting a VM whose desired power is stopped.
var ErrStopped = errors.New("VM is stopped (start it instead)")

// Restart asks the supervisor to restart a running VM.
func (d *Daemon) Restart(name string) error {
	d.mu.Lock()
	_, m := d.snapLocked()
	v, ok := m.VM(name)
	d.mu.Unlock()
	switch {
	case !ok:
		return fmt.Errorf("%w: %q", ErrNoSuchVM, name)
	case v.Power != spec.PowerRunning:
		return fmt.Errorf("%q: %w", name, ErrStopped)
	}
	if err := d.sup.Restart(name); err != nil {
		return fmt.Errorf("restarting %q: %w", name, err)
	}
	d.Wake()
	return nil
}

// mergeStatus builds the contract's status from the three reports.
func (d *Daemon) mergeStatus(want *config.Config, model *spec.Desired, srep supervisor.Report, nrep netplane.Report, pst []proxy.Status, errs []error) api.Status {
	st := api.Status{VMs: []api.VM{}, Exposures: []api.Exposure{}}
	sv := map[string]supervisor.VMStatus{}
	for _, v := range srep.VMs {
		sv[v.Name] = v
	}
	d.mu.Lock()
	facts := d.facts
	d.mu.Unlock()
	// A pass the network plane refused as a whole reports no guest and no
	// exposure: what waits on it fails with its reason.
	netErr := ""
	if nrep.Err != nil {
		netErr = strings.TrimPrefix(nrep.Err.Error(), "netplane: ")
	}
	listed := map[string]bool{}
	row := func(name, power string) api.VM {
		r := api.VM{Name: name, Phase: supervisor.PhasePending, Power: power}
		if s, ok := sv[name]; ok {
			r.Phase, r.Detail, r.PID, r.Restarts = s.Phase, s.Detail, s.PID, s.Restarts
			r.StateBytes, r.Wakes = s.StateBytes, s.Wakes
			if s.Progress != nil {
				r.Progress = &api.Progress{Done: s.Progress.Done, Total: s.Progress.Total}
			}
		}
		if f, ok := facts[name]; (!ok || f.Tap == "") && netErr != "" && r.Detail == "" {
			r.Detail = "network: " + netErr
		}
		if f, ok := facts[name]; ok {
			r.Tap = f.Tap
			if f.MAC != nil {
				r.MAC = f.MAC.String()
			}
			if f.Address.IsValid() {
				r.Address = f.Address.String()
			}
			if f.Address6.IsValid() {
				r.Address6 = f.Address6.String()
			}
			if f.Error != "" && r.Detail == "" {
				r.Detail = "network: " + f.Error
			}
		}
		return r
	}
	for _, v := range want.VMs {
		st.VMs = append(st.VMs, row(v.Name, v.Power))
		listed[v.Name] = true
	}
	for _, v := range srep.VMs { // recorded VMs on their way out
		if !listed[v.Name] {
			st.VMs = append(st.VMs, row(v.Name, ""))
		}
	}

	ns := make(map[string]netplane.ExposureStatus, len(nrep.Exposures))
	for _, e := range nrep.Exposures {
		ns[e.Name] = e
	}
	ps := map[string][]proxy.Status{}
	for _, p := range pst {
		ps[p.ID] = append(ps[p.ID], p)
	}
	// The row echoes the exposure as the config spells it: found by name,
	// never by position (the model is not bound to keep the file's order).
	spelt := make(map[string]*config.Exposure, len(want.Exposures))
	for i := range want.Exposures {
		spelt[want.Exposures[i].Name] = &want.Exposures[i]
	}
	if len(model.Exposures) > 0 {
		st.Exposures = make([]api.Exposure, 0, len(model.Exposures))
	}
	for _, e := range model.Exposures {
		ce, ok := spelt[e.Name]
		if !ok {
			continue
		}
		r := api.Exposure{Name: ce.Name, VM: ce.VM, Target: ce.Target, Target6: ce.Target6, Mode: ce.Mode, HostAddress: ce.HostAddress,
			HostPort: int(e.HostPort), HostPortLast: int(e.HostPortLast), Protocol: ce.Protocol,
			GuestPort: int(e.GuestPort), GuestPortLast: int(e.GuestPortLast), MaxConns: *ce.MaxConns,
			ProxyProtocol: ce.ProxyProtocol}
		var parts []part
		vm := e.Target.VM
		_, hasAddr := d.addrs.lookup(vm)
		if p, held := d.portParts[e.Name]; held {
			parts = append(parts, p) // its port is held elsewhere: no engine carries it
		} else {
			parts = d.engineParts(e, ns, ps, netErr, vm != "" && !hasAddr)
		}
		state, reason := mergeParts(parts)
		r.State, r.Reason = string(state), reason
		if state == spec.StatePending && vm != "" && r.Reason == "" {
			r.Reason = "guest has no address yet"
		}
		// The engines' figures; Status reads the shared slot over them
		// at every request.
		var c bpf.Counters
		if n, ok := ns[e.Name]; ok {
			c = n.Counters
		} else if p := ps[e.Name]; len(p) > 0 {
			c = p[0].Counters
		}
		r.Active, r.Accepted, r.Refused, r.Dropped, r.Denied, r.BytesIn, r.BytesOut = c.Active, c.Accepted, c.Refused, c.Dropped, c.Denied, c.BytesIn, c.BytesOut
		st.Exposures = append(st.Exposures, r)
	}
	markAsleep(&st)
	st.Warnings = append(st.Warnings, d.opts.Warnings...)
	st.Warnings = append(st.Warnings, nrep.Warnings...)
	if w := budgetWarning(model); w != "" {
		st.Warnings = append(st.Warnings, w)
	}
	if r := d.opts.SocketPathReason; r != "" {
		st.Warnings = append(st.Warnings, r)
	}
	if d.store != nil && !d.store.Pinned() {
		st.Warnings = append(st.Warnings, d.store.Reason())
	}
	if d.store != nil && d.store.Migrating() {
		st.Warnings = append(st.Warnings, "counters: an older brokkrd's "+bpf.V1MapName+" maps are still written (by its BPF programs, or the process that handed over): their counts are carried into "+bpf.MapName+" until nothing writes them")
	}
	for _, e := range errs {
		if e != nil {
			st.Warnings = append(st.Warnings, e.Error())
		}
	}
	return st
}

type part struct {
	path   string
	state  spec.ExposureState
	reason string
}

// mergeParts: failed beats pending beats active; reasons name their path.
// maxReasons bounds the reasons a status row names: a port range's
// listeners may each say why they failed.
const maxReasons = 4

func mergeParts(parts []part) (spec.ExposureState, string) {
	state := spec.StateActive
	var reasons []string
	more := 0 // distinct reasons past maxReasons (a range's listeners, one per port)
	for _, p := range parts {
		if p.state.Rank() > state.Rank() {
			state = p.state
		}
		if r := p.path + ": " + p.reason; p.reason != "" && !slices.Contains(reasons, r) {
			// The 127.0.0.1 and ::1 listeners often say the same.
			if len(reasons) < maxReasons {
				reasons = append(reasons, r)
			} else {
				more++
			}
		}
	}
	if len(parts) == 0 {
		return spec.StatePending, "no path carries this exposure"
	}
	if more > 0 {
		reasons = append(reasons, fmt.Sprintf("and %d more", more))
	}
	return state, joinReasons(reasons)
}

func joinReasons(r []string) string {
	out := ""
	for i, s := range r {
		if i > 0 {
			out += "; "
		}
		out += s
	}
	return out
}

// engineParts are the parts the engines report of e, one per path that
// carries it: netplane's rows ns, the socket path's, the proxy's ps, and
// pending where an engine has not reported it yet (failed with netErr
// where the network was refused and a proxied VM waits for an address it
// cannot get, noAddr).
func (d *Daemon) engineParts(e spec.Exposure, ns map[string]netplane.ExposureStatus, ps map[string][]proxy.Status, netErr string, noAddr bool) []part {
	var parts []part
	if e.UsesKernel() {
		if n, ok := ns[e.Name]; ok {
			parts = append(parts, part{"nat", n.State, n.Reason})
		} else if netErr != "" {
			parts = append(parts, part{"nat", spec.StateFailed, netErr})
		} else {
			parts = append(parts, part{"nat", spec.StatePending, "the network plane has not reported it yet"})
		}
	}
	if d.sock != nil && e.UsesSocketPath() {
		if p, ok := d.sockParts[e.Name]; ok {
			parts = append(parts, p)
		} else {
			parts = append(parts, part{"socket", spec.StatePending, "the socket path has not reported it yet"})
		}
	}
	if len(e.ProxyBinds(d.opts.IPv6Loopback, d.sock != nil)) > 0 {
		if p := ps[e.Name]; len(p) > 0 {
			for _, s := range p {
				if s.State == spec.StatePending && noAddr && netErr != "" {
					// Waiting for a guest address the refused network cannot give.
					s.State, s.Reason = spec.StateFailed, netErr
				}
				parts = append(parts, part{"proxy", s.State, s.Reason})
			}
		} else {
			parts = append(parts, part{"proxy", spec.StatePending, "the proxy has not reported it yet"})
		}
	}
	return parts
}
