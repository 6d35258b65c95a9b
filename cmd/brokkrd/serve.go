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
// exit status.
func serve(o options, stderr io.Writer) int {
	log := newLogger(o, stderr)
	slog.SetDefault(log)

	// Everything the daemon creates (socket, records, desired.json, leases)
	// is root's alone; set before the socket exists, so there is no window.
	unix.Umask(0o077)

	path, data, cfg, err := loadConfigData(o.config)
	if err != nil {
		var ce config.Errors
		if errors.As(err, &ce) {
			fmt.Fprintf(stderr, "brokkrd: %s: invalid config:\n%v\n", path, err)
		} else {
			fmt.Fprintf(stderr, "brokkrd: %v\n", err)
		}
		return 1
	}
	if path == "" {
		log.Info("no config file; running on embedded defaults")
	} else {
		log.Info("config loaded", "file", path)
	}

	// A hand-over from a running brokkrd, or listeners systemd kept.
	var h *inherited
	if os.Getenv(handoverEnv) != "" {
		if h, err = receiveHandover(); err != nil {
			log.Error("starting", "err", err)
			return 2
		}
		log.Info("taking over from the running brokkrd", "proxyListeners", h.listenerCount(), "proxyConnections", h.pairCount())
		if os.Getenv("WATCHDOG_USEC") != "" {
			// systemd named the old process; this one is the main PID now.
			os.Setenv("WATCHDOG_PID", strconv.Itoa(os.Getpid()))
		}
	}
	sd := fromSystemd()
	if n := len(sd); n > 0 {
		log.Info("proxy listeners kept by systemd's fd store", "count", n)
	}

	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	sys, err := open(ctx, cfg, log, h, sd)
	if err != nil {
		log.Error("starting", "err", err)
		return 2
	}
	handedOver := false
	defer func() {
		if !handedOver {
			sys.close()
		}
	}()

	if path != "" {
		applied, plan, err := sys.d.StartWithFile(path, data, cfg)
		if err != nil {
			// Running on desired.json instead would silently ignore the
			// file the operator edited.
			fmt.Fprintf(stderr, "brokkrd: %s changed since it was last applied and is rejected; not starting:\n%v\n", path, err)
			return 1
		}
		if applied {
			log.Info("config file applied (changed since it was last applied, or never applied)", "file", path,
				"vmsAdded", plan.VMs.Added, "vmsChanged", plan.VMs.Changed, "vmsRemoved", plan.VMs.Removed,
				"exposuresAdded", plan.Exposures.Added, "exposuresChanged", plan.Exposures.Changed,
				"exposuresRemoved", plan.Exposures.Removed, "warnings", plan.Warnings)
		} else {
			log.Info("config file unchanged since it was last applied; resuming from the persisted desired state", "file", path)
		}
	}

	var ln, upLn, mln net.Listener
	if h != nil {
		ln, upLn, mln = h.api, h.upgrade, h.metrics
	} else if ln, err = daemon.Listen(cfg.RunDir); err != nil {
		log.Error("starting", "err", err)
		return 2
	}
	if upLn == nil {
		if upLn, err = listenUpgrade(cfg.RunDir); err != nil {
			ln.Close()
			log.Error("starting", "err", fmt.Errorf("upgrade socket: %w", err))
			return 2
		}
	}
	if l := cfg.Metrics.Listen; l != "" && mln == nil {
		if mln, err = net.Listen("tcp", l); err != nil {
			ln.Close()
			upLn.Close()
			log.Error("starting", "err", fmt.Errorf("metrics.listen: %w", err))
			return 2
		}
	}

	// The control loop, stoppable for a hand-over and restartable after a
	// failed one. The fd store follows the listeners it binds.
	store := newFDStore(log, sd)
	var loopCancel context.CancelFunc
	var loopDone chan struct{}
	startLoop := func() {
		var lctx context.Context
		lctx, loopCancel = context.WithCancel(ctx)
		loopDone = make(chan struct{})
		go func() {
			defer close(loopDone)
			done := make(chan struct{})
			go func() { sys.d.Run(lctx); close(done) }()
			t := time.NewTicker(time.Second)
			defer t.Stop()
			// Inherited listeners no exposure claimed are let go only after a
			// while: a pass that skipped the proxy must not close a socket
			// the next pass would have bound.
			first := time.After(10 * time.Second)
			for {
				select {
				case <-done:
					return
				case <-first:
					first = nil
					for _, name := range sys.px.DropUnclaimed() {
						store.remove(name)
					}
					store.sync(sys.px)
				case <-t.C:
					store.sync(sys.px)
				}
			}
		}()
	}
	stopLoop := func() { loopCancel(); <-loopDone }
	startLoop()

	if h != nil {
		// Serve nothing until the old process gave up: converge once with
		// the proxy held, then confirm.
		select {
		case <-sys.d.FirstPass():
		case <-time.After(readyTimeout):
			log.Error("hand-over: the first pass did not finish in time")
			return 2
		}
		if err := h.confirm(); err != nil {
			log.Error("hand-over aborted", "err", err)
			stopLoop()
			return 2
		}
		sys.px.Resume()
		_ = sys.lock.Truncate(0)
		_, _ = sys.lock.WriteAt([]byte(strconv.Itoa(os.Getpid())+"\n"), 0)
		log.Info("hand-over complete; serving")
	}

	sock := filepath.Join(cfg.RunDir, daemon.SocketName)
	serveDone := make(chan error, 2)
	go func() { serveDone <- sys.d.Serve(ctx, ln) }()
	servers := 1
	if mln != nil {
		servers++
		go func() { serveDone <- sys.d.ServeMetrics(ctx, mln) }()
		log.Info("metrics served over TCP", "listen", mln.Addr().String())
	}
	upgrades := make(chan upgradeReq)
	upDone := make(chan struct{})
	go func() { serveUpgrades(upLn, upgrades); close(upDone) }()
	notifyDone := make(chan struct{})
	go func() { notifySystemd(ctx, sys.d, log); close(notifyDone) }()
	log.Info("brokkrd serving", "socket", sock, "stateDir", cfg.StateDir, "bpfDir", cfg.BPFDir,
		"hypervisor", cfg.Hypervisor.Kind, "counters", sys.countersWhere())

	self, _ := os.Executable()
	sigs := make(chan os.Signal, 4)
	signal.Notify(sigs, syscall.SIGTERM, syscall.SIGINT, syscall.SIGHUP, syscall.SIGUSR2)
	defer signal.Stop(sigs)
	code := 0
	doUpgrade := func(r upgradeReq) upgradeReply {
		log.Info("hand-over to a new process", "exe", r.Exe, "args", r.Args)
		stopLoop()
		pid, err := sys.handOver(r, ln, upLn, mln, log)
		if err != nil {
			startLoop()
			log.Error("hand-over failed; this process goes on serving", "err", err)
			notify(log, "STATUS=hand-over failed, still serving: "+err.Error())
			return upgradeReply{Error: err.Error()}
		}
		log.Info("handed over; exiting", "pid", pid)
		handedOver = true
		return upgradeReply{PID: pid}
	}
loop:
	for {
		select {
		case s := <-sigs:
			switch {
			case s == syscall.SIGHUP && cfg.Fleet != nil:
				log.Warn("SIGHUP: fleet mode takes the desired state from etcd; a changed config file takes effect when brokkrd restarts")
				continue
			case s == syscall.SIGHUP:
				reload(sys.d, path, log)
				continue
			case s == syscall.SIGUSR2:
				// The binary at the path this one was started from, with the
				// same flags: after a package upgrade, the new version.
				if doUpgrade(upgradeReq{Exe: self, Args: os.Args[1:]}); handedOver {
					break loop
				}
				continue
			}
			log.Info("stopping; VMs and nft rules stay in place", "signal", s.String())
			break loop
		case r := <-upgrades:
			rep := doUpgrade(r)
			r.reply <- rep
			if handedOver {
				break loop
			}
		case err := <-serveDone:
			servers--
			log.Error("API or metrics server stopped", "err", err)
			code = 2
			break loop
		}
	}
	if !handedOver {
		notify(log, "STOPPING=1\nSTATUS=stopping; VMs and nft rules stay in place")
		stopLoop()
	}
	cancel()
	upLn.Close()
	<-upDone
	<-notifyDone
	for ; servers > 0; servers-- {
		<-serveDone
	}
	if handedOver {
		// The new process holds the sockets, the lock and the rules; this
		// one only lets go of its copies (the frozen proxy counts nothing
		// more, and closing a duplicate descriptor ends no connection).
		sctx, scancel := context.WithTimeout(context.Background(), 15*time.Second)
		defer scancel()
		if err := sys.d.Close(sctx); err != nil {
			log.Warn("closing engines", "err", err)
		}
		sys.close()
		return 0
	}
	_ = os.Remove(sock)
	_ = os.Remove(filepath.Join(cfg.RunDir, upgradeSocket))
	sctx, scancel := context.WithTimeout(context.Background(), 15*time.Second)
	defer scancel()
	if err := sys.d.Close(sctx); err != nil {
		log.Warn("closing engines", "err", err)
	}
	return code
}

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
