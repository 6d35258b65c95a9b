package systemd

import (
	"context"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/brokkr/brokkr/daemon/api"
	"github.com/brokkr/brokkr/internal/nstest"
	"github.com/brokkr/brokkr/supervisor"
	"github.com/brokkr/brokkr/supervisor/scope"
	"github.com/brokkr/brokkr/tests/chfake"
)

// dist/brokkrd.service itself, run by the test's systemd with brokkrd and
// the cloud-hypervisor fake: only the binaries' and the config file's paths
// are changed, and a drop-in adds the environment a test needs (the bus,
// no cgroup BPF attach). `systemctl start` returns once brokkrd said READY;
// the VM runs in its scope; `systemctl stop` (the unit's default KillMode)
// leaves it running; the next start adopts it.
func TestDistUnitKeepsVMsAcrossAStop(t *testing.T) {
	if skipWhy != "" {
		t.Skip(skipWhy)
	}
	requireSystemd(t)
	// Not under /tmp: the unit has PrivateTmp=yes.
	base := filepath.Join("/var/lib", nstest.Name(t, "unit"))
	_ = os.RemoveAll(base)
	require.NoError(t, os.MkdirAll(base, 0o700))
	t.Cleanup(func() { killFakes(base); os.RemoveAll(base) })
	m := startManagerIn(t, base)
	ctx := context.Background()

	bin := filepath.Join(base, "bin")
	out, err := exec.Command("go", "build", "-o", bin+"/", "github.com/brokkr/brokkr/cmd/brokkrd", "github.com/brokkr/brokkr/cmd/brokkr").CombinedOutput()
	require.NoError(t, err, "%s", out)
	fake, err := os.ReadFile(fakeBin)
	require.NoError(t, err)
	require.NoError(t, os.WriteFile(filepath.Join(bin, "chfake"), fake, 0o755))
	// The unit's PrivateTmp and ProtectHome hide a checkout under /tmp,
	// /home or /root from the daemon and its VMMs: the fake's schema goes
	// beside it.
	schema, err := os.ReadFile(specPath)
	require.NoError(t, err)
	require.NoError(t, os.WriteFile(filepath.Join(bin, "cloud-hypervisor.yaml"), schema, 0o644))
	require.NoError(t, chfake.WriteLauncher(filepath.Join(bin, "cloud-hypervisor"), filepath.Join(bin, "chfake"), filepath.Join(bin, "cloud-hypervisor.yaml")))
	require.NoError(t, os.WriteFile(filepath.Join(base, "vmlinuz"), []byte("not really a kernel"), 0o600))
	run := filepath.Join(base, "run")
	cfgPath := filepath.Join(base, "brokkr.yaml")
	require.NoError(t, os.WriteFile(cfgPath, []byte(`stateDir: `+filepath.Join(base, "state")+`
runDir: `+run+`
bpfDir: /run/brk-bpf/brokkr
network:
  bridge: brk-sd0
  cidr: 10.213.9.1/24
hypervisor:
  kind: cloud-hypervisor
  path: `+filepath.Join(bin, "cloud-hypervisor")+`
vms:
  - name: web
    memory: 64M
    kernel: `+filepath.Join(base, "vmlinuz")+`
exposures:
  - {name: px, target: 10.213.9.200, guestPort: 7000, hostPort: 7300, hostAddress: 127.0.0.1, mode: proxy}
`), 0o600))

	logPath := filepath.Join(base, "brokkrd.log") // no journald here
	unit, err := os.ReadFile(filepath.Join("..", "..", "dist", "brokkrd.service"))
	require.NoError(t, err)
	text := strings.NewReplacer("/usr/local/bin/", bin+"/", "/etc/brokkr/brokkr.yaml", cfgPath).Replace(string(unit))
	units := filepath.Join(m.runtime, ".config", "systemd", "user") // $HOME is the runtime dir
	require.NoError(t, os.MkdirAll(filepath.Join(units, "brokkrd.service.d"), 0o755))
	require.NoError(t, os.WriteFile(filepath.Join(units, "brokkrd.service"), []byte(text), 0o644))
	require.NoError(t, os.WriteFile(filepath.Join(units, "brokkrd.service.d", "test.conf"), []byte(
		"[Service]\nEnvironment=DBUS_SYSTEM_BUS_ADDRESS="+m.busAddress()+" BROKKR_CGROUP=off\n"+
			"StandardOutput=append:"+logPath+"\nStandardError=append:"+logPath+"\n"), 0o644))
	require.NoError(t, m.conn.ReloadContext(ctx))

	journal := func() string {
		b, _ := os.ReadFile(logPath)
		props, _ := m.conn.GetUnitTypePropertiesContext(ctx, "brokkrd.service", "Service")
		var why []string
		for _, k := range []string{"Result", "ExecMainCode", "ExecMainStatus", "StatusText", "ExecStartPre"} {
			why = append(why, fmt.Sprintf("%s=%v", k, props[k]))
		}
		ml, _ := os.ReadFile(filepath.Join(m.runtime, "manager.log"))
		return strings.Join(why, " ") + "\nbrokkrd:\n" + string(b) + "\nmanager:\n" + string(ml)
	}
	start := func() {
		t.Helper()
		done := make(chan string, 1)
		_, err := m.conn.StartUnitContext(ctx, "brokkrd.service", "replace", done)
		require.NoError(t, err)
		select {
		case r := <-done:
			require.Equal(t, "done", r, "systemctl start brokkrd; manager log:\n%s", journal())
		case <-time.After(60 * time.Second):
			t.Fatal("brokkrd.service did not start within 60 s")
		}
	}
	t.Cleanup(func() { _, _ = m.conn.StopUnitContext(ctx, "brokkrd.service", "replace", nil) })

	start() // returns after READY=1: the first pass has run
	client := api.NewClient(filepath.Join(run, "brokkr.sock"))
	var pid int
	if !assert.Eventually(t, func() bool {
		st, err := client.Status(ctx)
		if err != nil || len(st.VMs) != 1 || st.VMs[0].Phase != "running" {
			return false
		}
		pid = st.VMs[0].PID
		return true
	}, 30*time.Second, 50*time.Millisecond) {
		st, err := client.Status(ctx)
		t.Fatalf("the VM is not running: %+v %v\n%s", st, err, journal())
	}
	st, err := client.Status(ctx)
	require.NoError(t, err)
	assert.NotContains(t, strings.Join(st.Warnings, "\n"), "scope", "no warning about the VMs' scopes")
	assert.Equal(t, webScope, m.relCgroup(pid), "the VMM runs in its scope")
	mainPID, err := m.conn.GetServicePropertyContext(ctx, "brokkrd.service", "MainPID")
	require.NoError(t, err)
	assert.Equal(t, "/app.slice/brokkrd.service", m.relCgroup(int(mainPID.Value.Value().(uint32))))
	vmStart, err := supervisor.ProcStartTime(pid)
	require.NoError(t, err)

	m.waitJob("systemctl stop brokkrd", func(done chan<- string) error {
		_, err := m.conn.StopUnitContext(ctx, "brokkrd.service", "replace", done)
		return err
	})
	assert.True(t, alive(pid, vmStart), "the VM survives `systemctl stop brokkrd`")
	b, _ := os.ReadFile(filepath.Join(m.cgroup, "app.slice", "brokkrd.service", "cgroup.procs"))
	assert.Empty(t, strings.TrimSpace(string(b)), "nothing is left in the stopped unit's cgroup")

	start()
	// READY=1 follows the first pass; the VM's worker adopts it right
	// after (a fresh-clone run saw "starting", pid 0, at READY). What
	// matters is that the running process is adopted, never replaced.
	var last *api.Status
	assert.Eventually(t, func() bool {
		st, err := client.Status(ctx)
		if err != nil || len(st.VMs) != 1 {
			return false
		}
		last = st
		return st.VMs[0].Phase == "running"
	}, 15*time.Second, 50*time.Millisecond, "the VM running again after the restart")
	require.NotNil(t, last, "no status after the restart")
	require.Len(t, last.VMs, 1)
	assert.Equal(t, pid, last.VMs[0].PID, "the next brokkrd adopts the VM")
	assert.True(t, alive(pid, vmStart), "the same process, not a second one")
	assert.Equal(t, "active", m.activeState(scope.Unit("web")))

	// The fd store, as the README's restart table says per systemd version:
	// a crash's automatic restart (Restart=on-failure) and `systemctl
	// restart` keep the proxy's listener on every version with the store
	// (219: it is kept while a restart is pending); a stop and a start
	// keep it only with FileDescriptorStorePreserve= (254).
	daemonPID := func() int {
		v, err := m.conn.GetServicePropertyContext(ctx, "brokkrd.service", "MainPID")
		require.NoError(t, err)
		return int(v.Value.Value().(uint32))
	}
	listener := func() string {
		t.Helper()
		var ino string
		if !assert.Eventually(t, func() bool { ino = listenInode(daemonPID(), 7300); return ino != "" }, 15*time.Second, 50*time.Millisecond) {
			st, err := client.Status(ctx)
			t.Fatalf("the proxy does not listen on 127.0.0.1:7300 (pid %d): %+v %v\n%s", daemonPID(), st, err, journal())
		}
		// Listening comes before the FDSTORE=1 message reaches systemd.
		require.Eventually(t, func() bool {
			v, err := m.conn.GetServicePropertyContext(ctx, "brokkrd.service", "NFileDescriptorStore")
			return err == nil && v.Value.Value().(uint32) == 1
		}, 10*time.Second, 50*time.Millisecond, "the listener is in the unit's fd store")
		return ino
	}
	version := systemdVersion(t, m)
	ino := listener()
	crashed := daemonPID()
	require.NoError(t, syscall.Kill(crashed, syscall.SIGKILL))
	require.Eventually(t, func() bool { p := daemonPID(); return p != 0 && p != crashed }, 30*time.Second, 100*time.Millisecond,
		"systemd restarts brokkrd after the crash (Restart=on-failure)")
	assert.Equal(t, ino, listener(), "systemd %d: a crash's restart keeps the listener (the fd store)", version)

	ino = listener()
	m.waitJob("systemctl restart brokkrd", func(done chan<- string) error {
		_, err := m.conn.RestartUnitContext(ctx, "brokkrd.service", "replace", done)
		return err
	})
	restartKept := listener() == ino
	assert.True(t, restartKept, "systemd %d: systemctl restart keeps the listener (a restart job keeps the store)", version)
	ino = listener()
	m.waitJob("systemctl stop brokkrd", func(done chan<- string) error {
		_, err := m.conn.StopUnitContext(ctx, "brokkrd.service", "replace", done)
		return err
	})
	start()
	stopKept := listener() == ino
	assert.Equal(t, version >= 254, stopKept, "systemd %d: a stop and a start keep the listener only with FileDescriptorStorePreserve= (254)", version)
	t.Logf("systemd %d: the listener kept across a crash: yes; systemctl restart: %v; stop and start: %v", version, restartKept, stopKept)
}

// listenInode is the inode of pid's TCP socket listening on port, from the
// /proc/PID/net/tcp of its network namespace ("" when none listens).
func listenInode(pid, port int) string {
	b, err := os.ReadFile(fmt.Sprintf("/proc/%d/net/tcp", pid))
	if err != nil {
		return ""
	}
	want := fmt.Sprintf(":%04X", port)
	for _, l := range strings.Split(string(b), "\n")[1:] {
		f := strings.Fields(l)
		if len(f) > 9 && strings.HasSuffix(f[1], want) && f[3] == "0A" {
			return f[9]
		}
	}
	return ""
}

// systemdVersion is the manager's version number (its Version property,
// "252.38-1~deb12u1" on Debian 12).
func systemdVersion(t *testing.T, m *manager) int {
	t.Helper()
	v, err := m.conn.GetManagerProperty("Version")
	require.NoError(t, err)
	s := strings.Trim(v, `"`)
	n := 0
	for _, c := range s {
		if c < '0' || c > '9' {
			break
		}
		n = n*10 + int(c-'0')
	}
	require.NotZero(t, n, "systemd version %q", s)
	return n
}
