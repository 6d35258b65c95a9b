package main

import (
	"bytes"
	"flag"
	"os"
	"path/filepath"
	"testing"

	"github.com/brokkr/brokkr/daemon/api"
	"github.com/brokkr/brokkr/daemon/config"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	"go.uber.org/goleak"
)

func TestMain(m *testing.M) {
	if role := os.Getenv(handoverRoleEnv); role != "" {
		os.Exit(handoverRole(role))
	}
	goleak.VerifyTestMain(m)
}

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

func brokkrd(t *testing.T, args ...string) (string, string, int) {
	t.Helper()
	var out, errb bytes.Buffer
	code := execute(args, &out, &errb)
	return out.String(), errb.String(), code
}

func TestCheck(t *testing.T) {
	dir := t.TempDir()
	good := filepath.Join(dir, "good.yaml")
	bad := filepath.Join(dir, "bad.yaml")
	require.NoError(t, os.WriteFile(good, []byte("vms: [{name: a, kernel: /k}]\nmetrics: {listen: 127.0.0.1:9464}\n"), 0o600))
	require.NoError(t, os.WriteFile(bad, []byte("vms:\n  - name: a\n    kernel: /k\n    cpus: many\nmetrics: {listen: nowhere}\n"), 0o600))

	out, _, code := brokkrd(t, "--config", good, "--check")
	assert.Equal(t, 0, code)
	assert.Equal(t, good+": valid (1 VMs, 0 exposures)\n", out)

	_, errs, code := brokkrd(t, "--config", bad, "--check")
	assert.Equal(t, 1, code)
	assert.Contains(t, errs, bad+": invalid config:\n")
	assert.Contains(t, errs, `  vms[0].cpus: "many" is not an integer`)

	_, errs, code = brokkrd(t, "--check", "--config", filepath.Join(dir, "missing.yaml"))
	assert.Equal(t, 1, code, "an explicit --config must exist")
	assert.Contains(t, errs, "missing.yaml")

	// The Go-flag spelling of old unit files still works.
	out, _, code = brokkrd(t, "-config", good, "-check")
	assert.Equal(t, 0, code)
	assert.Contains(t, out, "valid")
	out, _, code = brokkrd(t, "-config="+good, "--check")
	assert.Equal(t, 0, code)
	assert.Contains(t, out, "valid")
}

func TestFlagErrors(t *testing.T) {
	_, errs, code := brokkrd(t, "--log-format", "xml", "--check")
	assert.Equal(t, 1, code)
	assert.Contains(t, errs, `--log-format "xml": want text or json`)
	_, _, code = brokkrd(t, "--nope")
	assert.Equal(t, 1, code)
	_, _, code = brokkrd(t, "extra")
	assert.Equal(t, 1, code, "brokkrd takes no arguments")
}

func TestVersion(t *testing.T) {
	out, _, code := brokkrd(t, "--version")
	assert.Equal(t, 0, code)
	assert.Equal(t, "brokkrd "+api.CurrentBuild().String()+"\n", out)
}

func TestLegacyArgs(t *testing.T) {
	assert.Equal(t, []string{"--config", "f", "--log-json", "--debug=true"}, legacyArgs([]string{"-config", "f", "-log-json", "-debug=true"}))
	assert.Equal(t, []string{"--config", "f", "-x", "--", "-config"}, legacyArgs([]string{"--config", "f", "-x", "--", "-config"}),
		"unknown shorthands and anything after -- are left alone")
}

var update = flag.Bool("update", false, "rewrite testdata/help.txt")

// Changes to --help are deliberate: go test ./cmd/brokkrd -run Help -update.
func TestHelpGolden(t *testing.T) {
	out, errs, code := brokkrd(t, "--help")
	require.Equal(t, 0, code, errs)
	golden := filepath.Join("testdata", "help.txt")
	if *update {
		require.NoError(t, os.MkdirAll("testdata", 0o755))
		require.NoError(t, os.WriteFile(golden, []byte(out), 0o644))
		return
	}
	want, err := os.ReadFile(golden)
	require.NoError(t, err)
	assert.Equal(t, string(want), out, "brokkrd --help changed; if deliberate, run go test ./cmd/brokkrd -run Help -update")
	assert.Contains(t, out, "Examples:")
	assert.NotContains(t, out, "log-json", "the deprecated flag is not advertised")
}
