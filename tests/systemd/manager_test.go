package systemd

import (
	"bufio"
	"context"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"syscall"
	"testing"
	"time"

	sddbus "github.com/coreos/go-systemd/v22/dbus"
	"github.com/godbus/dbus/v5"
	"golang.org/x/sys/unix"

	"github.com/brokkr/brokkr/internal/nstest"
	"github.com/brokkr/brokkr/supervisor/scope"
)

// manager is a real systemd (the user-mode manager, `systemd --user`, which
// serves the same org.freedesktop.systemd1 API as the system manager,
// StartTransientUnit included) started for one test:
//   - in a cgroup v2 child cgroup the test creates (and removes), so every
//     unit it makes lives below it and the host's cgroups are not touched;
//   - in a mount namespace of its own where /sys/fs/cgroup is a cgroup2
//     mount (systemd then runs in unified mode, also on a hybrid host) and
//     /run is a fresh tmpfs holding /run/systemd/system (what sd_booted(3)
//     looks for, so `systemd --user` and scope.Detect accept it);
//   - in a network namespace of its own, empty, so none of its units can
//     touch the host's network;
//   - with a bpffs of its own at /run/brk-bpf, for a brokkrd run as its unit,
//     and /run/systemd/inaccessible, which a booting systemd would make.
//
// Its runtime directory ($XDG_RUNTIME_DIR) is on the host's /tmp: the test
// reaches its session bus (a dbus-daemon it socket-activates) there, and
// pids are the host's (no PID namespace), as with the system manager.
type manager struct {
	t       *testing.T
	cgroup  string // the host path of the manager's cgroup
	runtime string // $XDG_RUNTIME_DIR
	cmd     *exec.Cmd
	conn    *sddbus.Conn
}

// busAddress is the manager's session bus, which stands for the system bus.
func (m *manager) busAddress() string { return "unix:path=" + filepath.Join(m.runtime, "bus") }

func requireSystemd(t *testing.T) {
	t.Helper()
	if !nstest.Privileged() {
		t.Skip("needs root: runs a systemd in a cgroup and namespaces of its own")
	}
	for _, bin := range []string{"/lib/systemd/systemd", "/usr/bin/dbus-daemon"} {
		if _, err := os.Stat(bin); err != nil {
			t.Skipf("needs %s (Debian packages systemd and dbus): %v", bin, err)
		}
	}
}

// cgroup2Mount finds where the cgroup v2 hierarchy is mounted (on a hybrid
// host /sys/fs/cgroup/unified) and this process's cgroup in it.
func cgroup2Mount() (mount, self string, err error) {
	f, err := os.Open("/proc/self/mountinfo")
	if err != nil {
		return "", "", err
	}
	defer f.Close()
	sc := bufio.NewScanner(f)
	for sc.Scan() {
		// ID parent major:minor root mountpoint opts... - fstype source superopts
		l := sc.Text()
		i := strings.Index(l, " - ")
		if i < 0 || !strings.HasPrefix(l[i+3:], "cgroup2 ") {
			continue
		}
		if f := strings.Fields(l[:i]); len(f) >= 5 && f[3] == "/" {
			mount = f[4]
			break
		}
	}
	if mount == "" {
		return "", "", errors.New("no cgroup2 hierarchy is mounted")
	}
	b, err := os.ReadFile("/proc/self/cgroup")
	if err != nil {
		return "", "", err
	}
	for _, l := range strings.Split(string(b), "\n") {
		if p, ok := strings.CutPrefix(l, "0::"); ok {
			return mount, p, nil
		}
	}
	return "", "", errors.New("/proc/self/cgroup has no cgroup v2 line")
}

func startManager(t *testing.T) *manager { return startManagerIn(t, "") }

// startManagerIn keeps the manager's runtime directory under base ("" is
// the temp dir): units with PrivateTmp= cannot see the bus in /tmp.
func startManagerIn(t *testing.T, base string) *manager {
	t.Helper()
	requireSystemd(t)
	mnt, self, err := cgroup2Mount()
	if err != nil {
		t.Skipf("needs cgroup v2: %v", err)
	}
	m := &manager{t: t, cgroup: filepath.Join(mnt, self, nstest.Name(t, "sd"))}
	removeCgroup(m.cgroup) // a leftover of a killed run
	if err := os.Mkdir(m.cgroup, 0o755); err != nil {
		t.Fatalf("create cgroup: %v", err)
	}
	// Short: unix socket paths under it must stay below 108 bytes.
	if m.runtime, err = os.MkdirTemp(base, "brk-sd"); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(m.stop)

	cg, err := os.Open(m.cgroup)
	if err != nil {
		t.Fatal(err)
	}
	defer cg.Close()
	script := `set -e
mount -t cgroup2 cgroup2 /sys/fs/cgroup
mount -t tmpfs tmpfs /run
mkdir -p /run/systemd/system /run/brk-bpf
mount -t bpf bpf /run/brk-bpf
# The new network namespace's loopback, for services that listen on it.
ip link set lo up
# What a booting systemd makes in /run: the nodes that sandboxing options
# (ProtectHome=, InaccessiblePaths=...) mount over the paths they hide.
mkdir -p /run/systemd/inaccessible
cd /run/systemd/inaccessible
mkdir dir; touch reg; mkfifo fifo; mknod chr c 0 0; mknod blk b 0 0
chmod 0000 dir reg fifo chr blk
cd /
exec /lib/systemd/systemd --user --log-target=console`
	m.cmd = exec.Command("/bin/sh", "-c", script)
	m.cmd.Env = []string{"PATH=/usr/sbin:/usr/bin:/sbin:/bin", "HOME=" + m.runtime, "XDG_RUNTIME_DIR=" + m.runtime}
	log, err := os.Create(filepath.Join(m.runtime, "manager.log"))
	if err != nil {
		t.Fatal(err)
	}
	defer log.Close()
	m.cmd.Stdout, m.cmd.Stderr = log, log
	m.cmd.SysProcAttr = &syscall.SysProcAttr{
		// Go makes / private in the new mount namespace, so none of the
		// mounts above propagate to the host.
		Unshareflags: unix.CLONE_NEWNS | unix.CLONE_NEWNET,
		UseCgroupFD:  true, CgroupFD: int(cg.Fd()),
	}
	if err := m.cmd.Start(); err != nil {
		t.Fatalf("start systemd --user: %v", err)
	}

	deadline := time.Now().Add(20 * time.Second)
	for {
		if _, err := os.Stat(filepath.Join(m.runtime, "bus")); err == nil {
			if m.conn, err = m.dial(context.Background()); err == nil {
				break
			}
		}
		if time.Now().After(deadline) {
			b, _ := os.ReadFile(filepath.Join(m.runtime, "manager.log"))
			t.Fatalf("systemd --user did not come up within 20 s; its log:\n%s", b)
		}
		time.Sleep(50 * time.Millisecond)
	}
	return m
}

// dial connects to the manager over its bus, as a client of dbus-daemon,
// the way brokkrd reaches the system manager over the system bus.
func (m *manager) dial(ctx context.Context) (*sddbus.Conn, error) {
	return dialBus(m.busAddress())(ctx)
}

// dialBus connects to the systemd behind the bus at addr (a D-Bus address).
func dialBus(addr string) scope.Dialer {
	return func(ctx context.Context) (*sddbus.Conn, error) {
		return sddbus.NewConnection(func() (*dbus.Conn, error) {
			c, err := dbus.Dial(addr, dbus.WithContext(ctx))
			if err != nil {
				return nil, err
			}
			if err := c.Auth([]dbus.Auth{dbus.AuthExternal("0")}); err != nil {
				c.Close()
				return nil, err
			}
			if err := c.Hello(); err != nil {
				c.Close()
				return nil, err
			}
			return c, nil
		})
	}
}

func (m *manager) stop() {
	if m.conn != nil {
		m.conn.Close()
	}
	if m.cmd != nil && m.cmd.Process != nil {
		_ = m.cmd.Process.Signal(syscall.SIGTERM) // the manager stops its units
		done := make(chan struct{})
		go func() { _ = m.cmd.Wait(); close(done) }()
		select {
		case <-done:
		case <-time.After(10 * time.Second):
			_ = m.cmd.Process.Kill()
			<-done
		}
	}
	removeCgroup(m.cgroup)
	if m.runtime != "" {
		_ = os.RemoveAll(m.runtime)
	}
}

// removeCgroup kills whatever is left in the subtree (cgroup.kill) and
// removes its cgroups, deepest first.
func removeCgroup(dir string) {
	if _, err := os.Stat(dir); err != nil {
		return
	}
	_ = os.WriteFile(filepath.Join(dir, "cgroup.kill"), []byte("1"), 0)
	deadline := time.Now().Add(5 * time.Second)
	for {
		var dirs []string
		_ = filepath.WalkDir(dir, func(p string, d os.DirEntry, err error) error {
			if err == nil && d.IsDir() {
				dirs = append(dirs, p)
			}
			return nil
		})
		var left error
		for i := len(dirs) - 1; i >= 0; i-- {
			if err := os.Remove(dirs[i]); err != nil {
				left = err
			}
		}
		if left == nil || time.Now().After(deadline) {
			return
		}
		time.Sleep(50 * time.Millisecond)
	}
}

// cgroupOf returns pid's cgroup v2 path (the 0:: line of /proc/PID/cgroup).
func cgroupOf(pid int) (string, error) {
	b, err := os.ReadFile(fmt.Sprintf("/proc/%d/cgroup", pid))
	if err != nil {
		return "", err
	}
	for _, l := range strings.Split(string(b), "\n") {
		if p, ok := strings.CutPrefix(l, "0::"); ok {
			return p, nil
		}
	}
	return "", fmt.Errorf("/proc/%d/cgroup has no cgroup v2 line", pid)
}

// relCgroup is pid's cgroup relative to the manager's: "/brokkr.slice/...".
func (m *manager) relCgroup(pid int) string {
	m.t.Helper()
	p, err := cgroupOf(pid)
	if err != nil {
		m.t.Fatal(err)
	}
	_, self, _ := cgroup2Mount()
	base := filepath.Join(self, filepath.Base(m.cgroup))
	rel, ok := strings.CutPrefix(p, base)
	if !ok {
		return "outside the manager: " + p
	}
	return rel
}

// activeState is the unit's ActiveState, "" when systemd does not have it.
func (m *manager) activeState(unit string) string {
	m.t.Helper()
	units, err := m.conn.ListUnitsByNamesContext(context.Background(), []string{unit})
	if err != nil {
		m.t.Fatalf("ListUnitsByNames %s: %v", unit, err)
	}
	if len(units) == 0 || units[0].LoadState == "not-found" {
		return ""
	}
	return units[0].ActiveState
}

func (m *manager) waitJob(what string, start func(chan<- string) error) {
	m.t.Helper()
	done := make(chan string, 1)
	if err := start(done); err != nil {
		m.t.Fatalf("%s: %v", what, err)
	}
	select {
	case r := <-done:
		if r != "done" {
			m.t.Fatalf("%s: job %s", what, r)
		}
	case <-time.After(30 * time.Second):
		m.t.Fatalf("%s: no job result within 30 s", what)
	}
}
