package qemu

import (
	"context"
	"io"
	"log/slog"
	"net"
	"os"
	"path/filepath"
	"slices"
	"strconv"
	"syscall"
	"testing"
	"time"

	"github.com/brokkr/brokkr/internal/nstest"
	"github.com/brokkr/brokkr/supervisor"
)

// BenchmarkGuestBoot measures, for each machine/accelerator, the time from
// Start to the guest answering HTTP on :8080 from the host side of its
// bridge (BROKKR_BOOT_RUNS boots each, default 5; the median is reported).
// "auto" is what the daemon does by default: try KVM, fall back to TCG; a
// fresh backend per boot so every run pays the KVM attempt.
//
//	go test -run '^$' -bench GuestBoot -benchtime 1x ./supervisor/qemu/
func BenchmarkGuestBoot(b *testing.B) {
	nstest.RequireRoot(b)
	img := qemuGuest(b)
	runs := 5
	if v, err := strconv.Atoi(os.Getenv("BROKKR_BOOT_RUNS")); err == nil && v > 0 {
		runs = v
	}
	configs := []struct {
		name    string
		machine string
		accel   string
	}{
		{"q35-tcg", MachineQ35, AccelTCG},
		{"microvm-tcg", MachineMicroVM, AccelTCG},
		{"q35-auto", MachineQ35, AccelAuto},
	}
	// Rounds interleave the configurations, so load from other processes on
	// this shared machine falls on all of them alike.
	gn := newGuestNet(b)
	ready := make([][]float64, len(configs))
	started := make([][]float64, len(configs))
	notes := make([]string, len(configs))
	for i := 0; i < runs; i++ {
		for j, c := range configs {
			be := New("", WithNetNS(gn.NS.Path), WithMachine(c.machine), WithAccel(c.accel), WithConsoleFile(),
				WithLogger(slog.New(slog.NewTextHandler(io.Discard, nil))))
			s, r := bootOnce(b, be, gn, img, c.name+strconv.Itoa(i))
			started[j], ready[j] = append(started[j], s.Seconds()), append(ready[j], r.Seconds())
			notes[j] = be.KVMDisabledReason()
		}
	}
	for j, c := range configs {
		r, s := ready[j], started[j]
		slices.Sort(r)
		slices.Sort(s)
		b.Logf("%-12s Start->port median %.2f s (min %.2f, max %.2f, n=%d); Start returned after median %.3f s; accel note: %q",
			c.name, r[len(r)/2], r[0], r[len(r)-1], len(r), s[len(s)/2], notes[j])
		b.ReportMetric(r[len(r)/2], c.name+"-s-to-port-median")
	}
}

// bootOnce starts a guest, waits for :8080, and stops it.
func bootOnce(b *testing.B, be *Backend, gn *guestNet, img guestImage, name string) (started, ready time.Duration) {
	dir := b.TempDir()
	run, err := os.MkdirTemp("", "brkqm")
	if err != nil {
		b.Fatal(err)
	}
	defer os.RemoveAll(run)
	cfg := supervisor.LaunchConfig{
		Name: name, Dir: filepath.Join(dir, "vm"), RunDir: run, CPUs: 1, MemoryMiB: 256,
		Kernel: img.Kernel, Initramfs: img.Initramfs, Tap: gn.Tap, MAC: gn.MAC,
		ConsoleLog: filepath.Join(dir, "vm", "console.log"),
	}
	ctx, cancel := context.WithTimeout(context.Background(), 3*time.Minute)
	defer cancel()
	t0 := time.Now()
	inst, err := be.Start(ctx, cfg)
	if err != nil {
		b.Fatal(err)
	}
	started = time.Since(t0)
	var console *consoleWatch
	if inst.Console != nil {
		console = newConsoleWatch(inst.Console, "") // read, as the engine does
	}
	defer func() {
		_ = be.Stop(ctx, inst, 10*time.Second)
		_, _ = syscall.Wait4(inst.PID, nil, 0, nil)
		if console != nil {
			console.close()
		}
	}()
	for ctx.Err() == nil {
		if gn.dialGuest("tcp", "8080", func(c net.Conn) error { _, err := httpGet(c); return err }) == nil {
			return started, time.Since(t0)
		}
		time.Sleep(20 * time.Millisecond)
	}
	b.Fatalf("%s: guest never answered; console:\n%s", name, readFile(cfg.ConsoleLog))
	return
}
