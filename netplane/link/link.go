// Package link owns the host-side links of the guest network: the bridge and
// one tap per VM, inside the managed network namespace.
//
// Ownership: every link this package creates carries an ifalias starting
// with "brokkr:" ("brokkr:bridge", "brokkr:tap:<vm>"). The alias is kernel
// state, so it survives a daemon restart without a separate record, and it is
// the only thing that lets brokkr change or delete a link: a link without it
// (an operator's bridge that happens to share the configured name, a veth,
// the uplink) is never modified, only reported as a conflict.
package link

import (
	"crypto/sha256"
	"encoding/hex"
	"errors"
	"fmt"
	"io/fs"
	"net"
	"net/netip"
	"os"
	"strconv"
	"strings"

	"github.com/vishvananda/netlink"
	"golang.org/x/sys/unix"

	"github.com/brokkr/brokkr/internal/nlsafe"
)

const (
	// AliasPrefix marks a link as made by brokkr.
	AliasPrefix    = "brokkr:"
	bridgeAlias    = AliasPrefix + "bridge"
	tapAliasPrefix = AliasPrefix + "tap:"
	// MaxNameLen is IFNAMSIZ-1.
	MaxNameLen = unix.IFNAMSIZ - 1
	tapPrefix  = "brk-"
)

// ErrForeign says a link with the wanted name exists but brokkr did not make it.
var ErrForeign = errors.New("exists and was not created by brokkr")

// Manager creates, repairs and deletes brokkr's links in one namespace.
//
// Why 21 methods on one type: they share the one netlink handle of the
// namespace (and nothing else: 3 fields), and each file holds one concern
// of it (bridge.go, tap.go, ipv6.go, neigh.go; link.go the forwarding
// sysctls and the foreign-prefix scan). Types per concern would each wrap
// the same handle and add nothing a reader could not see from the file.
type Manager struct {
	ns string
	h  *netlink.Handle
	// nonePinned: the last PinNeighbours had no sleeper and left no
	// permanent entry; the next one with none has nothing to look at.
	nonePinned bool
}

// New opens a Manager on the namespace at nsPath ("" = the current one).
func New(nsPath string) (*Manager, error) {
	h, err := nlsafe.Handle(nsPath)
	if err != nil {
		return nil, err
	}
	return &Manager{ns: nsPath, h: h}, nil
}

// Close releases the netlink handle; links stay.
func (m *Manager) Close() { m.h.Close() }

// Handle is the netlink handle bound to the managed namespace.
func (m *Manager) Handle() *netlink.Handle { return m.h }

// Owned reports whether brokkr made the link.
func Owned(l netlink.Link) bool { return strings.HasPrefix(l.Attrs().Alias, AliasPrefix) }

// ValidName checks an interface name the way the kernel does (dev_valid_name).
func ValidName(name string) error {
	switch {
	case name == "":
		return errors.New("is empty")
	case len(name) > MaxNameLen:
		return fmt.Errorf("%q is longer than %d bytes", name, MaxNameLen)
	case name == "." || name == "..":
		return fmt.Errorf("%q is not an interface name", name)
	case strings.ContainsAny(name, "/: \t\n"):
		return fmt.Errorf("%q contains '/', ':' or whitespace", name)
	}
	return nil
}

// TapName derives the tap's name from the VM name: brk-<name> when it fits
// in 15 bytes, else brk-<first 5 bytes><6 hex of sha256(name)>, so two long
// names that share a prefix still get different taps.
func TapName(vm string) string {
	if len(tapPrefix)+len(vm) <= MaxNameLen {
		return tapPrefix + vm
	}
	sum := sha256.Sum256([]byte(vm))
	return tapPrefix + vm[:5] + hex.EncodeToString(sum[:3])
}

// GuestMAC is the guest's stable MAC: 52:54:00 (locally administered, the
// prefix QEMU uses) and three bytes of sha256(name, attempt). attempt > 0
// is for resolving a collision with another VM's MAC.
func GuestMAC(vm string, attempt int) net.HardwareAddr {
	sum := sha256.Sum256(fmt.Appendf(nil, "%s/%d", vm, attempt))
	return net.HardwareAddr{0x52, 0x54, 0x00, sum[0], sum[1], sum[2]}
}

// hostMAC is the MAC of the tap device itself. It must differ from the
// guest's: a bridge treats its ports' own MACs as local, so a tap carrying
// the guest's MAC would swallow the guest's traffic. The first byte 0xfe
// (libvirt does the same) also keeps it above any guest MAC, so the bridge
// never adopts it as its own address.
func hostMAC(guest net.HardwareAddr) net.HardwareAddr {
	mac := append(net.HardwareAddr(nil), guest...)
	mac[0] = 0xfe
	return mac
}

// bridgeMAC is a stable, locally administered MAC for the bridge, so its
// address does not follow its ports as they come and go (guests' ARP
// caches stay right).
func bridgeMAC(name string) net.HardwareAddr {
	sum := sha256.Sum256([]byte("bridge/" + name))
	return net.HardwareAddr{0x02, sum[0], sum[1], sum[2], sum[3], sum[4]}
}

// Links lists every link of the namespace.
func (m *Manager) Links() ([]netlink.Link, error) { return nlsafe.LinkList(m.h) }

// byName returns the link or nil when it does not exist.
func (m *Manager) byName(name string) (netlink.Link, error) {
	l, err := nlsafe.LinkByName(m.h, name)
	if nlsafe.IsNotFound(err) {
		return nil, nil
	}
	if err != nil {
		return nil, fmt.Errorf("looking up %s: %w", name, err)
	}
	return l, nil
}

// EnableForwarding sets net.ipv4.ip_forward=1 in the managed namespace (the
// sysctl is per namespace; written from a thread inside it). It reports
// whether the value had to change.
func (m *Manager) EnableForwarding() (changed bool, err error) {
	err = nlsafe.Do(m.ns, func() error {
		const p = "/proc/sys/net/ipv4/ip_forward"
		cur, err := os.ReadFile(p)
		if err != nil {
			return err
		}
		if strings.TrimSpace(string(cur)) == "1" {
			return nil
		}
		changed = true
		return os.WriteFile(p, []byte("1\n"), 0o644)
	})
	if err != nil {
		return false, fmt.Errorf("enabling ip_forward: %w", err)
	}
	return changed, nil
}

// EnableForwarding6 sets net.ipv6.conf.all.forwarding=1 in the managed
// namespace, which DNAT of IPv6 callers to the guests needs. Forwarding
// makes the kernel ignore router advertisements on an interface whose
// accept_ra is 1, so a host that configures its own IPv6 by SLAAC would
// lose its address and default route when they expire: every interface
// (and default, for those to come) with accept_ra 1 is set to 2 first,
// which accepts them while forwarding. It reports what it changed.
func (m *Manager) EnableForwarding6() (changed []string, err error) {
	err = nlsafe.Do(m.ns, func() error {
		const dir = "/proc/sys/net/ipv6/conf/"
		fwd := dir + "all/forwarding"
		cur, err := os.ReadFile(fwd)
		if err != nil {
			return err
		}
		if strings.TrimSpace(string(cur)) == "1" {
			return nil
		}
		ifs, err := os.ReadDir(dir)
		if err != nil {
			return err
		}
		for _, i := range ifs {
			p := dir + i.Name() + "/accept_ra"
			v, err := os.ReadFile(p)
			if err != nil || strings.TrimSpace(string(v)) != "1" {
				continue
			}
			if err := os.WriteFile(p, []byte("2\n"), 0o644); err != nil {
				return err
			}
			changed = append(changed, "net.ipv6.conf."+i.Name()+".accept_ra=2")
		}
		changed = append(changed, "net.ipv6.conf.all.forwarding=1")
		return os.WriteFile(fwd, []byte("1\n"), 0o644)
	})
	if err != nil {
		return changed, fmt.Errorf("enabling IPv6 forwarding: %w", err)
	}
	return changed, nil
}

// NeighbourProbes is how many times (a second apart, the kernel's
// retrans_time) the host asks for a guest's MAC before it gives up on it
// and answers the packets waiting for it with "host unreachable". The
// kernel's 3 (unicast) and 3 (broadcast) made a caller of a suspended VM
// fail with EHOSTUNREACH whenever the resume took longer than the host's
// patience (a CI run under load failed the nat wake test so); 30 waits as
// long as the proxy waits for a woken guest, its packets queued meanwhile.
const NeighbourProbes = 30

// patientNeighbours sets the bridge's neighbour probes (IPv4 and, where the
// bridge has it, IPv6 ucast_solicit and mcast_solicit) to NeighbourProbes in
// the managed namespace, on brokkr's bridge only. A value found otherwise
// is set without a word: a bridge made by a release before this one has
// the kernel's defaults, and that is not drift.
func (m *Manager) patientNeighbours(bridge string) error {
	want := strconv.Itoa(NeighbourProbes)
	err := nlsafe.Do(m.ns, func() error {
		for _, fam := range []string{"ipv4", "ipv6"} {
			dir := "/proc/sys/net/" + fam + "/neigh/" + bridge + "/"
			if _, err := os.Stat(dir); fam == "ipv6" && errors.Is(err, fs.ErrNotExist) {
				continue // IPv6 disabled on the host
			}
			for _, key := range []string{"ucast_solicit", "mcast_solicit"} {
				cur, err := os.ReadFile(dir + key)
				if err != nil {
					return err
				}
				if strings.TrimSpace(string(cur)) == want {
					continue
				}
				if err := os.WriteFile(dir+key, []byte(want+"\n"), 0o644); err != nil {
					return err
				}
			}
		}
		return nil
	})
	if err != nil {
		return fmt.Errorf("setting the neighbour probes of %s: %w", bridge, err)
	}
	return nil
}

// InterfacePrefix is an IPv4 or IPv6 prefix on a link brokkr does not own.
type InterfacePrefix struct {
	Link   string
	Prefix netip.Prefix
}

// ForeignPrefixes lists the IPv4 and IPv6 prefixes (not loopback, not
// link-local) of every link brokkr did not make, to refuse a bridge subnet
// that overlaps them.
func (m *Manager) ForeignPrefixes() ([]InterfacePrefix, error) {
	links, err := m.Links()
	if err != nil {
		return nil, err
	}
	return m.ForeignPrefixesIn(links)
}

// ForeignPrefixesIn is ForeignPrefixes over an existing link dump: one
// address dump per foreign link (brokkr's taps are skipped).
func (m *Manager) ForeignPrefixesIn(links []netlink.Link) ([]InterfacePrefix, error) {
	var out []InterfacePrefix
	for _, l := range links {
		if Owned(l) {
			continue
		}
		addrs, err := nlsafe.AddrList(m.h, l, netlink.FAMILY_ALL)
		if err != nil {
			return nil, fmt.Errorf("addresses of %s: %w", l.Attrs().Name, err)
		}
		for _, a := range addrs {
			p, ok := prefixOf(a.IPNet)
			if !ok {
				p, ok = prefix6Of(a.IPNet)
			}
			if ok && !p.Addr().IsLoopback() && !p.Addr().IsLinkLocalUnicast() {
				out = append(out, InterfacePrefix{Link: l.Attrs().Name, Prefix: p})
			}
		}
	}
	return out, nil
}

func prefixOf(n *net.IPNet) (netip.Prefix, bool) {
	if n == nil {
		return netip.Prefix{}, false
	}
	a, ok := netip.AddrFromSlice(n.IP.To4())
	if !ok {
		return netip.Prefix{}, false
	}
	ones, _ := n.Mask.Size()
	return netip.PrefixFrom(a, ones), true
}

func ipNet(p netip.Prefix) *net.IPNet {
	return &net.IPNet{IP: p.Addr().AsSlice(), Mask: net.CIDRMask(p.Bits(), p.Addr().BitLen())}
}
