package link

import (
	"errors"
	"fmt"
	"net"
	"net/netip"
	"os"
	"strings"

	"github.com/vishvananda/netlink"
	"golang.org/x/sys/unix"

	"github.com/brokkr/brokkr/internal/nlsafe"
)

// IPv6Enabled reports whether the link has IPv6: the kernel has it, it is
// not disabled on the link (disable_ipv6, inherited from default when the
// link was made), and the link's MTU is at least IPv6's 1280 (below that
// the kernel takes IPv6 off the link). Read inside the managed namespace.
func (m *Manager) IPv6Enabled(name string) (bool, error) {
	on := false
	err := nlsafe.Do(m.ns, func() error {
		b, err := os.ReadFile("/proc/sys/net/ipv6/conf/" + name + "/disable_ipv6")
		if errors.Is(err, os.ErrNotExist) {
			return nil
		}
		if err != nil {
			return err
		}
		on = strings.TrimSpace(string(b)) == "0"
		return nil
	})
	if err != nil {
		return false, fmt.Errorf("IPv6 on %s: %w", name, err)
	}
	return on, nil
}

// ensureBridge6 gives the bridge exactly one IPv6 address besides its
// link-local ones, want (none for the zero Prefix), and stops it from
// taking router advertisements: the only routers on the bridge are guests,
// and a guest must never configure the host. The address is added without
// duplicate address detection, so it is usable at once (brokkr owns the
// /64; every guest address has ff:fe in its middle, this one cannot).
func (m *Manager) ensureBridge6(l netlink.Link, want netip.Prefix, fix func(string)) error {
	name := l.Attrs().Name
	if err := m.setIPv6Conf(name, "accept_ra", "0", fix, "accepted router advertisements"); err != nil {
		return err
	}
	addrs, err := nlsafe.AddrList(m.h, l, netlink.FAMILY_V6)
	if err != nil {
		return fmt.Errorf("IPv6 addresses of %s: %w", name, err)
	}
	have := false
	for _, a := range addrs {
		p, ok := prefix6Of(a.IPNet)
		if !ok || p.Addr().IsLinkLocalUnicast() {
			continue
		}
		if p == want {
			have = true
			continue
		}
		fix(fmt.Sprintf("had stray address %s", p))
		if err := m.h.AddrDel(l, &a); err != nil {
			return fmt.Errorf("removing %s from %s: %w", p, name, err)
		}
	}
	if !have && want.IsValid() {
		fix(fmt.Sprintf("lost its address %s", want))
		if err := m.h.AddrAdd(l, &netlink.Addr{IPNet: ipNet(want), Flags: unix.IFA_F_NODAD}); err != nil {
			return fmt.Errorf("adding %s to %s: %w", want, name, err)
		}
	}
	return nil
}

// setIPv6Conf writes net.ipv6.conf.<link>.<key> when it differs, inside
// the managed namespace, reporting the drift as what.
func (m *Manager) setIPv6Conf(link, key, value string, fix func(string), what string) error {
	return nlsafe.Do(m.ns, func() error {
		p := "/proc/sys/net/ipv6/conf/" + link + "/" + key
		cur, err := os.ReadFile(p)
		if err != nil {
			return fmt.Errorf("reading %s: %w", p, err)
		}
		if strings.TrimSpace(string(cur)) == value {
			return nil
		}
		fix(what)
		if err := os.WriteFile(p, []byte(value+"\n"), 0o644); err != nil {
			return fmt.Errorf("setting %s: %w", p, err)
		}
		return nil
	})
}

func prefix6Of(n *net.IPNet) (netip.Prefix, bool) {
	if n == nil || n.IP.To4() != nil {
		return netip.Prefix{}, false
	}
	a, ok := netip.AddrFromSlice(n.IP)
	if !ok {
		return netip.Prefix{}, false
	}
	ones, _ := n.Mask.Size()
	return netip.PrefixFrom(a, ones), true
}
