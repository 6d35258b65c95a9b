package main

import (
	"os"
	"path/filepath"
	"testing"

	"github.com/brokkr/brokkr/daemon/config"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	"go.uber.org/goleak"
)

func TestMain(m *testing.M) { goleak.VerifyTestMain(m) }

func TestConfigSelection(t *testing.T) {
	if _, err := os.Stat(DefaultConfig); err == nil {
		t.Skipf("%s exists on this machine; the embedded-defaults case cannot be checked here", DefaultConfig)
	}
	path, cfg, err := loadConfig("")
	require.NoError(t, err)
	assert.Equal(t, "", path, "no file: embedded defaults")
	assert.Equal(t, config.Defaults(), cfg)

	_, _, err = loadConfig(filepath.Join(t.TempDir(), "missing.yaml"))
	assert.Error(t, err, "an explicit --config must exist")

	bad := filepath.Join(t.TempDir(), "bad.yaml")
	require.NoError(t, os.WriteFile(bad, []byte("vms: [{name: a, kernel: /k, cpus: 0}]\n"), 0o600))
	_, _, err = loadConfig(bad)
	require.Error(t, err)
	assert.Contains(t, err.Error(), "vms[0].cpus: 0 is out of range")

	good := filepath.Join(t.TempDir(), "good.yaml")
	require.NoError(t, os.WriteFile(good, []byte("network: {bridge: br-test}\n"), 0o600))
	path, cfg, err = loadConfig(good)
	require.NoError(t, err)
	assert.Equal(t, good, path)
	assert.Equal(t, "br-test", cfg.Network.Bridge)
}

func TestOneDaemonPerRunDir(t *testing.T) {
	dir := t.TempDir()
	a, err := lockRunDir(dir)
	require.NoError(t, err)
	_, err = lockRunDir(dir)
	require.Error(t, err)
	assert.Contains(t, err.Error(), "another brokkrd is running")
	require.NoError(t, a.Close())
	b, err := lockRunDir(dir)
	require.NoError(t, err, "the lock goes with the process that held it")
	b.Close()
}

func TestABPFDirOffBPFFSIsAnError(t *testing.T) {
	_, err := openStore(t.TempDir())
	require.Error(t, err, "a bpfDir that is not on a bpffs is never silently a plain directory")
	assert.Contains(t, err.Error(), "not on a bpffs")
}
