package netplane

import (
	"context"
	"net"
	"os"
	"path/filepath"
	"sync"
	"sync/atomic"
	"testing"
	"time"
	"unsafe"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	"golang.org/x/sys/unix"

	"github.com/brokkr/brokkr/internal/nstest"
	"github.com/brokkr/brokkr/internal/spec"
)

// nic stands in for a hypervisor's virtio-net device: it opens brokkr's tap
// the way cloud-hypervisor does and carries frames between it and the eth0
// of a guest namespace (through a veth whose other end sits in a "wire"
// namespace of its own, read and written raw). Everything the guest sends
// enters the bridge through the real tap, so anti-spoof, hairpin and DHCP
// are exercised on the port a VM would use.
type nic struct {
	tap  *os.File
	sock int
	stop atomic.Bool
	wg   sync.WaitGroup
}

func htons(v uint16) uint16 { return v<<8 | v>>8 }

func attachNIC(t *testing.T, host *nstest.NS, tap string, guest *nstest.NS, mac net.HardwareAddr) {
	wire := nstest.New(t, "wire")
	wire.MustRun(t, "ip", "link", "add", "rel0", "type", "veth", "peer", "name", "eth0", "address", mac.String(), "netns", guest.Name)
	wire.MustRun(t, "ip", "link", "set", "rel0", "up")
	guest.MustRun(t, "ip", "link", "set", "eth0", "up")

	n := &nic{}
	require.NoError(t, host.Do(func() error {
		fd, err := unix.Open("/dev/net/tun", unix.O_RDWR|unix.O_CLOEXEC, 0)
		if err != nil {
			return err
		}
		var req [unix.IFNAMSIZ + 64]byte
		copy(req[:unix.IFNAMSIZ-1], tap)
		*(*uint16)(unsafe.Pointer(&req[unix.IFNAMSIZ])) = unix.IFF_TAP | unix.IFF_NO_PI | unix.IFF_VNET_HDR
		if _, _, errno := unix.Syscall(unix.SYS_IOCTL, uintptr(fd), unix.TUNSETIFF, uintptr(unsafe.Pointer(&req[0]))); errno != 0 {
			unix.Close(fd)
			return errno
		}
		if err := unix.SetNonblock(fd, true); err != nil {
			unix.Close(fd)
			return err
		}
		n.tap = os.NewFile(uintptr(fd), tap)
		return nil
	}))
	require.NoError(t, wire.Do(func() error {
		ifi, err := net.InterfaceByName("rel0")
		if err != nil {
			return err
		}
		s, err := unix.Socket(unix.AF_PACKET, unix.SOCK_RAW|unix.SOCK_CLOEXEC, int(htons(unix.ETH_P_ALL)))
		if err != nil {
			return err
		}
		n.sock = s
		// Both ends carry a virtio_net_hdr, as between a tap and a
		// hypervisor: the veth hands over TCP with the checksum left to
		// offload, and the header is what says so.
		if err := unix.SetsockoptInt(s, unix.SOL_PACKET, unix.PACKET_VNET_HDR, 1); err != nil {
			return err
		}
		tv := unix.Timeval{Usec: 100_000}
		_ = unix.SetsockoptTimeval(s, unix.SOL_SOCKET, unix.SO_RCVTIMEO, &tv)
		return unix.Bind(s, &unix.SockaddrLinklayer{Protocol: htons(unix.ETH_P_ALL), Ifindex: ifi.Index})
	}))
	n.wg.Add(2)
	go func() { // tap -> guest
		defer n.wg.Done()
		buf := make([]byte, 65536)
		for {
			k, err := n.tap.Read(buf)
			if err != nil {
				return
			}
			_, _ = unix.Write(n.sock, buf[:k])
		}
	}()
	go func() { // guest -> tap
		defer n.wg.Done()
		buf := make([]byte, 65536)
		for !n.stop.Load() {
			k, from, err := unix.Recvfrom(n.sock, buf, 0)
			if err != nil {
				continue
			}
			if ll, ok := from.(*unix.SockaddrLinklayer); ok && ll.Pkttype == unix.PACKET_OUTGOING {
				continue // our own writes towards the guest
			}
			_, _ = n.tap.Write(buf[:k])
		}
	}()
	t.Cleanup(func() {
		n.stop.Store(true)
		_ = n.tap.Close()
		n.wg.Wait()
		_ = unix.Close(n.sock)
	})
}

// A guest behind a real brokkr tap: it leases its address by DHCP through
// the tap (anti-spoof lets the DHCP request from 0.0.0.0 pass), is reached
// from outside through the published port, reaches its own published port
// through the host address (hairpin on the tap's bridge port), and cannot
// use an address it was not given.
func TestGuestBehindARealTap(t *testing.T) {
	host, client := hostAndClient(t)
	p, _ := newPlane(t, host, t.TempDir())
	d := Desired{Network: network(), Guests: guestsOf("web"),
		Exposures: []Exposure{{Name: "web-http", Target: spec.Target{VM: "web"}, Proto: "tcp", HostPort: 8080, GuestPort: 80}}}
	rep := p.Converge(context.Background(), d)
	require.NoError(t, rep.Err)
	web := rep.Guests[0]

	guest := nstest.New(t, "guest")
	attachNIC(t, host, web.Tap, guest, web.MAC)
	script := filepath.Join(t.TempDir(), "udhcpc.script")
	b, err := os.ReadFile("../tests/guest/udhcpc.script")
	require.NoError(t, err)
	require.NoError(t, os.WriteFile(script, b, 0o755))
	out, err := guest.Run("busybox", "udhcpc", "-i", "eth0", "-n", "-q", "-f", "-t", "8", "-T", "1", "-s", script)
	require.NoError(t, err, out)
	assert.Contains(t, out, "lease of "+web.Address.String()+" obtained")
	serve(t, guest, ":80", "web")

	rep = p.Converge(context.Background(), d)
	require.NoError(t, rep.Err)
	assert.True(t, rep.Guests[0].Leased)
	assert.Equal(t, spec.StateActive, rep.Exposures[0].State)

	got, err := dial(client, "10.99.0.1:8080")
	require.NoError(t, err, "outside -> host port -> tap -> guest")
	assert.Equal(t, "web", got)
	got, err = dial(guest, "10.99.0.1:8080")
	require.NoError(t, err, "hairpin: the guest reaches its own published port through the host address")
	assert.Equal(t, "web", got)
	// Without hairpin on the tap's port the same call fails where
	// br_netfilter bridges it (the DNAT'd frame would go back out the port
	// it came in on); without br_netfilter (Debian's default: a module
	// nothing loads) it is routed through the host and hairpin plays no
	// part. Either way the next pass repairs the flag.
	host.MustRun(t, "bridge", "link", "set", "dev", web.Tap, "hairpin", "off")
	_, err = dial(guest, "10.99.0.1:8080")
	if _, berr := host.Run("sysctl", "-n", "net.bridge.bridge-nf-call-iptables"); berr == nil {
		assert.Error(t, err, "hairpin off: the frame cannot go back out the port it came in on")
	} else {
		assert.NoError(t, err, "no br_netfilter: the hairpin call is routed, not bridged")
	}
	rep = p.Converge(context.Background(), d)
	require.NoError(t, rep.Err)
	assert.Contains(t, rep.Repaired, "tap "+web.Tap+" had hairpin off")
	got, err = dial(guest, "10.99.0.1:8080")
	require.NoError(t, err)
	assert.Equal(t, "web", got)

	// Egress works from the guest's own address (masquerade) and not from
	// an address it was not given: that one is dropped at the tap.
	serve(t, client, ":7", "client")
	got, err = dial(guest, "10.99.0.2:7")
	require.NoError(t, err, "guest -> outside from its own address")
	assert.Equal(t, "client", got)
	guest.MustRun(t, "ip", "addr", "add", "10.213.0.99/24", "dev", "eth0")
	err = guest.Do(func() error {
		d := net.Dialer{Timeout: time.Second, LocalAddr: &net.TCPAddr{IP: net.ParseIP("10.213.0.99")}}
		c, err := d.Dial("tcp4", "10.99.0.2:7")
		if err == nil {
			c.Close()
		}
		return err
	})
	var ne net.Error
	require.ErrorAs(t, err, &ne, "a spoofed source address must not leave the tap")
	assert.True(t, ne.Timeout(), "dropped silently, not refused: %v", err)
	got, err = dial(guest, "10.99.0.2:7")
	require.NoError(t, err, "the guest's own address still works")
	assert.Equal(t, "client", got)
}
