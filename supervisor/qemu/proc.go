package qemu

import (
	"bufio"
	"os"
	"strconv"
	"strings"

	"github.com/brokkr/brokkr/internal/procfs"
)

// running reports whether pid is still the process that started at
// startTime and has not exited (a zombie has exited: it only waits to be
// reaped by its parent).
func running(pid int, startTime uint64) bool {
	st, err := procfs.ReadProcStat(pid)
	return err == nil && st.StartTime == startTime && !st.Exited()
}

// hostTSCKHz is the host's TSC frequency in kHz as /proc/cpuinfo's first
// "cpu MHz" gives it (0 when absent). Under TCG the guest's TSC runs at the
// host's rate.
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
