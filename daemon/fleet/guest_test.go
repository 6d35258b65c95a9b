package fleet_test

import (
	"bytes"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"syscall"
	"testing"
	"time"

	"github.com/brokkr/brokkr/daemon/fleet"
	"github.com/brokkr/brokkr/internal/nstest"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

// TestFleetRealGuest boots the test guest on a node from a fleet document,
// calls it through the published port, and restarts the daemon: the node
// adopts its VM as a single host does (same pid, no second spawn) and does
// not apply its document again.
func TestFleetRealGuest(t *testing.T) {
	needEnv(t)
	guest, err := filepath.Abs("../../.cache/guest")
	require.NoError(t, err)
	for _, f := range []string{"vmlinuz", "initramfs.cpio.gz"} {
		if _, err := os.Stat(filepath.Join(guest, f)); err != nil {
			t.Skipf("the guest image is missing (%v): run make guest-image", err)
		}
	}
	if _, err := exec.LookPath("qemu-system-x86_64"); err != nil {
		t.Skip("qemu-system-x86_64 is not installed (scripts/deps.sh)")
	}
	c := newCluster(t, 3, nil)
	cli := c.client(t, fleet.ClientConfig{})
	h1 := newNode(t, c, 1, "")
	t.Cleanup(func() { // VMs outlive brokkrd by design; the test's go with it
		for _, pid := range qemuPIDs(h1.run) {
			_ = syscall.Kill(pid, syscall.SIGKILL)
		}
	})
	doc := fmt.Sprintf(`network: %s
vms:
  - name: g1
    memory: 256M
    kernel: %s/vmlinuz
    initramfs: %s/initramfs.cpio.gz
    cmdline: "console=ttyS0 brokkr.name=g1"
exposures:
  - {name: echo, vm: g1, guestPort: 7000, hostPort: 7000, mode: nat}
`, h1.network(), guest, guest)
	f := writeFile(t, t.TempDir(), "g1.yaml", doc)
	out, errs, code := brokkr(t, c, nil, "fleet", "apply", "--node", "h1", "-f", f)
	require.Equal(t, 0, code, out+errs)
	assert.Contains(t, out, "+ vm g1")

	running := func() (bool, string) {
		for _, r := range list(t, cli) {
			if r.Node == "h1" {
				ok, s := converged([]fleet.NodeState{r}, "h1", 1)
				return ok && r.VMsRunning == 1, s
			}
		}
		return false, "no row"
	}
	waitFor(t, 3*time.Minute, "g1 running and its port active in h1's fleet status", running)
	waitFor(t, time.Minute, "the guest answering through h1's published port", func() (bool, string) {
		err := h1.echo(7000)
		return err == nil, fmt.Sprint(err)
	})
	before := h1.status().VMs[0]
	require.NotZero(t, before.PID)
	require.Len(t, qemuPIDs(h1.run), 1)

	h1.stop()
	require.NoError(t, h1.echo(7000), "the guest serves with the daemon down")
	h1.start()
	// The restarted daemon's own status, not the fleet row: etcd may still
	// hold the report the previous process wrote.
	waitFor(t, time.Minute, "h1 running its VM after the restart", func() (bool, string) {
		st := h1.status()
		if len(st.VMs) != 1 {
			return false, fmt.Sprint(st.VMs)
		}
		return st.VMs[0].Phase == "running" && st.VMs[0].PID != 0, fmt.Sprintf("%+v", st.VMs[0])
	})
	waitFor(t, time.Minute, "h1 converged after the restart", running)
	after := h1.status().VMs[0]
	assert.Equal(t, before.PID, after.PID, "adopted, not respawned")
	assert.Equal(t, 0, after.Restarts)
	assert.Equal(t, []int{before.PID}, qemuPIDs(h1.run), "one hypervisor process")
	require.NoError(t, h1.echo(7000))
	b, _ := os.ReadFile(h1.logPath)
	assert.Equal(t, 1, bytes.Count(b, []byte("desired document applied")), "the document is not applied again")
}

// qemuPIDs lists the hypervisor processes of a node (by its runDir).
func qemuPIDs(run string) []int { return nstest.LiveProcs("qemu-system", run+"/") }
