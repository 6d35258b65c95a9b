// Package procfs reads what brokkr needs of /proc: a process's state,
// session and start time, the processes whose command line matches, and
// the processes that hold given sockets. The supervisor uses it to find and
// identify VMMs, netplane/hold to name who holds a port, the tests to find
// the processes a daemon started.
package procfs

import (
	"bytes"
	"fmt"
	"os"
	"slices"
	"strconv"
	"strings"
	"unicode"
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

// Exited says the process has ended and only waits to be reaped.
func (s ProcStat) Exited() bool { return s.State == 'Z' || s.State == 'X' }

// Owner is a process that has one of the sockets SocketOwners looked for
// open, and its command name.
type Owner struct {
	PID  int
	Comm string
}

// SocketOwners lists, in pid order, the processes that have one of the
// sockets with the given inodes open (a "socket:[N]" link in
// /proc/<pid>/fd). It reads every process's descriptors: callers keep what
// it found rather than ask again each time. A process that goes while it
// is read is left out.
func SocketOwners(inodes map[uint64]bool) []Owner {
	if len(inodes) == 0 {
		return nil
	}
	ents, _ := os.ReadDir("/proc")
	var out []Owner
	for _, e := range ents {
		pid, err := strconv.Atoi(e.Name())
		if err != nil {
			continue
		}
		dir := fmt.Sprintf("/proc/%d/fd/", pid)
		fds, err := os.ReadDir(dir)
		if err != nil {
			continue
		}
		for _, fd := range fds {
			l, err := os.Readlink(dir + fd.Name())
			if err != nil || !strings.HasPrefix(l, "socket:[") {
				continue
			}
			ino, err := strconv.ParseUint(strings.TrimSuffix(strings.TrimPrefix(l, "socket:["), "]"), 10, 64)
			if err == nil && inodes[ino] {
				comm, _ := os.ReadFile(fmt.Sprintf("/proc/%d/comm", pid))
				out = append(out, Owner{PID: pid, Comm: strings.TrimSpace(string(comm))})
				break
			}
		}
	}
	slices.SortFunc(out, func(a, b Owner) int { return a.PID - b.PID })
	return out
}
