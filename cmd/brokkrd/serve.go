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

	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	sys, err := open(ctx, cfg, log)
	if err != nil {
		log.Error("starting", "err", err)
		return 2
	}
	defer sys.close()

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

	ln, err := daemon.Listen(cfg.RunDir)
	if err != nil {
		log.Error("starting", "err", err)
		return 2
	}
	sock := filepath.Join(cfg.RunDir, daemon.SocketName)
	serveDone := make(chan error, 2)
	go func() { serveDone <- sys.d.Serve(ctx, ln) }()
	servers := 1
	if l := cfg.Metrics.Listen; l != "" {
		mln, err := net.Listen("tcp", l)
		if err != nil {
			ln.Close()
			log.Error("starting", "err", fmt.Errorf("metrics.listen: %w", err))
			cancel()
			<-serveDone
			return 2
		}
		servers++
		go func() { serveDone <- sys.d.ServeMetrics(ctx, mln) }()
		log.Info("metrics served over TCP", "listen", mln.Addr().String())
	}
	loopDone := make(chan struct{})
	go func() { sys.d.Run(ctx); close(loopDone) }()
	notifyDone := make(chan struct{})
	go func() { notifySystemd(ctx, sys.d, log); close(notifyDone) }()
	log.Info("brokkrd serving", "socket", sock, "stateDir", cfg.StateDir, "bpfDir", cfg.BPFDir,
		"hypervisor", cfg.Hypervisor.Kind, "counters", sys.countersWhere())

	sigs := make(chan os.Signal, 4)
	signal.Notify(sigs, syscall.SIGTERM, syscall.SIGINT, syscall.SIGHUP)
	defer signal.Stop(sigs)
	code := 0
loop:
	for {
		select {
		case s := <-sigs:
			if s == syscall.SIGHUP && cfg.Fleet != nil {
				log.Warn("SIGHUP: fleet mode takes the desired state from etcd; a changed config file takes effect when brokkrd restarts")
				continue
			}
			if s == syscall.SIGHUP {
				reload(sys.d, path, log)
				continue
			}
			log.Info("stopping; VMs and nft rules stay in place", "signal", s.String())
			break loop
		case err := <-serveDone:
			servers--
			log.Error("API or metrics server stopped", "err", err)
			code = 2
			break loop
		}
	}
	notify(log, "STOPPING=1\nSTATUS=stopping; VMs and nft rules stay in place")
	cancel()
	<-notifyDone
	<-loopDone
	for ; servers > 0; servers-- {
		<-serveDone
	}
	_ = os.Remove(sock)
	sctx, scancel := context.WithTimeout(context.Background(), 15*time.Second)
	defer scancel()
	if err := sys.d.Close(sctx); err != nil {
		log.Warn("closing engines", "err", err)
	}
	return code
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
