package qemu

import (
	"fmt"
	"os"

	"golang.org/x/sys/unix"
)

// kvmUsable checks that /dev/kvm opens and speaks the stable KVM API. It
// cannot tell whether a guest will actually run (nested or PVM "KVM" passes
// this and still fails guests); launch's probe covers that.
func kvmUsable() error {
	f, err := os.OpenFile("/dev/kvm", os.O_RDWR|unix.O_CLOEXEC, 0)
	if err != nil {
		return fmt.Errorf("/dev/kvm: %w", err)
	}
	defer f.Close()
	const kvmGetAPIVersion = 0xAE00 // _IO(KVMIO, 0x00)
	v, _, errno := unix.Syscall(unix.SYS_IOCTL, f.Fd(), kvmGetAPIVersion, 0)
	if errno != 0 {
		return fmt.Errorf("/dev/kvm: KVM_GET_API_VERSION: %w", errno)
	}
	if v != 12 {
		return fmt.Errorf("/dev/kvm: KVM API version %d, want 12", v)
	}
	return nil
}
