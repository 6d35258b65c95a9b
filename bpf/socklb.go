package bpf

import (
	"bufio"
	"encoding/binary"
	"errors"
	"fmt"
	"net/netip"
	"os"
	"path/filepath"
	"strings"
	"syscall"

	"github.com/brokkr/brokkr/internal/kernelfeat"
	"github.com/cilium/ebpf"
	"github.com/cilium/ebpf/link"
	"golang.org/x/sys/unix"
)

// soNetnsCookie is SO_NETNS_COOKIE (Linux 5.14), not in x/sys/unix yet.
const soNetnsCookie = 71

// SockLB is the socket path: cgroup programs that send host-local callers
// to the guest when their socket connects, admitting them against the
// exposure's one cap and counting into its slot.
type SockLB struct {
	objs  socklbObjects
	links map[string]link.Link
	inNS  func(fn func() error) error
	// reaper closes the sockets of translations that no longer hold;
	// nil where the kernel cannot (reapWhy says why).
	reaper  *sockReaper
	reapWhy string
}

// SockLBConfig says where the socket path attaches and whom it serves.
type SockLBConfig struct {
	PinDir string // bpfDir (a bpffs)
	// Cgroup is the cgroup v2 directory the programs attach to: the root
	// for a daemon (every process on the host), a child in tests.
	Cgroup string
	// InNS runs fn inside the managed network namespace: only callers
	// there are translated.
	InNS func(fn func() error) error
}

// SockTarget is where an exposure's host-local callers go.
type SockTarget struct {
	// Guest is the IPv4 guest address and the guest port; the address may
	// be 0.0.0.0 for a guest reached over IPv6 alone (IPv4 callers are
	// then refused, counted as dropped).
	Guest netip.AddrPort
	// Guest6 is the guest's IPv6 address (the zero Addr: none): IPv6
	// callers go there, on Guest's port, rather than to Guest through a
	// v4-mapped address.
	Guest6 netip.Addr
	Slot   int // the exposure's slot in exposure_stats
	// Down refuses new callers at once (ECONNREFUSED, counted as
	// dropped): the guest has no address or is not running.
	Down bool
}

// socket path hooks: pin name, program, attach type.
func (s *SockLB) hooks() []struct {
	pin    string
	prog   *ebpf.Program
	attach ebpf.AttachType
} {
	o := &s.objs
	return []struct {
		pin    string
		prog   *ebpf.Program
		attach ebpf.AttachType
	}{
		{"sock_connect4_link", o.BrkSockConnect4, ebpf.AttachCGroupInet4Connect},
		{"sock_connect6_link", o.BrkSockConnect6, ebpf.AttachCGroupInet6Connect},
		{"sock_sendmsg4_link", o.BrkSockSendmsg4, ebpf.AttachCGroupUDP4Sendmsg},
		{"sock_sendmsg6_link", o.BrkSockSendmsg6, ebpf.AttachCGroupUDP6Sendmsg},
		{"sock_recvmsg4_link", o.BrkSockRecvmsg4, ebpf.AttachCGroupUDP4Recvmsg},
		{"sock_recvmsg6_link", o.BrkSockRecvmsg6, ebpf.AttachCGroupUDP6Recvmsg},
		{"sock_getpeername4_link", o.BrkSockGetpeername4, ebpf.AttachCgroupInet4GetPeername},
		{"sock_getpeername6_link", o.BrkSockGetpeername6, ebpf.AttachCgroupInet6GetPeername},
		{"sock_release_link", o.BrkSockRelease, ebpf.AttachCgroupInetSockRelease},
		{"sock_ops_link", o.BrkSockOps, ebpf.AttachCGroupSockOps},
		{"sock_ingress_link", o.BrkSockIngress, ebpf.AttachCGroupInetIngress},
		{"sock_egress_link", o.BrkSockEgress, ebpf.AttachCGroupInetEgress},
	}
}

// LoadSockLB loads the socket-path programs onto the maps pinned in
// cfg.PinDir and attaches them to cfg.Cgroup, adopting the links an earlier
// daemon pinned: a link on the same cgroup is kept, and if it runs an older
// program, that program is swapped in place (one atomic link update), so
// translation never stops and no hook ever runs two copies.
func LoadSockLB(cfg SockLBConfig) (*SockLB, error) {
	if err := checkBPFFS(cfg.PinDir); err != nil {
		return nil, err
	}
	if err := liftMemlock(); err != nil {
		return nil, err
	}
	if err := kernelfeat.Running().Missing(kernelfeat.SocketPath...); err != nil {
		return nil, err
	}
	if cfg.InNS == nil {
		cfg.InNS = func(fn func() error) error { return fn() }
	}
	cgid, err := cgroupID(cfg.Cgroup)
	if err != nil {
		return nil, fmt.Errorf("socket path: %w", err)
	}
	var cookie uint64
	if err := cfg.InNS(func() (err error) { cookie, err = netnsCookie(); return err }); err != nil {
		return nil, fmt.Errorf("socket path: the managed namespace's cookie: %w", err)
	}
	s := &SockLB{links: map[string]link.Link{}, inNS: cfg.InNS}
	if err := loadSocklbObjects(&s.objs, &ebpf.CollectionOptions{Maps: ebpf.MapOptions{PinPath: cfg.PinDir}}); err != nil {
		return nil, fmt.Errorf("socket path: loading programs: %w", err)
	}
	if err := s.objs.SockConfig.Put(uint32(0), socklbSockCfg{NetnsCookie: cookie}); err != nil {
		s.objs.Close()
		return nil, fmt.Errorf("socket path: config: %w", err)
	}
	for _, h := range s.hooks() {
		l, err := adoptCgroupLink(filepath.Join(cfg.PinDir, h.pin), cfg.Cgroup, cgid, h.prog, h.attach)
		if err != nil {
			s.Close()
			return nil, fmt.Errorf("socket path: %s on %s: %w", h.pin, cfg.Cgroup, err)
		}
		s.links[h.pin] = l
	}
	if s.reaper, err = loadSockReaper(cfg.PinDir); err != nil {
		// Before Linux 6.5 (no bpf_sock_destroy) the socket path works,
		// but a caller's socket keeps the guest it reached.
		s.reapWhy = err.Error()
	}
	return s, nil
}

// CloseStale closes the host-local callers' sockets whose translation no
// longer holds: their exposure now sends callers to another guest, has no
// guest address, or is gone. A TCP connection is reset, a connected UDP
// socket fails its next call with ECONNABORTED (and is disconnected), and
// their places are given back: no flow keeps going to an old guest, as on
// the nat path. It returns how many it closed; where the kernel cannot
// close sockets (StaleReason), none.
func (s *SockLB) CloseStale() (int, error) {
	if s.reaper == nil {
		return 0, nil
	}
	var n int
	err := s.inNS(func() (err error) { n, err = s.reaper.reap(); return err })
	if err != nil {
		return n, fmt.Errorf("socket path: closing sockets of changed exposures: %w", err)
	}
	return n, nil
}

// StaleReason says why CloseStale cannot close sockets ("" when it can).
func (s *SockLB) StaleReason() string { return s.reapWhy }

// adoptCgroupLink keeps a pinned link on the same cgroup (updating its
// program in place when it differs) or attaches and pins a new one.
func adoptCgroupLink(pin, cgroup string, cgid uint64, prog *ebpf.Program, attach ebpf.AttachType) (link.Link, error) {
	old, err := link.LoadPinnedLink(pin, nil)
	if err != nil && !errors.Is(err, os.ErrNotExist) {
		return nil, fmt.Errorf("loading pinned link: %w", err)
	}
	if old != nil {
		info, err := old.Info()
		if cg := cgroupInfo(info, err); cg != nil && cg.CgroupId == cgid && ebpf.AttachType(cg.AttachType) == attach {
			if sameProgram(old, prog, nil) {
				return old, nil
			}
			if err := old.Update(prog); err != nil {
				old.Close()
				return nil, fmt.Errorf("updating the pinned link's program: %w", err)
			}
			return old, nil
		}
	}
	l, err := link.AttachCgroup(link.CgroupOptions{Path: cgroup, Attach: attach, Program: prog})
	if err != nil {
		if old != nil {
			old.Close()
		}
		return nil, err
	}
	if old != nil {
		// Pinned on another cgroup (the configuration moved): detach it.
		_ = old.Unpin()
		_ = old.Close()
	}
	if err := l.Pin(pin); err != nil {
		l.Close()
		return nil, fmt.Errorf("pinning: %w", err)
	}
	return l, nil
}

func cgroupInfo(info *link.Info, err error) *link.CgroupInfo {
	if err != nil || info == nil {
		return nil
	}
	return info.Cgroup()
}

// cgroupID is the id the kernel reports for a cgroup v2 directory (its
// inode number).
func cgroupID(dir string) (uint64, error) {
	var st unix.Statfs_t
	if err := unix.Statfs(dir, &st); err != nil {
		return 0, fmt.Errorf("cgroup %s: %w", dir, err)
	}
	if st.Type != unix.CGROUP2_SUPER_MAGIC {
		return 0, fmt.Errorf("cgroup %s is not on a cgroup v2 hierarchy", dir)
	}
	fi, err := os.Stat(dir)
	if err != nil {
		return 0, fmt.Errorf("cgroup %s: %w", dir, err)
	}
	return fi.Sys().(*syscall.Stat_t).Ino, nil
}

// netnsCookie is the calling thread's network namespace cookie, as
// bpf_get_netns_cookie sees it.
func netnsCookie() (uint64, error) {
	fd, err := unix.Socket(unix.AF_INET, unix.SOCK_DGRAM|unix.SOCK_CLOEXEC, 0)
	if err != nil {
		return 0, err
	}
	defer unix.Close(fd)
	c, err := unix.GetsockoptUint64(fd, unix.SOL_SOCKET, soNetnsCookie)
	if err != nil {
		return 0, fmt.Errorf("SO_NETNS_COOKIE: %w", err)
	}
	return c, nil
}

// addr16 is an address as the programs key it: IPv6, IPv4 v4-mapped, in
// network byte order word by word; the unspecified address is the wildcard.
func addr16(a netip.Addr) [4]uint32 {
	var out [4]uint32
	if !a.IsValid() || a.IsUnspecified() {
		return out
	}
	b := a.As16()
	for i := range out {
		out[i] = binary.NativeEndian.Uint32(b[i*4:])
	}
	return out
}

func be16(p uint16) uint16 {
	var b [2]byte
	binary.BigEndian.PutUint16(b[:], p)
	return binary.NativeEndian.Uint16(b[:])
}

func sockKey(host netip.Addr, proto uint32, port uint16) socklbSockKey {
	return socklbSockKey{Addr: addr16(host.Unmap()), Port: be16(port), Proto: uint8(proto)}
}

// SetTarget translates host-local connects to host:port (host unspecified:
// any loopback or local address, see SetLocalAddrs) to t. Changing an
// exposure's guest affects new connects only.
func (s *SockLB) SetTarget(host netip.Addr, proto uint32, hostPort uint16, t SockTarget) error {
	g := t.Guest.Addr().Unmap()
	if !g.Is4() {
		return fmt.Errorf("socket path: guest %s is not IPv4", t.Guest)
	}
	if t.Guest6.IsValid() && (!t.Guest6.Is6() || t.Guest6.Is4In6() || t.Guest6.IsUnspecified()) {
		return fmt.Errorf("socket path: guest %s is not an IPv6 address", t.Guest6)
	}
	if t.Slot < 0 || t.Slot >= Slots {
		return fmt.Errorf("socket path: slot %d out of range", t.Slot)
	}
	ga := g.As4()
	v := socklbSockTarget{GuestIp4: binary.NativeEndian.Uint32(ga[:]), GuestPort: be16(t.Guest.Port()), Slot: uint32(t.Slot)}
	if t.Down {
		v.Flags = 1
	}
	k := sockKey(host, proto, hostPort)
	fail := func(err error) error {
		return fmt.Errorf("socket path: %s %s:%d: %w", ProtoName(proto), host, hostPort, err)
	}
	// The IPv6 address first: a target is never seen with another
	// exposure's (an IPv6 caller between the two writes gets the old
	// address of the same exposure, or the new one).
	if t.Guest6.IsValid() {
		if err := s.objs.SockTargets6.Put(k, socklbSockTarget6{GuestIp6: addr16(t.Guest6)}); err != nil {
			return fail(err)
		}
	} else if err := s.objs.SockTargets6.Delete(k); err != nil && !errors.Is(err, ebpf.ErrKeyNotExist) {
		return fail(err)
	}
	if err := s.objs.SockTargets.Put(k, v); err != nil {
		return fail(err)
	}
	return nil
}

// DeleteTarget stops translating new connects to host:port. Connections
// already made go on (they are the guest's own sockets) and give their
// places back when they end.
func (s *SockLB) DeleteTarget(host netip.Addr, proto uint32, hostPort uint16) error {
	k := sockKey(host, proto, hostPort)
	for _, m := range []*ebpf.Map{s.objs.SockTargets, s.objs.SockTargets6} {
		if err := m.Delete(k); err != nil && !errors.Is(err, ebpf.ErrKeyNotExist) {
			return fmt.Errorf("socket path: %s %s:%d: %w", ProtoName(proto), host, hostPort, err)
		}
	}
	return nil
}

// SetLocalAddrs sets the managed namespace's own addresses (loopback is
// implied) that a wildcard exposure answers on.
func (s *SockLB) SetLocalAddrs(addrs []netip.Addr) error {
	want := map[[4]uint32]bool{}
	for _, a := range addrs {
		if a.IsValid() && !a.IsUnspecified() {
			want[addr16(a.Unmap())] = true
		}
	}
	var k [4]uint32
	var v uint8
	var stale [][4]uint32
	it := s.objs.SockLocal.Iterate()
	for it.Next(&k, &v) {
		if !want[k] {
			stale = append(stale, k)
		}
		delete(want, k)
	}
	if err := it.Err(); err != nil {
		return fmt.Errorf("socket path: local addresses: %w", err)
	}
	for _, k := range stale {
		if err := s.objs.SockLocal.Delete(k); err != nil && !errors.Is(err, ebpf.ErrKeyNotExist) {
			return fmt.Errorf("socket path: local addresses: %w", err)
		}
	}
	for k := range want {
		if err := s.objs.SockLocal.Put(k, uint8(1)); err != nil {
			return fmt.Errorf("socket path: local addresses: %w", err)
		}
	}
	return nil
}

// Close drops the process's handles. The pinned links and maps stay, so
// callers keep being translated and counted without a daemon.
func (s *SockLB) Close() error {
	err := closeLinks(s.links, &s.objs)
	s.links = nil
	if s.reaper != nil {
		err = errors.Join(err, s.reaper.close())
		s.reaper = nil
	}
	return err
}

// Remove detaches the socket path and deletes its pins (the shared counter
// maps stay): what a teardown does.
func (s *SockLB) Remove() error {
	err := unpinLinks(s.links, s.objs.SockTargets, s.objs.SockTargets6, s.objs.SockLocal, s.objs.SockConfig,
		s.objs.SockSocks, s.objs.SockSocks6)
	return errors.Join(err, s.Close())
}

// CgroupV2Root finds the mounted cgroup v2 hierarchy (/sys/fs/cgroup on a
// unified host, /sys/fs/cgroup/unified on a hybrid one). With none mounted
// it mounts one at fallback.
func CgroupV2Root(fallback string) (string, error) {
	if p, err := cgroup2Mount(); err != nil || p != "" {
		return p, err
	}
	if err := os.MkdirAll(fallback, 0o755); err != nil {
		return "", fmt.Errorf("cgroup2 mount point %s: %w", fallback, err)
	}
	if err := unix.Mount("cgroup2", fallback, "cgroup2", 0, ""); err != nil {
		return "", fmt.Errorf("mounting cgroup2 at %s: %w", fallback, err)
	}
	return fallback, nil
}

// cgroup2Mount is the first cgroup2 mount point in /proc/self/mountinfo,
// preferring the usual places.
func cgroup2Mount() (string, error) {
	f, err := os.Open("/proc/self/mountinfo")
	if err != nil {
		return "", err
	}
	defer f.Close()
	var found []string
	sc := bufio.NewScanner(f)
	for sc.Scan() {
		// id parent maj:min root mountpoint opts ... - fstype source opts
		fields := strings.Fields(sc.Text())
		for i, fl := range fields {
			if fl == "-" && i+1 < len(fields) && fields[i+1] == "cgroup2" && len(fields) > 4 && fields[3] == "/" {
				found = append(found, fields[4])
			}
		}
	}
	if err := sc.Err(); err != nil {
		return "", err
	}
	for _, pref := range []string{"/sys/fs/cgroup", "/sys/fs/cgroup/unified"} {
		for _, p := range found {
			if p == pref {
				return p, nil
			}
		}
	}
	if len(found) > 0 {
		return found[0], nil
	}
	return "", nil
}
