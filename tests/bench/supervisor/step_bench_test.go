// Package supervisor_bench measures supervisor.Engine.Step latency with
// 1,000 VMs, 100 of them wedged in slow operations, against a baseline of
// the same 1,000 VMs all idle, measured in the same run.
package supervisor_bench

import (
	"context"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"slices"
	"syscall"
	"testing"
	"time"

	"go.uber.org/goleak"

	"github.com/brokkr/brokkr/supervisor"
)

func TestMain(m *testing.M) { goleak.VerifyTestMain(m) }

const (
	totalVMs  = 1000
	wedgedVMs = 100
	samples   = 300 // Steps measured per benchmark iteration
)

// benchHV is an in-process Hypervisor: every instance is one shared real
// process (so the engine's pidfd watchers are real), and Start returns at
// once. Nothing here is slow except what the images stage wedges.
type benchHV struct{ inst supervisor.Instance }

func (h *benchHV) Kind() string { return "bench" }
func (h *benchHV) Start(ctx context.Context, lc supervisor.LaunchConfig) (supervisor.Instance, error) {
	return h.inst, nil
}
func (h *benchHV) Adopt(context.Context, supervisor.Instance) error { return nil }
func (h *benchHV) Info(context.Context, supervisor.Instance) (supervisor.VMState, error) {
	return supervisor.VMRunning, nil
}
func (h *benchHV) Stop(context.Context, supervisor.Instance, time.Duration) error { return nil }
func (h *benchHV) Suspend(context.Context, supervisor.Instance, string, func() error) error {
	return errors.New("the benchmark's hypervisor does not suspend")
}
func (h *benchHV) Restore(context.Context, supervisor.LaunchConfig, string) (supervisor.Instance, error) {
	return supervisor.Instance{}, errors.New("the benchmark's hypervisor does not restore")
}
func (h *benchHV) Continue(context.Context, supervisor.Instance) error { return nil }

// wedgeImages blocks every fetch of a kernel named "wedged" until release.
type wedgeImages struct {
	release chan struct{}
	entered chan struct{}
}

func (w *wedgeImages) Fetch(ctx context.Context, src supervisor.Source, progress func(int64, int64)) (string, error) {
	if src.Location != "wedged" {
		return src.Location, nil
	}
	progress(1, 3)
	w.entered <- struct{}{}
	select {
	case <-w.release:
	case <-ctx.Done():
	}
	return "", ctx.Err()
}

func (w *wedgeImages) PrepareDisk(context.Context, string, string, int64) error { return nil }

func BenchmarkStep(b *testing.B) {
	b.Run("baseline-1000-idle", func(b *testing.B) { benchStep(b, 0) })
	b.Run("1000-with-100-wedged", func(b *testing.B) { benchStep(b, wedgedVMs) })
}

func benchStep(b *testing.B, wedged int) {
	sleeper := exec.Command("sleep", "3600")
	sleeper.SysProcAttr = &syscall.SysProcAttr{Setsid: true}
	if err := sleeper.Start(); err != nil {
		b.Fatal(err)
	}
	defer func() { sleeper.Process.Kill(); sleeper.Wait() }()
	inst, err := supervisor.Identify(sleeper.Process.Pid)
	if err != nil {
		b.Fatal(err)
	}
	base := "/dev/shm" // records are fsynced: keep the setup off the shared disk
	if _, err := os.Stat(base); err != nil {
		base = ""
	}
	state, _ := os.MkdirTemp(base, "brk-bench-state")
	run, _ := os.MkdirTemp(base, "brk-bench-run")
	defer os.RemoveAll(state)
	defer os.RemoveAll(run)
	kernel := state + "/vmlinuz"
	os.WriteFile(kernel, nil, 0o600)

	images := &wedgeImages{release: make(chan struct{}), entered: make(chan struct{}, totalVMs)}
	defer close(images.release)
	eng, err := supervisor.NewEngine(supervisor.Config{StateDir: state, RunDir: run, Hypervisor: &benchHV{inst: inst}, Images: images})
	if err != nil {
		b.Fatal(err)
	}
	defer eng.Stop()

	desired := make([]supervisor.VMSpec, totalVMs)
	for i := range desired {
		desired[i] = supervisor.VMSpec{Name: fmt.Sprintf("vm-%04d", i), CPUs: 1, MemoryMiB: 64,
			Kernel: supervisor.Source{Location: kernel}, Power: supervisor.PowerRunning, Restart: supervisor.RestartAlways}
	}
	// First the healthy VMs come up...
	healthy := desired[:totalVMs-wedged]
	waitUntil(b, eng, healthy, func(r supervisor.Report) bool {
		n := 0
		for _, v := range r.VMs {
			if v.Phase == supervisor.PhaseRunning {
				n++
			}
		}
		return n == len(healthy)
	})
	// ...then the rest wedge inside their image download.
	for i := totalVMs - wedged; i < totalVMs; i++ {
		desired[i].Kernel.Location = "wedged"
	}
	eng.Step(context.Background(), desired)
	for range wedged {
		<-images.entered
	}

	lat := make([]time.Duration, 0, samples*b.N)
	b.ResetTimer()
	for i := 0; i < b.N; i++ {
		for s := 0; s < samples; s++ {
			// Wedged VMs get a new spec every Step: deliveries to busy
			// workers are part of what is measured.
			for j := totalVMs - wedged; j < totalVMs; j++ {
				desired[j].CPUs = 1 + s%2
			}
			t0 := time.Now()
			r := eng.Step(context.Background(), desired)
			lat = append(lat, time.Since(t0))
			if len(r.VMs) != totalVMs {
				b.Fatalf("report has %d rows, want %d", len(r.VMs), totalVMs)
			}
		}
	}
	b.StopTimer()
	slices.Sort(lat)
	pct := func(p float64) float64 { return float64(lat[int(p*float64(len(lat)-1))].Microseconds()) / 1000 }
	b.ReportMetric(pct(0.50), "p50-ms")
	b.ReportMetric(pct(0.99), "p99-ms")
	b.ReportMetric(float64(samples), "steps/op")
}

func waitUntil(b *testing.B, eng *supervisor.Engine, desired []supervisor.VMSpec, ok func(supervisor.Report) bool) {
	deadline := time.Now().Add(2 * time.Minute)
	for time.Now().Before(deadline) {
		if ok(eng.Step(context.Background(), desired)) {
			return
		}
		time.Sleep(50 * time.Millisecond)
	}
	b.Fatal("VMs never came up")
}
