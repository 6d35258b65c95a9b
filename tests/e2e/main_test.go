// Package e2e tests brokkr black-box through its two binaries: brokkrd runs
// in a host namespace of the test's own (nsenter --net, so bpffs stays
// visible), a client namespace calls the published ports over veth, and one
// real VM (QEMU, TCG here) is booted and shared by the tests that need no
// daemon of their own (sharedEnv).
package e2e

import (
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"testing"

	"github.com/brokkr/brokkr/internal/nstest"
	"go.uber.org/goleak"
)

// bin holds the binaries built once for the whole package.
var bin string

func TestMain(m *testing.M) {
	nstest.CallerMain() // the socket path's callers run as this binary, in a child cgroup
	if !nstest.Privileged() {
		goleak.VerifyTestMain(m) // every test skips without root
	}
	// BROKKR_E2E_BIN names a directory with brokkrd and brokkr already
	// built: make test-kernels runs this package's test binary in a VM that
	// has no Go toolchain.
	prebuilt := os.Getenv("BROKKR_E2E_BIN")
	dir := prebuilt
	if dir == "" {
		var err error
		if dir, err = os.MkdirTemp("", "brk-e2e-bin-"); err != nil {
			fmt.Fprintln(os.Stderr, err)
			os.Exit(2)
		}
		cmd := exec.Command("go", "build", "-o", dir+"/", "github.com/brokkr/brokkr/cmd/brokkrd", "github.com/brokkr/brokkr/cmd/brokkr")
		cmd.Stdout, cmd.Stderr = os.Stderr, os.Stderr
		if err := cmd.Run(); err != nil {
			fmt.Fprintln(os.Stderr, "e2e: building the binaries:", err)
			os.RemoveAll(dir)
			os.Exit(2)
		}
	}
	bin = dir
	// goleak.VerifyTestMain exits by itself; the same check by hand lets the
	// binaries be removed afterwards.
	code := m.Run()
	stopShared()
	if code == 0 {
		if err := goleak.Find(); err != nil {
			fmt.Fprintln(os.Stderr, "goleak:", err)
			code = 1
		}
	}
	if prebuilt == "" {
		os.RemoveAll(dir)
	}
	os.Exit(code)
}

func repoRoot(t testing.TB) string {
	t.Helper()
	out, err := exec.Command("go", "env", "GOMOD").Output()
	if err != nil {
		t.Fatalf("go env GOMOD: %v", err)
	}
	return filepath.Dir(string(trimNL(out)))
}

func trimNL(b []byte) []byte {
	for len(b) > 0 && (b[len(b)-1] == '\n' || b[len(b)-1] == '\r') {
		b = b[:len(b)-1]
	}
	return b
}
