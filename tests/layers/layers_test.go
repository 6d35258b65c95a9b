// Package layers checks the direction of the module's imports: no package
// imports one above it, and the three engines not each other (issue 22:
// internal/nstest once imported supervisor, the one arrow that ran up).
// Pure: it parses import lines, no go command, no root.
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
// helpers, the BPF programs and maps, the three engines, the daemon that
// ties them together, the binaries, then the tests that drive them.
func rank(pkg string) int {
	switch top(pkg) {
	case "internal":
		return 0
	case "bpf":
		return 1
	case "netplane", "proxy", "supervisor":
		return 2
	case "daemon":
		return 3
	case "cmd":
		return 4
	case "tests":
		return 5
	}
	return -1 // a directory the layers do not name yet
}

func top(pkg string) string {
	t, _, _ := strings.Cut(pkg, "/")
	return t
}

// wrongWay lists "pkg imports dep" for each import of a higher layer, and
// of another engine: the engines never import each other (the daemon
// wires them).
func wrongWay(imports map[string][]string) []string {
	var out []string
	for pkg, deps := range imports {
		for _, d := range deps {
			if rank(d) > rank(pkg) || (rank(d) == 2 && rank(pkg) == 2 && top(d) != top(pkg)) {
				out = append(out, pkg+" imports "+d)
			}
		}
	}
	return out
}

// moduleImports maps each package directory under root (relative) to the
// module's packages its non-test files import (nil for none).
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
		pkg := filepath.ToSlash(rel)
		deps := out[pkg] // every package has an entry, with module imports or none
		for _, im := range f.Imports {
			if dep, ok := strings.CutPrefix(strings.Trim(im.Path.Value, `"`), module); ok {
				deps = append(deps, dep)
			}
		}
		out[pkg] = deps
		return nil
	})
	require.NoError(t, err)
	return out
}

func TestNoPackageImportsOneAboveItOrAnotherEngine(t *testing.T) {
	imports := moduleImports(t, "../..")
	require.Contains(t, imports, "daemon", "the walk found the module's packages")
	for pkg := range imports {
		assert.NotEqual(t, -1, rank(pkg), "%s: a top-level directory with no layer: give it one in rank", pkg)
	}
	assert.Empty(t, wrongWay(imports))
}

// The check itself: an arrow up or across the engines is found, arrows
// down are not.
func TestWrongWayFindsArrowsUpAndAcross(t *testing.T) {
	assert.ElementsMatch(t, []string{"internal/nstest imports supervisor", "proxy imports netplane/nft"}, wrongWay(map[string][]string{
		"internal/nstest": {"supervisor", "internal/procfs"},
		"proxy":           {"netplane/nft", "bpf"},
	}))
	assert.Empty(t, wrongWay(map[string][]string{
		"daemon":     {"netplane", "internal/spec", "daemon/config"},
		"netplane":   {"netplane/nft", "bpf/ctmark"},
		"cmd/brokkr": {"daemon/api"},
		"tests/e2e":  {"cmd/brokkr", "daemon"},
	}))
}
