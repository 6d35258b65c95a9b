package link

import (
	"bytes"
	"fmt"
	"net"
	"strings"

	"github.com/vishvananda/netlink"

	"github.com/brokkr/brokkr/internal/nlsafe"
)

const netlinkUp = net.FlagUp

// TapSpec is one VM's tap.
type TapSpec struct {
	VM         string
	Name       string           // TapName(VM)
	GuestMAC   net.HardwareAddr // the MAC the guest will use; the tap gets a derived host MAC
	MultiQueue bool
	Bridge     string
	MTU        int
}

// tapFlags are the flags a hypervisor opens the tap with; IFF_MULTI_QUEUE
// must match between creation and every open, the others are per-open.
func tapFlags(multiQueue bool) netlink.TuntapFlag {
	f := netlink.TUNTAP_NO_PI | netlink.TUNTAP_VNET_HDR
	if multiQueue {
		f |= netlink.TUNTAP_MULTI_QUEUE
	}
	return f
}

// TapResult is the outcome of ensuring one tap.
type TapResult struct {
	Created  bool
	Repaired []string // drift found on an existing tap and repaired
	Err      error
}

// EnsureTap is EnsureTaps for one tap.
func (m *Manager) EnsureTap(s TapSpec) (created bool, repaired []string, err error) {
	r := m.EnsureTaps([]TapSpec{s})[0]
	return r.Created, r.Repaired, r.Err
}

// EnsureTaps makes each VM's tap exist: persistent, brokkr's alias, the
// host MAC, attached to its bridge as a hairpin port, up. An existing tap is
// repaired in place (never recreated: a running VM may hold it open). A
// multi-queue mismatch on an existing tap cannot be fixed in place and is an
// error. The namespace is read with one link dump and one bridge-port dump
// for all taps, so a pass stays linear in the number of taps.
func (m *Manager) EnsureTaps(specs []TapSpec) []TapResult {
	out := make([]TapResult, len(specs))
	fail := func(err error) []TapResult {
		for i := range out {
			out[i].Err = err
		}
		return out
	}
	links, err := m.Links()
	if err != nil {
		return fail(err)
	}
	byName := map[string]netlink.Link{}
	for _, l := range links {
		byName[l.Attrs().Name] = l
	}
	hairpin, err := nlsafe.HairpinPorts(m.ns)
	if err != nil {
		return fail(fmt.Errorf("reading bridge ports: %w", err))
	}
	for i, s := range specs {
		out[i] = m.ensureTap(s, byName, hairpin)
	}
	return out
}

func (m *Manager) ensureTap(s TapSpec, byName map[string]netlink.Link, hairpin map[int]bool) (r TapResult) {
	br := byName[s.Bridge]
	if br == nil {
		r.Err = fmt.Errorf("bridge %s does not exist", s.Bridge)
		return r
	}
	l := byName[s.Name]
	alias := tapAliasPrefix + s.VM
	if l != nil && (l.Attrs().Alias != alias || l.Type() != "tuntap") {
		if Owned(l) {
			r.Err = fmt.Errorf("link %s belongs to another brokkr object (%s)", s.Name, l.Attrs().Alias)
		} else {
			r.Err = fmt.Errorf("link %s %w", s.Name, ErrForeign)
		}
		return r
	}
	if l == nil {
		var err error
		if l, err = m.createTap(s, alias); err != nil {
			r.Err = err
			return r
		}
		r.Created = true
	}
	fix := func(what string) {
		if !r.Created {
			r.Repaired = append(r.Repaired, fmt.Sprintf("tap %s %s", s.Name, what))
		}
	}
	fail := func(format string, args ...any) TapResult {
		r.Err = fmt.Errorf(format, args...)
		return r
	}
	if tt, ok := l.(*netlink.Tuntap); ok && (tt.Flags&netlink.TUNTAP_MULTI_QUEUE != 0) != s.MultiQueue {
		return fail("tap %s has multiQueue=%v, want %v: delete the VM's tap (stop the VM) to change it",
			s.Name, !s.MultiQueue, s.MultiQueue)
	}
	want := hostMAC(s.GuestMAC)
	if !bytes.Equal(l.Attrs().HardwareAddr, want) {
		fix(fmt.Sprintf("had MAC %s", l.Attrs().HardwareAddr))
		if err := m.h.LinkSetHardwareAddr(l, want); err != nil {
			return fail("setting MAC of %s: %w", s.Name, err)
		}
	}
	if s.MTU > 0 && l.Attrs().MTU != s.MTU {
		fix(fmt.Sprintf("had MTU %d", l.Attrs().MTU))
		if err := m.h.LinkSetMTU(l, s.MTU); err != nil {
			return fail("setting MTU of %s: %w", s.Name, err)
		}
	}
	attached := l.Attrs().MasterIndex == br.Attrs().Index
	if !attached {
		fix("was not attached to " + s.Bridge)
		if err := m.h.LinkSetMaster(l, br); err != nil {
			return fail("attaching %s to %s: %w", s.Name, s.Bridge, err)
		}
	}
	// Hairpin lets a guest reach its own published port through the host
	// address: the DNATed frame goes back out the port it came in on. A port
	// just attached starts with hairpin off.
	if !attached || !hairpin[l.Attrs().Index] {
		if attached {
			fix("had hairpin off")
		}
		if err := m.h.LinkSetHairpin(l, true); err != nil {
			return fail("hairpin on %s: %w", s.Name, err)
		}
	}
	if l.Attrs().Flags&netlinkUp == 0 {
		fix("was down")
		if err := m.h.LinkSetUp(l); err != nil {
			return fail("setting %s up: %w", s.Name, err)
		}
	}
	return r
}

// createTap makes the tap, marks it with alias and returns it as the kernel
// now reports it.
func (m *Manager) createTap(s TapSpec, alias string) (netlink.Link, error) {
	tap := &netlink.Tuntap{
		LinkAttrs: netlink.LinkAttrs{Name: s.Name},
		Mode:      netlink.TUNTAP_MODE_TAP,
		Flags:     tapFlags(s.MultiQueue),
		Queues:    0, // create, persist, close: the hypervisor opens its own queues
	}
	// TUNSETIFF makes the device in the calling thread's namespace, not the
	// handle's, so the create runs on a thread inside the managed namespace.
	err := nlsafe.Do(m.ns, func() error {
		h, err := netlink.NewHandle()
		if err != nil {
			return err
		}
		defer h.Close()
		return h.LinkAdd(tap)
	})
	if err != nil {
		return nil, fmt.Errorf("creating tap %s: %w", s.Name, err)
	}
	l, err := m.byName(s.Name)
	if err == nil && l == nil {
		err = fmt.Errorf("not found after creation")
	}
	if err == nil {
		err = m.h.LinkSetAlias(l, alias)
	}
	if err != nil {
		if l != nil {
			_ = m.h.LinkDel(l)
		}
		return nil, fmt.Errorf("marking tap %s: %w", s.Name, err)
	}
	return l, nil
}

// OwnedTaps maps the name of every tap brokkr made in the namespace to its VM.
func (m *Manager) OwnedTaps() (map[string]string, error) {
	links, err := m.Links()
	if err != nil {
		return nil, err
	}
	return OwnedTapsIn(links), nil
}

// OwnedTapsIn is OwnedTaps over an existing link dump.
func OwnedTapsIn(links []netlink.Link) map[string]string {
	out := map[string]string{}
	for _, l := range links {
		if vm, ok := strings.CutPrefix(l.Attrs().Alias, tapAliasPrefix); ok {
			out[l.Attrs().Name] = vm
		}
	}
	return out
}

// DeleteTap removes a tap brokkr made; a missing one is fine, a foreign one
// is refused.
func (m *Manager) DeleteTap(name string) error {
	l, err := m.byName(name)
	if err != nil || l == nil {
		return err
	}
	if !strings.HasPrefix(l.Attrs().Alias, tapAliasPrefix) {
		return fmt.Errorf("not deleting %s: link %w", name, ErrForeign)
	}
	if err := m.h.LinkDel(l); err != nil && !nlsafe.IsNotFound(err) {
		return fmt.Errorf("deleting tap %s: %w", name, err)
	}
	return nil
}
