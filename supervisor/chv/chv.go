// Package chv runs guests under cloud-hypervisor: one VMM process per VM,
// started with only --api-socket and then driven through its REST API in
// kata's order (ping, create, info, boot, info).
package chv

import (
	"context"
	"errors"
	"fmt"
	"net/http"
	"net/url"
	"os"
	"os/exec"
	"path/filepath"
	"syscall"
	"time"

	"github.com/brokkr/brokkr/supervisor"
)

// Backend is the cloud-hypervisor supervisor.Hypervisor.
type Backend struct {
	path string
	// ForceWait is how long each forced stop step (vmm.shutdown, SIGTERM)
	// is given before the next, harder one. Default 3 s.
	ForceWait time.Duration
	// PowerButtonEvery is how often Stop presses the power button again
	// while the guest runs (supervisor.PowerButtonEvery when 0).
	PowerButtonEvery time.Duration
}

var _ supervisor.Hypervisor = (*Backend)(nil)

// New returns a backend running the cloud-hypervisor binary at path ("" =
// looked up in PATH when a VM starts).
func New(path string) *Backend { return &Backend{path: path, ForceWait: 3 * time.Second} }

// Kind implements supervisor.Hypervisor.
func (b *Backend) Kind() string { return "cloud-hypervisor" }

// Socket names within LaunchConfig.RunDir.
const (
	APISocketName    = "api.sock"
	SerialSocketName = "serial.sock"
	LogName          = "cloud-hypervisor.log"
)

func (b *Backend) binary() (string, error) {
	if b.path != "" {
		return b.path, nil
	}
	p, err := exec.LookPath("cloud-hypervisor")
	if err != nil {
		return "", fmt.Errorf("cloud-hypervisor binary: %w", err)
	}
	return p, nil
}

// VMConfigFor builds the complete vm.create body for a launch.
func VMConfigFor(lc supervisor.LaunchConfig) *VMConfig {
	cfg := &VMConfig{
		CPUs:    CPUsConfig{BootVCPUs: lc.CPUs, MaxVCPUs: lc.CPUs},
		Memory:  MemoryConfig{Size: int64(lc.MemoryMiB) << 20},
		Payload: PayloadConfig{Kernel: lc.Kernel, Initramfs: lc.Initramfs, Cmdline: lc.Cmdline},
		RNG:     RNGConfig{Src: "/dev/urandom"},
		// The serial port goes to a socket the engine reads into a size-capped
		// console.log (cloud-hypervisor's File mode truncates on open and
		// cannot be capped); the virtio console is off.
		Serial:  ConsoleConfig{Mode: "Socket", Socket: filepath.Join(lc.RunDir, SerialSocketName)},
		Console: ConsoleConfig{Mode: "Off"},
	}
	if lc.DiskPath != "" {
		cfg.Disks = []DiskConfig{{Path: lc.DiskPath, ID: "disk0"}}
	}
	if lc.Tap != "" {
		n := NetConfig{Tap: lc.Tap, ID: "net0", NumQueues: 2, QueueSize: 256}
		if lc.MAC != nil {
			n.MAC = lc.MAC.String()
		}
		cfg.Net = []NetConfig{n}
	}
	return cfg
}

// Start launches cloud-hypervisor in its own session (it outlives the
// daemon), waits for its API, creates and boots the VM, and returns once
// vm.info says Running. On any failure the process it started is killed.
func (b *Backend) Start(ctx context.Context, lc supervisor.LaunchConfig) (supervisor.Instance, error) {
	return b.launch(ctx, lc, func(c *client) error {
		if err := c.create(ctx, VMConfigFor(lc)); err != nil {
			return err
		}
		if err := expectState(ctx, c, "Created"); err != nil {
			return err
		}
		if err := c.put(ctx, "vm.boot"); err != nil {
			return err
		}
		return expectState(ctx, c, "Running")
	})
}

// Restore implements supervisor.Hypervisor: a new VMM, then vm.restore from
// the snapshot directory; the guest stays paused until Continue. The
// snapshot names the tap, which is still the VM's own (the old VMM is gone,
// so it is free to open).
func (b *Backend) Restore(ctx context.Context, lc supervisor.LaunchConfig, dir string) (supervisor.Instance, error) {
	return b.launch(ctx, lc, func(c *client) error {
		if err := c.do(ctx, http.MethodPut, "vm.restore", RestoreConfig{SourceURL: fileURL(dir)}, nil, http.StatusNoContent, http.StatusOK); err != nil {
			return err
		}
		return expectState(ctx, c, "Paused")
	})
}

// launch starts the VMM with only its API socket, waits for the API, and
// runs setup (which makes the guest) on it. On any failure the process is
// killed and reaped.
func (b *Backend) launch(ctx context.Context, lc supervisor.LaunchConfig, setup func(*client) error) (inst supervisor.Instance, err error) {
	bin, err := b.binary()
	if err != nil {
		return inst, err
	}
	if err := os.MkdirAll(lc.RunDir, 0o700); err != nil {
		return inst, err
	}
	if err := os.MkdirAll(lc.Dir, 0o700); err != nil {
		return inst, err
	}
	apiSock := filepath.Join(lc.RunDir, APISocketName)
	serialSock := filepath.Join(lc.RunDir, SerialSocketName)
	for _, s := range []string{apiSock, serialSock} {
		// Releases before ~v54 fail with AddrInUse on a socket left by a
		// crash; we remove it, but only once a connect proves it is dead.
		if err := supervisor.RemoveStaleSocket(s); err != nil {
			return inst, err
		}
	}
	logf, err := os.OpenFile(filepath.Join(lc.Dir, LogName), os.O_WRONLY|os.O_CREATE|os.O_APPEND, 0o640)
	if err != nil {
		return inst, err
	}
	defer logf.Close()
	cmd := exec.Command(bin, "--api-socket", "path="+apiSock)
	cmd.Stdout, cmd.Stderr = logf, logf
	cmd.Dir = lc.Dir
	// Setsid and no Pdeathsig: the VMM must survive the daemon.
	cmd.SysProcAttr = &syscall.SysProcAttr{Setsid: true}
	if err := cmd.Start(); err != nil {
		return inst, fmt.Errorf("start %s: %w", bin, err)
	}
	pid := cmd.Process.Pid
	// The engine reaps the process through its pidfd; Go must not.
	cmd.Process.Release()
	defer func() {
		if err != nil {
			killAndReap(pid)
		}
	}()
	if lc.Place != nil {
		if err = lc.Place(pid); err != nil {
			return inst, err
		}
	}
	inst, err = supervisor.Identify(pid)
	if err != nil {
		return inst, fmt.Errorf("identify pid %d: %w", pid, err)
	}
	inst.APISocket, inst.ConsoleSocket = apiSock, serialSock
	pfd, err := supervisor.OpenPidfd(inst)
	if err != nil {
		return inst, err
	}
	defer pfd.Close()

	c := newClient(apiSock)
	defer c.close()
	if err := b.waitAPI(ctx, c, pfd, inst.PID); err != nil {
		return inst, err
	}
	// Read the executable only now: a wrapper (a shell script, a nix
	// launcher) has exec'd the real VMM by the time the API answers.
	if inst.Exe, err = supervisor.ProcExe(pid); err != nil {
		return inst, err
	}
	if err := setup(c); err != nil {
		return inst, err
	}
	return inst, nil
}

// waitAPI pings until the VMM answers with its own pid, the process dies,
// or ctx ends.
func (b *Backend) waitAPI(ctx context.Context, c *client, pfd *supervisor.Pidfd, pid int) error {
	delay := 5 * time.Millisecond
	for {
		p, err := c.ping(ctx)
		if err == nil {
			if p.PID != 0 && p.PID != pid {
				return fmt.Errorf("vmm.ping: API socket answered by pid %d, not %d", p.PID, pid)
			}
			return nil
		}
		if pfd.Exited() {
			return fmt.Errorf("cloud-hypervisor exited before its API answered (see %s)", LogName)
		}
		select {
		case <-ctx.Done():
			return fmt.Errorf("vmm.ping: %w (last: %v)", ctx.Err(), err)
		case <-time.After(delay):
		}
		delay = min(2*delay, 100*time.Millisecond)
	}
}

func expectState(ctx context.Context, c *client, want string) error {
	i, err := c.info(ctx)
	if err != nil {
		return err
	}
	if i.State != want {
		return fmt.Errorf("vm.info: state %q, want %q", i.State, want)
	}
	return nil
}

func killAndReap(pid int) {
	_ = syscall.Kill(pid, syscall.SIGKILL)
	var ws syscall.WaitStatus
	_, _ = syscall.Wait4(pid, &ws, 0, nil)
}

// Adopt proves inst is still the VMM that was recorded: same pid, start time
// and executable, and its API answering with that pid while a guest runs.
// A VMM that is alive but runs no guest (the daemon died inside Start) is
// stopped, so that a fresh Start can take its place.
func (b *Backend) Adopt(ctx context.Context, inst supervisor.Instance) error {
	if err := supervisor.CheckIdentity(inst); err != nil {
		return err
	}
	c := newClient(inst.APISocket)
	defer c.close()
	p, err := c.ping(ctx)
	if err != nil {
		return err
	}
	if p.PID != inst.PID {
		return fmt.Errorf("vmm.ping on %s answers with pid %d, recorded %d", inst.APISocket, p.PID, inst.PID)
	}
	i, err := c.info(ctx)
	if err == nil && (i.State == "Running" || i.State == "Paused") {
		return nil
	}
	if err == nil {
		err = fmt.Errorf("vm.info: state %q", i.State)
	}
	_ = b.Stop(ctx, inst, time.Second)
	return fmt.Errorf("VMM pid %d runs no guest (%v); stopped it", inst.PID, err)
}

// Info reports the guest's state from vm.info.
func (b *Backend) Info(ctx context.Context, inst supervisor.Instance) (supervisor.VMState, error) {
	c := newClient(inst.APISocket)
	defer c.close()
	i, err := c.info(ctx)
	if err != nil {
		return "", err
	}
	switch i.State {
	case "Created":
		return supervisor.VMCreated, nil
	case "Running":
		return supervisor.VMRunning, nil
	case "Paused":
		return supervisor.VMPaused, nil
	default:
		return supervisor.VMShutdown, nil
	}
}

// Counters returns vm.counters (per-device counters).
func (b *Backend) Counters(ctx context.Context, inst supervisor.Instance) (map[string]map[string]int64, error) {
	c := newClient(inst.APISocket)
	defer c.close()
	return c.counters(ctx)
}

// Stop presses the power button (again every PowerButtonEvery: a guest still
// booting drops a press) and gives the guest grace to power off (the VMM
// exits with it); then stops the guest from the VMM side (vm.shutdown)
// and asks the VMM to exit (vmm.shutdown), then SIGTERM, then SIGKILL, each
// given ForceWait. Signals go through a pidfd so a reused pid is never hit.
func (b *Backend) Stop(ctx context.Context, inst supervisor.Instance, grace time.Duration) error {
	pfd, err := supervisor.OpenPidfd(inst)
	if err != nil {
		return nil // already gone
	}
	defer pfd.Close()
	c := newClient(inst.APISocket)
	defer c.close()
	wait := func(d time.Duration) bool {
		wctx, cancel := context.WithTimeout(ctx, d)
		defer cancel()
		return pfd.Wait(wctx) == nil
	}
	call := func(endpoint string, d time.Duration) error {
		cctx, cancel := context.WithTimeout(ctx, d)
		defer cancel()
		return c.put(cctx, endpoint)
	}
	force := b.ForceWait
	if force <= 0 {
		force = 3 * time.Second
	}
	var steps []error
	// A cancelled ctx (the daemon is shutting down) ends the escalation:
	// the VM is left as it is for the next daemon, never killed for it.
	exited, err := supervisor.PressPowerButton(grace, b.PowerButtonEvery,
		func() error { return call("vm.power-button", min(grace, 5*time.Second)) },
		wait, func() bool { return ctx.Err() != nil })
	if exited {
		return nil
	}
	if err != nil {
		steps = append(steps, err)
	}
	if ctx.Err() != nil {
		return ctx.Err()
	}
	// vm.shutdown may fail (404/405 when the guest never booted); the VMM
	// exit below is what matters.
	_ = call("vm.shutdown", force)
	if err := call("vmm.shutdown", force); err != nil {
		steps = append(steps, err)
	} else if wait(force) {
		return nil
	}
	if ctx.Err() != nil {
		return ctx.Err()
	}
	if err := pfd.Signal(syscall.SIGTERM); err == nil && wait(force) {
		return nil
	}
	if ctx.Err() != nil {
		return ctx.Err()
	}
	if err := pfd.Signal(syscall.SIGKILL); err != nil && !pfd.Exited() {
		return errors.Join(append(steps, fmt.Errorf("SIGKILL pid %d: %w", inst.PID, err))...)
	}
	if !wait(force) {
		return errors.Join(append(steps, fmt.Errorf("pid %d survived SIGKILL", inst.PID))...)
	}
	return nil
}

// fileURL is the file:// URL of a local directory, as vm.snapshot and
// vm.restore take it.
func fileURL(dir string) string { return (&url.URL{Scheme: "file", Path: dir}).String() }

// Suspend implements supervisor.Hypervisor: vm.pause, vm.snapshot into dir,
// saved, then the VMM is ended (vmm.shutdown, SIGTERM, SIGKILL: the guest is
// paused and its state on disk, so nothing is lost however it ends). A
// failure before that resumes the guest.
func (b *Backend) Suspend(ctx context.Context, inst supervisor.Instance, dir string, saved func() error) error {
	pfd, err := supervisor.OpenPidfd(inst)
	if err != nil {
		return fmt.Errorf("VMM pid %d: %w", inst.PID, err)
	}
	defer pfd.Close()
	c := newClient(inst.APISocket)
	defer c.close()
	i, err := c.info(ctx)
	if err != nil {
		return err
	}
	if i.State != "Paused" {
		if err := c.put(ctx, "vm.pause"); err != nil {
			return err
		}
	}
	err = c.do(ctx, http.MethodPut, "vm.snapshot", SnapshotConfig{DestinationURL: fileURL(dir)}, nil, http.StatusNoContent, http.StatusOK)
	if err == nil {
		err = saved()
	}
	if err != nil {
		return b.resumeAfter(c, err)
	}
	return b.end(ctx, pfd, c, inst)
}

// resumeAfter runs the guest again after a failed suspend, even when the
// caller's ctx has ended (a paused guest serves nobody), and returns cause
// (with the resume's own failure, if any).
func (b *Backend) resumeAfter(c *client, cause error) error {
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	if err := c.put(ctx, "vm.resume"); err != nil {
		return errors.Join(cause, fmt.Errorf("and the guest stays paused: %w", err))
	}
	return cause
}

// end ends a VMM whose guest is paused and saved: vmm.shutdown, then
// SIGTERM, then SIGKILL, each given ForceWait.
func (b *Backend) end(ctx context.Context, pfd *supervisor.Pidfd, c *client, inst supervisor.Instance) error {
	force := b.ForceWait
	if force <= 0 {
		force = 3 * time.Second
	}
	wait := func() bool {
		wctx, cancel := context.WithTimeout(ctx, force)
		defer cancel()
		return pfd.Wait(wctx) == nil
	}
	cctx, cancel := context.WithTimeout(ctx, force)
	err := c.put(cctx, "vmm.shutdown")
	cancel()
	if err == nil && wait() {
		return nil
	}
	if err := pfd.Signal(syscall.SIGTERM); err == nil && wait() {
		return nil
	}
	if err := pfd.Signal(syscall.SIGKILL); err != nil && !pfd.Exited() {
		return fmt.Errorf("SIGKILL pid %d: %w", inst.PID, err)
	}
	if !wait() {
		return fmt.Errorf("pid %d survived SIGKILL", inst.PID)
	}
	return nil
}

// Continue implements supervisor.Hypervisor: vm.resume of a paused guest.
// cloud-hypervisor has no call that sets the guest's clock: a restored
// guest's wall clock runs on from where it was paused until the guest's
// own NTP steps it (docs/ARCHITECTURE.md, "Suspend and resume").
func (b *Backend) Continue(ctx context.Context, inst supervisor.Instance) error {
	c := newClient(inst.APISocket)
	defer c.close()
	i, err := c.info(ctx)
	if err != nil {
		return err
	}
	switch i.State {
	case "Running":
		return nil
	case "Paused":
		if err := c.put(ctx, "vm.resume"); err != nil {
			return err
		}
		return expectState(ctx, c, "Running")
	}
	return fmt.Errorf("vm.info: state %q, want Paused", i.State)
}
