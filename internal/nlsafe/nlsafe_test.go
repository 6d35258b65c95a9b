package nlsafe_test

import (
	"errors"
	"os"
	"testing"

	"github.com/brokkr/brokkr/internal/nlsafe"
	"github.com/brokkr/brokkr/internal/nstest"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	"github.com/vishvananda/netlink"
	"go.uber.org/goleak"
)

func TestMain(m *testing.M) { goleak.VerifyTestMain(m) }

func TestRetryStopsOnCleanDump(t *testing.T) {
	calls := 0
	v, err := nlsafe.Retry(func() (int, error) {
		calls++
		if calls < 3 {
			return -1, netlink.ErrDumpInterrupted
		}
		return 42, nil
	})
	require.NoError(t, err)
	assert.Equal(t, 42, v)
	assert.Equal(t, 3, calls)
}

func TestRetryGivesUpAfterMaxAttempts(t *testing.T) {
	calls := 0
	_, err := nlsafe.Retry(func() (int, error) { calls++; return 0, netlink.ErrDumpInterrupted })
	assert.ErrorIs(t, err, netlink.ErrDumpInterrupted)
	assert.Equal(t, nlsafe.MaxAttempts, calls)
}

func TestRetryPassesOtherErrorsAtOnce(t *testing.T) {
	calls := 0
	boom := errors.New("boom")
	_, err := nlsafe.Retry(func() (int, error) { calls++; return 0, boom })
	assert.ErrorIs(t, err, boom)
	assert.Equal(t, 1, calls)
}

func TestHandleAndDoStayInTheNamespace(t *testing.T) {
	ns := nstest.New(t, "nl")
	h, err := nlsafe.Handle(ns.Path)
	require.NoError(t, err)
	defer h.Close()
	require.NoError(t, h.LinkAdd(&netlink.Bridge{LinkAttrs: netlink.LinkAttrs{Name: "brk-dummy0"}}))

	_, err = nlsafe.LinkByName(h, "nope0")
	assert.True(t, nlsafe.IsNotFound(err), "missing link must match LinkNotFoundError: %v", err)

	var seen bool
	require.NoError(t, nlsafe.Do(ns.Path, func() error {
		_, err := os.Stat("/proc/sys/net/ipv4/conf/brk-dummy0")
		seen = err == nil
		return nil
	}))
	assert.True(t, seen, "Do must run inside the namespace (the dummy link is visible in /proc/sys)")
	out := ns.MustRun(t, "ip", "-o", "link", "show", "brk-dummy0")
	assert.Contains(t, out, "brk-dummy0")
}
