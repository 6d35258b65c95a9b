package chv

import (
	"bufio"
	"context"
	"errors"
	"net"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/brokkr/brokkr/supervisor"
)

// banner is the first line the fake guest prints on its serial socket.
func banner(t *testing.T, sock string) string {
	t.Helper()
	c, err := net.DialTimeout("unix", sock, 5*time.Second)
	require.NoError(t, err)
	defer c.Close()
	_ = c.SetReadDeadline(time.Now().Add(5 * time.Second))
	line, err := bufio.NewReader(c).ReadString('\n')
	require.NoError(t, err)
	return strings.TrimSpace(line)
}

// Suspend pauses, snapshots into the directory, calls saved and ends the
// VMM; Restore starts a new VMM from the snapshot with the guest paused,
// Continue runs it: the same guest boot, in a new process, on the same tap.
func TestSuspendRestoreContinue(t *testing.T) {
	e := newEnv(t)
	ctx := context.Background()
	lc := e.launch("web")
	inst, err := e.backend.Start(ctx, lc)
	require.NoError(t, err)
	booted := banner(t, inst.ConsoleSocket)
	bootID := strings.TrimSuffix(booted[strings.Index(booted, "(boot ")+6:], ")")
	require.Len(t, bootID, 16, booted)

	dir := filepath.Join(lc.Dir, "suspend")
	require.NoError(t, os.Mkdir(dir, 0o700))
	savedCalls := 0
	require.NoError(t, e.backend.Suspend(ctx, inst, dir, func() error {
		savedCalls++
		assert.NoError(t, supervisor.CheckIdentity(inst), "saved runs before the VMM ends")
		return nil
	}))
	reap(inst.PID)
	assert.Equal(t, 1, savedCalls)
	assert.Error(t, supervisor.CheckIdentity(inst), "the VMM is gone after Suspend")
	c := e.calls()
	assert.Equal(t, []string{"GET vm.info 200", "PUT vm.pause 204", "PUT vm.snapshot 204", "PUT vmm.shutdown 204"}, c[len(c)-4:])
	fi, err := os.Stat(filepath.Join(dir, "memory-ranges"))
	require.NoError(t, err)
	assert.Equal(t, int64(lc.MemoryMiB)<<20, fi.Size())

	restored, err := e.backend.Restore(ctx, lc, dir)
	require.NoError(t, err)
	defer reap(restored.PID)
	assert.NotEqual(t, inst.PID, restored.PID)
	st, err := e.backend.Info(ctx, restored)
	require.NoError(t, err)
	assert.Equal(t, supervisor.VMPaused, st, "Restore leaves the guest paused")
	require.NoError(t, e.backend.Continue(ctx, restored))
	st, _ = e.backend.Info(ctx, restored)
	assert.Equal(t, supervisor.VMRunning, st)
	require.NoError(t, e.backend.Continue(ctx, restored), "Continue of a running guest is a no-op")
	assert.Equal(t, "chfake: restored boot "+bootID+" (snapshot 1)", banner(t, restored.ConsoleSocket))
	var restore string
	for _, l := range e.requests() {
		if strings.HasPrefix(l, "PUT /api/v1/vm.restore") {
			restore = l
		}
	}
	assert.Contains(t, restore, `{"source_url":"file://`+dir+`"}`)
	for _, c := range e.calls() {
		assert.NotContains(t, c, " 400", "the fake rejected a request body")
	}
	require.NoError(t, e.backend.Stop(ctx, restored, 2*time.Second))
}

// A snapshot the VMM refuses, or a saved callback that fails, leaves the
// guest running in the same process, with the reason.
func TestFailedSuspendKeepsTheGuestRunning(t *testing.T) {
	for name, c := range map[string]struct {
		behaviour []string
		saved     error
		want      string
	}{
		"refused":      {behaviour: []string{"CHFAKE_REFUSE=vm.snapshot"}, want: "vm.snapshot: HTTP 500: chfake: refused vm.snapshot"},
		"saved failed": {saved: errors.New("no space left on device"), want: "no space left on device"},
	} {
		t.Run(name, func(t *testing.T) {
			e := newEnv(t, c.behaviour...)
			ctx := context.Background()
			lc := e.launch("vm")
			inst, err := e.backend.Start(ctx, lc)
			require.NoError(t, err)
			defer reap(inst.PID)
			dir := t.TempDir()
			err = e.backend.Suspend(ctx, inst, dir, func() error { return c.saved })
			require.ErrorContains(t, err, c.want)
			require.NoError(t, supervisor.CheckIdentity(inst), "the VMM still runs")
			assert.Equal(t, "PUT vm.resume 204", e.calls()[len(e.calls())-1])
			st, err := e.backend.Info(ctx, inst)
			require.NoError(t, err)
			assert.Equal(t, supervisor.VMRunning, st, "the guest runs again")
			require.NoError(t, e.backend.Stop(ctx, inst, 2*time.Second))
		})
	}
}

// A snapshot that cannot be loaded fails Restore and leaves no VMM behind.
func TestRestoreOfABadSnapshotFails(t *testing.T) {
	e := newEnv(t)
	ctx := context.Background()
	lc := e.launch("vm")
	inst, err := e.backend.Start(ctx, lc)
	require.NoError(t, err)
	dir := t.TempDir()
	require.NoError(t, e.backend.Suspend(ctx, inst, dir, func() error { return nil }))
	reap(inst.PID)
	require.NoError(t, os.Truncate(filepath.Join(dir, "memory-ranges"), 100))
	_, err = e.backend.Restore(ctx, lc, dir)
	require.ErrorContains(t, err, "vm.restore: HTTP 400")
	assert.Empty(t, fakePIDs(e.dir), "a failed Restore left its VMM running")
}
