package qemu

import (
	"net"
	"os"
	"syscall"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/brokkr/brokkr/supervisor"
)

// A guest that does not act on the power button (here: still booting, no
// acpid yet) is ended by QMP quit once the grace period is over. No network:
// the VM has no tap, so this needs neither root nor a namespace.
func TestStopEscalatesWhenGuestIgnoresPowerButton(t *testing.T) {
	img := qemuGuest(t)
	cfg := guestConfig(t, img, "deaf", 128)
	b := New("", WithAccel(AccelTCG), WithConsoleFile())
	inst, err := b.Start(t.Context(), cfg)
	require.NoError(t, err)
	killAtCleanup(t, inst, cfg.ConsoleLog)
	state, err := b.Info(t.Context(), inst)
	require.NoError(t, err)
	assert.Equal(t, supervisor.VMRunning, state)

	const grace = 300 * time.Millisecond
	t0 := time.Now()
	require.NoError(t, b.Stop(t.Context(), inst, grace))
	took := time.Since(t0)
	t.Logf("Stop took %s", took.Round(time.Millisecond))
	assert.GreaterOrEqual(t, took, grace, "the guest had its grace period")
	assert.Less(t, took, grace+b.stopStepMax, "QMP quit ended it; no SIGTERM/SIGKILL wait was needed")
	assert.NotContains(t, readFile(cfg.ConsoleLog), "powering off", "the guest never handled the button")
	var ws syscall.WaitStatus
	_, err = syscall.Wait4(inst.PID, &ws, 0, nil)
	require.NoError(t, err)
	assert.True(t, ws.Exited(), "qemu exited by itself on quit (not by a signal): %v", ws)

	// A stale QMP socket (a file nobody listens on, as a SIGKILLed qemu
	// leaves) is removed and does not block the next start.
	_ = os.Remove(inst.APISocket)
	ln, err := net.Listen("unix", inst.APISocket)
	require.NoError(t, err)
	ln.(*net.UnixListener).SetUnlinkOnClose(false)
	ln.Close()
	require.FileExists(t, inst.APISocket)
	require.NoError(t, os.WriteFile(cfg.ConsoleLog, []byte("previous boot\n"), 0o600))
	inst2, err := b.Start(t.Context(), cfg)
	require.NoError(t, err)
	killAtCleanup(t, inst2, cfg.ConsoleLog)
	require.NoError(t, b.Adopt(t.Context(), inst2))
	assert.Error(t, b.Adopt(t.Context(), inst), "the old instance is not adoptable")
	assert.Equal(t, "previous boot\n", readFile(cfg.ConsoleLog+".1"), "the previous boot's console is kept")
}

// A wedged qemu (SIGSTOPped here: QMP never answers, SIGTERM stays pending)
// is still ended: the QMP steps time out, SIGKILL follows, and Stop returns
// without hanging.
func TestStopWedgedQEMUEndsWithSIGKILL(t *testing.T) {
	img := qemuGuest(t)
	cfg := guestConfig(t, img, "wedged", 128)
	cfg.ConsoleLog = ""
	b := New("", WithAccel(AccelTCG))
	b.qmpTimeout, b.stopStepMax = 300*time.Millisecond, 300*time.Millisecond
	inst, err := b.Start(t.Context(), cfg)
	require.NoError(t, err)
	killAtCleanup(t, inst, cfg.ConsoleLog)
	require.NoError(t, syscall.Kill(inst.PID, syscall.SIGSTOP))
	_, err = b.Info(t.Context(), inst)
	require.Error(t, err, "a wedged qemu does not answer QMP")

	t0 := time.Now()
	require.NoError(t, b.Stop(t.Context(), inst, 300*time.Millisecond))
	t.Logf("Stop took %s", time.Since(t0).Round(time.Millisecond))
	var ws syscall.WaitStatus
	_, err = syscall.Wait4(inst.PID, &ws, 0, nil)
	require.NoError(t, err)
	assert.True(t, ws.Signaled() && ws.Signal() == syscall.SIGKILL, "ended by SIGKILL, got %v", ws)
}
