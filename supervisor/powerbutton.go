package supervisor

import "time"

// PowerButtonEvery is how often a stop presses the guest's power button
// again while the guest is still running. A press that arrives before
// anything in the guest listens for it (a VM stopped while it boots: no
// acpid or systemd-logind yet) is dropped by the guest, and without a
// second press a graceful stop would always end in a forced one. A guest
// that is already powering off ignores the extra presses.
const PowerButtonEvery = 5 * time.Second

// PressPowerButton presses the power button and waits up to grace for the
// guest to power off, pressing again every `every` (PowerButtonEvery when
// every <= 0). waitExit(d) waits up to d and reports whether the process
// has exited; done reports that the caller's context has ended, after
// which nothing more is pressed. If the first press fails the guest cannot
// have heard it, so the error is returned at once for the caller to
// escalate; a later press may fail because the VMM is already exiting, so
// those failures are ignored.
func PressPowerButton(grace, every time.Duration, press func() error, waitExit func(time.Duration) bool, done func() bool) (exited bool, err error) {
	return pressPowerButton(time.Now, grace, every, press, waitExit, done)
}

// pressPowerButton is PressPowerButton on the clock now (a fake one in
// tests, so that they do not depend on how long a sleep takes).
func pressPowerButton(now func() time.Time, grace, every time.Duration, press func() error, waitExit func(time.Duration) bool, done func() bool) (exited bool, err error) {
	if every <= 0 {
		every = PowerButtonEvery
	}
	end := now().Add(grace)
	if err := press(); err != nil {
		return false, err
	}
	for {
		if waitExit(min(every, max(end.Sub(now()), 0))) {
			return true, nil
		}
		if done() || end.Sub(now()) <= 0 {
			return false, nil
		}
		_ = press()
	}
}
