package main

import (
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"syscall"

	"github.com/brokkr/brokkr/daemon/api"
)

func newClient(sock string) *api.Client { return api.NewClient(sock) }

func syscallKill0(pid int) error { return syscall.Kill(pid, 0) }

// perm: the API socket is 0600 root, a non-root CLI caller is told
// "permission denied", and nothing under stateDir or runDir is world-readable.
func (x *h) perm() {
	fi, err := os.Stat(x.sock)
	if err != nil {
		x.fail("perm: %v", err)
		return
	}
	st := fi.Sys().(*syscall.Stat_t)
	x.figure("perm.socket", fmt.Sprintf("%04o uid=%d", fi.Mode().Perm(), st.Uid), x.sock)
	x.check("perm.socket_is_0600_root", b2i(fi.Mode().Perm() == 0o600 && st.Uid == 0), 1, "")
	cmd := exec.Command("setpriv", "--reuid=65534", "--regid=65534", "--clear-groups", filepath.Join(x.bin, "brokkr"), "--socket", x.sock, "status")
	out, err := cmd.CombinedOutput()
	code := 0
	if ee, ok := err.(*exec.ExitError); ok {
		code = ee.ExitCode()
	}
	msg := strings.TrimSpace(string(out))
	x.figure("perm.nobody_cli", fmt.Sprintf("exit %d", code), msg)
	x.check("perm.nobody_told_permission_denied", b2i(code != 0 && strings.Contains(strings.ToLower(msg), "permission denied")), 1, "")
	var readable []string
	for _, dir := range []string{x.state, x.run} {
		_ = filepath.Walk(dir, func(p string, info os.FileInfo, err error) error {
			if err == nil && !info.IsDir() && info.Mode().Perm()&0o004 != 0 {
				readable = append(readable, p)
			}
			return nil
		})
	}
	x.check("perm.world_readable_files", int64(len(readable)), 0, strings.Join(readable, " "))
	leases := filepath.Join(x.state, "netplane", "leases.json")
	if fi, err := os.Stat(leases); err == nil {
		x.figure("perm.leases", fmt.Sprintf("%04o", fi.Mode().Perm()), leases)
	}
}
