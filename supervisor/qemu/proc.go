package qemu

import (
	"bufio"
	"bytes"
	"fmt"
	"os"
	"strconv"
	"strings"
)

// procStat is what the backend reads from /proc/<pid>/stat.
type procStat struct {
	State     byte   // field 3: R, S, D, Z, ...
	StartTime uint64 // field 22: start time in clock ticks since boot
}

func readProcStat(pid int) (procStat, error) {
	b, err := os.ReadFile(fmt.Sprintf("/proc/%d/stat", pid))
	if err != nil {
		return procStat{}, err
	}
	return parseProcStat(b)
}

// parseProcStat reads fields after the command name, which may itself hold
// spaces and parentheses, so it splits after the last ')'.
func parseProcStat(b []byte) (procStat, error) {
	i := bytes.LastIndexByte(b, ')')
	if i < 0 {
		return procStat{}, fmt.Errorf("/proc stat: no ')' in %q", b)
	}
	f := strings.Fields(string(b[i+1:]))
	// f[0] is field 3 (state); field 22 is f[19].
	if len(f) < 20 || len(f[0]) != 1 {
		return procStat{}, fmt.Errorf("/proc stat: %d fields after the command name, want >= 20", len(f))
	}
	st, err := strconv.ParseUint(f[19], 10, 64)
	if err != nil {
		return procStat{}, fmt.Errorf("/proc stat: start time %q: %w", f[19], err)
	}
	return procStat{State: f[0][0], StartTime: st}, nil
}

// running reports whether pid is still the process that started at
// startTime and has not exited (a zombie has exited: it only waits to be
// reaped by its parent).
func running(pid int, startTime uint64) bool {
	st, err := readProcStat(pid)
	if err != nil {
		return false
	}
	return st.StartTime == startTime && st.State != 'Z' && st.State != 'X'
}

func procExe(pid int) (string, error) { return os.Readlink(fmt.Sprintf("/proc/%d/exe", pid)) }

// hostTSCKHz is the host's TSC frequency in kHz: the kernel's refined TSC
// calibration when dmesg still holds it, else cpuinfo's "cpu MHz". Under
// TCG the guest's TSC runs at the host's rate.
func hostTSCKHz() int64 {
	f, err := os.Open("/proc/cpuinfo")
	if err != nil {
		return 0
	}
	defer f.Close()
	sc := bufio.NewScanner(f)
	for sc.Scan() {
		k, v, ok := strings.Cut(sc.Text(), ":")
		if !ok || strings.TrimSpace(k) != "cpu MHz" {
			continue
		}
		mhz, err := strconv.ParseFloat(strings.TrimSpace(v), 64)
		if err != nil || mhz <= 0 {
			return 0
		}
		return int64(mhz * 1000)
	}
	return 0
}
