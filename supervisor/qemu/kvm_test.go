package qemu

import (
	"context"
	"log/slog"
	"net"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/brokkr/brokkr/internal/nstest"
)

// Under a /dev/kvm that runs qemu but not the guest (PVM here: stock
// kernels crawl through decompression, then die on an emulation failure),
// the launch is given up after the probe window and the VM comes up under
// TCG; the backend then stays on TCG. -cpu host,-arch-capabilities gets
// qemu past its start-up MSR check, so the guest really runs under KVM
// first. On a host with working KVM the guest simply boots under KVM.
func TestKVMProbeFallsBackToTCG(t *testing.T) {
	nstest.RequireRoot(t)
	if err := kvmUsable(); err != nil {
		t.Skipf("no usable /dev/kvm (%v): nothing to fall back from", err)
	}
	img := qemuGuest(t)
	gn := newGuestNet(t)
	b := New("", WithNetNS(gn.NS.Path), WithAccel(AccelAuto), WithKVMCPU("host,-arch-capabilities"),
		WithKVMProbeWindow(2*time.Second), WithLogger(slog.New(slog.NewTextHandler(testWriter{t}, nil))))
	cfg := guestConfig(t, img, "kvmprobe", 256)
	cfg.Tap, cfg.MAC = gn.Tap, gn.MAC
	ctx, cancel := context.WithTimeout(t.Context(), 3*time.Minute)
	defer cancel()
	t0 := time.Now()
	inst, err := b.Start(ctx, cfg)
	require.NoError(t, err)
	killAtCleanup(t, inst, cfg.ConsoleLog)
	reason := b.KVMDisabledReason()
	t.Logf("Start took %s; KVM disabled reason: %q", time.Since(t0).Round(time.Millisecond), reason)
	qlog := readFile(filepath.Join(cfg.Dir, "qemu.log"))
	if _, err := os.Stat("/sys/module/kvm_pvm"); err == nil {
		// This machine: the fallback must have happened, for a stated reason.
		require.NotEmpty(t, reason, "PVM cannot run a stock kernel; the backend must have fallen back")
		assert.True(t, strings.Contains(reason, "printed nothing") || strings.Contains(reason, "internal error"), reason)
		assert.Contains(t, qlog, "launch (kvm)")
		assert.Contains(t, qlog, "launch (tcg)")
		cmdline, _ := os.ReadFile("/proc/" + itoa(inst.PID) + "/cmdline")
		assert.Contains(t, string(cmdline), "tcg", "the running process is the TCG relaunch")
		// Remembered: the next launch goes straight to TCG.
		accel, why := b.pickAccel()
		assert.Equal(t, AccelTCG, accel)
		assert.Equal(t, reason, why)
	}
	require.Eventually(t, func() bool {
		return gn.dialGuest("tcp", "8080", func(c net.Conn) error { _, err := httpGet(c); return err }) == nil
	}, 90*time.Second, 50*time.Millisecond, "guest never answered; console:\n%s", readFile(cfg.ConsoleLog))
	t.Logf("guest answered %s after Start was called", time.Since(t0).Round(time.Millisecond))
	require.NoError(t, b.Stop(ctx, inst, 20*time.Second))
}

func itoa(i int) string { return strconv.Itoa(i) }
