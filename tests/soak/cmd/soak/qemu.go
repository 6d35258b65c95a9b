package main

import (
	"os"
	"path/filepath"
	"syscall"
	"time"
)

// qemuFaults is the faults phase again with real QEMU guests (under TCG on a
// host without /dev/kvm): the guest image make guest-image builds, fewer
// kills, exposures and VMs, since each VM is a real QEMU process of 256 MiB
// booting a kernel.
func (x *h) qemuFaults() {
	// soak.sh runs the driver from the repository's root.
	wd, _ := os.Getwd()
	img := guestImage{kernel: filepath.Join(wd, ".cache/guest/vmlinuz"), initramfs: filepath.Join(wd, ".cache/guest/initramfs.cpio.gz")}
	for _, f := range []string{img.kernel, img.initramfs} {
		if _, err := os.Stat(f); err != nil {
			x.fail("qemu: guest image: %v (make guest-image builds it)", err)
			return
		}
	}
	// The fake's VMs go first: a daemon for another hypervisor would find
	// their records and could not adopt them.
	base := desired{Exposures: stableExposures}
	if _, err := x.apply(base, 60*time.Second); err != nil {
		x.fail("qemu: apply base: %v", err)
		return
	}
	if _, err := x.waitConverged(base, 60*time.Second); err != nil {
		x.fail("qemu: base: %v", err)
		return
	}
	x.stopDaemon(syscall.SIGTERM)
	x.qemu = &img
	if err := x.writeConfig(base); err != nil {
		x.fail("qemu: %v", err)
		return
	}
	if err := x.startDaemon(); err != nil {
		x.fail("qemu: restart with hypervisor qemu: %v", err)
		return
	}
	if _, err := x.waitConverged(base, 60*time.Second); err != nil {
		x.fail("qemu: base: %v", err)
		return
	}
	x.killDuringConverges("qemu", envInt("SOAK_QEMU_KILLS", 10), envInt("SOAK_QEMU_EXPOSURES", 200), envInt("SOAK_QEMU_VMS", 3))
}
