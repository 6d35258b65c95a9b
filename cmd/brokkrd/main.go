// Command brokkrd is brokkr's daemon: it owns the guest network and the
// hypervisor processes of this host and publishes guest ports, converging
// towards the desired state on every change and every second.
//
//	brokkrd [--config FILE]
//
// Without --config it reads /etc/brokkr/brokkr.yaml, and without that file
// it runs on the embedded defaults. SIGTERM/SIGINT stop the daemon and leave
// VMs and nft rules in place; SIGHUP reloads the config file.
package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"io/fs"
	"log/slog"
	"os"
	"os/signal"
	"path/filepath"
	"syscall"
	"time"

	"github.com/brokkr/brokkr/daemon"
	"github.com/brokkr/brokkr/daemon/config"
	"golang.org/x/sys/unix"
)

// DefaultConfig is read when --config is not given and it exists.
const DefaultConfig = "/etc/brokkr/brokkr.yaml"

func main() {
	os.Exit(run())
}

func run() int {
	cfgPath := flag.String("config", "", "config file (default "+DefaultConfig+" if it exists, else embedded defaults)")
	logJSON := flag.Bool("log-json", false, "log JSON lines instead of text")
	debug := flag.Bool("debug", false, "log debug messages")
	flag.Parse()
	if flag.NArg() > 0 {
		fmt.Fprintf(os.Stderr, "brokkrd: unexpected arguments %q\n", flag.Args())
		return 1
	}
	level := slog.LevelInfo
	if *debug {
		level = slog.LevelDebug
	}
	var h slog.Handler = slog.NewTextHandler(os.Stderr, &slog.HandlerOptions{Level: level})
	if *logJSON {
		h = slog.NewJSONHandler(os.Stderr, &slog.HandlerOptions{Level: level})
	}
	log := slog.New(h)
	slog.SetDefault(log)

	// Everything the daemon creates (socket, records, desired.json, leases)
	// is root's alone; set before the socket exists, so there is no window.
	unix.Umask(0o077)

	path, cfg, err := loadConfig(*cfgPath)
	if err != nil {
		fmt.Fprintf(os.Stderr, "brokkrd: %v\n", err)
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

	ln, err := daemon.Listen(cfg.RunDir)
	if err != nil {
		log.Error("starting", "err", err)
		return 2
	}
	sock := filepath.Join(cfg.RunDir, daemon.SocketName)
	serveDone := make(chan error, 1)
	go func() { serveDone <- sys.d.Serve(ctx, ln) }()
	loopDone := make(chan struct{})
	go func() { sys.d.Run(ctx); close(loopDone) }()
	log.Info("brokkrd serving", "socket", sock, "stateDir", cfg.StateDir, "bpfDir", cfg.BPFDir,
		"hypervisor", cfg.Hypervisor.Kind, "counters", sys.countersWhere())

	sigs := make(chan os.Signal, 4)
	signal.Notify(sigs, syscall.SIGTERM, syscall.SIGINT, syscall.SIGHUP)
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
			log.Error("API server stopped", "err", err)
			code = 2
			break loop
		}
	}
	cancel()
	<-loopDone
	<-serveDone
	_ = os.Remove(sock)
	sctx, scancel := context.WithTimeout(context.Background(), 15*time.Second)
	defer scancel()
	if err := sys.d.Close(sctx); err != nil {
		log.Warn("closing engines", "err", err)
	}
	return code
}

// loadConfig picks the config: --config (must exist), else the default
// path if it exists, else the embedded defaults. path is "" for defaults.
func loadConfig(flagPath string) (string, *config.Config, error) {
	path := flagPath
	if path == "" {
		if _, err := os.Stat(DefaultConfig); err == nil {
			path = DefaultConfig
		} else if !errors.Is(err, fs.ErrNotExist) {
			return "", nil, fmt.Errorf("%s: %w", DefaultConfig, err)
		}
	}
	if path == "" {
		return "", config.Defaults(), nil
	}
	b, err := os.ReadFile(path)
	if err != nil {
		return "", nil, err
	}
	cfg, err := config.Parse(b)
	if err != nil {
		return "", nil, fmt.Errorf("%s: invalid config:\n%w", path, err)
	}
	return path, cfg, nil
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
			log.Info("SIGHUP: config reloaded", "file", path, "vmsAdded", plan.VMs.Added, "vmsChanged", plan.VMs.Changed,
				"vmsRemoved", plan.VMs.Removed, "exposuresAdded", plan.Exposures.Added,
				"exposuresChanged", plan.Exposures.Changed, "exposuresRemoved", plan.Exposures.Removed, "warnings", plan.Warnings)
			return
		}
	}
	log.Error("SIGHUP: reload rejected; desired state unchanged", "file", path, "err", err)
}
