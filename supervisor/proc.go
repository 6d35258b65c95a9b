package supervisor

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"net"
	"os"
	"strconv"
	"syscall"
	"time"
	"unicode"

	"golang.org/x/sys/unix"
)

// ProcStat is what brokkr reads from /proc/<pid>/stat.
type ProcStat struct {
	State     byte   // field 3: R, S, D, Z, ...
	Session   int    // field 6: the session ID (a VMM leads its own: Setsid)
	StartTime uint64 // field 22: start time in clock ticks since boot
}

// ReadProcStat reads /proc/<pid>/stat.
func ReadProcStat(pid int) (ProcStat, error) {
	b, err := os.ReadFile(fmt.Sprintf("/proc/%d/stat", pid))
	if err != nil {
		return ProcStat{}, err
	}
	st, err := ParseProcStat(b)
	if err != nil {
		return ProcStat{}, fmt.Errorf("/proc/%d/stat: %w", pid, err)
	}
	return st, nil
}

// ParseProcStat reads the fields after the command name (field 2), which
// may itself hold spaces and parentheses, so it splits after the last ')'.
func ParseProcStat(b []byte) (ProcStat, error) {
	i := bytes.LastIndexByte(b, ')')
	if i < 0 {
		return ProcStat{}, fmt.Errorf("no ')' in %q", b)
	}
	f := bytes.Fields(b[i+1:])
	// f[0] is field 3 (state), so field 22 is f[19].
	if len(f) < 20 {
		return ProcStat{}, fmt.Errorf("%d fields after the command name, want >= 20", len(f))
	}
	if len(f[0]) != 1 || !unicode.IsLetter(rune(f[0][0])) {
		return ProcStat{}, fmt.Errorf("state %q is not one letter", f[0])
	}
	sid, err := strconv.Atoi(string(f[3]))
	if err != nil {
		return ProcStat{}, fmt.Errorf("session %q: %w", f[3], err)
	}
	st, err := strconv.ParseUint(string(f[19]), 10, 64)
	if err != nil {
		return ProcStat{}, fmt.Errorf("start time %q: %w", f[19], err)
	}
	return ProcStat{State: f[0][0], Session: sid, StartTime: st}, nil
}

// Proc is one live process FindProcs found.
type Proc struct {
	PID  int
	Stat ProcStat
}

// FindProcs lists the live processes (zombies left out) whose
// NUL-separated command line match accepts, as /proc is at the call. The
// command line is tested first: it is the selective test, so the stat of
// every other process on the host is never read.
func FindProcs(match func(cmdline []byte) bool) []Proc {
	ents, _ := os.ReadDir("/proc")
	var out []Proc
	for _, e := range ents {
		pid, err := strconv.Atoi(e.Name())
		if err != nil {
			continue
		}
		cmd, err := os.ReadFile(fmt.Sprintf("/proc/%d/cmdline", pid))
		if err != nil || !match(cmd) {
			continue
		}
		if st, err := ReadProcStat(pid); err == nil && !st.Exited() {
			out = append(out, Proc{PID: pid, Stat: st})
		}
	}
	return out
}

// SessionLeadersNaming lists the live processes that lead their own session
// (as a VMM started with Setsid does, also after a wrapper exec'd it) and
// whose command line holds needle: the VMMs started for one VM's run
// directory. A shell or tool that merely names the path leads no session.
func SessionLeadersNaming(needle string) []Instance {
	var out []Instance
	for _, p := range FindProcs(func(cmd []byte) bool { return bytes.Contains(cmd, []byte(needle)) }) {
		if p.PID != os.Getpid() && p.Stat.Session == p.PID {
			out = append(out, Instance{PID: p.PID, StartTime: p.Stat.StartTime})
		}
	}
	return out
}

// Exited says the process has ended and only waits to be reaped.
func (s ProcStat) Exited() bool { return s.State == 'Z' || s.State == 'X' }

// ProcStartTime returns field 22 of /proc/<pid>/stat: the process start time
// in clock ticks since boot. Together with the pid it names one process for
// the life of the host, which a bare pid (reused after exit) does not.
func ProcStartTime(pid int) (uint64, error) {
	st, err := ReadProcStat(pid)
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
	st, err := ReadProcStat(inst.PID)
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
