package daemon

import (
	"context"
	"errors"
	"os"
	"path/filepath"
	"testing"

	"github.com/brokkr/brokkr/daemon/config"
	"github.com/brokkr/brokkr/internal/spec"
	"github.com/brokkr/brokkr/supervisor"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

// restartWith is a brokkrd start: a new daemon on the same stateDir, with
// the config file at path as it is now.
func restartWith(t *testing.T, stateDir, runDir, path string) (*rig, []byte, *config.Config) {
	t.Helper()
	b, err := os.ReadFile(path)
	require.NoError(t, err)
	cfg, err := config.Parse(b)
	require.NoError(t, err)
	cfg.StateDir, cfg.RunDir = stateDir, runDir
	return newRigWith(t, cfg), b, cfg
}

func power(r *rig, vm string) spec.Power {
	for _, v := range r.d.Desired().VMs {
		if v.Name == vm {
			return spec.Power(v.Power)
		}
	}
	return ""
}

func TestFileOrDesiredJSONOnRestart(t *testing.T) {
	stateDir, runDir := t.TempDir(), shortDir(t)
	file := filepath.Join(t.TempDir(), "brokkr.yaml")
	require.NoError(t, os.WriteFile(file, []byte(rigConfig), 0o600))

	// First start: nothing recorded, so the file is applied (to the same
	// state New took from it) and recorded.
	r, b, cfg := restartWith(t, stateDir, runDir, file)
	applied, plan, err := r.d.StartWithFile(file, b, cfg)
	require.NoError(t, err)
	assert.True(t, applied)
	assert.True(t, plan.VMs.Empty() && plan.Exposures.Empty())
	rec, err := config.ReadApplied(stateDir)
	require.NoError(t, err)
	assert.Equal(t, config.FileHash(b), rec.SHA256)
	assert.Equal(t, file, rec.Path)

	// Run-time changes after it: brokkr vm stop.
	require.NoError(t, r.d.SetPower("db", supervisor.PowerStopped))

	// Restart with the file untouched: desired.json wins, db stays stopped.
	r, b, cfg = restartWith(t, stateDir, runDir, file)
	applied, _, err = r.d.StartWithFile(file, b, cfg)
	require.NoError(t, err)
	assert.False(t, applied)
	assert.Equal(t, supervisor.PowerStopped, power(r, "db"))

	// The file edited while brokkrd was down: the file is applied, and the
	// plan says what that changed (db back to the file's running).
	require.NoError(t, os.WriteFile(file, []byte(rigConfig+"  - {name: new, vm: db, guestPort: 1, hostPort: 9999}\n"), 0o600))
	r, b, cfg = restartWith(t, stateDir, runDir, file)
	applied, plan, err = r.d.StartWithFile(file, b, cfg)
	require.NoError(t, err)
	assert.True(t, applied)
	assert.Equal(t, []string{"new"}, plan.Exposures.Added)
	assert.Equal(t, []string{"db"}, plan.VMs.Changed)
	assert.Equal(t, supervisor.PowerRunning, power(r, "db"))

	// Started with another file: that is a change too.
	other := filepath.Join(t.TempDir(), "other.yaml")
	require.NoError(t, os.WriteFile(other, b, 0o600))
	r, b, cfg = restartWith(t, stateDir, runDir, other)
	applied, _, err = r.d.StartWithFile(other, b, cfg)
	require.NoError(t, err)
	assert.True(t, applied)
}

func TestARejectedFileIsAnErrorNotIgnored(t *testing.T) {
	stateDir, runDir := t.TempDir(), shortDir(t)
	file := filepath.Join(t.TempDir(), "brokkr.yaml")
	require.NoError(t, os.WriteFile(file, []byte(rigConfig), 0o600))
	r, b, cfg := restartWith(t, stateDir, runDir, file)
	_, _, err := r.d.StartWithFile(file, b, cfg)
	require.NoError(t, err)

	require.NoError(t, os.WriteFile(file, []byte(rigConfig+"# edited\n"), 0o600))
	r, b, cfg = restartWith(t, stateDir, runDir, file)
	r.net.invalid = []error{errors.New("hostAddress 192.0.2.1 is not on this host")}
	applied, _, err := r.d.StartWithFile(file, b, cfg)
	assert.True(t, applied)
	require.Error(t, err)
	assert.Contains(t, err.Error(), "not on this host")
	rec, _ := config.ReadApplied(stateDir)
	assert.NotEqual(t, config.FileHash(b), rec.SHA256, "a rejected file is not recorded as applied")
}

// systemctl reload runs `brokkr apply -f FILE`: the API apply of the file's
// own bytes records it, so the next start does not re-apply it over a later
// vm stop.
func TestAPIApplyOfTheFileRecordsIt(t *testing.T) {
	stateDir, runDir := t.TempDir(), shortDir(t)
	file := filepath.Join(t.TempDir(), "brokkr.yaml")
	require.NoError(t, os.WriteFile(file, []byte(rigConfig), 0o600))
	r, b, cfg := restartWith(t, stateDir, runDir, file)
	_, _, err := r.d.StartWithFile(file, b, cfg)
	require.NoError(t, err)

	edited := []byte(rigConfig + "# edited\n")
	require.NoError(t, os.WriteFile(file, edited, 0o600))
	c := serve(t, r)
	_, err = c.Apply(context.Background(), []byte(rigConfig+"# not the file\n"), false)
	require.NoError(t, err)
	rec, _ := config.ReadApplied(stateDir)
	assert.Equal(t, config.FileHash(b), rec.SHA256, "a body that is not the file records nothing")
	_, err = c.Apply(context.Background(), edited, true)
	require.NoError(t, err)
	rec, _ = config.ReadApplied(stateDir)
	assert.Equal(t, config.FileHash(b), rec.SHA256, "a dry run records nothing")
	_, err = c.Apply(context.Background(), edited, false)
	require.NoError(t, err)
	rec, _ = config.ReadApplied(stateDir)
	assert.Equal(t, config.FileHash(edited), rec.SHA256)

	require.NoError(t, r.d.SetPower("web", supervisor.PowerStopped))
	r, b, cfg = restartWith(t, stateDir, runDir, file)
	applied, _, err := r.d.StartWithFile(file, b, cfg)
	require.NoError(t, err)
	assert.False(t, applied)
	assert.Equal(t, supervisor.PowerStopped, power(r, "web"))
}
