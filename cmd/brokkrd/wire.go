package main

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"net/netip"
	"os"
	"path/filepath"
	"sync/atomic"
	"time"

	"github.com/brokkr/brokkr/bpf"
	"github.com/brokkr/brokkr/daemon"
	"github.com/brokkr/brokkr/daemon/config"
	"github.com/brokkr/brokkr/daemon/fleet"
	"github.com/brokkr/brokkr/internal/kernelfeat"
	"github.com/brokkr/brokkr/netplane"
	"github.com/brokkr/brokkr/netplane/hold"
	"github.com/brokkr/brokkr/proxy"
	"github.com/brokkr/brokkr/supervisor"
	"github.com/brokkr/brokkr/supervisor/chv"
	"github.com/brokkr/brokkr/supervisor/images"
	"github.com/brokkr/brokkr/supervisor/qemu"
	"github.com/brokkr/brokkr/supervisor/scope"
	"golang.org/x/sys/unix"
)

// system is everything one brokkrd process opened.
type system struct {
	d     *daemon.Daemon
	store *bpf.Store
	sock  *bpf.SockLB // nil when the socket path is off
	lock  *os.File
	fleet *fleet.Agent // nil on a single host
	// scopes puts VMMs into systemd scopes; nil where systemd does not run
	// the host.
	scopes *scope.Systemd
	// The proxy's Manager, for the hand-over.
	px *proxy.Manager
	// kwake is where the kernel paths ask for wakes; nil when off.
	kwake *bpf.Wake
	// holds are the exposures' held host ports (daemon/ports.go).
	holds *hold.Set
}

func (s *system) countersWhere() string {
	if s.store.Pinned() {
		return s.store.Path()
	}
	return "memory only: " + s.store.Reason()
}

func (s *system) close() {
	if s.sock != nil {
		_ = s.sock.Close() // the pinned links stay: translation goes on
	}
	if s.fleet != nil {
		_ = s.fleet.Close()
	}
	if s.scopes != nil {
		s.scopes.Close()
	}
	if s.kwake != nil {
		_ = s.kwake.Close()
	}
	s.holds.Close()
	_ = s.store.Close()
	_ = s.lock.Close()
}

// open takes the runDir lock, opens the counter map and builds the three
// engines around one daemon. With h (a hand-over) the lock is the old
// process's, the proxy starts from its snapshots and is held until Resume;
// listeners systemd kept (sd) are bound from instead of anew.
func open(ctx context.Context, cfg *config.Config, log *slog.Logger, h *inherited, sd map[string]*os.File) (*system, error) {
	var lock *os.File
	var err error
	var pxOpts []proxy.Option
	var kept map[string]uint64
	if h != nil {
		lock, pxOpts, kept = h.lock, []proxy.Option{proxy.WithHold()}, h.kept()
	} else if lock, err = lockRunDir(cfg.RunDir); err != nil {
		return nil, err
	}
	fail := func(err error) (*system, error) { lock.Close(); return nil, err }

	var warnings []string
	store, err := openStore(cfg.BPFDir)
	if err != nil {
		log.Warn("counters in memory only (bpftool and `brokkr stats` will not see them)", "err", err)
		store = bpf.NewInMemory(fmt.Sprintf("counters in memory only: %v", err))
	}

	var d atomic.Pointer[daemon.Daemon]
	addrs := daemon.NewAddressBook()
	// A suspended VM's callers are held by the proxy until it runs again.
	wakes := daemon.NewWakes()
	pxOpts = append(pxOpts, proxy.WithWaker(wakes, proxy.DefaultWakeHold))
	pxOpts = append(pxOpts, proxy.WithHolders(func(proto string, a netip.AddrPort) string {
		return hold.Holders("", hold.Side{Addr: a.Addr(), Proto: proto, Port: a.Port()})
	}))
	px := proxy.NewManager(addrs.Resolve, store, append(pxOpts, proxy.WithResolver6(addrs.Resolve6))...)
	px.Inherit(sd)
	plane, err := netplane.New(netplane.Options{
		StateDir: cfg.StateDir,
		Stats:    store,
		Logger:   log.With("engine", "netplane"),
		OnLease: func(vm string, addr netip.Addr) {
			if dd := d.Load(); dd != nil {
				dd.Wake() // publish the guest's port now, not at the next tick
			}
		},
		// Callers a capped nat exposure admits on its slow path are spliced
		// by the proxy's code (and ended by its StopAll).
		Overflow: px.Carry,
	})
	if err != nil {
		store.Close()
		return fail(err)
	}

	var hv supervisor.Hypervisor
	switch cfg.Hypervisor.Kind {
	case config.HypervisorQEMU:
		hv = qemu.New(cfg.Hypervisor.Path, qemu.WithLogger(log.With("engine", "qemu")))
	case config.HypervisorCHV:
		hv = chv.New(cfg.Hypervisor.Path)
	default:
		return fail(fmt.Errorf("hypervisor.kind %q is not supported", cfg.Hypervisor.Kind))
	}
	cache, err := images.New(cfg.StateDir, images.WithLogger(log.With("engine", "images")))
	if err != nil {
		plane.Close()
		store.Close()
		return fail(err)
	}
	scopes, warn := openScopes(ctx, log)
	if warn != "" {
		warnings = append(warnings, warn)
	}
	closeScopes := func() {
		if scopes != nil {
			scopes.Close()
		}
	}
	supCfg := supervisor.Config{
		StateDir:             cfg.StateDir,
		RunDir:               cfg.RunDir,
		Hypervisor:           hv,
		Images:               cache,
		MaxConcurrentCreates: *cfg.Hypervisor.MaxConcurrentCreates,
		Logger:               log.With("engine", "supervisor"),
		Notify:               wakes.Phase,
		Traffic: func(vm string) (supervisor.Traffic, bool) {
			if dd := d.Load(); dd != nil {
				return dd.VMTraffic(vm)
			}
			return supervisor.Traffic{}, false
		},
		Resumed: func(vm string, took time.Duration) {
			if dd := d.Load(); dd != nil {
				dd.ObserveResume(vm, took)
			}
		},
	}
	if scopes != nil {
		supCfg.Placer = scopes // never a nil *scope.Systemd in the interface
	}
	eng, err := supervisor.NewEngine(supCfg)
	if err != nil {
		closeScopes()
		plane.Close()
		store.Close()
		return fail(err)
	}
	ipv6 := daemon.HaveIPv6Loopback()
	if !ipv6 {
		log.Info("no IPv6 loopback here: auto exposures serve local callers on 127.0.0.1 only")
	}
	// Fleet mode: the desired state comes from etcd (the client connects
	// in the background; the node serves its persisted state meanwhile).
	var agent *fleet.Agent
	var src daemon.Source
	if cfg.Fleet != nil {
		if agent, err = fleet.New(cfg, log); err != nil {
			eng.Stop()
			closeScopes()
			plane.Close()
			store.Close()
			return fail(err)
		}
		src = agent
	}
	sock, sockReason := openSocketPath(cfg, store)
	kwake, warn := openKernelWake(cfg, store, log)
	if warn != "" {
		warnings = append(warnings, warn)
	}
	var heldBefore map[string]*os.File
	if h != nil {
		heldBefore = h.holds
	}
	holds := hold.New("", heldBefore)
	opts := daemon.Options{
		Holds: holds,
		Host:  cfg, Store: store, Supervisor: eng, Network: plane, Proxy: px, Addresses: addrs,
		Logger: log, Warnings: warnings, IPv6Loopback: ipv6, SocketPathReason: sockReason, Source: src,
		KeptProxyActive: kept, Wakes: wakes, KernelWake: kwake,
	}
	if err := kernelfeat.Running().Missing(kernelfeat.NatPath...); err != nil {
		opts.CappedAutoByProxy = "the nat path's fallback (" + err.Error() + ") cannot share a cap with host-local callers"
	}
	if sock != nil {
		opts.SocketPath = sock
		if why := sock.StaleReason(); why != "" {
			log.Warn("the socket path cannot close its callers' sockets when an exposure moves or goes: they keep the guest they reached", "reason", why)
		}
	} else {
		log.Warn("auto exposures serve local callers through loopback proxies", "reason", sockReason)
	}
	dd, err := daemon.New(opts)
	if err != nil {
		if kwake != nil {
			kwake.Close()
		}
		if agent != nil {
			agent.Close()
		}
		if sock != nil {
			sock.Close()
		}
		eng.Stop()
		closeScopes()
		plane.Close()
		holds.Close()
		store.Close()
		return fail(err)
	}
	d.Store(dd)
	wakes.Route(dd.WakeVM)
	if h != nil {
		// One Manager takes every snapshot: a process from before the
		// listeners were keyed by (name, address) hands over a second
		// one ("v6") for its ::1 listeners, under the same names.
		for _, sn := range h.snaps {
			px.Inherit(sn.Listeners)
			px.Adopt(sn.Pairs)
		}
	}
	return &system{d: dd, store: store, sock: sock, lock: lock, fleet: agent, px: px, scopes: scopes, kwake: kwake, holds: holds}, nil
}

// openKernelWake opens the maps through which the nat path and the socket
// path ask for a suspended VM's wake (bpf.Wake), or says why not: then
// only the proxy's callers wake a suspended VM.
func openKernelWake(cfg *config.Config, store *bpf.Store, log *slog.Logger) (*bpf.Wake, string) {
	if !store.Pinned() {
		return nil, ""
	}
	w, err := bpf.OpenWake(cfg.BPFDir)
	if err != nil {
		log.Warn("callers on the nat and socket paths do not wake a suspended VM", "err", err)
		return nil, "callers on the nat and socket paths do not wake a suspended VM: " + err.Error()
	}
	return w, ""
}

// openScopes gives every VMM a systemd scope of its own where systemd runs
// the host (docs/ARCHITECTURE.md, "Supervision and adoption"). Elsewhere
// VMMs stay in brokkrd's cgroup, each in its own session, as before. Under
// systemd with no answer on its bus the warning goes into status: a VMM in
// brokkrd.service's cgroup dies with `systemctl stop brokkrd`.
func openScopes(ctx context.Context, log *slog.Logger) (*scope.Systemd, string) {
	dctx, cancel := context.WithTimeout(ctx, 10*time.Second)
	defer cancel()
	s, err := scope.Detect(dctx)
	switch {
	case err == nil:
		log.Info("VMs run in systemd scopes of their own", "slice", scope.Slice)
		return s, ""
	case errors.Is(err, scope.ErrNoSystemd):
		log.Info("VMs stay in brokkrd's cgroup, each in its own session", "reason", err)
		return nil, ""
	default:
		log.Warn("VMs stay in brokkrd's cgroup", "err", err)
		return nil, fmt.Sprintf("VMs are not in systemd scopes of their own (%v): stopping brokkrd.service stops them", err)
	}
}

// openSocketPath attaches the socket path to the cgroup v2 root (mounting
// a cgroup2 hierarchy under runDir if none is mounted), or says why not.
// BROKKR_CGROUP names another cgroup to attach to, or "off": test
// harnesses use it so that a daemon under test never attaches to the
// host's root cgroup.
func openSocketPath(cfg *config.Config, store *bpf.Store) (*bpf.SockLB, string) {
	if !store.Pinned() {
		return nil, "socket path off: the counter map is not pinned"
	}
	cg := os.Getenv("BROKKR_CGROUP")
	if cg == "off" {
		return nil, "socket path off (BROKKR_CGROUP=off)"
	}
	if cg == "" {
		root, err := bpf.CgroupV2Root(filepath.Join(cfg.RunDir, "cgroup2"))
		if err != nil {
			return nil, fmt.Sprintf("socket path unavailable: %v", err)
		}
		cg = root
	}
	lb, err := bpf.LoadSockLB(bpf.SockLBConfig{PinDir: cfg.BPFDir, Cgroup: cg})
	if err != nil {
		return nil, fmt.Sprintf("socket path: fallback (%v): auto's host-local callers go through the proxy on 127.0.0.1 and ::1", err)
	}
	return lb, ""
}

// openStore makes bpfDir usable (mounting bpffs at /sys/fs/bpf if needed)
// and opens the pinned exposure_stats_v2 map (copying an older brokkrd's
// exposure_stats into it, see bpf/migrate.go).
func openStore(dir string) (*bpf.Store, error) {
	if err := bpf.EnsureBPFFS(dir); err != nil {
		return nil, err
	}
	return bpf.Open(dir)
}

// migrationTick is how often a process that copied the v1 counter maps
// checks whether anything still writes them.
const migrationTick = 2 * time.Second

// finishMigration ends the copy from the v1 counter maps (exposure_stats
// and the maps beside it) once nothing writes them any more: called once
// the process this one took over from is gone, it retries until no BPF
// program uses them (this binary's programs replace the earlier ones at
// the nat path's first load; an upgrade whose programs cannot load keeps
// the earlier ones, and their counts are carried over for as long).
func (s *system) finishMigration(ctx context.Context, log *slog.Logger) {
	if !s.store.Migrating() {
		return
	}
	go func() {
		t := time.NewTicker(migrationTick)
		defer t.Stop()
		var said string
		for {
			done, err := s.store.FinishMigration()
			if done {
				if err != nil {
					log.Warn("counters: closing the v1 maps", "err", err)
				}
				log.Info("counters: every count of the v1 maps is in " + bpf.MapName + "; their pins are removed")
				return
			}
			if err != nil && err.Error() != said {
				said = err.Error()
				log.Warn("counters: the v1 maps are still written; carrying their counts over", "err", err)
			}
			select {
			case <-ctx.Done():
				return
			case <-t.C:
			}
		}
	}()
}

// lockRunDir takes an exclusive flock on runDir/brokkrd.lock: two daemons
// on one state would each adopt and converge the same VMs and rules.
func lockRunDir(runDir string) (*os.File, error) {
	if err := os.MkdirAll(runDir, 0o700); err != nil {
		return nil, fmt.Errorf("runDir: %w", err)
	}
	path := filepath.Join(runDir, "brokkrd.lock")
	f, err := os.OpenFile(path, os.O_CREATE|os.O_RDWR, 0o600)
	if err != nil {
		return nil, fmt.Errorf("runDir: %w", err)
	}
	if err := unix.Flock(int(f.Fd()), unix.LOCK_EX|unix.LOCK_NB); err != nil {
		f.Close()
		if errors.Is(err, unix.EWOULDBLOCK) {
			return nil, fmt.Errorf("%s: another brokkrd is running with this runDir", path)
		}
		return nil, fmt.Errorf("%s: %w", path, err)
	}
	_ = f.Truncate(0)
	fmt.Fprintf(f, "%d\n", os.Getpid())
	return f, nil
}
