package bpf

import (
	"encoding/binary"
	"errors"
	"fmt"
	"io"
	"net/netip"
	"os"
	"path/filepath"

	"github.com/brokkr/brokkr/internal/kernelfeat"
	"github.com/cilium/ebpf"
	"github.com/cilium/ebpf/link"
)

// The programs find an exposure's slot from its connections' ct mark:
// the layout is package ctmark's (bpf/ctmark.h on the C side).

// NetfilterPriority is where the nat-path programs sit: right after the DNAT
// (nft nat chains at -100), so a connection's first packet already carries
// its exposure's mark. A replaced program goes to the other of the two
// (netfilterPriorityAlt): the kernel refuses a second BPF program at one
// hook and priority (EBUSY) and cannot update a netfilter link in place, so
// the new link is attached beside the old one before the old one goes.
const (
	NetfilterPriority    = -99
	netfilterPriorityAlt = -98
)

// Pin names of the nat path's links under bpfDir. The links keep the
// programs attached while no daemon runs; a new daemon adopts them.
// brk_nat_pre and brk_nat_out have one link per family and hook (the *6
// pins are their IPv6 links; a binary before them had none).
const (
	pinNatPre     = "nat_pre_link"
	pinNatOut     = "nat_out_link"
	pinNatPre6    = "nat_pre6_link"
	pinNatOut6    = "nat_out6_link"
	pinNatReflect = "nat_reflect_link"
)

// NatPath is the kernel nat path: admission against the cap, release and
// counting, by BPF programs writing the exposures' slots.
type NatPath struct {
	// objs: the maps, and the netfilter hooks' programs (nil when an
	// earlier daemon's programs were adopted; only the maps when the
	// programs are tc's).
	objs  *natpathObjects
	tc    *nattcObjects // the tc programs (Hooks "tc"), nil otherwise
	links map[string]link.Link
	// adopted says why this binary's programs did not load and the ones an
	// earlier brokkrd attached serve on ("" when this binary's run).
	adopted string
	pinDir  string
	// allow is what the allowFrom trie holds, per slot (nil until read).
	allow map[uint32]*allowSlot
	// bridge and inNS: where the tc programs are (for Remove).
	bridge int
	inNS   func(fn func() error) error
}

// NatPathConfig says where the programs attach.
type NatPathConfig struct {
	PinDir  string       // bpfDir (a bpffs)
	Bridge  int          // ifindex of the guest bridge (the reflector's egress hook)
	Guests  netip.Prefix // the bridge subnet (callers there are bridged, not routed)
	Guests6 netip.Prefix // the bridge's IPv6 subnet, if it has one
	// InNS runs fn inside the managed network namespace: netfilter and tcx
	// links belong to the namespace of the thread that makes them.
	InNS func(fn func() error) error
	// TC runs the tc programs even where the netfilter hooks' load: what
	// a kernel before 6.4 gets, on this one. So does BROKKR_NAT_HOOKS=tc
	// in the environment (README, "Kernels").
	TC bool
}

// HooksEnv is the environment variable that, set to "tc", runs the nat
// path's tc programs on a kernel that has the netfilter hooks' too: to
// compare them, and how make test runs the nat path's tests both ways.
const HooksEnv = "BROKKR_NAT_HOOKS"

// LoadNatPath loads the nat-path programs onto the maps pinned in
// cfg.PinDir (created if absent) and attaches them, adopting links an
// earlier daemon pinned when they run the same programs, so the path never
// stops and is never attached twice.
//
// When this binary's programs cannot load or attach (a pinned map of another
// layout, a kernel that refuses them), the fallback's nft marks must not
// run under an earlier binary's programs, which would read them as slots:
// the programs already attached serve on (NatPath.Adopted says why), or,
// when they cannot, none does and the error is returned.
func LoadNatPath(cfg NatPathConfig) (*NatPath, error) {
	if err := checkBPFFS(cfg.PinDir); err != nil {
		return nil, err
	}
	if err := liftMemlock(); err != nil {
		return nil, err
	}
	if cfg.InNS == nil {
		cfg.InNS = func(fn func() error) error { return fn() }
	}
	k := kernelfeat.Running()
	if k.Missing(kernelfeat.NatPathNetfilter...) != nil || cfg.TC || os.Getenv(HooksEnv) == "tc" {
		// Before 6.4: the tc programs, or nothing. An earlier binary's
		// programs are replaced, never adopted: where this binary's cannot
		// run, none does.
		if err := k.Missing(kernelfeat.NatPath...); err != nil {
			return nil, err
		}
		n, err := loadNatPathTC(cfg)
		if err != nil {
			return nil, errors.Join(err, cfg.InNS(func() error { return detachTC(cfg.Bridge) }))
		}
		return n, nil
	}
	n, err := loadNatPath(cfg)
	if err == nil {
		return n, nil
	}
	old, aerr := adoptNatPath(cfg, err)
	if aerr == nil {
		return old, nil
	}
	if derr := detachNatPath(cfg.PinDir); derr != nil {
		return nil, errors.Join(err, derr)
	}
	return nil, err
}

func loadNatPath(cfg NatPathConfig) (*NatPath, error) {
	n := &NatPath{links: map[string]link.Link{}, objs: &natpathObjects{}, pinDir: cfg.PinDir}
	if err := loadNatpathObjects(n.objs, &ebpf.CollectionOptions{Maps: ebpf.MapOptions{PinPath: cfg.PinDir}}); err != nil {
		return nil, fmt.Errorf("nat path: loading programs: %w", err)
	}
	if err := n.SetGuests(cfg.Guests, cfg.Guests6); err != nil {
		n.objs.Close()
		return nil, err
	}
	type want struct {
		pin    string
		prog   *ebpf.Program
		attach func(old *link.Info) (link.Link, error)
		same   func(*link.Info) bool
	}
	nf := func(family link.NetfilterProtocolFamily, hook link.NetfilterInetHook, p *ebpf.Program) func(*link.Info) (link.Link, error) {
		return func(old *link.Info) (link.Link, error) {
			prio := int32(NetfilterPriority)
			if o := nfInfo(old); o != nil && o.Priority == NetfilterPriority {
				prio = netfilterPriorityAlt
			}
			var l link.Link
			err := cfg.InNS(func() (err error) {
				l, err = link.AttachNetfilter(link.NetfilterOptions{Program: p, ProtocolFamily: family,
					Hook: hook, Priority: prio})
				return err
			})
			return l, err
		}
	}
	// A pinned link is kept only at the family it is pinned for (the
	// same program serves both).
	nfOf := func(family link.NetfilterProtocolFamily) func(*link.Info) bool {
		return func(i *link.Info) bool { f := i.Netfilter(); return f != nil && f.ProtocolFamily == family }
	}
	nf4, nf6 := nfOf(link.NetfilterProtoIPv4), nfOf(link.NetfilterProtoIPv6)
	wants := []want{
		{pinNatPre, n.objs.BrkNatPre, nf(link.NetfilterProtoIPv4, link.NetfilterInetPreRouting, n.objs.BrkNatPre), nf4},
		{pinNatOut, n.objs.BrkNatOut, nf(link.NetfilterProtoIPv4, link.NetfilterInetLocalOut, n.objs.BrkNatOut), nf4},
		{pinNatPre6, n.objs.BrkNatPre, nf(link.NetfilterProtoIPv6, link.NetfilterInetPreRouting, n.objs.BrkNatPre), nf6},
		{pinNatOut6, n.objs.BrkNatOut, nf(link.NetfilterProtoIPv6, link.NetfilterInetLocalOut, n.objs.BrkNatOut), nf6},
		{pinNatReflect, n.objs.BrkNatReflect, func(*link.Info) (link.Link, error) {
			var l link.Link
			err := cfg.InNS(func() (err error) {
				l, err = link.AttachTCX(link.TCXOptions{Interface: cfg.Bridge, Program: n.objs.BrkNatReflect, Attach: ebpf.AttachTCXEgress})
				return err
			})
			return l, err
		}, func(i *link.Info) bool { t := i.TCX(); return t != nil && int(t.Ifindex) == cfg.Bridge }},
	}
	for _, w := range wants {
		l, err := adoptOrAttach(filepath.Join(cfg.PinDir, w.pin), w.prog, w.attach, w.same)
		if err != nil {
			n.Close()
			return nil, fmt.Errorf("nat path: %s: %w", w.pin, err)
		}
		n.links[w.pin] = l
	}
	// The tc programs a daemon run with HooksEnv=tc left on the bridge
	// would go on seeing every packet: the flows are shared, so nothing
	// would be counted twice, but every packet would pay twice.
	if err := cfg.InNS(func() error { return detachTC(cfg.Bridge) }); err != nil {
		n.Close()
		return nil, fmt.Errorf("nat path: taking the tc programs off: %w", err)
	}
	// Only now, with this binary's programs attached: the sweep too is
	// theirs from here on, and the previous binary's is let go.
	if err := n.armSweeper(); err != nil {
		n.Close()
		return nil, err
	}
	return n, nil
}

// armSweeper runs brk_nat_arm once: the sweeping timer runs this object's
// sweep from now on (docs/ARCHITECTURE.md, "The nat path").
func (n *NatPath) armSweeper() error {
	arm := n.objs.BrkNatArm
	if n.tc != nil {
		arm = n.tc.BrkNattcArm
	}
	ret, err := arm.Run(&ebpf.RunOptions{Data: make([]byte, 14)})
	if err != nil {
		return fmt.Errorf("nat path: arming the sweep: %w", err)
	}
	if ret != 0 {
		return fmt.Errorf("nat path: arming the sweep: brk_nat_arm returned %d", ret)
	}
	return nil
}

// Adopted says why this binary's programs did not load, when the nat path
// runs on the programs an earlier brokkrd attached ("" otherwise).
func (n *NatPath) Adopted() string { return n.adopted }

// IPv6 reports whether programs run at the IPv6 hooks: an earlier binary's
// that were adopted may have none, and then an IPv6 connection would be
// neither capped nor counted.
func (n *NatPath) IPv6() bool {
	return n.tc != nil || n.links[pinNatPre6] != nil && n.links[pinNatOut6] != nil
}

// adoptNatPath keeps the nat path an earlier brokkrd attached: its pinned
// netfilter links still run its programs, which count and release by the
// same mark. A reflector left on a bridge that is gone is attached again,
// with the same program, to cfg.Bridge.
func adoptNatPath(cfg NatPathConfig, why error) (*NatPath, error) {
	n := &NatPath{links: map[string]link.Link{}, pinDir: cfg.PinDir,
		adopted: why.Error() + "; the programs an earlier brokkrd attached serve on"}
	for _, pin := range []string{pinNatPre, pinNatOut, pinNatPre6, pinNatOut6} {
		l, err := link.LoadPinnedLink(filepath.Join(cfg.PinDir, pin), nil)
		if (pin == pinNatPre6 || pin == pinNatOut6) && errors.Is(err, os.ErrNotExist) {
			continue // an earlier binary without the IPv6 links
		}
		if err != nil {
			n.Close()
			return nil, fmt.Errorf("nat path: no earlier programs to keep: %s: %w", pin, err)
		}
		n.links[pin] = l
		if info, err := l.Info(); err != nil || info.Netfilter() == nil {
			n.Close()
			return nil, fmt.Errorf("nat path: the pinned %s is not attached", pin)
		}
	}
	l, err := adoptReflector(cfg, filepath.Join(cfg.PinDir, pinNatReflect))
	if err != nil {
		n.Close()
		return nil, err
	}
	n.links[pinNatReflect] = l
	return n, nil
}

// adoptReflector keeps the pinned reflector link when it is on cfg.Bridge,
// or attaches its program there (the bridge was made anew).
func adoptReflector(cfg NatPathConfig, pin string) (link.Link, error) {
	old, err := link.LoadPinnedLink(pin, nil)
	if err != nil {
		return nil, fmt.Errorf("nat path: no earlier programs to keep: %s: %w", pinNatReflect, err)
	}
	info, err := old.Info()
	if err == nil {
		if t := info.TCX(); t != nil && int(t.Ifindex) == cfg.Bridge {
			return old, nil
		}
	}
	defer old.Close()
	if err != nil {
		return nil, fmt.Errorf("nat path: the pinned %s: %w", pinNatReflect, err)
	}
	prog, err := ebpf.NewProgramFromID(info.Program)
	if err != nil {
		return nil, fmt.Errorf("nat path: the pinned %s's program: %w", pinNatReflect, err)
	}
	defer prog.Close()
	var l link.Link
	if err := cfg.InNS(func() (err error) {
		l, err = link.AttachTCX(link.TCXOptions{Interface: cfg.Bridge, Program: prog, Attach: ebpf.AttachTCXEgress})
		return err
	}); err != nil {
		return nil, fmt.Errorf("nat path: attaching the earlier reflector: %w", err)
	}
	_ = old.Unpin()
	if err := l.Pin(pin); err != nil {
		l.Close()
		return nil, fmt.Errorf("nat path: pinning the earlier reflector: %w", err)
	}
	return l, nil
}

// detachNatPath removes the pins of the nat path's links, so the last
// handle's close detaches their programs: the fallback's marks are then
// read by no program. The flows those programs tracked keep the places
// they hold until the exposure's slot is given up.
func detachNatPath(dir string) error {
	var errs []error
	for _, pin := range []string{pinNatPre, pinNatOut, pinNatPre6, pinNatOut6, pinNatReflect} {
		if err := os.Remove(filepath.Join(dir, pin)); err != nil && !errors.Is(err, os.ErrNotExist) {
			errs = append(errs, fmt.Errorf("nat path: detaching the earlier %s: %w", pin, err))
		}
	}
	return errors.Join(errs...)
}

// adoptOrAttach keeps a pinned link that runs the same program (by tag) and
// passes same; otherwise it attaches prog, pins the new link, and only then
// detaches the old one, so the hook is never empty.
func adoptOrAttach(pin string, prog *ebpf.Program, attach func(old *link.Info) (link.Link, error), same func(*link.Info) bool) (link.Link, error) {
	old, err := link.LoadPinnedLink(pin, nil)
	if err != nil && !errors.Is(err, os.ErrNotExist) {
		return nil, fmt.Errorf("loading pinned link: %w", err)
	}
	var oldInfo *link.Info
	if old != nil {
		if sameProgram(old, prog, same) {
			return old, nil
		}
		oldInfo, _ = old.Info()
	}
	l, err := attach(oldInfo)
	if err != nil {
		if old != nil {
			old.Close()
		}
		return nil, err
	}
	if old != nil {
		_ = old.Unpin()
		_ = old.Close() // the last reference: detaches the old program
	}
	if err := l.Pin(pin); err != nil {
		l.Close()
		return nil, fmt.Errorf("pinning: %w", err)
	}
	return l, nil
}

func nfInfo(i *link.Info) *link.NetfilterInfo {
	if i == nil {
		return nil
	}
	return i.Netfilter()
}

func sameProgram(l link.Link, prog *ebpf.Program, same func(*link.Info) bool) bool {
	info, err := l.Info()
	if err != nil {
		return false
	}
	if same != nil && !same(info) {
		return false
	}
	attached, err := ebpf.NewProgramFromID(info.Program)
	if err != nil {
		return false
	}
	defer attached.Close()
	a, err := attached.Info()
	if err != nil {
		return false
	}
	b, err := prog.Info()
	if err != nil {
		return false
	}
	return a.Tag == b.Tag && sameMaps(a, b)
}

// sameMaps reports whether two programs use the same maps. A program's tag
// does not depend on the maps it references, and every map brokkr's
// programs use is pinned by name, so one loaded by this binary uses the
// pinned maps of today: an attached program of the same tag that uses
// others (a previous release's, on the exposure_stats of before
// migrate.go's copy) must be replaced, or it would go on counting into
// maps no one reads.
func sameMaps(a, b *ebpf.ProgramInfo) bool {
	am, aok := a.MapIDs()
	bm, bok := b.MapIDs()
	if !aok || !bok || len(am) != len(bm) {
		return false
	}
	seen := make(map[ebpf.MapID]bool, len(am))
	for _, id := range am {
		seen[id] = true
	}
	for _, id := range bm {
		if !seen[id] {
			return false
		}
	}
	return true
}

// SetGuests tells the programs the bridge subnets: v4 an IPv4 prefix, v6
// an IPv6 one; an invalid (zero) prefix says the bridge has none of that
// family. Adopted programs keep the subnets they were given.
func (n *NatPath) SetGuests(v4, v6 netip.Prefix) error {
	if n.objs == nil {
		return nil
	}
	var c natpathNatCfg
	if v4.IsValid() && v4.Addr().Is4() {
		a := v4.Masked().Addr().As4()
		c.GuestNet = binary.NativeEndian.Uint32(a[:])
		var m [4]byte
		binary.BigEndian.PutUint32(m[:], ^uint32(0)<<(32-v4.Bits()))
		c.GuestMask = binary.NativeEndian.Uint32(m[:])
	}
	if err := n.objs.NatConfig.Put(uint32(0), c); err != nil {
		return fmt.Errorf("nat path: config: %w", err)
	}
	if err := n.objs.NatConfig6.Put(uint32(0), guestCfg6(v6)); err != nil {
		return fmt.Errorf("nat path: config6: %w", err)
	}
	return nil
}

// guestCfg6 is nat_config6's value for the IPv6 subnet p: the network and
// its mask, word by word in network byte order; all zero (no subnet) for
// anything but a valid IPv6 prefix of at least one bit.
func guestCfg6(p netip.Prefix) natpathNatCfg6 {
	var c natpathNatCfg6
	if !p.IsValid() || !p.Addr().Is6() || p.Addr().Is4In6() || p.Bits() == 0 {
		return c
	}
	a := p.Masked().Addr().As16()
	for i := range 4 {
		c.GuestNet[i] = binary.NativeEndian.Uint32(a[4*i:])
		var m [4]byte
		bits := min(max(p.Bits()-32*i, 0), 32)
		binary.BigEndian.PutUint32(m[:], uint32(uint64(0xffffffff)<<(32-bits)))
		c.GuestMask[i] = binary.NativeEndian.Uint32(m[:])
	}
	return c
}

// Close drops the process's handles. The pinned links and maps stay, so the
// path keeps working without a daemon.
func (n *NatPath) Close() error {
	var objs io.Closer = nopCloser{}
	if n.objs != nil {
		objs = n.objs
	}
	err := closeLinks(n.links, objs)
	if n.tc != nil {
		err = errors.Join(err, n.tc.Close())
	}
	n.links = nil
	return err
}

type nopCloser struct{}

func (nopCloser) Close() error { return nil }

// Remove detaches the nat path and deletes its pins (the shared counter maps
// stay): what a teardown does.
func (n *NatPath) Remove() error {
	var err error
	if n.tc != nil {
		err = n.inNS(func() error { return detachTC(n.bridge) })
	}
	if n.objs != nil {
		err = errors.Join(err, unpinLinks(n.links, n.objs.NatFlows, n.objs.NatConfig, n.objs.NatConfig6, n.objs.NatSweep, n.objs.AllowFrom, n.objs.AllowRestrictedV2))
	} else {
		err = unpinLinks(n.links)
		for _, m := range []string{"nat_flows", "nat_config", "nat_config6", "nat_sweep", "allow_from", AllowRestrictedMapName} {
			_ = os.Remove(filepath.Join(n.pinDir, m))
		}
	}
	return errors.Join(err, n.Close())
}

// closeLinks drops a process's handles on its links and objects; pinned
// ones stay attached.
func closeLinks(links map[string]link.Link, objs io.Closer) error {
	var errs []error
	for _, l := range links {
		errs = append(errs, l.Close())
	}
	return errors.Join(append(errs, objs.Close())...)
}

// unpinLinks deletes the pins of links and of maps only they use, so the
// last handle's close detaches them.
func unpinLinks(links map[string]link.Link, maps ...*ebpf.Map) error {
	var errs []error
	for _, l := range links {
		errs = append(errs, l.Unpin())
	}
	for _, m := range maps {
		_ = m.Unpin()
	}
	return errors.Join(errs...)
}
