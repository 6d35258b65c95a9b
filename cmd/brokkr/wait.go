package main

import (
	"context"
	"errors"
	"fmt"
	"io"
	"os"
	"strings"
	"time"

	"github.com/brokkr/brokkr/daemon/api"
	"github.com/brokkr/brokkr/daemon/config"
	"github.com/brokkr/brokkr/internal/spec"
	"golang.org/x/sys/unix"
)

func asErrors(err error, ce *config.Errors) bool { return errors.As(err, ce) }

func isTerminal(w io.Writer) bool {
	f, ok := w.(*os.File)
	if !ok {
		return false
	}
	_, err := unix.IoctlGetTermios(int(f.Fd()), unix.TCGETS)
	return err == nil
}

// failGrace is how long --wait tolerates a failed VM or exposure.
var failGrace = 15 * time.Second

// bar draws a progress bar from the VM's structured progress (an image
// download), or a phase marker otherwise.
func bar(v api.VM) string {
	const width = 20
	if p := v.Progress; p != nil && p.Total > 0 {
		n := int(min(p.Done, p.Total) * width / p.Total)
		return "[" + strings.Repeat("#", n) + strings.Repeat(".", width-n) + "]"
	}
	steps := map[spec.Phase]int{spec.PhasePending: 1, spec.PhaseCreating: 2, spec.PhaseStarting: 3, spec.PhaseRunning: 4,
		spec.PhaseStopping: 2, spec.PhaseStopped: 4, spec.PhaseFailed: 4,
		spec.PhaseSuspending: 2, spec.PhaseSuspended: 4, spec.PhaseResuming: 3}
	n := steps[spec.Phase(v.Phase)] * width / 4
	return "[" + strings.Repeat("=", n) + strings.Repeat(" ", width-n) + "]"
}

// converged reports whether the status shows the desired state reached, and
// a failure (VM failed, exposure failed) that waiting will not fix.
func converged(st *api.Status) (done bool, failed []string) {
	done = true
	for _, v := range st.VMs {
		want := v.Power
		if want == "" {
			done = false // a VM on its way out
			continue
		}
		switch {
		case v.Phase == string(spec.PhaseFailed):
			failed = append(failed, fmt.Sprintf("vm %s failed: %s", v.Name, v.Detail))
		case want == string(spec.PowerRunning) && v.Phase == string(spec.PhaseSuspended):
			// Suspended by its idleSuspend: where a running VM rests.
		case want == string(spec.PowerRunning) && v.Phase != string(spec.PhaseRunning):
			done = false
		case want == string(spec.PowerStopped) && v.Phase != string(spec.PhaseStopped):
			done = false
		case want == string(spec.PowerSuspended) && v.Phase != string(spec.PhaseSuspended):
			done = false
		}
	}
	for _, e := range st.Exposures {
		switch spec.ExposureState(e.State) {
		case spec.StateFailed:
			failed = append(failed, fmt.Sprintf("exposure %s failed: %s", e.Name, e.Reason))
		case spec.StatePending:
			done = false
		}
	}
	return done && len(failed) == 0, failed
}

// waitConverged polls the status until the desired state is reached, with
// a redrawn progress view on a terminal and one line per change otherwise.
func waitConverged(ctx context.Context, w io.Writer, c *api.Client, timeout time.Duration) error {
	ctx, cancel := context.WithTimeout(ctx, timeout)
	defer cancel()
	tty := isTerminal(w)
	drawn := 0
	last := map[string]string{}
	good := 0
	var failingSince time.Time
	// The first pass after an apply may not have run yet; a status from
	// before it would look converged.
	time.Sleep(1200 * time.Millisecond)
	for {
		st, err := c.Status(ctx)
		if err != nil {
			if ctx.Err() != nil {
				return fmt.Errorf("--wait: gave up after %s", timeout)
			}
			return err
		}
		if tty {
			if drawn > 0 {
				fmt.Fprintf(w, "\x1b[%dA", drawn)
			}
			drawn = 0
			for _, v := range st.VMs {
				fmt.Fprintf(w, "\x1b[2K  vm %-20s %s %-9s %s\n", v.Name, bar(v), v.Phase, v.Detail)
				drawn++
			}
			for _, e := range st.Exposures {
				fmt.Fprintf(w, "\x1b[2K  exposure %-14s %s %-8s %s\n", e.Name, listen(e), e.State, e.Reason)
				drawn++
			}
		} else {
			for _, v := range st.VMs {
				line := v.Phase + " " + v.Detail
				if last["vm/"+v.Name] != line {
					last["vm/"+v.Name] = line
					fmt.Fprintf(w, "vm %s: %s\n", v.Name, strings.TrimSpace(line))
				}
			}
			for _, e := range st.Exposures {
				line := e.State + " " + e.Reason
				if last["ex/"+e.Name] != line {
					last["ex/"+e.Name] = line
					fmt.Fprintf(w, "exposure %s: %s\n", e.Name, strings.TrimSpace(line))
				}
			}
		}
		done, failed := converged(st)
		// A failure can heal (a port freed, a VM restarted by its policy):
		// give up only when it has lasted failGrace.
		if len(failed) == 0 {
			failingSince = time.Time{}
		} else if failingSince.IsZero() {
			failingSince = time.Now()
		} else if time.Since(failingSince) > failGrace {
			for _, f := range failed {
				fmt.Fprintln(os.Stderr, "brokkr:", f)
			}
			return silentError{2}
		}
		if done {
			good++
			if good >= 2 {
				fmt.Fprintln(w, "converged")
				return nil
			}
		} else {
			good = 0
		}
		select {
		case <-ctx.Done():
			return fmt.Errorf("--wait: not converged after %s", timeout)
		case <-time.After(500 * time.Millisecond):
		}
	}
}

// pollEvery is how often --wait reads the status.
var pollEvery = 500 * time.Millisecond

func findVM(st *api.Status, name string) (api.VM, bool) {
	for _, v := range st.VMs {
		if v.Name == name {
			return v, true
		}
	}
	return api.VM{}, false
}

// vmReached reports whether v is where `vm <verb> --wait` waits for it:
// running, stopped, or running in a process other than before's.
func vmReached(v api.VM, until string, before api.VM) bool {
	switch until {
	case "running":
		return v.Phase == string(spec.PhaseRunning)
	case "stopped":
		return v.Phase == string(spec.PhaseStopped)
	case "suspended":
		return v.Phase == string(spec.PhaseSuspended)
	case "restarted":
		return v.Phase == string(spec.PhaseRunning) && ((v.PID > 0 && v.PID != before.PID) || v.Restarts > before.Restarts)
	}
	return false
}

// waitVM follows one VM until vmReached, with one progress line: redrawn
// in place on a terminal, a new line per change otherwise. A failure that
// lasts failGrace, the VM leaving the desired state, or the timeout end it
// with exit 2.
func waitVM(ctx context.Context, w io.Writer, c *api.Client, name, until string, before api.VM, timeout time.Duration) error {
	ctx, cancel := context.WithTimeout(ctx, timeout)
	defer cancel()
	tty := isTerminal(w)
	start := time.Now()
	last, lastPhase := "", ""
	var failingSince time.Time
	for {
		st, err := c.Status(ctx)
		if err != nil {
			if ctx.Err() != nil {
				// The time ran out during a status call: say what was
				// seen last, as when it runs out between two calls.
				if lastPhase != "" {
					return fmt.Errorf("--wait: %s is still %s after %s, not %s", name, lastPhase, timeout, until)
				}
				return fmt.Errorf("--wait: %s is not %s after %s", name, until, timeout)
			}
			return err
		}
		v, ok := findVM(st, name)
		if !ok {
			return fmt.Errorf("--wait: %s is no longer in the desired state", name)
		}
		lastPhase = v.Phase
		line := fmt.Sprintf("%s: %s", name, v.Phase)
		if v.Detail != "" {
			line += " (" + v.Detail + ")"
		}
		if tty {
			fmt.Fprintf(w, "\r\x1b[2K%s %s", line, time.Since(start).Round(time.Second))
		} else if line != last {
			fmt.Fprintln(w, line)
		}
		last = line
		if vmReached(v, until, before) {
			if tty {
				fmt.Fprintln(w)
			}
			fmt.Fprintf(w, "%s: %s after %s\n", name, until, time.Since(start).Round(100*time.Millisecond))
			return nil
		}
		if v.Phase != string(spec.PhaseFailed) {
			failingSince = time.Time{}
		} else if failingSince.IsZero() {
			failingSince = time.Now()
		} else if time.Since(failingSince) > failGrace {
			if tty {
				fmt.Fprintln(w)
			}
			return fmt.Errorf("--wait: %s failed: %s", name, v.Detail)
		}
		select {
		case <-ctx.Done():
			if tty {
				fmt.Fprintln(w)
			}
			return fmt.Errorf("--wait: %s is still %s after %s, not %s", name, v.Phase, timeout, until)
		case <-time.After(pollEvery):
		}
	}
}
