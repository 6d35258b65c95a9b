// Package layers checks the direction of the module's imports: no package
// imports one above it (issue 22: internal/nstest once imported
// supervisor, the one arrow that ran up). Pure: it parses import lines,
// no go command, no root.
package layers

import (
	"go/parser"
	"go/token"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

const module = "github.com/brokkr/brokkr/"

// rank is a package's layer, by its first path element: the shared
// model and helpers, then the engines, then the daemon that ties them
// together, then the binaries, then the tests that drive them.
func rank(pkg string) int {
	switch top, _, _ := strings.Cut(pkg, "/"); top {
	case "internal":
		return 0
	case "bpf", "netplane", "proxy", "supervisor":
		return 1
	case "daemon":
		return 2
	case "cmd":
		return 3
	default: // tests
		return 4
	}
}

// upward lists "pkg imports dep" for each import of a higher layer.
func upward(imports map[string][]string) []string {
	var out []string
	for pkg, deps := range imports {
		for _, d := range deps {
			if rank(d) > rank(pkg) {
				out = append(out, pkg+" imports "+d)
			}
		}
	}
	return out
}

// moduleImports maps each package directory under root (relative) to the
// module's packages its non-test files import.
func moduleImports(t *testing.T, root string) map[string][]string {
	t.Helper()
	out := map[string][]string{}
	err := filepath.WalkDir(root, func(p string, d os.DirEntry, err error) error {
		if err != nil {
			return err
		}
		if d.IsDir() && (strings.HasPrefix(d.Name(), ".") || d.Name() == "testdata") && p != root {
			return filepath.SkipDir
		}
		if d.IsDir() || !strings.HasSuffix(p, ".go") || strings.HasSuffix(p, "_test.go") {
			return nil
		}
		f, err := parser.ParseFile(token.NewFileSet(), p, nil, parser.ImportsOnly)
		require.NoError(t, err)
		rel, err := filepath.Rel(root, filepath.Dir(p))
		require.NoError(t, err)
		for _, im := range f.Imports {
			if dep, ok := strings.CutPrefix(strings.Trim(im.Path.Value, `"`), module); ok {
				out[filepath.ToSlash(rel)] = append(out[filepath.ToSlash(rel)], dep)
			}
		}
		return nil
	})
	require.NoError(t, err)
	return out
}

func TestNoPackageImportsOneAboveIt(t *testing.T) {
	imports := moduleImports(t, "../..")
	require.Contains(t, imports, "daemon", "the walk found the module's packages")
	assert.Empty(t, upward(imports))
}

// The check itself: an arrow up is found, arrows down and across are not.
func TestUpwardFindsAnArrowUp(t *testing.T) {
	assert.Equal(t, []string{"internal/nstest imports supervisor"}, upward(map[string][]string{
		"internal/nstest": {"supervisor", "internal/procfs"},
	}))
	assert.Empty(t, upward(map[string][]string{
		"daemon":     {"netplane", "internal/spec", "daemon/config"},
		"cmd/brokkr": {"daemon/api"},
		"tests/e2e":  {"cmd/brokkr", "daemon"},
	}))
}
