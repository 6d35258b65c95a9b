package qemu

import (
	"context"
	"log/slog"
	"net"
	"os"
	"path/filepath"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/brokkr/brokkr/internal/nstest"
	"github.com/brokkr/brokkr/supervisor"
	"github.com/brokkr/brokkr/supervisor/images"
)

// qemuProcsFor lists the live qemu processes whose command line names dir.
func qemuProcsFor(dir string) []int { return nstest.LiveProcs("qemu-system", dir) }

// The engine drives a real guest through this backend: it boots and
// serves, survives an engine restart (the new engine adopts the same
// process, no second qemu), is restarted after kill -9, and is powered off
// when desired stopped.
func TestEngineWithRealGuest(t *testing.T) {
	nstest.RequireRoot(t)
	img := qemuGuest(t)
	gn := newGuestNet(t)
	logger := slog.New(slog.NewTextHandler(testWriter{t}, &slog.HandlerOptions{Level: slog.LevelInfo}))
	b := New("", WithNetNS(gn.NS.Path), WithAccel(AccelTCG), WithLogger(logger))
	state := t.TempDir()
	run, err := os.MkdirTemp("", "brkqm")
	require.NoError(t, err)
	t.Cleanup(func() {
		for _, pid := range qemuProcsFor(run) {
			_ = syscall.Kill(pid, syscall.SIGKILL)
			_, _ = syscall.Wait4(pid, nil, 0, nil)
		}
		os.RemoveAll(run)
	})
	cache, err := images.New(state, images.WithLogger(logger))
	require.NoError(t, err)
	newEngine := func() *supervisor.Engine {
		e, err := supervisor.NewEngine(supervisor.Config{StateDir: state, RunDir: run, Hypervisor: b, Images: cache, Logger: logger})
		require.NoError(t, err)
		return e
	}
	spec := supervisor.VMSpec{
		Name: "web", CPUs: 1, MemoryMiB: 256,
		Kernel:    supervisor.Source{Location: img.Kernel},
		Initramfs: &supervisor.Source{Location: img.Initramfs},
		Power:     supervisor.PowerRunning, Restart: supervisor.RestartAlways,
		Tap: gn.Tap, MAC: gn.MAC,
	}
	waitRow := func(e *supervisor.Engine, spec supervisor.VMSpec, ok func(supervisor.VMStatus) bool) supervisor.VMStatus {
		t.Helper()
		var last supervisor.VMStatus
		deadline := time.Now().Add(2 * time.Minute)
		for time.Now().Before(deadline) {
			for _, r := range e.Step(context.Background(), []supervisor.VMSpec{spec}).VMs {
				if r.Name == spec.Name {
					last = r
					if ok(r) {
						return r
					}
				}
			}
			time.Sleep(50 * time.Millisecond)
		}
		t.Fatalf("row never matched; last %+v", last)
		return last
	}
	reach := func() {
		t.Helper()
		require.Eventually(t, func() bool {
			return gn.dialGuest("tcp", "8080", func(c net.Conn) error { _, err := httpGet(c); return err }) == nil
		}, 90*time.Second, 50*time.Millisecond, "guest never answered")
	}

	// The guest answers on 8080 before it prints READY (init starts httpd,
	// then waits for acpid), and its console reaches the log later still
	// (the serial port is slow under TCG). So the log is checked by waiting
	// for the line, never right after the guest answered.
	console := filepath.Join(state, "vms", "web", "console.log")
	logged := func(n int) {
		t.Helper()
		require.Eventually(t, func() bool { return strings.Count(readFile(console), "BROKKR-GUEST-READY") >= n },
			60*time.Second, 50*time.Millisecond, "READY #%d never reached console.log; it ends:\n%s", n, tail(readFile(console), 5))
	}

	e1 := newEngine()
	first := waitRow(e1, spec, func(r supervisor.VMStatus) bool { return r.Phase == supervisor.PhaseRunning })
	reach()
	// Before the daemon goes away: what the guest prints while no engine
	// is connected is lost by design (the console socket has no reader).
	logged(1)
	e1.Stop() // the daemon goes away; the VM stays

	e2 := newEngine()
	defer e2.Stop()
	adopted := waitRow(e2, spec, func(r supervisor.VMStatus) bool { return r.Phase == supervisor.PhaseRunning })
	assert.Equal(t, first.PID, adopted.PID, "adopted, not restarted")
	assert.Equal(t, []int{first.PID}, qemuProcsFor(run), "exactly one qemu for the VM")
	reach()

	require.NoError(t, syscall.Kill(first.PID, syscall.SIGKILL))
	again := waitRow(e2, spec, func(r supervisor.VMStatus) bool {
		return r.Phase == supervisor.PhaseRunning && r.PID != first.PID && r.PID != 0
	})
	assert.Equal(t, 1, again.Restarts)
	reach()

	// The restarted guest's console reached the engine's log too.
	logged(2)

	spec.Power = supervisor.PowerStopped
	t0 := time.Now()
	waitRow(e2, spec, func(r supervisor.VMStatus) bool { return r.Phase == supervisor.PhaseStopped })
	assert.Empty(t, qemuProcsFor(run), "powered off")
	// The default grace is 30 s: a stop well inside it was the guest
	// powering off on the button, not the escalation.
	assert.Less(t, time.Since(t0), 10*time.Second)
	// The console copier outlives the stop request, so the guest's last
	// words reach the log.
	assert.Contains(t, readFile(console), "power button, powering off")
}
