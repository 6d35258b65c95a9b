package config

import (
	"time"

	"github.com/brokkr/brokkr/internal/spec"
)

// minIdleSuspend is the shortest idleSuspend: the supervisor reads a VM's
// counters once a second, and a guest suspended between two callers a few
// seconds apart pays a resume each time.
const minIdleSuspend = 5 * time.Second

// compileSuspend checks a VM's power (running, stopped, suspended) and its
// idleSuspend, into mv.
func compileSuspend(add func(path, format string, a ...any), p string, v VM, mv *spec.VM) {
	switch mv.Power {
	case spec.PowerRunning, spec.PowerStopped, spec.PowerSuspended:
	default:
		add(p+".power", "%q is not one of running, stopped, suspended", v.Power)
	}
	switch v.IdleSuspend {
	case "", "0":
		return
	}
	d, err := time.ParseDuration(v.IdleSuspend)
	switch {
	case err != nil:
		add(p+".idleSuspend", "%q is not a duration (like 10m or 90s; 0 = never)", v.IdleSuspend)
	case d < 0:
		add(p+".idleSuspend", "%q is negative (0 = never)", v.IdleSuspend)
	case d > 0 && d < minIdleSuspend:
		add(p+".idleSuspend", "%q is shorter than %s (0 = never)", v.IdleSuspend, minIdleSuspend)
	default:
		mv.IdleSuspend = d
	}
}
