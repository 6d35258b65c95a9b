package link

import (
	"testing"
	"unsafe"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	"golang.org/x/sys/unix"

	"github.com/brokkr/brokkr/internal/nlsafe"
)

// openQueue attaches to an existing tap the way a hypervisor does
// (TUNSETIFF on /dev/net/tun with the tap's name), from inside ns.
func openQueue(nsPath, name string, flags uint16) (int, error) {
	var fd int
	err := nlsafe.Do(nsPath, func() error {
		var err error
		fd, err = unix.Open("/dev/net/tun", unix.O_RDWR|unix.O_CLOEXEC, 0)
		if err != nil {
			return err
		}
		var req [unix.IFNAMSIZ + 64]byte
		copy(req[:unix.IFNAMSIZ-1], name)
		*(*uint16)(unsafe.Pointer(&req[unix.IFNAMSIZ])) = flags
		if _, _, errno := unix.Syscall(unix.SYS_IOCTL, uintptr(fd), unix.TUNSETIFF, uintptr(unsafe.Pointer(&req[0]))); errno != 0 {
			unix.Close(fd)
			return errno
		}
		return nil
	})
	return fd, err
}

// The taps brokkr makes are the ones a hypervisor can open: a single-queue
// tap with the flags cloud-hypervisor and QEMU use, a multi-queue tap with
// several queues; a multi-queue open of a single-queue tap is refused, which
// is why Guest.MultiQueue must match the VM's queue count.
func TestHypervisorCanOpenTheTaps(t *testing.T) {
	m, ns := newManager(t)
	_, _, err := m.EnsureBridge(testBridge)
	require.NoError(t, err)
	const vnet = unix.IFF_TAP | unix.IFF_NO_PI | unix.IFF_VNET_HDR
	single := TapSpec{VM: "one", Name: TapName("one"), GuestMAC: GuestMAC("one", 0), Bridge: "brokkr0"}
	multi := TapSpec{VM: "many", Name: TapName("many"), GuestMAC: GuestMAC("many", 0), Bridge: "brokkr0", MultiQueue: true}
	for _, s := range []TapSpec{single, multi} {
		_, _, err := m.EnsureTap(s)
		require.NoError(t, err)
	}

	fd, err := openQueue(ns.Path, single.Name, vnet)
	require.NoError(t, err)
	_, err = openQueue(ns.Path, single.Name, vnet)
	assert.ErrorIs(t, err, unix.EBUSY, "a second opener of a single-queue tap gets EBUSY")
	unix.Close(fd)
	_, err = openQueue(ns.Path, single.Name, vnet|unix.IFF_MULTI_QUEUE)
	assert.ErrorIs(t, err, unix.EINVAL)

	var fds []int
	for i := 0; i < 2; i++ {
		fd, err := openQueue(ns.Path, multi.Name, vnet|unix.IFF_MULTI_QUEUE)
		require.NoError(t, err, "queue %d", i)
		fds = append(fds, fd)
	}
	for _, fd := range fds {
		unix.Close(fd)
	}
	// Closing the hypervisor's queues leaves the persistent tap in place.
	taps, err := m.OwnedTaps()
	require.NoError(t, err)
	assert.Len(t, taps, 2)
}
