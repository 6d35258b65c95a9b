package qemu

import (
	"context"
	"fmt"
	"io"
	"log/slog"
	"net"
	"os"
	"path/filepath"
	"regexp"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/brokkr/brokkr/internal/nstest"
)

// echo writes msg on c and reads it back.
func echo(c net.Conn, msg string) error {
	_ = c.SetDeadline(time.Now().Add(10 * time.Second))
	if _, err := io.WriteString(c, msg); err != nil {
		return err
	}
	got := make([]byte, len(msg))
	if _, err := io.ReadFull(c, got); err != nil {
		return err
	}
	if string(got) != msg {
		return fmt.Errorf("echo: got %q want %q", got, msg)
	}
	return nil
}

var uptimeRE = regexp.MustCompile(`(BROKKR-GUEST-READY|powering off) .*uptime=([0-9.]+)`)

// uptimes are the guest's uptime counter as it printed it on the console:
// at READY (boot) and at power-off.
func uptimes(t *testing.T, console string) (ready, off float64) {
	t.Helper()
	for _, m := range uptimeRE.FindAllStringSubmatch(console, -1) {
		v, err := strconv.ParseFloat(m[2], 64)
		require.NoError(t, err)
		if m[1] == "BROKKR-GUEST-READY" {
			ready = v
		} else {
			off = v
		}
	}
	return ready, off
}

// A real guest is suspended to a file and restored in a new qemu, and it is
// the same guest, not a reboot: a TCP connection opened before the suspend
// (the guest's echo server holds its socket open) echoes after the resume,
// the console shows one boot, and the uptime the guest prints when it
// powers off is past the uptime it printed at boot. Before that a suspend
// onto a full disk fails with the reason and leaves the guest running in
// its qemu; after it, a state cut short fails Restore and leaves no qemu.
func TestSuspendRestoreIsTheSameGuest(t *testing.T) {
	nstest.RequireRoot(t)
	img := qemuGuest(t)
	gn := newGuestNet(t)
	b := New("", WithNetNS(gn.NS.Path), WithAccel(AccelTCG), WithConsoleFile(), WithLogger(testLogger(t)))
	cfg := guestConfig(t, img, "susp", 256)
	cfg.Tap, cfg.MAC = gn.Tap, gn.MAC
	ctx, cancel := context.WithTimeout(t.Context(), 4*time.Minute)
	defer cancel()
	inst, err := b.Start(ctx, cfg)
	require.NoError(t, err)
	killAtCleanup(t, inst, cfg.ConsoleLog)
	require.Eventually(t, func() bool { return strings.Contains(readFile(cfg.ConsoleLog), "BROKKR-GUEST-READY") },
		90*time.Second, 50*time.Millisecond, "guest never got ready; console:\n%s", readFile(cfg.ConsoleLog))

	var held net.Conn
	require.NoError(t, gn.NS.Do(func() error {
		held, err = net.DialTimeout("tcp", net.JoinHostPort(gn.IP, "7000"), 5*time.Second)
		return err
	}))
	defer held.Close()
	require.NoError(t, echo(held, "before\n"))

	// A full disk: the migration fails, the guest runs on in its qemu.
	full := nstest.SmallTmpfs(t, 4<<20)
	err = b.Suspend(ctx, inst, full, func() error { t.Error("saved called for a failed state"); return nil })
	require.Error(t, err)
	assert.Contains(t, err.Error(), "No space left on device")
	require.True(t, running(inst.PID, inst.StartTime), "the failed suspend ended qemu")
	status, err := qmpStatus(ctx, inst.APISocket)
	require.NoError(t, err)
	assert.Equal(t, "running", status)
	require.NoError(t, echo(held, "after a failed suspend\n"))

	dir := filepath.Join(cfg.Dir, "suspend")
	require.NoError(t, os.Mkdir(dir, 0o700))
	t0 := time.Now()
	saved := false
	require.NoError(t, b.Suspend(ctx, inst, dir, func() error {
		saved = true
		return nil
	}))
	took := time.Since(t0)
	require.True(t, saved)
	assert.False(t, running(inst.PID, inst.StartTime), "qemu ended after the suspend")
	_, _ = syscall.Wait4(inst.PID, nil, 0, nil)
	fi, err := os.Stat(filepath.Join(dir, stateName))
	require.NoError(t, err)
	t.Logf("suspend took %s, state %d bytes", took.Round(time.Millisecond), fi.Size())
	launch, err := os.ReadFile(filepath.Join(dir, launchName))
	require.NoError(t, err)
	assert.Contains(t, string(launch), `"-machine","pc-q35-`, "the machine type is pinned to its version")

	time.Sleep(2 * time.Second) // suspended: nothing runs
	t0 = time.Now()
	restored, err := b.Restore(ctx, cfg, dir)
	require.NoError(t, err)
	killAtCleanup(t, restored, cfg.ConsoleLog)
	status, err = qmpStatus(ctx, restored.APISocket)
	require.NoError(t, err)
	assert.Equal(t, "paused", status, "Restore leaves the guest paused")
	require.NoError(t, b.Continue(ctx, restored))
	require.NoError(t, echo(held, "after the resume\n"), "the connection opened before the suspend lives on")
	t.Logf("restore and continue took %s", time.Since(t0).Round(time.Millisecond))
	require.NoError(t, gn.dialGuest("tcp", "8080", func(c net.Conn) error {
		page, err := httpGet(c)
		if err == nil && !strings.Contains(page, "name=susp") {
			err = fmt.Errorf("page %q", page)
		}
		return err
	}))
	held.Close()

	stopByPowerButton(t, b, ctx, restored, cfg.ConsoleLog, 60*time.Second)
	console := readFile(cfg.ConsoleLog)
	assert.Equal(t, 1, strings.Count(console, "BROKKR-GUEST: init"), "one boot:\n%s", console)
	ready, off := uptimes(t, console)
	t.Logf("guest uptime at boot %.2f s, at power-off %.2f s", ready, off)
	assert.Greater(t, off, ready, "the uptime counter went on from where it was")

	// A state cut short: the incoming qemu fails to load it and is gone.
	require.NoError(t, os.Truncate(filepath.Join(dir, stateName), fi.Size()/2))
	_, err = b.Restore(ctx, cfg, dir)
	require.Error(t, err)
	t.Logf("restore of a truncated state: %v", err)
	assert.Empty(t, nstest.LiveProcs(cfg.RunDir, "qemu-system"), "a failed Restore left a qemu")
}

func testLogger(t *testing.T) *slog.Logger { return slog.New(slog.NewTextHandler(testWriter{t}, nil)) }
