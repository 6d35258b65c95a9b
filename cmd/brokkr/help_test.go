package main

import (
	"flag"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/spf13/cobra"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

var update = flag.Bool("update", false, "rewrite the --help golden files under testdata/help")

// commands lists every command brokkr defines (not cobra's own help and
// completion), depth first.
func commands(c *cobra.Command) []*cobra.Command {
	var out []*cobra.Command
	for _, s := range c.Commands() {
		if s.Name() == "help" || s.Name() == "completion" {
			continue
		}
		out = append(out, s)
		out = append(out, commands(s)...)
	}
	return out
}

// Changes to --help are deliberate: go test ./cmd/brokkr -run Help -update
// rewrites testdata/help, and the diff is reviewed with the change.
func TestHelpGolden(t *testing.T) {
	t.Setenv("BROKKR_SOCKET", "") // the default shown must not depend on the caller's environment
	root := newRoot()
	paths := [][]string{{}}
	for _, c := range commands(root) {
		paths = append(paths, strings.Fields(strings.TrimPrefix(c.CommandPath(), "brokkr")))
	}
	seen := map[string]bool{}
	for _, p := range paths {
		name := strings.Join(append([]string{"brokkr"}, p...), "_") + ".txt"
		seen[name] = true
		out, errs, code := run(t, append(p, "--help")...)
		require.Equal(t, 0, code, errs)
		golden := filepath.Join("testdata", "help", name)
		if *update {
			require.NoError(t, os.MkdirAll(filepath.Dir(golden), 0o755))
			require.NoError(t, os.WriteFile(golden, []byte(out), 0o644))
			continue
		}
		want, err := os.ReadFile(golden)
		require.NoError(t, err, "no golden file; run go test ./cmd/brokkr -run Help -update")
		assert.Equal(t, string(want), out, "%s changed; if deliberate, run go test ./cmd/brokkr -run Help -update", golden)
	}
	files, err := filepath.Glob(filepath.Join("testdata", "help", "*.txt"))
	require.NoError(t, err)
	for _, f := range files {
		assert.True(t, seen[filepath.Base(f)], "%s is the help of no command; remove it", f)
	}
}

func TestEveryCommandHasLongHelpAndExamples(t *testing.T) {
	root := newRoot()
	for _, c := range append([]*cobra.Command{root}, commands(root)...) {
		assert.NotEmpty(t, c.Long, "%s has no Long", c.CommandPath())
		assert.NotEmpty(t, c.Example, "%s has no Example", c.CommandPath())
		for _, line := range strings.Split(c.Example, "\n") {
			assert.True(t, strings.HasPrefix(line, "  brokkr ") || strings.HasPrefix(line, "  source <(brokkr") || strings.Contains(line, "| brokkr "),
				"%s: example %q does not run brokkr", c.CommandPath(), line)
		}
	}
}
