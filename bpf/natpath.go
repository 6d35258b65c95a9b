package bpf

import (
	"encoding/binary"
	"errors"
	"fmt"
	"io"
	"net/netip"
	"os"
	"path/filepath"

	"github.com/cilium/ebpf"
	"github.com/cilium/ebpf/link"
)

// The programs find an exposure's slot from its connections' ct mark:
// the layout is package ctmark's (bpf/ctmark.h on the C side).

// NetfilterPriority is where the nat-path programs sit: right after the DNAT
// (nft nat chains at -100), so a connection's first packet already carries
// its exposure's mark.
const NetfilterPriority = -99

// Pin names of the nat path's links under bpfDir. The links keep the
// programs attached while no daemon runs; a new daemon adopts them.
const (
	pinNatPre     = "nat_pre_link"
	pinNatOut     = "nat_out_link"
	pinNatReflect = "nat_reflect_link"
)

// NatPath is the kernel nat path: admission against the cap, release and
// counting, by BPF programs writing the exposures' slots.
type NatPath struct {
	objs  natpathObjects
	links map[string]link.Link
}

// NatPathConfig says where the programs attach.
type NatPathConfig struct {
	PinDir string       // bpfDir (a bpffs)
	Bridge int          // ifindex of the guest bridge (the reflector's egress hook)
	Guests netip.Prefix // the bridge subnet (callers there are bridged, not routed)
	// InNS runs fn inside the managed network namespace: netfilter and tcx
	// links belong to the namespace of the thread that makes them.
	InNS func(fn func() error) error
}

// LoadNatPath loads the nat-path programs onto the maps pinned in
// cfg.PinDir (created if absent) and attaches them, adopting links an
// earlier daemon pinned when they run the same programs, so the path never
// stops and is never attached twice.
func LoadNatPath(cfg NatPathConfig) (*NatPath, error) {
	if err := checkBPFFS(cfg.PinDir); err != nil {
		return nil, err
	}
	if cfg.InNS == nil {
		cfg.InNS = func(fn func() error) error { return fn() }
	}
	n := &NatPath{links: map[string]link.Link{}}
	err := loadNatpathObjects(&n.objs, &ebpf.CollectionOptions{Maps: ebpf.MapOptions{PinPath: cfg.PinDir}})
	if err != nil {
		return nil, fmt.Errorf("nat path: loading programs: %w", err)
	}
	if err := n.SetGuests(cfg.Guests); err != nil {
		n.objs.Close()
		return nil, err
	}
	type want struct {
		pin    string
		prog   *ebpf.Program
		attach func() (link.Link, error)
		same   func(*link.Info) bool
	}
	nf := func(hook link.NetfilterInetHook, p *ebpf.Program) func() (link.Link, error) {
		return func() (link.Link, error) {
			var l link.Link
			err := cfg.InNS(func() (err error) {
				l, err = link.AttachNetfilter(link.NetfilterOptions{Program: p, ProtocolFamily: link.NetfilterProtoIPv4,
					Hook: hook, Priority: NetfilterPriority})
				return err
			})
			return l, err
		}
	}
	wants := []want{
		{pinNatPre, n.objs.BrkNatPre, nf(link.NetfilterInetPreRouting, n.objs.BrkNatPre), nil},
		{pinNatOut, n.objs.BrkNatOut, nf(link.NetfilterInetLocalOut, n.objs.BrkNatOut), nil},
		{pinNatReflect, n.objs.BrkNatReflect, func() (link.Link, error) {
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
	return n, nil
}

// adoptOrAttach keeps a pinned link that runs the same program (by tag) and
// passes same; otherwise it attaches prog, pins the new link, and only then
// detaches the old one, so the hook is never empty.
func adoptOrAttach(pin string, prog *ebpf.Program, attach func() (link.Link, error), same func(*link.Info) bool) (link.Link, error) {
	old, err := link.LoadPinnedLink(pin, nil)
	if err != nil && !errors.Is(err, os.ErrNotExist) {
		return nil, fmt.Errorf("loading pinned link: %w", err)
	}
	if old != nil {
		if sameProgram(old, prog, same) {
			return old, nil
		}
	}
	l, err := attach()
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
	return a.Tag == b.Tag
}

// SetGuests tells the programs the bridge subnet.
func (n *NatPath) SetGuests(p netip.Prefix) error {
	var c natpathNatCfg
	if p.IsValid() && p.Addr().Is4() {
		a := p.Masked().Addr().As4()
		c.GuestNet = binary.NativeEndian.Uint32(a[:])
		var m [4]byte
		binary.BigEndian.PutUint32(m[:], ^uint32(0)<<(32-p.Bits()))
		c.GuestMask = binary.NativeEndian.Uint32(m[:])
	}
	if err := n.objs.NatConfig.Put(uint32(0), c); err != nil {
		return fmt.Errorf("nat path: config: %w", err)
	}
	return nil
}

// Close drops the process's handles. The pinned links and maps stay, so the
// path keeps working without a daemon.
func (n *NatPath) Close() error {
	err := closeLinks(n.links, &n.objs)
	n.links = nil
	return err
}

// Remove detaches the nat path and deletes its pins (the shared counter maps
// stay): what a teardown does.
func (n *NatPath) Remove() error {
	err := unpinLinks(n.links, n.objs.NatFlows, n.objs.NatConfig, n.objs.NatSweep)
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
