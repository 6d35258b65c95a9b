package qemu

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"github.com/brokkr/brokkr/internal/procfs"
	"os"
	"os/exec"
	"slices"
	"strings"
	"syscall"
	"time"

	"golang.org/x/sys/unix"

	"github.com/brokkr/brokkr/supervisor"
)

// Files of a suspended VM's state directory.
const (
	stateName  = "qemu.state" // the migration stream: RAM and device state
	launchName = "qemu.json"  // the command line the state was saved from
)

// savedLaunch is the command line of the qemu whose state was saved. The
// incoming qemu must have the same machine and devices as the one that
// saved it, so it is started from this, not from the current backend's
// idea of a command line (a newer brokkr may add devices).
type savedLaunch struct {
	Args []string `json:"args"`
}

// maxBandwidth lifts migration's 32 MiB/s default cap (meant to spare a
// network link): a state written to a local file goes as fast as the disk.
const maxBandwidth = 1 << 40

// stateFD is the descriptor name the migration stream is passed under.
const stateFD = "brokkr-state"

// Suspend implements supervisor.Hypervisor: QMP stop, the command line
// saved beside the state (with the machine type pinned to its versioned
// name, so a newer qemu whose "q35" means another version still loads it),
// migrate to a file the daemon opened and passes over QMP (QEMU 7.2 has no
// file: URI; fd: needs no shell), then fsync, saved, and quit. A failure
// before quit runs the guest again (cont).
func (b *Backend) Suspend(ctx context.Context, inst supervisor.Instance, dir string, saved func() error) error {
	if !running(inst.PID, inst.StartTime) {
		return fmt.Errorf("qemu: pid %d is not running", inst.PID)
	}
	cmdline, err := os.ReadFile(fmt.Sprintf("/proc/%d/cmdline", inst.PID))
	if err != nil {
		return fmt.Errorf("qemu: pid %d: %w", inst.PID, err)
	}
	args := strings.Split(strings.TrimSuffix(string(cmdline), "\x00"), "\x00")[1:]
	f, err := os.OpenFile(dir+"/"+stateName, os.O_RDWR|os.O_CREATE|os.O_TRUNC, 0o600)
	if err != nil {
		return fmt.Errorf("qemu: %w", err)
	}
	defer f.Close()
	stopped := false
	err = qmpWith(ctx, inst.APISocket, func(m *monitor) error {
		if _, err := m.run("stop", nil); err != nil {
			return err
		}
		stopped = true
		ret, err := m.run("qom-get", map[string]string{"path": "/machine", "property": "type"})
		if err != nil {
			return err
		}
		var machine string
		if err := json.Unmarshal(ret, &machine); err != nil || !strings.HasSuffix(machine, "-machine") {
			return fmt.Errorf("qemu: machine type %s", ret)
		}
		if err := writeLaunch(dir, savedArgs(args, strings.TrimSuffix(machine, "-machine"))); err != nil {
			return err
		}
		if _, err := m.run("migrate-set-parameters", map[string]any{"max-bandwidth": maxBandwidth}); err != nil {
			return err
		}
		if _, err := m.runWithFile("getfd", map[string]string{"fdname": stateFD}, f); err != nil {
			return err
		}
		if _, err := m.run("migrate", map[string]string{"uri": "fd:" + stateFD}); err != nil {
			return err
		}
		return waitMigration(ctx, m)
	})
	if err == nil {
		// The state must be on disk before the process that holds the
		// guest ends; and the page cache it sits in would be guest RAM
		// held on the host by another name.
		if err = f.Sync(); err == nil {
			_ = unix.Fadvise(int(f.Fd()), 0, 0, unix.FADV_DONTNEED)
			err = saved()
		}
	}
	if err != nil {
		if stopped {
			return b.contAfter(inst, fmt.Errorf("qemu: suspend: %w", err))
		}
		return fmt.Errorf("qemu: suspend: %w", err)
	}
	return b.end(ctx, inst)
}

// waitMigration polls query-migrate until the stream is complete, or
// reports why it failed (ENOSPC shows up here as qemu's error-desc).
func waitMigration(ctx context.Context, m *monitor) error {
	for {
		ret, err := m.run("query-migrate", nil)
		if err != nil {
			return err
		}
		var st struct {
			Status    string `json:"status"`
			ErrorDesc string `json:"error-desc"`
		}
		if err := json.Unmarshal(ret, &st); err != nil {
			return fmt.Errorf("query-migrate: %s: %w", ret, err)
		}
		switch st.Status {
		case "completed":
			return nil
		case "failed", "cancelled":
			if st.ErrorDesc == "" {
				st.ErrorDesc = "no reason given"
			}
			return fmt.Errorf("migration %s: %s", st.Status, st.ErrorDesc)
		}
		if ctx.Err() != nil {
			_, _ = m.run("migrate_cancel", nil)
			return ctx.Err()
		}
		time.Sleep(10 * time.Millisecond)
	}
}

// savedArgs is qemu's command line as an incoming qemu needs it: the
// versioned machine type, no -incoming of an earlier resume.
func savedArgs(args []string, machine string) []string {
	out := make([]string, 0, len(args))
	for i := 0; i < len(args); i++ {
		switch args[i] {
		case "-incoming":
			i++
			continue
		case "-machine", "-M":
			if i+1 < len(args) {
				opts := strings.SplitN(args[i+1], ",", 2)
				opts[0] = machine
				if strings.HasPrefix(opts[0], "type=") {
					opts[0] = "type=" + machine
				}
				out = append(out, args[i], strings.Join(opts, ","))
				i++
				continue
			}
		}
		out = append(out, args[i])
	}
	return out
}

func writeLaunch(dir string, args []string) error {
	b, err := json.Marshal(savedLaunch{Args: args})
	if err != nil {
		return err
	}
	f, err := os.OpenFile(dir+"/"+launchName, os.O_WRONLY|os.O_CREATE|os.O_TRUNC, 0o600)
	if err != nil {
		return err
	}
	if _, err := f.Write(b); err != nil {
		f.Close()
		return err
	}
	if err := f.Sync(); err != nil {
		f.Close()
		return err
	}
	return f.Close()
}

// contAfter runs the guest again after a failed suspend (even once the
// caller's ctx has ended: a paused guest serves nobody) and returns cause,
// with cont's own failure if any.
func (b *Backend) contAfter(inst supervisor.Instance, cause error) error {
	ctx, cancel := context.WithTimeout(context.Background(), 2*b.qmpTimeout)
	defer cancel()
	if _, err := qmpRun(ctx, inst.APISocket, "cont"); err != nil {
		return errors.Join(cause, fmt.Errorf("and the guest stays paused: %w", err))
	}
	return cause
}

// end ends a qemu whose guest is saved: quit, then SIGKILL (the guest is
// paused and its state on disk, so nothing is lost however it ends).
func (b *Backend) end(ctx context.Context, inst supervisor.Instance) error {
	if err := b.qmpDo(ctx, inst, "quit"); err != nil {
		b.log.Debug("qemu: quit after suspend", "pid", inst.PID, "err", err)
	}
	if waitExit(ctx, inst, b.stopStepMax) {
		return nil
	}
	_ = b.signal(inst, syscall.SIGKILL)
	if waitExit(ctx, inst, 10*time.Second) {
		return nil
	}
	return fmt.Errorf("qemu: pid %d survived SIGKILL after suspend", inst.PID)
}

// Restore implements supervisor.Hypervisor: qemu started from the saved
// command line with -incoming fd:3 (the state file, inherited), the
// console log appended to rather than truncated; it returns once QMP says
// the guest is loaded and paused (the source was stopped, so qemu does not
// start it by itself).
func (b *Backend) Restore(ctx context.Context, cfg supervisor.LaunchConfig, dir string) (supervisor.Instance, error) {
	raw, err := os.ReadFile(dir + "/" + launchName)
	if err != nil {
		return supervisor.Instance{}, fmt.Errorf("qemu: restore: %w", err)
	}
	var sl savedLaunch
	if err := json.Unmarshal(raw, &sl); err != nil || len(sl.Args) == 0 {
		return supervisor.Instance{}, fmt.Errorf("qemu: restore: %s is corrupt (%v)", launchName, err)
	}
	if err := sameLaunch(sl.Args, cfg); err != nil {
		return supervisor.Instance{}, fmt.Errorf("qemu: restore: %w", err)
	}
	bin, err := b.binary()
	if err != nil {
		return supervisor.Instance{}, err
	}
	state, err := os.Open(dir + "/" + stateName)
	if err != nil {
		return supervisor.Instance{}, fmt.Errorf("qemu: restore: %w", err)
	}
	defer state.Close()
	for _, d := range []string{cfg.Dir, cfg.RunDir} {
		if err := os.MkdirAll(d, 0o700); err != nil {
			return supervisor.Instance{}, fmt.Errorf("qemu: vm %s: %w", cfg.Name, err)
		}
	}
	sock := qmpSocket(cfg)
	if socketInUse(sock) {
		return supervisor.Instance{}, fmt.Errorf("qemu: vm %s: %s is served by a running process; refusing to start a second qemu", cfg.Name, sock)
	}
	_ = os.Remove(sock)
	console := consoleSocketIn(sl.Args)
	if console != "" {
		_ = os.Remove(console)
	}
	args := append(incomingArgs(sl.Args), "-incoming", "fd:3")

	logf, err := os.OpenFile(qemuLog(cfg), os.O_CREATE|os.O_WRONLY|os.O_APPEND, 0o600)
	if err != nil {
		return supervisor.Instance{}, fmt.Errorf("qemu: vm %s: %w", cfg.Name, err)
	}
	defer logf.Close()
	logStart, _ := logf.Seek(0, 2)
	fmt.Fprintf(logf, "--- %s restore: %s %s\n", time.Now().UTC().Format(time.RFC3339), bin, strings.Join(args, " "))
	cmd := exec.Command(bin, args...)
	cmd.Stdout, cmd.Stderr = logf, logf
	cmd.ExtraFiles = []*os.File{state}
	cmd.SysProcAttr = &syscall.SysProcAttr{Setsid: true}
	if err := startIn(b.netnsPath, cmd); err != nil {
		return supervisor.Instance{}, fmt.Errorf("qemu: vm %s: start %s: %w", cfg.Name, bin, err)
	}
	// Read from the start, as Start does: the guest prints as soon as it
	// continues, and qemu drops what comes while no reader is connected.
	var cw *consoleWatch
	if console != "" {
		cw, _ = watchConsole(ctx, console, cfg.ConsoleLog) // else the engine connects itself
	}
	fail := func(err error) (supervisor.Instance, error) {
		if cw != nil {
			cw.close()
		}
		_ = cmd.Process.Kill()
		_ = cmd.Wait()
		_ = os.Remove(sock)
		return supervisor.Instance{}, err
	}
	pid := cmd.Process.Pid
	if cfg.Place != nil {
		if err := cfg.Place(pid); err != nil {
			return fail(fmt.Errorf("qemu: vm %s: %w", cfg.Name, err))
		}
	}
	st, err := procfs.ReadProcStat(pid)
	var exe string
	if err == nil {
		exe, err = supervisor.ProcExe(pid)
	}
	if err != nil {
		return fail(fmt.Errorf("qemu: vm %s: qemu exited at restore: %s", cfg.Name, logTail(qemuLog(cfg), logStart)))
	}
	inst := supervisor.Instance{PID: pid, StartTime: st.StartTime, Exe: exe, APISocket: sock, ConsoleSocket: console}
	if err := b.waitQMP(ctx, inst, "paused"); err != nil {
		return fail(fmt.Errorf("qemu: vm %s: restore: %w; qemu.log: %s", cfg.Name, err, logTail(qemuLog(cfg), logStart)))
	}
	if cw != nil {
		inst.Console = cw.handOver()
	}
	_ = cmd.Process.Release()
	return inst, nil
}

// sameLaunch checks that a saved command line is this VM's: its QMP
// socket, and its tap and MAC (the guest comes back to its own network).
func sameLaunch(args []string, cfg supervisor.LaunchConfig) error {
	joined := "\x00" + strings.Join(args, "\x00") + "\x00"
	need := []string{"unix:" + qmpSocket(cfg) + ","}
	if cfg.Tap != "" {
		need = append(need, "ifname="+cfg.Tap+",", "mac="+cfg.MAC.String())
	}
	for _, n := range need {
		if !strings.Contains(joined, n) {
			return fmt.Errorf("the saved state is not this VM's launch (no %q on its command line)", n)
		}
	}
	return nil
}

// consoleSocketIn is the serial console's socket on a command line ("":
// the console goes to a file).
func consoleSocketIn(args []string) string {
	for i, a := range args {
		if a == "-chardev" && i+1 < len(args) {
			for _, opt := range strings.Split(args[i+1], ",") {
				if p, ok := strings.CutPrefix(opt, "path="); ok && strings.HasPrefix(args[i+1], "socket,id=console0,") {
					return p
				}
			}
		}
	}
	return ""
}

// incomingArgs adjusts a saved command line for the incoming qemu: a
// console written to a file is appended to (qemu truncates it otherwise,
// and the log of the guest's whole life is wanted).
func incomingArgs(args []string) []string {
	out := slices.Clone(args)
	for i, a := range out {
		if a == "-chardev" && i+1 < len(out) && strings.HasPrefix(out[i+1], "file,id=console0,") && !strings.Contains(out[i+1], ",append=") {
			out[i+1] += ",append=on"
		}
	}
	return out
}

// Continue implements supervisor.Hypervisor: QMP cont. The guest's clock
// is not corrected: its clocks are part of the saved state (TCG's virtual
// clock, kvmclock), so it runs on from the moment it was paused; setting
// its wall clock needs an agent inside the guest (qemu-guest-agent's
// guest-set-time), which brokkr's guests are not required to run
// (docs/ARCHITECTURE.md, "Suspend and resume").
func (b *Backend) Continue(ctx context.Context, inst supervisor.Instance) error {
	qctx, cancel := context.WithTimeout(ctx, b.qmpTimeout)
	defer cancel()
	status, err := qmpStatus(qctx, inst.APISocket)
	if err != nil {
		return err
	}
	if status == "running" {
		return nil
	}
	if _, err := qmpRun(qctx, inst.APISocket, "cont"); err != nil {
		return err
	}
	if status, err = qmpStatus(qctx, inst.APISocket); err != nil {
		return err
	}
	if status != "running" {
		return fmt.Errorf("qemu: pid %d: status %q after cont", inst.PID, status)
	}
	return nil
}
