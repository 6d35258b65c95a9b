package main

import (
	"context"
	"fmt"
	"log/slog"
	"time"

	"github.com/brokkr/brokkr/daemon/api"
	"github.com/brokkr/brokkr/internal/spec"
	sd "github.com/coreos/go-systemd/v22/daemon"
)

// The systemd notify protocol is spoken through
// github.com/coreos/go-systemd/v22/daemon rather than a hand-written
// sd_notify: it handles abstract-namespace sockets ("@..."), the
// WATCHDOG_USEC/WATCHDOG_PID checks and unset-environment semantics the way
// libsystemd does, is small (no cgo, no D-Bus for this part) and the same
// module carries the D-Bus client the per-VM scopes will need. Without
// NOTIFY_SOCKET (not under systemd, or Type=simple) every call is a no-op.

// loopState is what the notifier reads from the daemon.
type loopState interface {
	FirstPass() <-chan struct{}
	LastPass() time.Time
	Status() api.Status
}

// statusLine is systemd's STATUS= (shown by systemctl status).
func statusLine(st api.Status) string {
	vms, running, failed := len(st.VMs), 0, 0
	for _, v := range st.VMs {
		switch spec.Phase(v.Phase) {
		case spec.PhaseRunning:
			running++
		case spec.PhaseFailed:
			failed++
		}
	}
	active, efailed := 0, 0
	for _, e := range st.Exposures {
		switch spec.ExposureState(e.State) {
		case spec.StateActive:
			active++
		case spec.StateFailed:
			efailed++
		}
	}
	s := fmt.Sprintf("%d/%d VMs running, %d/%d exposures active", running, vms, active, len(st.Exposures))
	if failed+efailed > 0 {
		s += fmt.Sprintf("; %d VMs and %d exposures failed", failed, efailed)
	}
	return s
}

func notify(log *slog.Logger, state string) {
	if _, err := sd.SdNotify(false, state); err != nil {
		log.Warn("sd_notify", "err", err)
	}
}

// notifySystemd sends READY=1 once the socket serves (the caller starts
// the API server first) and the first pass is done, so `systemctl start`
// returns with the host converged once; then a STATUS= line when it
// changes, and WATCHDOG=1 while the control loop keeps finishing passes: a
// loop stuck in a pass stops the pings and systemd restarts brokkrd (the
// VMs are untouched: KillMode=process).
func notifySystemd(ctx context.Context, d loopState, log *slog.Logger) {
	select {
	case <-ctx.Done():
		return
	case <-d.FirstPass():
	}
	last := statusLine(d.Status())
	notify(log, sd.SdNotifyReady+"\nSTATUS="+last)
	wd, err := sd.SdWatchdogEnabled(false)
	if err != nil {
		log.Warn("watchdog settings", "err", err)
	}
	every := time.Second
	if wd > 0 {
		every = min(every, wd/3)
	}
	t := time.NewTicker(every)
	defer t.Stop()
	for {
		select {
		case <-ctx.Done():
			return
		case <-t.C:
		}
		if s := statusLine(d.Status()); s != last {
			last = s
			notify(log, "STATUS="+s)
		}
		// A pass takes at most its engines' deadlines (10 s each); one not
		// finished for half the watchdog period is stuck.
		if wd > 0 && time.Since(d.LastPass()) < wd/2 {
			notify(log, sd.SdNotifyWatchdog)
		}
	}
}
