package main

import (
	"context"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net"
	"os"
	"os/signal"
	"path/filepath"
	"strconv"
	"syscall"
	"time"

	"github.com/brokkr/brokkr/daemon"
	"github.com/brokkr/brokkr/daemon/config"
	"golang.org/x/sys/unix"
)

func newLogger(o options, w io.Writer) *slog.Logger {
	level := slog.LevelInfo
	if o.debug {
		level = slog.LevelDebug
	}
	var h slog.Handler = slog.NewTextHandler(w, &slog.HandlerOptions{Level: level})
	if o.logFormat == "json" {
		h = slog.NewJSONHandler(w, &slog.HandlerOptions{Level: level})
	}
	return slog.New(h)
}

// serve runs the daemon until a signal or a fatal error; it returns the
// exit status. Each step is a method of process below, in the order they run.
func serve(o options, stderr io.Writer) int {
	p := &process{log: newLogger(o, stderr), stderr: stderr}
	slog.SetDefault(p.log)

	// Everything the daemon creates (socket, records, desired.json, leases)
	// is root's alone; set before the socket exists, so there is no window.
	unix.Umask(0o077)

	data, code := p.loadConfig(o.config)
	if code != 0 {
		return code
	}
	if code := p.receiveInherited(); code != 0 {
		return code
	}
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	var err error
	if p.sys, err = open(ctx, p.cfg, p.log, p.inh, p.sd); err != nil {
		p.log.Error("starting", "err", err)
		return 2
	}
	defer func() {
		if !p.handedOver {
			p.sys.close()
		}
	}()
	if code := p.applyConfigFile(data); code != 0 {
		return code
	}
	if err := p.listen(); err != nil {
		p.log.Error("starting", "err", err)
		return 2
	}
	p.loop = &controlLoop{sys: p.sys, store: newFDStore(p.log, p.sd), ctx: ctx}
	p.loop.start()
	if code := p.finishHandover(); code != 0 {
		return code
	}
	// The process that handed over (if any) is gone: only programs can
	// still write the v1 counter maps now.
	p.sys.finishMigration(ctx, p.log)
	srv := p.startServing(ctx)
	code = p.waitForStop(srv)
	return p.shutdown(cancel, srv, code)
}

// process is one brokkrd from its start to its exit: what serve's steps
// share.
type process struct {
	log    *slog.Logger
	stderr io.Writer
	path   string // the config file; "" on embedded defaults
	cfg    *config.Config
	inh    *inherited          // a hand-over from a running brokkrd, or nil
	sd     map[string]*os.File // listeners systemd's fd store kept
	sys    *system
	// The API socket, the upgrade socket and metrics.listen (nil when off).
	ln, upLn, mln net.Listener
	loop          *controlLoop
	handedOver    bool
}

// loadConfig reads the config brokkrd runs on; code is the exit status when
// it is rejected.
func (p *process) loadConfig(flagPath string) (data []byte, code int) {
	path, data, cfg, err := loadConfigData(flagPath)
	if err != nil {
		var ce config.Errors
		if errors.As(err, &ce) {
			fmt.Fprintf(p.stderr, "brokkrd: %s: invalid config:\n%v\n", path, err)
		} else {
			fmt.Fprintf(p.stderr, "brokkrd: %v\n", err)
		}
		return nil, 1
	}
	if path == "" {
		p.log.Info("no config file; running on embedded defaults")
	} else {
		p.log.Info("config loaded", "file", path)
	}
	p.path, p.cfg = path, cfg
	return data, 0
}

// receiveInherited takes a hand-over from a running brokkrd, if this
// process is its successor, and the listeners systemd kept.
func (p *process) receiveInherited() int {
	if os.Getenv(handoverEnv) != "" {
		h, err := receiveHandover()
		if err != nil {
			p.log.Error("starting", "err", err)
			return 2
		}
		p.inh = h
		p.log.Info("taking over from the running brokkrd", "proxyListeners", h.listenerCount(), "proxyConnections", h.pairCount())
		if os.Getenv("WATCHDOG_USEC") != "" {
			// systemd named the old process; this one is the main PID now.
			os.Setenv("WATCHDOG_PID", strconv.Itoa(os.Getpid()))
		}
	}
	p.sd = fromSystemd()
	if n := len(p.sd); n > 0 {
		p.log.Info("proxy listeners kept by systemd's fd store", "count", n)
	}
	return 0
}

// applyConfigFile applies the config file when it changed since it was
// last applied (README: "Which wins, the file or desired.json").
func (p *process) applyConfigFile(data []byte) int {
	if p.path == "" {
		return 0
	}
	applied, plan, err := p.sys.d.StartWithFile(p.path, data, p.cfg)
	if err != nil {
		// Running on desired.json instead would silently ignore the
		// file the operator edited.
		fmt.Fprintf(p.stderr, "brokkrd: %s changed since it was last applied and is rejected; not starting:\n%v\n", p.path, err)
		return 1
	}
	if applied {
		p.log.Info("config file applied (changed since it was last applied, or never applied)", "file", p.path,
			"vmsAdded", plan.VMs.Added, "vmsChanged", plan.VMs.Changed, "vmsRemoved", plan.VMs.Removed,
			"exposuresAdded", plan.Exposures.Added, "exposuresChanged", plan.Exposures.Changed,
			"exposuresRemoved", plan.Exposures.Removed, "warnings", plan.Warnings)
	} else {
		p.log.Info("config file unchanged since it was last applied; resuming from the persisted desired state", "file", p.path)
	}
	return 0
}

// listen opens (or takes over) the API socket, the upgrade socket and
// metrics.listen.
func (p *process) listen() error {
	var err error
	if p.inh != nil {
		p.ln, p.upLn, p.mln = p.inh.api, p.inh.upgrade, p.inh.metrics
	} else if p.ln, err = daemon.Listen(p.cfg.RunDir); err != nil {
		return err
	}
	if p.upLn == nil {
		if p.upLn, err = listenUpgrade(p.cfg.RunDir); err != nil {
			p.ln.Close()
			return fmt.Errorf("upgrade socket: %w", err)
		}
	}
	if l := p.cfg.Metrics.Listen; l != "" && p.mln == nil {
		if p.mln, err = net.Listen("tcp", l); err != nil {
			p.ln.Close()
			p.upLn.Close()
			return fmt.Errorf("metrics.listen: %w", err)
		}
	}
	return nil
}

// finishHandover, in a process taking over, serves nothing until the old
// process gave up: it converges once with the proxy held, then confirms.
func (p *process) finishHandover() int {
	if p.inh == nil {
		return 0
	}
	select {
	case <-p.sys.d.FirstPass():
	case <-time.After(readyTimeout):
		p.log.Error("hand-over: the first pass did not finish in time")
		return 2
	}
	if err := p.inh.confirm(); err != nil {
		p.log.Error("hand-over aborted", "err", err)
		p.loop.stop()
		return 2
	}
	p.sys.px.Resume()
	_ = p.sys.lock.Truncate(0)
	_, _ = p.sys.lock.WriteAt([]byte(strconv.Itoa(os.Getpid())+"\n"), 0)
	p.log.Info("hand-over complete; serving")
	return 0
}

// servers are the goroutines startServing began, for shutdown to wait on.
type servers struct {
	done     chan error // one per API or metrics server that returned
	running  int
	upgrades chan upgradeReq
	upDone   chan struct{}
	notified chan struct{}
}

// startServing serves the API, metrics.listen, the upgrade socket and
// systemd's notifications.
func (p *process) startServing(ctx context.Context) *servers {
	srv := &servers{done: make(chan error, 2), running: 1, upgrades: make(chan upgradeReq),
		upDone: make(chan struct{}), notified: make(chan struct{})}
	go func() { srv.done <- p.sys.d.Serve(ctx, p.ln) }()
	if p.mln != nil {
		srv.running++
		go func() { srv.done <- p.sys.d.ServeMetrics(ctx, p.mln) }()
		p.log.Info("metrics served over TCP", "listen", p.mln.Addr().String())
	}
	go func() { serveUpgrades(p.upLn, srv.upgrades); close(srv.upDone) }()
	go func() { notifySystemd(ctx, p.sys.d, p.log); close(srv.notified) }()
	p.log.Info("brokkrd serving", "socket", filepath.Join(p.cfg.RunDir, daemon.SocketName), "stateDir", p.cfg.StateDir,
		"bpfDir", p.cfg.BPFDir, "hypervisor", p.cfg.Hypervisor.Kind, "counters", p.sys.countersWhere())
	return srv
}

// waitForStop serves signals and upgrade requests until one of them (or a
// failed server) ends this process; it returns the exit status.
func (p *process) waitForStop(srv *servers) int {
	self, _ := os.Executable()
	sigs := make(chan os.Signal, 4)
	signal.Notify(sigs, syscall.SIGTERM, syscall.SIGINT, syscall.SIGHUP, syscall.SIGUSR2)
	defer signal.Stop(sigs)
	for {
		select {
		case s := <-sigs:
			switch {
			case s == syscall.SIGHUP && p.cfg.Fleet != nil:
				p.log.Warn("SIGHUP: fleet mode takes the desired state from etcd; a changed config file takes effect when brokkrd restarts")
				continue
			case s == syscall.SIGHUP:
				reload(p.sys.d, p.path, p.log)
				continue
			case s == syscall.SIGUSR2:
				// The binary at the path this one was started from, with the
				// same flags: after a package upgrade, the new version.
				if p.upgrade(upgradeReq{Exe: self, Args: os.Args[1:]}); p.handedOver {
					return 0
				}
				continue
			}
			p.log.Info("stopping; VMs and nft rules stay in place", "signal", s.String())
			return 0
		case r := <-srv.upgrades:
			r.reply <- p.upgrade(r)
			if p.handedOver {
				return 0
			}
		case err := <-srv.done:
			srv.running--
			p.log.Error("API or metrics server stopped", "err", err)
			return 2
		}
	}
}

// upgrade hands this process over to a new one; when that fails the loop
// starts again and this process goes on serving.
func (p *process) upgrade(r upgradeReq) upgradeReply {
	p.log.Info("hand-over to a new process", "exe", r.Exe, "args", r.Args)
	p.loop.stop()
	pid, err := p.sys.handOver(r, p.ln, p.upLn, p.mln, p.log)
	if err != nil {
		p.loop.start()
		p.log.Error("hand-over failed; this process goes on serving", "err", err)
		notify(p.log, "STATUS=hand-over failed, still serving: "+err.Error())
		return upgradeReply{Error: err.Error()}
	}
	p.log.Info("handed over; exiting", "pid", pid)
	p.handedOver = true
	return upgradeReply{PID: pid}
}

// shutdown stops the loop and the servers and closes the engines; after a
// hand-over it only lets go of this process's copies.
func (p *process) shutdown(cancel context.CancelFunc, srv *servers, code int) int {
	if !p.handedOver {
		notify(p.log, "STOPPING=1\nSTATUS=stopping; VMs and nft rules stay in place")
		p.loop.stop()
	}
	cancel()
	p.upLn.Close()
	<-srv.upDone
	<-srv.notified
	for ; srv.running > 0; srv.running-- {
		<-srv.done
	}
	sctx, scancel := context.WithTimeout(context.Background(), 15*time.Second)
	defer scancel()
	if p.handedOver {
		// The new process holds the sockets, the lock and the rules; this
		// one only lets go of its copies (the frozen proxy counts nothing
		// more, and closing a duplicate descriptor ends no connection).
		if err := p.sys.d.Close(sctx); err != nil {
			p.log.Warn("closing engines", "err", err)
		}
		p.sys.close()
		return 0
	}
	_ = os.Remove(filepath.Join(p.cfg.RunDir, daemon.SocketName))
	_ = os.Remove(filepath.Join(p.cfg.RunDir, upgradeSocket))
	if err := p.sys.d.Close(sctx); err != nil {
		p.log.Warn("closing engines", "err", err)
	}
	return code
}

// controlLoop runs the daemon's loop, stoppable for a hand-over and
// restartable after a failed one. The fd store follows the listeners the
// proxy binds.
type controlLoop struct {
	sys    *system
	store  *fdStore
	ctx    context.Context
	cancel context.CancelFunc
	done   chan struct{}
}

func (l *controlLoop) start() {
	var lctx context.Context
	lctx, l.cancel = context.WithCancel(l.ctx)
	l.done = make(chan struct{})
	go func() {
		defer close(l.done)
		done := make(chan struct{})
		go func() { l.sys.d.Run(lctx); close(done) }()
		t := time.NewTicker(time.Second)
		defer t.Stop()
		// Inherited listeners no exposure claimed are let go only after a
		// while: a pass that skipped the proxy must not close a socket the
		// next pass would have bound.
		first := time.After(10 * time.Second)
		for {
			select {
			case <-done:
				return
			case <-first:
				first = nil
				for _, name := range l.sys.px.DropUnclaimed() {
					l.store.remove(name)
				}
				l.sys.holds.DropUnclaimed()
				l.store.sync(l.sys.px)
			case <-t.C:
				l.store.sync(l.sys.px)
			}
		}
	}()
}

func (l *controlLoop) stop() { l.cancel(); <-l.done }

func (h *inherited) listenerCount() int {
	n := 0
	for _, s := range h.snaps {
		n += len(s.Listeners)
	}
	return n
}

func (h *inherited) pairCount() int {
	n := 0
	for _, s := range h.snaps {
		n += len(s.Pairs)
	}
	return n
}

// reload re-reads the config file and applies it like `brokkr apply`: as a
// whole or not at all.
func reload(d *daemon.Daemon, path string, log *slog.Logger) {
	if path == "" {
		log.Warn("SIGHUP: running on embedded defaults, there is no config file to reload")
		return
	}
	b, err := os.ReadFile(path)
	if err != nil {
		log.Error("SIGHUP: reload failed; desired state unchanged", "err", err)
		return
	}
	cfg, err := config.Parse(b)
	if err == nil {
		var plan daemon.ApplyResult
		plan, err = d.Apply(cfg, false)
		if err == nil {
			if err := d.FileApplied(path, b); err != nil {
				log.Warn("SIGHUP: recording the applied file", "err", err)
			}
			log.Info("SIGHUP: config reloaded", "file", path, "vmsAdded", plan.VMs.Added, "vmsChanged", plan.VMs.Changed,
				"vmsRemoved", plan.VMs.Removed, "exposuresAdded", plan.Exposures.Added,
				"exposuresChanged", plan.Exposures.Changed, "exposuresRemoved", plan.Exposures.Removed, "warnings", plan.Warnings)
			return
		}
	}
	log.Error("SIGHUP: reload rejected; desired state unchanged", "file", path, "err", err)
}
