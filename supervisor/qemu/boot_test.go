package qemu

import (
	"bufio"
	"context"
	"fmt"
	"io"
	"log/slog"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/brokkr/brokkr/internal/nstest"
	"github.com/brokkr/brokkr/supervisor"
	"github.com/brokkr/brokkr/supervisor/images"
)

// guestImage is the kernel and initramfs from tests/guest/build.sh.
type guestImage struct{ Kernel, Initramfs string }

// findGuestImage reads .cache/guest/env (BROKKR_GUEST_DIR overrides the
// directory) or skips the test saying how to build it.
func findGuestImage(t testing.TB) guestImage {
	t.Helper()
	dir := os.Getenv("BROKKR_GUEST_DIR")
	if dir == "" {
		dir = filepath.Join("..", "..", ".cache", "guest")
	}
	f, err := os.Open(filepath.Join(dir, "env"))
	if err != nil {
		t.Skipf("no guest image (%v): run `make guest-image` (tests/guest/build.sh)", err)
	}
	defer f.Close()
	var g guestImage
	sc := bufio.NewScanner(f)
	for sc.Scan() {
		k, v, _ := strings.Cut(sc.Text(), "=")
		switch k {
		case "GUEST_KERNEL":
			g.Kernel = v
		case "GUEST_INITRAMFS":
			g.Initramfs = v
		}
	}
	if g.Kernel == "" || g.Initramfs == "" {
		t.Skipf("%s/env lacks GUEST_KERNEL or GUEST_INITRAMFS: rerun tests/guest/build.sh", dir)
	}
	return g
}

// shortRunDir is a RunDir for qemu's sockets outside t.TempDir, whose long
// paths can pass the 107-byte unix socket limit.
// guestConfig is the test guest's launch config: a temp state dir with its
// console log, a short run dir (sun_path), 1 vCPU. Callers add a tap.
func guestConfig(t testing.TB, img guestImage, name string, memMiB int) supervisor.LaunchConfig {
	dir := t.TempDir()
	return supervisor.LaunchConfig{
		Name: name, Dir: filepath.Join(dir, "vm"), RunDir: shortRunDir(t), CPUs: 1, MemoryMiB: memMiB,
		Kernel: img.Kernel, Initramfs: img.Initramfs,
		ConsoleLog: filepath.Join(dir, "vm", "console.log"),
	}
}

func shortRunDir(t testing.TB) string {
	t.Helper()
	run, err := os.MkdirTemp("", "brkqm")
	require.NoError(t, err)
	t.Cleanup(func() { os.RemoveAll(run) })
	return run
}

// killAtCleanup kills and reaps a started qemu when the test ends, whatever
// happened: no qemu is left behind. The
// console connection Start handed over is read meanwhile, as the engine
// reads it, into the console log: a console nobody reads fills its socket
// and stalls the guest's console writes.
func killAtCleanup(t testing.TB, inst supervisor.Instance, consoleLog string) {
	var w *consoleWatch
	if inst.Console != nil {
		w = newConsoleWatch(inst.Console, consoleLog)
	}
	t.Cleanup(func() {
		_ = syscall.Kill(inst.PID, syscall.SIGKILL)
		_, _ = syscall.Wait4(inst.PID, nil, 0, nil)
		if w != nil {
			w.close()
		}
	})
}

// qemuGuest is the preamble of every test that starts a real qemu: skipped
// under -short or without qemu, it returns the guest image to boot.
func qemuGuest(t testing.TB) guestImage {
	t.Helper()
	if testing.Short() {
		t.Skip("starts a real qemu (-short)")
	}
	if _, err := exec.LookPath("qemu-system-x86_64"); err != nil {
		t.Skip("qemu-system-x86_64 not installed (scripts/deps.sh installs qemu-system-x86)")
	}
	return findGuestImage(t)
}

// guestNet is a namespace with a bridge, a tap for the guest and a DHCP
// server that leases guestIP to guestMAC.
type guestNet struct {
	NS  *nstest.NS
	Tap string
	MAC net.HardwareAddr
	IP  string
}

func newGuestNet(t testing.TB) *guestNet { return newGuestNetDHCP(t, true) }

func newGuestNetDHCP(t testing.TB, dhcp bool) *guestNet {
	t.Helper()
	ns := nstest.New(t, "vm")
	g := &guestNet{NS: ns, Tap: "tap0", MAC: net.HardwareAddr{0x52, 0x54, 0, 0xbb, 0, 0x0a}, IP: "10.213.77.10"}
	for _, c := range [][]string{
		{"ip", "link", "add", "br0", "type", "bridge"},
		{"ip", "addr", "add", "10.213.77.1/24", "dev", "br0"},
		{"ip", "link", "set", "br0", "up"},
		{"ip", "tuntap", "add", "dev", g.Tap, "mode", "tap"},
		{"ip", "link", "set", g.Tap, "master", "br0", "up"},
	} {
		ns.MustRun(t, c[0], c[1:]...)
	}
	if !dhcp {
		return g
	}
	dir := t.TempDir()
	conf := filepath.Join(dir, "udhcpd.conf")
	require.NoError(t, os.WriteFile(filepath.Join(dir, "leases"), nil, 0o600))
	require.NoError(t, os.WriteFile(conf, []byte(fmt.Sprintf(
		"start 10.213.77.100\nend 10.213.77.150\ninterface br0\nlease_file %s/leases\npidfile %s/udhcpd.pid\n"+
			"opt subnet 255.255.255.0\nopt router 10.213.77.1\nstatic_lease %s %s\n", dir, dir, g.MAC, g.IP)), 0o600))
	dhcpd := ns.Command("busybox", "udhcpd", "-f", conf)
	require.NoError(t, dhcpd.Start())
	t.Cleanup(func() { _ = dhcpd.Process.Kill(); _ = dhcpd.Wait() })
	return g
}

// dialGuest connects from inside the namespace (the socket is made on a
// thread switched into it) and runs fn on the connection.
func (g *guestNet) dialGuest(network, port string, fn func(net.Conn) error) error {
	return g.NS.Do(func() error {
		c, err := net.DialTimeout(network, net.JoinHostPort(g.IP, port), 500*time.Millisecond)
		if err != nil {
			return err
		}
		defer c.Close()
		_ = c.SetDeadline(time.Now().Add(2 * time.Second))
		return fn(c)
	})
}

func httpGet(c net.Conn) (string, error) {
	if _, err := io.WriteString(c, "GET / HTTP/1.0\r\n\r\n"); err != nil {
		return "", err
	}
	b, err := io.ReadAll(c)
	return string(b), err
}

// A real guest (Debian cloud kernel + busybox initramfs) boots through the
// backend with qemu inside a test namespace, answers on its ports, is seen
// running by QMP, is adopted by a fresh backend (same pid), refuses a second
// qemu on its QMP socket, and powers off through the ACPI power button.
func TestBootGuestAdoptStop(t *testing.T) {
	nstest.RequireRoot(t)
	img := qemuGuest(t)
	gn := newGuestNet(t)

	logger := slog.New(slog.NewTextHandler(testWriter{t}, nil))
	// Auto: where /dev/kvm is PVM (this machine) the KVM launch fails and
	// the backend relaunches under TCG; on a real KVM host it boots on KVM.
	b := New("", WithNetNS(gn.NS.Path), WithAccel(AccelAuto), WithKVMProbeWindow(5*time.Second), WithConsoleFile(), WithLogger(logger))
	dir := t.TempDir()
	run := shortRunDir(t)
	// A root disk made the way the engine makes one: a sparse copy of a
	// base image, grown.
	base := filepath.Join(dir, "base.raw")
	require.NoError(t, os.WriteFile(base, []byte("brokkr disk\n"), 0o644))
	disk := filepath.Join(dir, "disk.raw")
	_, err := images.CloneDisk(t.Context(), base, disk, 64<<20)
	require.NoError(t, err)
	cfg := supervisor.LaunchConfig{
		Name: "boot1", Dir: filepath.Join(dir, "vm"), RunDir: run,
		CPUs: 1, MemoryMiB: 256,
		Kernel: img.Kernel, Initramfs: img.Initramfs,
		Tap: gn.Tap, MAC: gn.MAC, DiskPath: disk,
		ConsoleLog: filepath.Join(dir, "vm", "console.log"),
	}
	ctx, cancel := context.WithTimeout(t.Context(), 3*time.Minute)
	defer cancel()
	t0 := time.Now()
	inst, err := b.Start(ctx, cfg)
	require.NoError(t, err)
	killAtCleanup(t, inst, cfg.ConsoleLog)
	t.Logf("Start returned after %s: pid %d, accel note %q", time.Since(t0).Round(time.Millisecond), inst.PID, b.KVMDisabledReason())
	require.Equal(t, filepath.Join(run, "qmp.sock"), inst.APISocket)
	assert.Empty(t, inst.ConsoleSocket, "with WithConsoleFile qemu writes the log itself")
	exe, _ := filepath.EvalSymlinks("/usr/bin/qemu-system-x86_64")
	assert.Equal(t, exe, inst.Exe)
	pidText, err := os.ReadFile(filepath.Join(run, "qemu.pid"))
	require.NoError(t, err)
	assert.Equal(t, fmt.Sprint(inst.PID), strings.TrimSpace(string(pidText)), "-pidfile names the process Start returned")
	// qemu runs in the namespace, in its own session.
	nsLink, _ := os.Readlink(fmt.Sprintf("/proc/%d/ns/net", inst.PID))
	var st syscall.Stat_t
	require.NoError(t, syscall.Stat(gn.NS.Path, &st))
	assert.Equal(t, fmt.Sprintf("net:[%d]", st.Ino), nsLink)
	sid, _ := sessionID(inst.PID)
	assert.Equal(t, inst.PID, sid, "qemu leads its own session (Setsid)")

	// The guest answers HTTP on 8080 from inside the namespace.
	var page string
	require.Eventually(t, func() bool {
		err := gn.dialGuest("tcp", "8080", func(c net.Conn) error {
			var err error
			page, err = httpGet(c)
			return err
		})
		return err == nil && strings.Contains(page, "200 OK")
	}, 90*time.Second, 50*time.Millisecond, "guest never answered on :8080; console:\n%s", readFile(cfg.ConsoleLog))
	t.Logf("guest answered HTTP %s after Start was called", time.Since(t0).Round(time.Millisecond))
	assert.Contains(t, page, "name=boot1", "the VM name reaches the guest")
	assert.Contains(t, page, "addr=10.213.77.10/24")
	assert.Contains(t, page, "disks=vda", "the disk is attached as virtio-blk")
	// The guest's init starts httpd before it prints READY: wait for the line.
	assert.Eventually(t, func() bool { return strings.Contains(readFile(cfg.ConsoleLog), "BROKKR-GUEST-READY") },
		60*time.Second, 50*time.Millisecond, "the serial console goes to ConsoleLog")

	// Echo services: TCP holds the connection, UDP answers datagrams.
	require.NoError(t, gn.dialGuest("tcp", "7000", func(c net.Conn) error {
		for _, m := range []string{"one\n", "two\n"} {
			if _, err := io.WriteString(c, m); err != nil {
				return err
			}
			got := make([]byte, len(m))
			if _, err := io.ReadFull(c, got); err != nil {
				return err
			}
			if string(got) != m {
				return fmt.Errorf("tcp echo: got %q want %q", got, m)
			}
		}
		return nil
	}))
	require.NoError(t, gn.dialGuest("udp", "7001", func(c net.Conn) error {
		if _, err := io.WriteString(c, "dgram"); err != nil {
			return err
		}
		buf := make([]byte, 16)
		n, err := c.Read(buf)
		if err != nil {
			return err
		}
		if string(buf[:n]) != "dgram" {
			return fmt.Errorf("udp echo: got %q", buf[:n])
		}
		return nil
	}))

	// Many connections held open at once (callers of an exposure cap need
	// a guest that keeps them), each echoing its own bytes.
	const held = 300
	require.NoError(t, gn.NS.Do(func() error {
		conns := make([]net.Conn, 0, held)
		defer func() {
			for _, c := range conns {
				c.Close()
			}
		}()
		for i := 0; i < held; i++ {
			c, err := net.DialTimeout("tcp", net.JoinHostPort(gn.IP, "7000"), 2*time.Second)
			if err != nil {
				return fmt.Errorf("connection %d: %w", i, err)
			}
			conns = append(conns, c)
		}
		for i, c := range conns {
			_ = c.SetDeadline(time.Now().Add(10 * time.Second))
			msg := fmt.Sprintf("conn-%03d\n", i)
			if _, err := io.WriteString(c, msg); err != nil {
				return err
			}
			got := make([]byte, len(msg))
			if _, err := io.ReadFull(c, got); err != nil {
				return fmt.Errorf("connection %d: %w", i, err)
			}
			if string(got) != msg {
				return fmt.Errorf("connection %d got %q", i, got)
			}
		}
		return nil
	}))

	state, err := b.Info(ctx, inst)
	require.NoError(t, err)
	assert.Equal(t, supervisor.VMRunning, state)

	// A second qemu for the same VM is refused while the first serves QMP.
	_, err = b.Start(ctx, cfg)
	require.Error(t, err)
	assert.Contains(t, err.Error(), "refusing to start a second qemu")

	// A fresh backend (the daemon restarted) adopts the same process...
	b2 := New("", WithNetNS(gn.NS.Path), WithLogger(logger))
	require.NoError(t, b2.Adopt(ctx, inst))
	// ...but not a record whose start time or executable differ.
	wrong := inst
	wrong.StartTime++
	assert.ErrorContains(t, b2.Adopt(ctx, wrong), "reused")
	wrong = inst
	wrong.Exe = "/usr/bin/cloud-hypervisor"
	assert.ErrorContains(t, b2.Adopt(ctx, wrong), "recorded /usr/bin/cloud-hypervisor")

	// Stop: the power button is enough; the guest powers itself off. The
	// grace is wide because this guest runs under TCG on a shared machine
	// while the other packages' tests run theirs: once its poweroff took
	// 30.06 s, and once (make test, 2026-12-04) the guest had run its
	// handler ("power button, powering off") and was still shutting down,
	// a virtio-net stall trace on its console, when 90 s were up. How long
	// a starved guest takes is not this test's question; that the button,
	// not the escalation, stopped it is.
	stopByPowerButton(t, b2, ctx, inst, cfg.ConsoleLog, 180*time.Second)
	_, err = b2.Info(ctx, inst)
	assert.Error(t, err, "Info of a stopped VM is an error")
	require.NoError(t, b2.Stop(ctx, inst, time.Second), "stopping a stopped VM is a no-op")
}

func sessionID(pid int) (int, error) {
	b, err := os.ReadFile(fmt.Sprintf("/proc/%d/stat", pid))
	if err != nil {
		return 0, err
	}
	f := strings.Fields(string(b[strings.LastIndexByte(string(b), ')')+1:]))
	var sid int
	_, err = fmt.Sscan(f[3], &sid) // field 6: session
	return sid, err
}

func readFile(p string) string { b, _ := os.ReadFile(p); return string(b) }

// tail returns the last n lines of s.
func tail(s string, n int) string {
	lines := strings.Split(strings.TrimRight(s, "\n"), "\n")
	if len(lines) > n {
		lines = lines[len(lines)-n:]
	}
	return strings.Join(lines, "\n")
}

type testWriter struct{ t testing.TB }

func (w testWriter) Write(p []byte) (int, error) {
	w.t.Log(strings.TrimRight(string(p), "\n"))
	return len(p), nil
}

// Without a DHCP server the guest's init takes the address from the kernel
// ip= argument (Debian's kernel has no IP autoconfig, so init parses it).
func TestGuestStaticAddressFromCmdline(t *testing.T) {
	nstest.RequireRoot(t)
	img := qemuGuest(t)
	gn := newGuestNetDHCP(t, false)
	gn.IP = "10.213.77.21"
	b := New("", WithNetNS(gn.NS.Path), WithAccel(AccelTCG), WithConsoleFile())
	dir := t.TempDir()
	run := shortRunDir(t)
	cfg := supervisor.LaunchConfig{
		Name: "static", Dir: filepath.Join(dir, "vm"), RunDir: run, CPUs: 1, MemoryMiB: 256,
		Kernel: img.Kernel, Initramfs: img.Initramfs, Tap: gn.Tap, MAC: gn.MAC,
		Cmdline:    "ip=10.213.77.21::10.213.77.1:255.255.255.0::eth0:off",
		ConsoleLog: filepath.Join(dir, "vm", "console.log"),
	}
	inst, err := b.Start(t.Context(), cfg)
	require.NoError(t, err)
	killAtCleanup(t, inst, cfg.ConsoleLog)
	var page string
	require.Eventually(t, func() bool {
		return gn.dialGuest("tcp", "8080", func(c net.Conn) error {
			var err error
			page, err = httpGet(c)
			return err
		}) == nil
	}, 90*time.Second, 50*time.Millisecond, "guest never answered; console:\n%s", readFile(cfg.ConsoleLog))
	assert.Contains(t, page, "addr=10.213.77.21/24")
	assert.Contains(t, readFile(cfg.ConsoleLog), "no DHCP lease; using")
	require.NoError(t, b.Stop(t.Context(), inst, 20*time.Second))
}

// The microvm machine (virtio-mmio devices found through ACPI, the host TSC
// rate on the cmdline) boots the same guest, which serves and powers off on
// the ACPI power button (microvm's GED).
func TestMicroVMBootAndPowerButton(t *testing.T) {
	nstest.RequireRoot(t)
	img := qemuGuest(t)
	gn := newGuestNet(t)
	b := New("", WithNetNS(gn.NS.Path), WithAccel(AccelTCG), WithMachine(MachineMicroVM), WithConsoleFile())
	if b.tscKHz == 0 {
		t.Skip("no host TSC rate in /proc/cpuinfo: microvm under TCG may hang calibrating")
	}
	cfg := guestConfig(t, img, "micro", 256)
	cfg.Tap, cfg.MAC = gn.Tap, gn.MAC
	inst, err := b.Start(t.Context(), cfg)
	require.NoError(t, err)
	killAtCleanup(t, inst, cfg.ConsoleLog)
	require.Eventually(t, func() bool {
		return gn.dialGuest("tcp", "8080", func(c net.Conn) error { _, err := httpGet(c); return err }) == nil
	}, 90*time.Second, 50*time.Millisecond, "guest never answered; console:\n%s", readFile(cfg.ConsoleLog))
	assert.Contains(t, readFile(cfg.ConsoleLog), "tsc_early_khz=", "the TSC hint reached the kernel")
	assert.Less(t, stopByPowerButton(t, b, t.Context(), inst, cfg.ConsoleLog, 20*time.Second), 10*time.Second,
		"the power button, not the escalation, stopped it")
}

// A guest stopped while it is still booting, before anything in it listens
// to the power button, drops that first press. Stop presses again while the
// grace lasts, so the guest still powers itself off instead of being quit.
func TestAPowerButtonPressedDuringBootIsPressedAgain(t *testing.T) {
	nstest.RequireRoot(t)
	img := qemuGuest(t)
	gn := newGuestNet(t)
	b := New("", WithNetNS(gn.NS.Path), WithAccel(AccelTCG), WithConsoleFile())
	cfg := guestConfig(t, img, "early", 256)
	cfg.Tap, cfg.MAC = gn.Tap, gn.MAC
	inst, err := b.Start(t.Context(), cfg)
	require.NoError(t, err)
	killAtCleanup(t, inst, cfg.ConsoleLog)
	// The power button's input device exists once the modules are loaded;
	// acpid, which acts on it, starts only after the network is up.
	require.Eventually(t, func() bool { return strings.Contains(readFile(cfg.ConsoleLog), "modules loaded") },
		90*time.Second, 10*time.Millisecond, "guest never loaded its modules; console:\n%s", readFile(cfg.ConsoleLog))
	took := stopByPowerButton(t, b, t.Context(), inst, cfg.ConsoleLog, 30*time.Second)
	// Without this the test would pass with the re-press broken on a guest
	// that happened to listen before the first press.
	assert.GreaterOrEqual(t, took, supervisor.PowerButtonEvery-time.Second, "the first press was dropped: the second one stopped it")
}

// stopByPowerButton stops inst with grace and checks the guest powered itself
// off: Stop returned before the grace ran out, the guest's button handler
// ran, and qemu (reaped here) exited 0. It returns how long Stop took.
func stopByPowerButton(t *testing.T, b *Backend, ctx context.Context, inst supervisor.Instance, console string, grace time.Duration) time.Duration {
	t.Helper()
	t0 := time.Now()
	require.NoError(t, b.Stop(ctx, inst, grace))
	took := time.Since(t0)
	t.Logf("Stop took %s; console tail:\n%s", took.Round(time.Millisecond), tail(readFile(console), 12))
	assert.Less(t, took, grace, "the power button, not the escalation, stopped it")
	assert.True(t, strings.Contains(readFile(console), "power button, powering off"), "the guest's handler ran")
	var ws syscall.WaitStatus
	pid, err := syscall.Wait4(inst.PID, &ws, 0, nil)
	require.NoError(t, err)
	assert.Equal(t, inst.PID, pid)
	assert.True(t, ws.Exited() && ws.ExitStatus() == 0, "qemu exits 0 after a guest power-off, got %v", ws)
	return took
}
