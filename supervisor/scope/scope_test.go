package scope

import (
	"context"
	"errors"
	"fmt"
	"os"
	"testing"

	"github.com/godbus/dbus/v5"
	"github.com/stretchr/testify/assert"
)

// Where systemd does not run the host there is no Placer: VMMs stay in the
// daemon's cgroup, and the daemon is told so (not a bus error to warn of).
// The calls against a real systemd are in tests/systemd.
func TestDetectWithoutSystemd(t *testing.T) {
	if _, err := os.Stat("/run/systemd/system"); err == nil {
		t.Skip("systemd runs this host")
	}
	s, err := Detect(context.Background())
	assert.Nil(t, s)
	assert.ErrorIs(t, err, ErrNoSystemd)
}

func TestUnitName(t *testing.T) {
	assert.Equal(t, "brokkr-vm-web-1.scope", Unit("web-1"))
}

// systemd's answers arrive as dbus.Error values, also when wrapped.
func TestIsDBusError(t *testing.T) {
	exists := dbus.Error{Name: "org.freedesktop.systemd1.UnitExists"}
	assert.True(t, isDBusError(exists, "org.freedesktop.systemd1.UnitExists"))
	assert.True(t, isDBusError(fmt.Errorf("start: %w", exists), "org.freedesktop.systemd1.UnitExists"))
	assert.False(t, isDBusError(exists, "org.freedesktop.systemd1.NoSuchUnit"))
	assert.False(t, isDBusError(errors.New("org.freedesktop.systemd1.UnitExists"), "org.freedesktop.systemd1.UnitExists"))
	assert.False(t, isDBusError(nil, "org.freedesktop.systemd1.UnitExists"))
}
