package qemu

import (
	"bufio"
	"context"
	"net"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

// By default the serial console is served on RunDir/console.sock. The KVM
// probe's reader sees the guest's first output and appends it to the
// console log; once it lets go, the next reader (the engine's copy) gets
// the rest of the boot. No network: needs neither root nor a namespace.
func TestConsoleSocketProbeThenHandOver(t *testing.T) {
	img := qemuGuest(t)
	cfg := guestConfig(t, img, "cons", 128)
	b := New("", WithAccel(AccelTCG))
	inst, err := b.Start(t.Context(), cfg)
	require.NoError(t, err)
	killAtCleanup(t, inst.PID)
	require.Equal(t, filepath.Join(cfg.RunDir, "console.sock"), inst.ConsoleSocket)

	// The probe's reader, as a KVM launch runs it.
	plan := launchPlan{Machine: MachineQ35, Accel: AccelTCG}
	require.True(t, consoleOnSerial(kernelCmdline(cfg, plan)))
	w, err := watchConsole(t.Context(), inst.ConsoleSocket, cfg.ConsoleLog)
	require.NoError(t, err)
	require.Eventually(t, w.printed, 60*time.Second, 20*time.Millisecond, "no console output")
	// The serial port trickles bytes in: printed() is true after the first
	// one, so wait until the log holds the kernel's first line.
	require.Eventually(t, func() bool { return strings.Contains(readFile(cfg.ConsoleLog), " Linux") },
		60*time.Second, 20*time.Millisecond, "the probe never logged the kernel banner")
	w.close()
	assert.True(t, strings.HasPrefix(readFile(cfg.ConsoleLog), "[    0.000000] Linux"),
		"the probe's bytes are in the console log: %q", readFile(cfg.ConsoleLog))

	// The next reader gets the rest, up to the guest's init starting.
	ctx, cancel := context.WithTimeout(t.Context(), 90*time.Second)
	defer cancel()
	// Retried like the engine's reader does: QEMU listens with a backlog of
	// one and re-arms its listener only after it has seen the last client go.
	var d net.Dialer
	var c net.Conn
	require.Eventually(t, func() bool {
		c, err = d.DialContext(ctx, "unix", inst.ConsoleSocket)
		return err == nil
	}, 5*time.Second, 20*time.Millisecond, "console socket: %v", err)
	defer c.Close()
	_ = c.SetReadDeadline(time.Now().Add(90 * time.Second))
	sc := bufio.NewScanner(c)
	ready := false
	for sc.Scan() {
		if strings.Contains(sc.Text(), "BROKKR-GUEST: init") {
			ready = true
			break
		}
	}
	assert.True(t, ready, "the second reader saw the guest come up (%v)", sc.Err())
	// Still booting (no acpid yet): the grace is short, quit ends it.
	require.NoError(t, b.Stop(t.Context(), inst, time.Second))
	_, err = os.Stat(inst.ConsoleSocket)
	assert.True(t, os.IsNotExist(err) || !socketInUse(inst.ConsoleSocket), "nobody serves the console after stop")
}
