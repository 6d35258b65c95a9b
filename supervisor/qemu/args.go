package qemu

import (
	"fmt"
	"slices"
	"strconv"
	"strings"

	"github.com/brokkr/brokkr/supervisor"
)

// Machine types the backend can boot.
const (
	MachineQ35     = "q35"
	MachineMicroVM = "microvm"
)

// Accelerators. AccelAuto tries KVM and falls back to TCG when KVM is missing
// or the guest fails under it.
const (
	AccelAuto = "auto"
	AccelKVM  = "kvm"
	AccelTCG  = "tcg"
)

// launchPlan is everything that decides one qemu command line.
type launchPlan struct {
	Machine   string // MachineQ35 | MachineMicroVM
	Accel     string // AccelKVM | AccelTCG (resolved, never auto)
	CPU       string // -cpu model under KVM ("" = host)
	TSCKHz    int64  // microvm: host TSC for tsc_early_khz= (0: leave it to the guest)
	QMPSocket string
	PIDFile   string
	// ConsoleSocket, when set, carries the serial port (the engine copies
	// it into the size-capped console.log); else qemu writes ConsoleLog.
	ConsoleSocket string
}

// validateLaunch names the first LaunchConfig field the backend cannot use.
func validateLaunch(cfg supervisor.LaunchConfig) error {
	switch {
	case cfg.Name == "":
		return fmt.Errorf("qemu: LaunchConfig.Name is empty")
	case cfg.Kernel == "":
		return fmt.Errorf("qemu: vm %s: LaunchConfig.Kernel is empty (direct kernel boot needs a kernel)", cfg.Name)
	case cfg.RunDir == "":
		return fmt.Errorf("qemu: vm %s: LaunchConfig.RunDir is empty", cfg.Name)
	case cfg.Dir == "":
		return fmt.Errorf("qemu: vm %s: LaunchConfig.Dir is empty", cfg.Name)
	case cfg.CPUs < 0:
		return fmt.Errorf("qemu: vm %s: LaunchConfig.CPUs is %d", cfg.Name, cfg.CPUs)
	case cfg.MemoryMiB < 0:
		return fmt.Errorf("qemu: vm %s: LaunchConfig.MemoryMiB is %d", cfg.Name, cfg.MemoryMiB)
	case cfg.Tap != "" && len(cfg.MAC) != 6:
		return fmt.Errorf("qemu: vm %s: LaunchConfig.MAC %q is not a 6-byte MAC", cfg.Name, cfg.MAC)
	case strings.ContainsAny(cfg.Tap, ",="):
		return fmt.Errorf("qemu: vm %s: LaunchConfig.Tap %q contains ',' or '='", cfg.Name, cfg.Tap)
	}
	for field, p := range map[string]string{"Kernel": cfg.Kernel, "Initramfs": cfg.Initramfs, "DiskPath": cfg.DiskPath, "ConsoleLog": cfg.ConsoleLog} {
		// qemu splits -drive/-chardev option strings on ','.
		if strings.Contains(p, ",") {
			return fmt.Errorf("qemu: vm %s: LaunchConfig.%s %q contains ','", cfg.Name, field, p)
		}
	}
	return nil
}

// kernelCmdline adds what the backend relies on to the user's cmdline:
// the serial console (the console log), panic=-1 (with -no-reboot a guest
// panic ends qemu, so the engine sees the exit), the VM name for the guest,
// and on microvm under TCG the host TSC frequency (microvm has no HPET or
// PM timer, and TSC calibration against the PIT under TCG can hang the guest).
//
// What follows a "--" is init's argument list, not the kernel's: the
// additions go before it, and a key is looked for only in the kernel's part.
func kernelCmdline(cfg supervisor.LaunchConfig, p launchPlan) string {
	args := strings.Fields(cfg.Cmdline)
	var initArgs []string
	if i := slices.Index(args, "--"); i >= 0 {
		args, initArgs = args[:i:i], args[i:]
	}
	has := func(key string) bool {
		for _, a := range args {
			if a == key || strings.HasPrefix(a, key+"=") {
				return true
			}
		}
		return false
	}
	if !has("console") {
		args = append(args, "console=ttyS0")
	}
	if !has("panic") {
		args = append(args, "panic=-1")
	}
	if !has("brokkr.name") {
		args = append(args, "brokkr.name="+cfg.Name)
	}
	// Under KVM the guest has kvmclock and needs no hint.
	if p.Machine == MachineMicroVM && p.Accel == AccelTCG && p.TSCKHz > 0 && !has("tsc_early_khz") {
		args = append(args, "tsc_early_khz="+strconv.FormatInt(p.TSCKHz, 10))
	}
	return strings.Join(append(args, initArgs...), " ")
}

// buildArgs is the qemu-system-x86_64 argument list for one launch.
func buildArgs(cfg supervisor.LaunchConfig, p launchPlan) []string {
	cpus, mem := cfg.CPUs, cfg.MemoryMiB
	if cpus == 0 {
		cpus = 1
	}
	if mem == 0 {
		mem = 256
	}
	devSuffix := "-pci"
	if p.Machine == MachineMicroVM {
		devSuffix = "-device" // virtio-mmio transport
	}
	args := []string{
		"-name", "guest=" + cfg.Name,
		"-machine", p.Machine,
		"-accel", p.Accel,
	}
	if p.Accel == AccelKVM {
		cpu := p.CPU
		if cpu == "" {
			cpu = "host"
		}
		args = append(args, "-cpu", cpu)
	}
	args = append(args,
		"-smp", strconv.Itoa(cpus),
		"-m", strconv.Itoa(mem),
		"-nodefaults", "-no-user-config", "-display", "none",
		"-no-reboot",
		"-pidfile", p.PIDFile,
		"-qmp", "unix:"+p.QMPSocket+",server=on,wait=off",
		"-kernel", cfg.Kernel,
	)
	if cfg.Initramfs != "" {
		args = append(args, "-initrd", cfg.Initramfs)
	}
	args = append(args, "-append", kernelCmdline(cfg, p))
	switch {
	case p.ConsoleSocket != "":
		args = append(args, "-chardev", "socket,id=console0,path="+p.ConsoleSocket+",server=on,wait=off", "-serial", "chardev:console0")
	case cfg.ConsoleLog != "":
		args = append(args, "-chardev", "file,id=console0,path="+cfg.ConsoleLog, "-serial", "chardev:console0")
	default:
		args = append(args, "-serial", "null")
	}
	if cfg.Tap != "" {
		args = append(args,
			"-netdev", "tap,id=net0,ifname="+cfg.Tap+",script=no,downscript=no",
			"-device", "virtio-net"+devSuffix+",netdev=net0,mac="+cfg.MAC.String())
	}
	if cfg.DiskPath != "" {
		args = append(args,
			"-drive", "file="+cfg.DiskPath+",if=none,id=disk0,format=raw,discard=unmap",
			"-device", "virtio-blk"+devSuffix+",drive=disk0")
	}
	return args
}
