package supervisor

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"net"
	"os"
	"syscall"
	"time"

	"github.com/brokkr/brokkr/internal/procfs"
	"golang.org/x/sys/unix"
)

// SessionLeadersNaming lists the live processes that lead their own session
// (as a VMM started with Setsid does, also after a wrapper exec'd it) and
// whose command line holds needle: the VMMs started for one VM's run
// directory. A shell or tool that merely names the path leads no session.
func SessionLeadersNaming(needle string) []Instance {
	var out []Instance
	for _, p := range procfs.FindProcs(func(cmd []byte) bool { return bytes.Contains(cmd, []byte(needle)) }) {
		if p.PID != os.Getpid() && p.Stat.Session == p.PID {
			out = append(out, Instance{PID: p.PID, StartTime: p.Stat.StartTime})
		}
	}
	return out
}

// ProcStartTime returns field 22 of /proc/<pid>/stat: the process start time
// in clock ticks since boot. Together with the pid it names one process for
// the life of the host, which a bare pid (reused after exit) does not.
func ProcStartTime(pid int) (uint64, error) {
	st, err := procfs.ReadProcStat(pid)
	return st.StartTime, err
}

// ProcExe returns the target of /proc/<pid>/exe.
func ProcExe(pid int) (string, error) {
	return os.Readlink(fmt.Sprintf("/proc/%d/exe", pid))
}

// Identify fills PID, StartTime and Exe for a freshly started process. Call
// it before the process can be reaped (a child that is not waited for keeps
// its pid).
func Identify(pid int) (Instance, error) {
	st, err := ProcStartTime(pid)
	if err != nil {
		return Instance{}, err
	}
	exe, err := ProcExe(pid)
	if err != nil {
		return Instance{}, err
	}
	return Instance{PID: pid, StartTime: st, Exe: exe}, nil
}

// ErrNotSameProcess says the pid is gone or now names another process.
var ErrNotSameProcess = errors.New("not the recorded process")

// CheckIdentity proves that inst.PID is still the process that was recorded:
// alive, same start time, same executable.
func CheckIdentity(inst Instance) error {
	if inst.PID <= 0 {
		return fmt.Errorf("pid %d: %w", inst.PID, ErrNotSameProcess)
	}
	st, err := procfs.ReadProcStat(inst.PID)
	if err != nil {
		return fmt.Errorf("pid %d: %w (%v)", inst.PID, ErrNotSameProcess, err)
	}
	if st.StartTime != inst.StartTime {
		return fmt.Errorf("pid %d: start time %d, recorded %d: %w", inst.PID, st.StartTime, inst.StartTime, ErrNotSameProcess)
	}
	if inst.Exe != "" {
		exe, err := ProcExe(inst.PID)
		if err != nil {
			return fmt.Errorf("pid %d: exe: %w (%v)", inst.PID, ErrNotSameProcess, err)
		}
		if exe != inst.Exe {
			return fmt.Errorf("pid %d: exe %q, recorded %q: %w", inst.PID, exe, inst.Exe, ErrNotSameProcess)
		}
	}
	if st.Exited() {
		return fmt.Errorf("pid %d: exited (zombie): %w", inst.PID, ErrNotSameProcess)
	}
	return nil
}

// Pidfd is a pollable handle on one process (pidfd_open). It cannot be
// confused with a later process that reuses the pid.
type Pidfd struct {
	f   *os.File
	pid int
}

// OpenPidfd opens a pidfd on inst.PID and proves, after opening, that it is
// the recorded process (same start time): checking after the open closes the
// window in which the pid could be reused. An exited but unreaped child
// (zombie) still opens; its pidfd is readable at once.
func OpenPidfd(inst Instance) (*Pidfd, error) {
	fd, err := unix.PidfdOpen(inst.PID, unix.PIDFD_NONBLOCK)
	if err != nil {
		return nil, fmt.Errorf("pidfd_open %d: %w", inst.PID, err)
	}
	f := os.NewFile(uintptr(fd), fmt.Sprintf("pidfd:%d", inst.PID))
	st, err := ProcStartTime(inst.PID)
	if err != nil || st != inst.StartTime {
		f.Close()
		return nil, fmt.Errorf("pid %d: %w", inst.PID, ErrNotSameProcess)
	}
	return &Pidfd{f: f, pid: inst.PID}, nil
}

// Wait blocks until the process exits or ctx ends. It parks in the Go
// netpoller (the pidfd turns readable at exit): no periodic polling.
func (p *Pidfd) Wait(ctx context.Context) error {
	rc, err := p.f.SyscallConn()
	if err != nil {
		return err
	}
	// An earlier Wait cancelled by its ctx left a deadline in the past.
	if err := p.f.SetReadDeadline(time.Time{}); err != nil {
		return err
	}
	stop := context.AfterFunc(ctx, func() { _ = p.f.SetReadDeadline(time.Unix(1, 0)) })
	defer stop()
	var ready bool
	err = rc.Read(func(fd uintptr) bool {
		ready = readable(fd)
		return ready
	})
	if ready {
		return nil
	}
	if ctx.Err() != nil {
		return ctx.Err()
	}
	if err == nil {
		err = errors.New("pidfd wait ended without exit")
	}
	return err
}

// Exited reports, without blocking, whether the process has exited.
func (p *Pidfd) Exited() bool {
	rc, err := p.f.SyscallConn()
	if err != nil {
		return true
	}
	var ready bool
	_ = rc.Control(func(fd uintptr) { ready = readable(fd) })
	return ready
}

// readable polls fd without blocking: a pidfd turns readable when its
// process exits.
func readable(fd uintptr) bool {
	fds := []unix.PollFd{{Fd: int32(fd), Events: unix.POLLIN}}
	n, err := unix.Poll(fds, 0)
	return err == nil && n > 0
}

// Signal sends sig through the pidfd, so it can only reach this process.
func (p *Pidfd) Signal(sig syscall.Signal) error {
	rc, err := p.f.SyscallConn()
	if err != nil {
		return err
	}
	var serr error
	if err := rc.Control(func(fd uintptr) { serr = unix.PidfdSendSignal(int(fd), sig, nil, 0) }); err != nil {
		return err
	}
	return serr
}

// ExitStatus describes how a process ended. Known is false when the process
// was not the daemon's child (adopted after a restart): only its parent
// could read the status.
type ExitStatus struct {
	Known    bool
	Code     int
	Signal   syscall.Signal
	Signaled bool
}

// Clean says the process exited with status 0.
func (s ExitStatus) Clean() bool { return s.Known && !s.Signaled && s.Code == 0 }

func (s ExitStatus) String() string {
	switch {
	case !s.Known:
		return "exit status unknown (not our child)"
	case s.Signaled:
		return fmt.Sprintf("killed by signal %d (%s)", int(s.Signal), s.Signal)
	default:
		return fmt.Sprintf("exit status %d", s.Code)
	}
}

// Reap collects the exit status of an exited child (so it does not linger as
// a zombie). For a process that is not our child the status is unknown.
func (p *Pidfd) Reap() ExitStatus {
	var ws unix.WaitStatus
	for {
		pid, err := unix.Wait4(p.pid, &ws, unix.WNOHANG, nil)
		if errors.Is(err, unix.EINTR) {
			continue
		}
		if err != nil || pid != p.pid {
			return ExitStatus{}
		}
		if ws.Signaled() {
			return ExitStatus{Known: true, Signaled: true, Signal: ws.Signal()}
		}
		return ExitStatus{Known: true, Code: ws.ExitStatus()}
	}
}

// Close releases the pidfd.
func (p *Pidfd) Close() error { return p.f.Close() }

// RemoveStaleSocket removes a unix socket left behind by a dead process, and
// only after proving nobody listens on it: connect must be refused. A socket
// with a live listener, or a path that is not a socket, is an error and is
// left alone.
func RemoveStaleSocket(path string) error {
	fi, err := os.Lstat(path)
	if errors.Is(err, os.ErrNotExist) {
		return nil
	}
	if err != nil {
		return err
	}
	if fi.Mode()&os.ModeSocket == 0 {
		return fmt.Errorf("%s exists and is not a socket", path)
	}
	c, err := net.DialTimeout("unix", path, time.Second)
	if err == nil {
		c.Close()
		return fmt.Errorf("socket %s is in use by a live process", path)
	}
	if !errors.Is(err, syscall.ECONNREFUSED) {
		return fmt.Errorf("probe socket %s: %w", path, err)
	}
	if err := os.Remove(path); err != nil && !errors.Is(err, os.ErrNotExist) {
		return err
	}
	return nil
}
