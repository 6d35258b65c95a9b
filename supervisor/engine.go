package supervisor

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"net"
	"net/netip"
	"os"
	"path/filepath"
	"regexp"
	"slices"
	"strings"
	"sync"
	"time"

	"github.com/brokkr/brokkr/internal/spec"
)

// ImageFetcher turns image sources into local files. The daemon wires it to
// supervisor/images (content-addressed cache, sha256, shared downloads).
type ImageFetcher interface {
	// Fetch returns a local file holding src's content, verified against
	// src.SHA256 when set. progress(done, total) reports a download as it
	// goes (total < 0 when unknown); it must be cheap and must not block.
	Fetch(ctx context.Context, src Source, progress func(done, total int64)) (string, error)
	// PrepareDisk makes the VM's own disk at dst: a sparse copy of base,
	// grown to size bytes (0 = base's size). Called only when dst is absent.
	PrepareDisk(ctx context.Context, base, dst string, size int64) error
}

// Config configures an Engine. Zero durations take the defaults named.
type Config struct {
	StateDir, RunDir string
	Hypervisor       Hypervisor
	// Images resolves kernel, initramfs and disk sources. nil: local paths
	// only, and no disks.
	Images               ImageFetcher
	MaxConcurrentCreates int // 0 = unlimited
	Logger               *slog.Logger
	// Placer puts every VMM into a scope of its own. nil: VMMs stay in the
	// daemon's cgroup, each in its own session.
	Placer Placer

	StartTimeout    time.Duration // one Start (launch + boot); default 2 min
	StopGrace       time.Duration // power button to forced stop; default 30 s
	ConsoleMaxBytes int64         // console.log cap; default 4 MiB
	BackoffBase     time.Duration // first restart delay; default 100 ms
	BackoffMax      time.Duration // delay cap; default 1 min
	StableRun       time.Duration // an up-time that resets the backoff; default 60 s

	// Traffic reads the counters of a VM's exposures, for idleSuspend; ok
	// false when they cannot be read (the VM is then never taken for
	// idle). nil: idleSuspend is never acted on.
	Traffic func(vm string) (t Traffic, ok bool)
	// IdleCheck is how often a VM with idleSuspend has its traffic read;
	// default 1 s.
	IdleCheck time.Duration
	// SuspendRetry is how long a VM whose suspend failed keeps running
	// before the next try; default 1 min.
	SuspendRetry time.Duration
	// Notify, when set, is told each VM's phase when it changes (the
	// daemon holds a suspended VM's callers until it runs). It must not
	// block.
	Notify func(vm, phase string)
	// Resumed, when set, is told how long each wake took: from the
	// Engine.Wake that asked for it to the guest running again. It must
	// not block.
	Resumed func(vm string, took time.Duration)
}

func (c *Config) applyDefaults() {
	def := func(d *time.Duration, v time.Duration) {
		if *d <= 0 {
			*d = v
		}
	}
	def(&c.StartTimeout, 2*time.Minute)
	def(&c.StopGrace, 30*time.Second)
	def(&c.BackoffBase, 100*time.Millisecond)
	def(&c.BackoffMax, time.Minute)
	def(&c.StableRun, 60*time.Second)
	def(&c.IdleCheck, time.Second)
	def(&c.SuspendRetry, time.Minute)
	if c.ConsoleMaxBytes <= 0 {
		c.ConsoleMaxBytes = 4 << 20
	}
	if c.Logger == nil {
		c.Logger = slog.New(slog.DiscardHandler)
	}
	if c.Images == nil {
		c.Images = localFiles{}
	}
}

// Engine runs one worker goroutine per VM. Step hands each worker its newest
// desired spec and returns at once with every worker's last published row:
// no VM, however wedged, can delay the report.
type Engine struct {
	cfg     Config
	ctx     context.Context
	cancel  context.CancelFunc
	creates chan struct{} // create slots; nil = unlimited

	mu      sync.Mutex
	workers map[string]*worker
	gen     uint64 // Step counter, see worker.gen
	stopped bool
	wg      sync.WaitGroup
}

// NameRE is the VM name syntax (docs/ARCHITECTURE.md, "External contract"); names become directory names.
var NameRE = regexp.MustCompile(`^[a-z0-9-]{1,32}$`)

// NewEngine opens StateDir and starts a worker for every VM that has a
// record there: each one adopts its running hypervisor (or finds it dead)
// straight away, and acts on it once a Step says what is desired.
func NewEngine(cfg Config) (*Engine, error) {
	if cfg.StateDir == "" {
		return nil, errors.New("supervisor config: StateDir is required")
	}
	if cfg.RunDir == "" {
		return nil, errors.New("supervisor config: RunDir is required")
	}
	if cfg.Hypervisor == nil {
		return nil, errors.New("supervisor config: Hypervisor is required")
	}
	if cfg.MaxConcurrentCreates < 0 {
		return nil, fmt.Errorf("supervisor config: MaxConcurrentCreates %d is negative", cfg.MaxConcurrentCreates)
	}
	cfg.applyDefaults()
	for _, d := range []string{filepath.Join(cfg.StateDir, "vms"), filepath.Join(cfg.RunDir, "vms")} {
		if err := os.MkdirAll(d, 0o700); err != nil {
			return nil, fmt.Errorf("supervisor: %w", err)
		}
	}
	ents, err := os.ReadDir(filepath.Join(cfg.StateDir, "vms"))
	if err != nil {
		return nil, fmt.Errorf("supervisor: %w", err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	e := &Engine{cfg: cfg, ctx: ctx, cancel: cancel, workers: map[string]*worker{}}
	if cfg.MaxConcurrentCreates > 0 {
		e.creates = make(chan struct{}, cfg.MaxConcurrentCreates)
	}
	e.mu.Lock()
	defer e.mu.Unlock()
	for _, ent := range ents {
		name := ent.Name()
		if !ent.IsDir() || !NameRE.MatchString(name) {
			cfg.Logger.Warn("ignoring entry in the VM state directory: not a VM name", "path", filepath.Join(cfg.StateDir, "vms", name))
			continue
		}
		if _, err := os.Lstat(recordPath(e.vmDir(name))); errors.Is(err, os.ErrNotExist) {
			continue // a directory without a record: nothing to adopt
		}
		w := e.spawn(name)
		w.mu.Lock()
		w.hasRecord = true
		w.mu.Unlock()
		w.signal()
	}
	return e, nil
}

func (e *Engine) vmDir(name string) string  { return filepath.Join(e.cfg.StateDir, "vms", name) }
func (e *Engine) runDir(name string) string { return filepath.Join(e.cfg.RunDir, "vms", name) }

// spawn starts a worker; e.mu must be held.
func (e *Engine) spawn(name string) *worker {
	w := newWorker(e, name)
	e.workers[name] = w
	e.wg.Add(1)
	go func() {
		defer e.wg.Done()
		w.run(e.ctx)
	}()
	return w
}

// Step delivers desired state and reports. It only takes short locks: the
// workers do all the work, and a row shows what each is doing right now.
func (e *Engine) Step(ctx context.Context, desired []VMSpec) Report {
	e.mu.Lock()
	defer e.mu.Unlock()
	if e.stopped {
		return Report{}
	}
	// Each worker is stamped with the Step that named it, which tells the
	// desired from the absent ones without building a set per Step.
	e.gen++
	gen := e.gen
	rows := make([]VMStatus, 0, max(len(desired), len(e.workers)))
	var unknown map[string]bool // invalid specs naming no worker
	for i := range desired {
		spec := &desired[i]
		w := e.workers[spec.Name]
		if (w != nil && w.gen == gen) || unknown[spec.Name] {
			rows = append(rows, VMStatus{Name: spec.Name, Phase: PhaseFailed, Detail: "spec: name: duplicate VM name"})
			continue
		}
		if err := ValidateSpec(spec); err != nil {
			// Bad input changes nothing: a VM that exists keeps its old
			// desired state (it is not treated as deleted).
			row := VMStatus{Name: spec.Name}
			if w != nil {
				w.gen = gen
				row = w.row()
			} else {
				if unknown == nil {
					unknown = map[string]bool{}
				}
				unknown[spec.Name] = true
			}
			row.Phase, row.Detail = PhaseFailed, "spec: "+err.Error()
			rows = append(rows, row)
			continue
		}
		if w == nil {
			w = e.spawn(spec.Name)
		}
		w.gen = gen
		w.deliver(spec)
		rows = append(rows, w.row())
	}
	for name, w := range e.workers {
		if w.gen == gen {
			continue
		}
		w.deliverAbsent()
		if w.reapable() {
			delete(e.workers, name)
			close(w.quit)
			continue
		}
		rows = append(rows, w.row())
	}
	slices.SortFunc(rows, func(a, b VMStatus) int { return strings.Compare(a.Name, b.Name) })
	return Report{VMs: rows}
}

// Wake asks a VM suspended by its idleSuspend to resume: a caller arrived
// through one of its exposures. A VM that is not suspended is left alone,
// and wakes that come while one is being acted on coalesce. It reports
// whether the engine knows the VM.
func (e *Engine) Wake(name string) bool {
	e.mu.Lock()
	defer e.mu.Unlock()
	w := e.workers[name]
	if e.stopped || w == nil {
		return false
	}
	w.requestWake()
	return true
}

// Restart asks the VM's worker to stop and start its hypervisor again (an
// operator's request: no backoff, and a crash history is forgotten).
func (e *Engine) Restart(name string) error {
	e.mu.Lock()
	defer e.mu.Unlock()
	if e.stopped {
		return errors.New("supervisor: engine stopped")
	}
	w := e.workers[name]
	if w == nil {
		return fmt.Errorf("supervisor: no VM named %q", name)
	}
	w.requestRestart()
	return nil
}

// Stop ends every worker (a pass in progress is cancelled) and waits for
// them. Hypervisor processes keep running: a new Engine adopts them.
func (e *Engine) Stop() {
	e.mu.Lock()
	if !e.stopped {
		e.stopped = true
		e.cancel()
		for name, w := range e.workers {
			close(w.quit)
			delete(e.workers, name)
		}
	}
	e.mu.Unlock()
	e.wg.Wait()
}

// workerCount is for tests: how many workers the engine holds.
func (e *Engine) workerCount() int {
	e.mu.Lock()
	defer e.mu.Unlock()
	return len(e.workers)
}

// ValidateSpec checks one VMSpec; the error names the field.
func ValidateSpec(s *VMSpec) error {
	switch {
	case !NameRE.MatchString(s.Name):
		return fmt.Errorf("name: %q must match %s", s.Name, NameRE)
	case s.CPUs < 1:
		return fmt.Errorf("cpus: %d must be at least 1", s.CPUs)
	case s.MemoryMiB < 16:
		return fmt.Errorf("memory: %d MiB must be at least 16", s.MemoryMiB)
	case s.Kernel.Location == "":
		return errors.New("kernel: required")
	case s.Initramfs != nil && s.Initramfs.Location == "":
		return errors.New("initramfs: location is empty")
	case s.Disk != nil && s.Disk.Source.Location == "":
		return errors.New("disk.source: required")
	case s.Disk != nil && s.Disk.Size < 0:
		return fmt.Errorf("disk.size: %d is negative", s.Disk.Size)
	}
	switch s.Power {
	case "", PowerRunning, PowerStopped, PowerSuspended:
	default:
		return fmt.Errorf("power: %q must be running, stopped or suspended", s.Power)
	}
	if s.IdleSuspend < 0 {
		return fmt.Errorf("idleSuspend: %s is negative", s.IdleSuspend)
	}
	switch s.Restart {
	case "", RestartAlways, RestartOnFailure, RestartNever:
	default:
		return fmt.Errorf("restart: %q must be always, on-failure or never", s.Restart)
	}
	if s.MAC != nil && len(s.MAC) != 6 {
		return fmt.Errorf("mac: %v is not a 6-byte MAC", s.MAC)
	}
	return nil
}

// cloneSpec deep-copies a spec so the caller's slice can be reused freely.
func cloneSpec(s *VMSpec) *VMSpec {
	c := *s
	if s.Initramfs != nil {
		v := *s.Initramfs
		c.Initramfs = &v
	}
	if s.Disk != nil {
		v := *s.Disk
		c.Disk = &v
	}
	if s.MAC != nil {
		c.MAC = append(net.HardwareAddr(nil), s.MAC...)
	}
	if s.IP != nil {
		v := *s.IP
		c.IP = &v
	}
	return &c
}

// specEqual compares two specs field by field (cheap enough for every Step).
func specEqual(a, b *VMSpec) bool {
	if a == nil || b == nil {
		return a == b
	}
	if a.Name != b.Name || a.CPUs != b.CPUs || a.MemoryMiB != b.MemoryMiB || a.Kernel != b.Kernel ||
		a.Cmdline != b.Cmdline || a.Power != b.Power || a.Restart != b.Restart || a.IdleSuspend != b.IdleSuspend || a.Tap != b.Tap ||
		!sameIP(a.IP, b.IP) || string(a.MAC) != string(b.MAC) {
		return false
	}
	if (a.Initramfs == nil) != (b.Initramfs == nil) || (a.Initramfs != nil && *a.Initramfs != *b.Initramfs) {
		return false
	}
	if (a.Disk == nil) != (b.Disk == nil) || (a.Disk != nil && *a.Disk != *b.Disk) {
		return false
	}
	return true
}

// sameMachine says whether a running VM started from a can serve b: power,
// restart policy and idleSuspend change without a restart, anything else
// needs one (and makes a suspended VM's saved state useless).
func sameMachine(a, b *VMSpec) bool {
	x, y := *a, *b
	x.Power, y.Power, x.Restart, y.Restart = "", "", "", ""
	x.IP, y.IP = withoutIPv6(x.IP), withoutIPv6(y.IP)
	x.IdleSuspend, y.IdleSuspend = 0, 0
	return specEqual(&x, &y)
}

// withoutIPv6 is ip without its IPv6 address: a changed one (IPv6 turned on
// or network.cidr6 changed, with DHCP off) reaches the command line at the
// VM's next boot but restarts nothing, since the router advertisements
// already carry the change to the running guest.
func withoutIPv6(ip *spec.StaticIP) *spec.StaticIP {
	if ip == nil || !ip.Addr6.IsValid() {
		return ip
	}
	v := *ip
	v.Addr6 = netip.Prefix{}
	return &v
}

// localFiles is the ImageFetcher used when none is configured: local paths
// as they are, no downloads, no disks.
type localFiles struct{}

func (localFiles) Fetch(_ context.Context, src Source, _ func(int64, int64)) (string, error) {
	if strings.Contains(src.Location, "://") {
		return "", fmt.Errorf("%s: no image fetcher configured for URLs", src.Location)
	}
	if _, err := os.Stat(src.Location); err != nil {
		return "", err
	}
	return src.Location, nil
}

func (localFiles) PrepareDisk(context.Context, string, string, int64) error {
	return errors.New("no image fetcher configured for disks")
}

func sameIP(a, b *spec.StaticIP) bool {
	return a == b || (a != nil && b != nil && *a == *b)
}
