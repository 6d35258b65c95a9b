package qemu

import (
	"net"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	"go.uber.org/goleak"

	"github.com/brokkr/brokkr/internal/procfs"
	"github.com/brokkr/brokkr/supervisor"
)

func TestMain(m *testing.M) { goleak.VerifyTestMain(m) }

func testLaunch() supervisor.LaunchConfig {
	return supervisor.LaunchConfig{
		Name: "web", Dir: "/var/lib/brokkr/vms/web", RunDir: "/run/brokkr/vms/web",
		CPUs: 2, MemoryMiB: 512,
		Kernel: "/k/vmlinuz", Initramfs: "/k/initrd.gz", Cmdline: "quiet",
		DiskPath: "/var/lib/brokkr/vms/web/disk.raw",
		Tap:      "brk-web", MAC: net.HardwareAddr{0x52, 0x54, 0, 1, 2, 3},
		ConsoleLog: "/var/lib/brokkr/vms/web/console.log",
	}
}

// fakeQEMU writes a qemu-system-x86_64 that runs script (sh) and returns it
// with a launch config whose directories are in the test's temp dir.
func fakeQEMU(t *testing.T, script string) (string, supervisor.LaunchConfig) {
	t.Helper()
	dir := t.TempDir()
	fake := filepath.Join(dir, "qemu-system-x86_64")
	require.NoError(t, os.WriteFile(fake, []byte("#!/bin/sh\n"+script+"\n"), 0o755))
	cfg := testLaunch()
	cfg.Dir, cfg.RunDir = filepath.Join(dir, "vm"), filepath.Join(dir, "run")
	cfg.ConsoleLog = filepath.Join(cfg.Dir, "console.log")
	return fake, cfg
}

// argAfter returns the value following flag's n-th occurrence.
func argAfter(args []string, flag string, n int) string {
	for i, a := range args {
		if a == flag && i+1 < len(args) {
			if n == 0 {
				return args[i+1]
			}
			n--
		}
	}
	return ""
}

func TestBuildArgsQ35TCG(t *testing.T) {
	p := launchPlan{Machine: MachineQ35, Accel: AccelTCG, TSCKHz: 2445432, QMPSocket: "/run/q.sock", PIDFile: "/run/q.pid"}
	args := buildArgs(testLaunch(), p)
	assert.Equal(t, "q35", argAfter(args, "-machine", 0))
	assert.Equal(t, "tcg", argAfter(args, "-accel", 0))
	assert.NotContains(t, args, "-cpu", "no -cpu host under TCG")
	assert.Equal(t, "2", argAfter(args, "-smp", 0))
	assert.Equal(t, "512", argAfter(args, "-m", 0))
	assert.Contains(t, args, "-no-reboot")
	assert.Contains(t, args, "-nodefaults")
	assert.Equal(t, "/run/q.pid", argAfter(args, "-pidfile", 0))
	assert.Equal(t, "unix:/run/q.sock,server=on,wait=off", argAfter(args, "-qmp", 0))
	assert.Equal(t, "/k/vmlinuz", argAfter(args, "-kernel", 0))
	assert.Equal(t, "/k/initrd.gz", argAfter(args, "-initrd", 0))
	assert.Equal(t, "quiet console=ttyS0 panic=-1 brokkr.name=web", argAfter(args, "-append", 0),
		"q35 needs no TSC hint")
	assert.Equal(t, "file,id=console0,path=/var/lib/brokkr/vms/web/console.log", argAfter(args, "-chardev", 0))
	assert.Equal(t, "chardev:console0", argAfter(args, "-serial", 0))
	assert.Equal(t, "tap,id=net0,ifname=brk-web,script=no,downscript=no", argAfter(args, "-netdev", 0))
	assert.Equal(t, "virtio-net-pci,netdev=net0,mac=52:54:00:01:02:03", argAfter(args, "-device", 0))
	assert.Equal(t, "file=/var/lib/brokkr/vms/web/disk.raw,if=none,id=disk0,format=raw,discard=unmap", argAfter(args, "-drive", 0))
	assert.Equal(t, "virtio-blk-pci,drive=disk0", argAfter(args, "-device", 1))
}

func TestBuildArgsMicroVMKVM(t *testing.T) {
	p := launchPlan{Machine: MachineMicroVM, Accel: AccelKVM, TSCKHz: 2445432, QMPSocket: "/q", PIDFile: "/p"}
	args := buildArgs(testLaunch(), p)
	assert.Equal(t, "microvm", argAfter(args, "-machine", 0))
	assert.Equal(t, "kvm", argAfter(args, "-accel", 0))
	assert.Equal(t, "host", argAfter(args, "-cpu", 0))
	assert.Equal(t, "quiet console=ttyS0 panic=-1 brokkr.name=web", argAfter(args, "-append", 0), "KVM guests have kvmclock: no TSC hint")
	p.Accel = AccelTCG
	assert.Equal(t, "quiet console=ttyS0 panic=-1 brokkr.name=web tsc_early_khz=2445432", argAfter(buildArgs(testLaunch(), p), "-append", 0))
	assert.Equal(t, "virtio-net-device,netdev=net0,mac=52:54:00:01:02:03", argAfter(args, "-device", 0), "microvm has virtio-mmio, not PCI")
	assert.Equal(t, "virtio-blk-device,drive=disk0", argAfter(args, "-device", 1))
}

func TestBuildArgsOptionalParts(t *testing.T) {
	cfg := testLaunch()
	cfg.Initramfs, cfg.DiskPath, cfg.Tap, cfg.MAC, cfg.ConsoleLog = "", "", "", nil, ""
	cfg.CPUs, cfg.MemoryMiB = 0, 0
	args := buildArgs(cfg, launchPlan{Machine: MachineQ35, Accel: AccelTCG, QMPSocket: "/q", PIDFile: "/p"})
	for _, f := range []string{"-initrd", "-drive", "-netdev", "-device", "-chardev"} {
		assert.NotContains(t, args, f)
	}
	assert.Equal(t, "null", argAfter(args, "-serial", 0))
	assert.Equal(t, "1", argAfter(args, "-smp", 0), "0 CPUs means the default of 1")
	assert.Equal(t, "256", argAfter(args, "-m", 0), "0 MiB means the default of 256")
}

// The user's own console=, panic= and tsc_early_khz= win; nothing is doubled.
func TestKernelCmdlineKeepsUserValues(t *testing.T) {
	cfg := testLaunch()
	cfg.Cmdline = "console=hvc0 panic=5 tsc_early_khz=1000 brokkr.name=other root=/dev/vda"
	got := kernelCmdline(cfg, launchPlan{Machine: MachineMicroVM, Accel: AccelTCG, TSCKHz: 2445432})
	assert.Equal(t, cfg.Cmdline, got)
	// panicky=1 is not panic=.
	cfg.Cmdline = "panicky=1"
	got = kernelCmdline(cfg, launchPlan{Machine: MachineMicroVM, Accel: AccelTCG})
	assert.Equal(t, "panicky=1 console=ttyS0 panic=-1 brokkr.name=web", got, "no TSC hint when the host rate is unknown")
}

// What follows "--" is init's: the backend's additions go before it, and a
// console= among init's arguments does not count as the kernel's.
func TestKernelCmdlineAddsBeforeInitsArguments(t *testing.T) {
	cfg := testLaunch()
	cfg.Cmdline = "quiet rdinit=/bin/busybox -- sh -c \"seq 1 3; console=x\""
	got := kernelCmdline(cfg, launchPlan{Machine: MachineMicroVM, Accel: AccelTCG, TSCKHz: 1000})
	assert.Equal(t, "quiet rdinit=/bin/busybox console=ttyS0 panic=-1 brokkr.name=web tsc_early_khz=1000 -- sh -c \"seq 1 3; console=x\"", got)
}

func TestValidateLaunchNamesTheField(t *testing.T) {
	cases := map[string]func(*supervisor.LaunchConfig){
		"Name":       func(c *supervisor.LaunchConfig) { c.Name = "" },
		"Kernel":     func(c *supervisor.LaunchConfig) { c.Kernel = "" },
		"RunDir":     func(c *supervisor.LaunchConfig) { c.RunDir = "" },
		"Dir":        func(c *supervisor.LaunchConfig) { c.Dir = "" },
		"CPUs":       func(c *supervisor.LaunchConfig) { c.CPUs = -1 },
		"MemoryMiB":  func(c *supervisor.LaunchConfig) { c.MemoryMiB = -5 },
		"MAC":        func(c *supervisor.LaunchConfig) { c.MAC = net.HardwareAddr{1, 2} },
		"Tap":        func(c *supervisor.LaunchConfig) { c.Tap = "a,b" },
		"DiskPath":   func(c *supervisor.LaunchConfig) { c.DiskPath = "/x,y" },
		"ConsoleLog": func(c *supervisor.LaunchConfig) { c.ConsoleLog = "/c,l" },
	}
	require.NoError(t, validateLaunch(testLaunch()))
	for field, mutate := range cases {
		cfg := testLaunch()
		mutate(&cfg)
		err := validateLaunch(cfg)
		if assert.Error(t, err, field) && field != "Name" {
			assert.Contains(t, err.Error(), "LaunchConfig."+field)
		}
	}
}

// running tells this process from one with another start time.
func TestRunning(t *testing.T) {
	self, err := procfs.ReadProcStat(os.Getpid())
	require.NoError(t, err)
	assert.True(t, running(os.Getpid(), self.StartTime))
	assert.False(t, running(os.Getpid(), self.StartTime+1), "another start time is another process")
}

func TestVMState(t *testing.T) {
	assert.Equal(t, supervisor.VMRunning, vmState("running"))
	assert.Equal(t, supervisor.VMCreated, vmState("prelaunch"))
	for _, s := range []string{"shutdown", "guest-panicked", "internal-error", "io-error"} {
		assert.Equal(t, supervisor.VMShutdown, vmState(s), s)
	}
	for _, s := range []string{"paused", "suspended", "inmigrate", "watchdog"} {
		assert.Equal(t, supervisor.VMPaused, vmState(s), s)
	}
}

func TestHostTSCKHz(t *testing.T) {
	b, err := os.ReadFile("/proc/cpuinfo")
	require.NoError(t, err)
	if !strings.Contains(string(b), "cpu MHz") {
		t.Skip("/proc/cpuinfo has no cpu MHz line on this machine")
	}
	khz := hostTSCKHz()
	assert.Greater(t, khz, int64(100_000), "a TSC under 100 MHz is a parse error")
}

// A qemu that dies at once: Start fails with qemu's own words, leaves no
// process and no socket behind.
func TestStartReportsEarlyExit(t *testing.T) {
	fake, cfg := fakeQEMU(t, "echo 'qemu-system-x86_64: -netdev tap: could not open /dev/net/tun' >&2\nexit 1")
	b := New(fake, WithAccel(AccelTCG))
	_, err := b.Start(t.Context(), cfg)
	require.Error(t, err)
	assert.Contains(t, err.Error(), "could not open /dev/net/tun")
	assert.Contains(t, err.Error(), "vm web")
	_, serr := os.Stat(filepath.Join(cfg.RunDir, "qmp.sock"))
	assert.True(t, os.IsNotExist(serr))
	log, _ := os.ReadFile(filepath.Join(cfg.Dir, "qemu.log"))
	assert.True(t, slices.ContainsFunc(strings.Split(string(log), "\n"), func(l string) bool {
		return strings.HasPrefix(l, "--- ") && strings.Contains(l, "-accel tcg")
	}), "qemu.log records the command line: %s", log)
}

func TestStartRejectsBadMachine(t *testing.T) {
	cfg := testLaunch()
	_, err := New("", WithMachine("pc-i440fx")).Start(t.Context(), cfg)
	require.Error(t, err)
	assert.Contains(t, err.Error(), "pc-i440fx")
}

// Stop of a process that is already gone (or a reused pid) does nothing.
func TestStopDeadInstance(t *testing.T) {
	self, err := procfs.ReadProcStat(os.Getpid())
	require.NoError(t, err)
	inst := supervisor.Instance{PID: os.Getpid(), StartTime: self.StartTime + 1, APISocket: "/nonexistent"}
	require.NoError(t, New("").Stop(t.Context(), inst, 0))
	_, err = New("").Info(t.Context(), inst)
	assert.Error(t, err)
	assert.Error(t, New("").Adopt(t.Context(), inst), "a reused pid is not adopted")
}

func TestConsoleOnSerial(t *testing.T) {
	assert.True(t, consoleOnSerial("quiet console=ttyS0 panic=-1"))
	assert.True(t, consoleOnSerial("console=tty0 console=ttyS0,115200n8"))
	assert.False(t, consoleOnSerial("console=ttyS0 console=hvc0"), "the last console= is the one init writes to")
	assert.False(t, consoleOnSerial("console=ttyS1"))
	assert.False(t, consoleOnSerial(""))
}

func TestKVMCPUModel(t *testing.T) {
	p := launchPlan{Machine: MachineQ35, Accel: AccelKVM, CPU: "host,-arch-capabilities", QMPSocket: "/q", PIDFile: "/p"}
	assert.Equal(t, "host,-arch-capabilities", argAfter(buildArgs(testLaunch(), p), "-cpu", 0))
	p.Accel = AccelTCG
	assert.NotContains(t, buildArgs(testLaunch(), p), "-cpu", "the KVM CPU model is not used under TCG")
}

// When the TCG relaunch fails as well, the fault is not KVM's: the error
// says what happened under both, and KVM is not given up.
func TestKVMNotGivenUpWhenTCGFailsToo(t *testing.T) {
	if err := kvmUsable(); err != nil {
		t.Skipf("no usable /dev/kvm (%v): the KVM attempt is never made", err)
	}
	fake, cfg := fakeQEMU(t, "echo \"qemu-system-x86_64: bad config ($*)\" | grep -o 'bad config.*-accel [a-z]*' >&2\nexit 1")
	b := New(fake, WithAccel(AccelAuto))
	_, err := b.Start(t.Context(), cfg)
	require.Error(t, err)
	assert.Contains(t, err.Error(), "-accel tcg", "the TCG attempt's own error")
	assert.Contains(t, err.Error(), "under KVM before", "and what happened under KVM")
	assert.Empty(t, b.KVMDisabledReason(), "KVM is still to be tried next time")
	accel, _ := b.pickAccel()
	assert.Equal(t, AccelKVM, accel)
}

func TestBuildArgsConsoleSocket(t *testing.T) {
	p := launchPlan{Machine: MachineQ35, Accel: AccelTCG, QMPSocket: "/run/vm/qmp.sock", PIDFile: "/p", ConsoleSocket: "/run/vm/console.sock"}
	args := buildArgs(testLaunch(), p)
	assert.Equal(t, "socket,id=console0,path=/run/vm/console.sock,server=on,wait=off", argAfter(args, "-chardev", 0),
		"the socket wins over ConsoleLog: the engine copies it into the capped log")
	assert.Equal(t, "chardev:console0", argAfter(args, "-serial", 0))
}
