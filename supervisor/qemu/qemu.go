// Package qemu is the QEMU backend of the supervisor: it runs
// qemu-system-x86_64 with a direct kernel boot, virtio-net on the VM's tap,
// the serial console in a file and QMP on a unix socket in the VM's RunDir.
//
// KVM is used when it works. On hosts where /dev/kvm exists but cannot run
// the guest (no /dev/kvm, qemu refusing the CPU, nested or PVM "KVM" that
// stops with an emulation failure or crawls through decompression), the
// first launch is abandoned and relaunched under TCG, and the backend
// remembers it so later launches go straight to TCG.
package qemu

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"sync"
	"syscall"
	"time"

	"github.com/brokkr/brokkr/internal/nlsafe"
	"github.com/brokkr/brokkr/internal/procfs"
	"github.com/brokkr/brokkr/supervisor"
)

// Backend runs VMs as qemu-system-x86_64 processes. Safe for concurrent use.
type Backend struct {
	path        string
	machine     string
	accel       string
	netnsPath   string
	tscKHz      int64
	kvmCPU      string
	kvmWindow   time.Duration
	consoleFile bool
	qmpTimeout  time.Duration
	stopStepMax time.Duration
	log         *slog.Logger

	mu        sync.Mutex
	kvmBroken string // why KVM was given up in this process ("" = not given up)
	tcgWarned bool   // the TCG fallback has been logged once
}

var _ supervisor.Hypervisor = (*Backend)(nil)

// Option configures a Backend.
type Option func(*Backend)

// WithMachine picks the machine type: MachineQ35 (default) or MachineMicroVM.
// Both boot reliably under TCG here; microvm is ~13% faster to a serving
// guest (BENCHMARKS.md), but under TCG it depends on the host TSC rate read
// from /proc/cpuinfo, which hosts with frequency scaling misreport, so q35
// is the default.
func WithMachine(m string) Option { return func(b *Backend) { b.machine = m } }

// WithAccel picks the accelerator: AccelAuto (default), AccelKVM or AccelTCG.
// AccelKVM still falls back to TCG when KVM fails; AccelTCG never tries KVM.
func WithAccel(a string) Option { return func(b *Backend) { b.accel = a } }

// WithNetNS runs qemu inside the network namespace at path (e.g.
// /run/netns/NAME), where the VM's tap lives. "" (default) means the
// caller's own namespace.
func WithNetNS(path string) Option { return func(b *Backend) { b.netnsPath = path } }

// WithKVMProbeWindow is how long a KVM launch may go without the guest
// printing on its serial console before KVM is declared unusable (default 10 s;
// a working KVM guest prints in well under a second).
func WithKVMProbeWindow(d time.Duration) Option { return func(b *Backend) { b.kvmWindow = d } }

// WithKVMCPU sets the -cpu model for KVM launches (default "host"; TCG
// launches use qemu's default model).
func WithKVMCPU(model string) Option { return func(b *Backend) { b.kvmCPU = model } }

// WithConsoleFile has qemu write the serial console straight into
// LaunchConfig.ConsoleLog (the previous boot's kept as console.log.1): the
// log then also covers the time the daemon is down, but is not size-capped
// within a boot. By default the console is served on RunDir/console.sock
// (Instance.ConsoleSocket) and the engine copies it into a capped log.
func WithConsoleFile() Option { return func(b *Backend) { b.consoleFile = true } }

// WithLogger sets the logger (default slog.Default()).
func WithLogger(l *slog.Logger) Option { return func(b *Backend) { b.log = l } }

// New returns a backend running the qemu binary at path ("" = look up
// qemu-system-x86_64 in PATH at launch).
func New(path string, opts ...Option) *Backend {
	b := &Backend{
		path:        path,
		machine:     MachineQ35,
		accel:       AccelAuto,
		kvmCPU:      "host",
		kvmWindow:   10 * time.Second,
		qmpTimeout:  5 * time.Second,
		stopStepMax: 3 * time.Second,
		log:         slog.Default(),
	}
	for _, o := range opts {
		o(b)
	}
	if b.tscKHz == 0 {
		b.tscKHz = hostTSCKHz()
	}
	return b
}

// Kind implements supervisor.Hypervisor.
func (b *Backend) Kind() string { return "qemu" }

func (b *Backend) binary() (string, error) {
	p := b.path
	if p == "" {
		p = "qemu-system-x86_64"
	}
	full, err := exec.LookPath(p)
	if err != nil {
		return "", fmt.Errorf("qemu binary %q: %w", p, err)
	}
	return filepath.Abs(full)
}

// Paths inside a VM's directories.
func qmpSocket(cfg supervisor.LaunchConfig) string { return filepath.Join(cfg.RunDir, "qmp.sock") }
func pidFile(cfg supervisor.LaunchConfig) string   { return filepath.Join(cfg.RunDir, "qemu.pid") }
func consoleSocket(cfg supervisor.LaunchConfig) string {
	return filepath.Join(cfg.RunDir, "console.sock")
}
func qemuLog(cfg supervisor.LaunchConfig) string { return filepath.Join(cfg.Dir, "qemu.log") }

// Start implements supervisor.Hypervisor: it launches qemu, waits until QMP
// says the guest runs, and returns the instance. The process is not reaped
// here (the engine watches and reaps it); on error everything started is
// killed and reaped.
func (b *Backend) Start(ctx context.Context, cfg supervisor.LaunchConfig) (supervisor.Instance, error) {
	if err := validateLaunch(cfg); err != nil {
		return supervisor.Instance{}, err
	}
	if b.machine != MachineQ35 && b.machine != MachineMicroVM {
		return supervisor.Instance{}, fmt.Errorf("qemu: machine %q: want %s or %s", b.machine, MachineQ35, MachineMicroVM)
	}
	bin, err := b.binary()
	if err != nil {
		return supervisor.Instance{}, err
	}
	for _, d := range []string{cfg.Dir, cfg.RunDir} {
		if err := os.MkdirAll(d, 0o700); err != nil {
			return supervisor.Instance{}, fmt.Errorf("qemu: vm %s: %w", cfg.Name, err)
		}
	}
	sock := qmpSocket(cfg)
	if len(sock) >= 108 {
		return supervisor.Instance{}, fmt.Errorf("qemu: vm %s: QMP socket path %q is %d bytes, the limit is 107 (use a shorter RunDir)", cfg.Name, sock, len(sock))
	}
	if socketInUse(sock) {
		return supervisor.Instance{}, fmt.Errorf("qemu: vm %s: %s is served by a running process; refusing to start a second qemu", cfg.Name, sock)
	}
	// Nobody serves it: a leftover of a dead qemu, like its console socket.
	_ = os.Remove(sock)
	_ = os.Remove(consoleSocket(cfg))

	accel, why := b.pickAccel()
	if why != "" {
		b.mu.Lock()
		warn := !b.tcgWarned
		b.tcgWarned = true
		b.mu.Unlock()
		if warn {
			b.log.Warn("qemu: using TCG (software emulation), KVM is unusable", "vm", cfg.Name, "reason", why)
		}
	}
	inst, err := b.launch(ctx, bin, cfg, accel)
	if err == nil || accel != AccelKVM {
		return inst, err
	}
	var kf *kvmFailure
	if !errors.As(err, &kf) {
		return inst, err
	}
	b.log.Warn("qemu: KVM failed for this guest; relaunching under TCG (software emulation)",
		"vm", cfg.Name, "reason", kf.reason)
	inst, err = b.launch(ctx, bin, cfg, AccelTCG)
	if err != nil {
		// TCG failed too: the guest or the config is at fault, not
		// (necessarily) KVM, so KVM is not given up.
		return inst, fmt.Errorf("%w (under KVM before: %s)", err, kf.reason)
	}
	// Only TCG works: stay on it for the life of this backend.
	b.mu.Lock()
	b.kvmBroken, b.tcgWarned = kf.reason, true
	b.mu.Unlock()
	b.log.Warn("qemu: using TCG from now on", "reason", kf.reason)
	return inst, nil
}

// kvmFailure says a launch under KVM failed in a way TCG may not.
type kvmFailure struct{ reason string }

func (e *kvmFailure) Error() string { return "KVM unusable: " + e.reason }

// pickAccel resolves the configured accelerator; why explains a fallback to TCG.
func (b *Backend) pickAccel() (accel, why string) {
	if b.accel == AccelTCG {
		return AccelTCG, ""
	}
	b.mu.Lock()
	broken := b.kvmBroken
	b.mu.Unlock()
	if broken != "" {
		return AccelTCG, broken
	}
	if err := kvmUsable(); err != nil {
		return AccelTCG, err.Error()
	}
	return AccelKVM, ""
}

// launch runs qemu once with the given accelerator.
func (b *Backend) launch(ctx context.Context, bin string, cfg supervisor.LaunchConfig, accel string) (supervisor.Instance, error) {
	plan := launchPlan{Machine: b.machine, Accel: accel, CPU: b.kvmCPU, TSCKHz: b.tscKHz, QMPSocket: qmpSocket(cfg), PIDFile: pidFile(cfg)}
	if !b.consoleFile {
		plan.ConsoleSocket = consoleSocket(cfg)
	}
	if b.consoleFile && cfg.ConsoleLog != "" {
		// One previous boot's console is kept for post-mortems.
		if fi, err := os.Stat(cfg.ConsoleLog); err == nil && fi.Size() > 0 {
			_ = os.Rename(cfg.ConsoleLog, cfg.ConsoleLog+".1")
		}
	}
	logf, err := os.OpenFile(qemuLog(cfg), os.O_CREATE|os.O_WRONLY|os.O_APPEND, 0o600)
	if err != nil {
		return supervisor.Instance{}, fmt.Errorf("qemu: vm %s: %w", cfg.Name, err)
	}
	defer logf.Close()
	logStart, _ := logf.Seek(0, 2)
	args := buildArgs(cfg, plan)
	fmt.Fprintf(logf, "--- %s launch (%s): %s %s\n", time.Now().UTC().Format(time.RFC3339), accel, bin, strings.Join(args, " "))

	cmd := exec.Command(bin, args...)
	cmd.Stdin = nil
	cmd.Stdout, cmd.Stderr = logf, logf
	// Own session: the VM outlives the daemon and its terminal signals.
	// No Pdeathsig, for the same reason.
	cmd.SysProcAttr = &syscall.SysProcAttr{Setsid: true}
	if err := startIn(b.netnsPath, cmd); err != nil {
		return supervisor.Instance{}, fmt.Errorf("qemu: vm %s: start %s: %w", cfg.Name, bin, err)
	}
	pid := cmd.Process.Pid
	// The console is read from the start and the connection handed to the
	// engine as it is (Instance.Console): qemu serves one reader at a time
	// and drops what the guest prints while none is connected, so a reader
	// that let go for the engine's to connect lost what came between (in
	// an e2e run, the middle of the kernel's command line: "brokkr.nweb").
	var console *consoleWatch
	if plan.ConsoleSocket != "" {
		console, _ = watchConsole(ctx, plan.ConsoleSocket, cfg.ConsoleLog) // else the engine connects itself
	}
	fail := func(err error) (supervisor.Instance, error) {
		if console != nil {
			console.close()
		}
		_ = cmd.Process.Kill()
		_ = cmd.Wait()
		_ = os.Remove(plan.QMPSocket)
		if plan.ConsoleSocket != "" {
			_ = os.Remove(plan.ConsoleSocket)
		}
		return supervisor.Instance{}, err
	}
	if cfg.Place != nil {
		if err := cfg.Place(pid); err != nil {
			return fail(fmt.Errorf("qemu: vm %s: %w", cfg.Name, err))
		}
	}
	st, err := procfs.ReadProcStat(pid)
	var exe string
	if err == nil {
		exe, err = supervisor.ProcExe(pid) // a zombie has no exe link
	}
	if err != nil {
		// qemu already exited: say why. Under KVM that may be KVM's doing
		// (qemu refusing the host CPU); Start retries under TCG.
		detail := logTail(qemuLog(cfg), logStart)
		if accel == AccelKVM {
			return fail(&kvmFailure{reason: "qemu exited at start under KVM: " + detail})
		}
		return fail(fmt.Errorf("qemu: vm %s: qemu exited at start: %s", cfg.Name, detail))
	}
	inst := supervisor.Instance{PID: pid, StartTime: st.StartTime, Exe: exe, APISocket: plan.QMPSocket, ConsoleSocket: plan.ConsoleSocket}

	// QMP comes up once qemu has set the machine up; an exit before that is
	// a bad command line, a missing tap, or (under KVM) a CPU qemu refused.
	if err := b.waitQMP(ctx, inst, "running"); err != nil {
		detail := logTail(qemuLog(cfg), logStart)
		if accel == AccelKVM && !running(pid, st.StartTime) {
			return fail(&kvmFailure{reason: "qemu exited at start under KVM: " + detail})
		}
		return fail(fmt.Errorf("qemu: vm %s: %w; qemu.log: %s", cfg.Name, err, detail))
	}
	if accel == AccelKVM {
		if err := b.probeKVM(ctx, cfg, plan, inst, console, logStart); err != nil {
			return fail(err)
		}
	}
	if console != nil {
		inst.Console = console.handOver()
	}
	// The engine watches (pidfd) and reaps the process from here on.
	_ = cmd.Process.Release()
	return inst, nil
}

// waitQMP polls until QMP answers query-status with want ("running" after
// a boot, "paused" once an incoming state is loaded).
func (b *Backend) waitQMP(ctx context.Context, inst supervisor.Instance, want string) error {
	// A boot reports within 30 s; loading a state takes as long as its
	// size does, bounded by ctx.
	deadline := time.Now().Add(30 * time.Second)
	if want != "running" {
		deadline = time.Time{}
	}
	var last error
	for {
		if !running(inst.PID, inst.StartTime) {
			return fmt.Errorf("qemu exited during start")
		}
		if _, err := os.Stat(inst.APISocket); err == nil {
			qctx, cancel := context.WithTimeout(ctx, b.qmpTimeout)
			status, err := qmpStatus(qctx, inst.APISocket)
			cancel()
			if err == nil {
				if status == want {
					return nil
				}
				last = fmt.Errorf("guest status %q", status)
				if status == "internal-error" || status == "shutdown" || status == "guest-panicked" {
					return last
				}
			} else {
				last = err
			}
		}
		if ctx.Err() != nil {
			return fmt.Errorf("waiting for QMP: %w (last: %v)", ctx.Err(), last)
		}
		if !deadline.IsZero() && time.Now().After(deadline) {
			return fmt.Errorf("QMP did not report the guest %s within 30s (last: %v)", want, last)
		}
		select {
		case <-ctx.Done():
		case <-time.After(20 * time.Millisecond):
		}
	}
}

// probeKVM watches a KVM launch for the probe window. The vCPU stopping
// with an internal error (QMP status) or qemu exiting is a kvmFailure. When
// the guest's console is the serial port, the guest printing there proves
// KVM works, and silence for the whole window is a kvmFailure too (emulated
// "KVM" crawling through the kernel's decompressor); with the console
// elsewhere, silence proves nothing and KVM is trusted after the window.
func (b *Backend) probeKVM(ctx context.Context, cfg supervisor.LaunchConfig, plan launchPlan, inst supervisor.Instance, console *consoleWatch, logStart int64) error {
	onSerial := consoleOnSerial(kernelCmdline(cfg, plan))
	var printed func() bool
	switch {
	case !onSerial:
		printed = func() bool { return false }
	case plan.ConsoleSocket != "":
		if console == nil {
			return &kvmFailure{reason: "console socket: not connected"}
		}
		printed = console.printed
	case cfg.ConsoleLog != "":
		printed = func() bool {
			fi, err := os.Stat(cfg.ConsoleLog)
			return err == nil && fi.Size() > 0
		}
	default:
		onSerial, printed = false, func() bool { return false }
	}
	end := time.Now().Add(b.kvmWindow)
	for {
		if printed() {
			return nil
		}
		if !running(inst.PID, inst.StartTime) {
			return &kvmFailure{reason: "qemu exited during boot: " + logTail(qemuLog(cfg), logStart)}
		}
		qctx, cancel := context.WithTimeout(ctx, b.qmpTimeout)
		status, err := qmpStatus(qctx, inst.APISocket)
		cancel()
		if err == nil && status == "internal-error" {
			return &kvmFailure{reason: "vCPU stopped with a KVM internal error: " + logTail(qemuLog(cfg), logStart)}
		}
		if time.Now().After(end) {
			if !onSerial {
				return nil
			}
			return &kvmFailure{reason: fmt.Sprintf("the guest printed nothing on its serial console within %s under KVM", b.kvmWindow)}
		}
		select {
		case <-ctx.Done():
			return fmt.Errorf("qemu: vm %s: waiting for the guest under KVM: %w", cfg.Name, ctx.Err())
		case <-time.After(100 * time.Millisecond):
		}
	}
}

// consoleOnSerial reports whether the kernel's last console= is the first
// serial port (the last console= is /dev/console, where init prints).
func consoleOnSerial(cmdline string) bool {
	last := ""
	for _, a := range strings.Fields(cmdline) {
		if v, ok := strings.CutPrefix(a, "console="); ok {
			last = v
		}
	}
	return last == "ttyS0" || strings.HasPrefix(last, "ttyS0,")
}

// startIn starts cmd inside the network namespace at path ("" = ours). The
// child inherits the namespace of the thread that forks it, so the fork
// happens on a locked thread switched into the namespace.
func startIn(path string, cmd *exec.Cmd) error {
	return nlsafe.Do(path, cmd.Start)
}

// logTail is the end of what qemu wrote to its log since offset, on one line.
func logTail(path string, offset int64) string {
	b, err := os.ReadFile(path)
	if err != nil || offset > int64(len(b)) {
		return "(no qemu.log)"
	}
	b = b[offset:]
	// Skip our own launch line.
	if i := strings.IndexByte(string(b), '\n'); i >= 0 && strings.HasPrefix(string(b), "--- ") {
		b = b[i+1:]
	}
	if len(b) > 600 {
		b = b[len(b)-600:]
	}
	s := strings.Join(strings.Fields(string(b)), " ")
	if s == "" {
		return "(qemu.log empty)"
	}
	return s
}

// Adopt implements supervisor.Hypervisor: the recorded pid must still be the
// same qemu (start time, executable) and serve the recorded QMP socket.
func (b *Backend) Adopt(ctx context.Context, inst supervisor.Instance) error {
	st, err := procfs.ReadProcStat(inst.PID)
	if err != nil {
		return fmt.Errorf("qemu: pid %d is gone: %w", inst.PID, err)
	}
	if st.StartTime != inst.StartTime {
		return fmt.Errorf("qemu: pid %d was reused (start time %d, recorded %d)", inst.PID, st.StartTime, inst.StartTime)
	}
	if st.State == 'Z' || st.State == 'X' {
		return fmt.Errorf("qemu: pid %d has exited", inst.PID)
	}
	exe, err := supervisor.ProcExe(inst.PID)
	if err != nil {
		return fmt.Errorf("qemu: pid %d: %w", inst.PID, err)
	}
	if exe != inst.Exe {
		return fmt.Errorf("qemu: pid %d runs %s, recorded %s", inst.PID, exe, inst.Exe)
	}
	qctx, cancel := context.WithTimeout(ctx, b.qmpTimeout)
	defer cancel()
	peer, err := socketPeerPID(qctx, inst.APISocket)
	if err != nil {
		return fmt.Errorf("qemu: pid %d: QMP socket %s: %w", inst.PID, inst.APISocket, err)
	}
	if peer != inst.PID {
		return fmt.Errorf("qemu: QMP socket %s is served by pid %d, not %d", inst.APISocket, peer, inst.PID)
	}
	if _, err := qmpStatus(qctx, inst.APISocket); err != nil {
		return fmt.Errorf("qemu: pid %d: %w", inst.PID, err)
	}
	return nil
}

// Info implements supervisor.Hypervisor from QMP query-status.
func (b *Backend) Info(ctx context.Context, inst supervisor.Instance) (supervisor.VMState, error) {
	if !running(inst.PID, inst.StartTime) {
		return "", fmt.Errorf("qemu: pid %d is not running", inst.PID)
	}
	qctx, cancel := context.WithTimeout(ctx, b.qmpTimeout)
	defer cancel()
	status, err := qmpStatus(qctx, inst.APISocket)
	if err != nil {
		return "", err
	}
	return vmState(status), nil
}

// vmState maps QEMU's RunState names onto the supervisor's states.
func vmState(status string) supervisor.VMState {
	switch status {
	case "running":
		return supervisor.VMRunning
	case "prelaunch":
		return supervisor.VMCreated
	case "shutdown", "guest-panicked", "internal-error", "io-error":
		return supervisor.VMShutdown
	default: // paused, suspended, debug, watchdog, inmigrate, postmigrate, ...
		return supervisor.VMPaused
	}
}

// Stop implements supervisor.Hypervisor: the ACPI power button, pressed
// again every supervisor.PowerButtonEvery while the guest is still running, up to grace
// for the guest to power off; then QMP quit, SIGTERM, SIGKILL, each given a
// short while. It returns once the process has exited (an unreaped zombie
// counts as exited), or ctx's error.
func (b *Backend) Stop(ctx context.Context, inst supervisor.Instance, grace time.Duration) error {
	if !running(inst.PID, inst.StartTime) {
		return nil
	}
	exited, err := supervisor.PressPowerButton(grace, supervisor.PowerButtonEvery,
		func() error { return b.qmpDo(ctx, inst, "system_powerdown") },
		func(d time.Duration) bool { return waitExit(ctx, inst, d) },
		func() bool { return ctx.Err() != nil })
	if exited {
		return nil
	}
	if err != nil {
		b.log.Debug("qemu: stop step failed", "pid", inst.PID, "step", "system_powerdown", "err", err)
	}
	if ctx.Err() != nil {
		return fmt.Errorf("qemu: stopping pid %d: %w", inst.PID, ctx.Err())
	}
	b.log.Info("qemu: still running, escalating", "pid", inst.PID, "after", "system_powerdown")
	steps := []struct {
		name string
		do   func() error
		wait time.Duration
	}{
		{"quit", func() error { return b.qmpDo(ctx, inst, "quit") }, b.stopStepMax},
		{"SIGTERM", func() error { return b.signal(inst, syscall.SIGTERM) }, b.stopStepMax},
		{"SIGKILL", func() error { return b.signal(inst, syscall.SIGKILL) }, 10 * time.Second},
	}
	for _, s := range steps {
		if err := s.do(); err != nil {
			b.log.Debug("qemu: stop step failed", "pid", inst.PID, "step", s.name, "err", err)
		}
		if waitExit(ctx, inst, s.wait) {
			return nil
		}
		if ctx.Err() != nil {
			return fmt.Errorf("qemu: stopping pid %d: %w", inst.PID, ctx.Err())
		}
		b.log.Info("qemu: still running, escalating", "pid", inst.PID, "after", s.name)
	}
	return fmt.Errorf("qemu: pid %d survived SIGKILL", inst.PID)
}

func (b *Backend) qmpDo(ctx context.Context, inst supervisor.Instance, cmd string) error {
	qctx, cancel := context.WithTimeout(ctx, b.qmpTimeout)
	defer cancel()
	_, err := qmpRun(qctx, inst.APISocket, cmd)
	return err
}

// signal sends sig only if pid is still the recorded process.
func (b *Backend) signal(inst supervisor.Instance, sig syscall.Signal) error {
	if !running(inst.PID, inst.StartTime) {
		return nil
	}
	return syscall.Kill(inst.PID, sig)
}

// waitExit polls until the process has exited, up to d or ctx's end.
func waitExit(ctx context.Context, inst supervisor.Instance, d time.Duration) bool {
	end := time.Now().Add(d)
	for {
		if !running(inst.PID, inst.StartTime) {
			return true
		}
		if time.Now().After(end) || ctx.Err() != nil {
			return false
		}
		select {
		case <-ctx.Done():
		case <-time.After(25 * time.Millisecond):
		}
	}
}

// KVMDisabledReason says why this backend launches under TCG instead of KVM
// ("" while KVM has not failed here), for status and logs.
func (b *Backend) KVMDisabledReason() string {
	if b.accel == AccelTCG {
		return "tcg configured"
	}
	b.mu.Lock()
	defer b.mu.Unlock()
	if b.kvmBroken != "" {
		return b.kvmBroken
	}
	if err := kvmUsable(); err != nil {
		return err.Error()
	}
	return ""
}
