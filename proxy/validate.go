package proxy

import (
	"fmt"
	"net/netip"
	"strconv"
	"time"

	"github.com/brokkr/brokkr/internal/spec"
)

// DefaultUDPIdle is how long a UDP flow lives without traffic when the spec
// does not say.
const DefaultUDPIdle = 60 * time.Second

// checked is a Spec with its defaults filled in. Its fields were validated
// where the desired state entered (config.Compile); what is left for the
// proxy is what only it knows: which ID and socket it already holds, and
// what the kernel says when it binds.
type checked struct {
	Spec
	host netip.Addr // unmapped; the zero of the family for "any"
	idle time.Duration
}

// port is the host port the listener binds.
func (c checked) port() uint16 {
	if c.Port != 0 {
		return c.Port
	}
	return c.HostPort
}

// guestPort is where the listener's callers go on the guest.
func (c checked) guestPort() uint16 { return c.GuestPortOf(c.port()) }

// bindKey is what two exposures must not share: one socket per protocol,
// address and port.
func (c checked) bindKey() string {
	return string(c.Proto) + " " + netip.AddrPortFrom(c.host, c.port()).String()
}

// listenKey says which changes need a new socket. MaxConns, UDPIdle and
// ProxyProtocol are not in it: a changed cap, idle timeout or header is
// applied in place (to the connections accepted after it), without dropping
// the listener or its connections.
func (c checked) listenKey() string {
	return c.bindKey() + " -> " + c.Target.String() + ":" + strconv.Itoa(int(c.guestPort()))
}

// key is the listener's name in the Manager.
func (c checked) key() listenerKey { return listenerKey{c.Name, c.host, c.port()} }

// hostAddrPort is the address the listener binds.
func (c checked) hostAddrPort() string {
	return netip.AddrPortFrom(c.host, c.port()).String()
}

func fill(s Spec) checked {
	c := checked{Spec: s, host: s.Listen.Unmap(), idle: s.UDPIdle}
	if !c.host.IsValid() {
		c.host = netip.IPv4Unspecified()
	}
	if c.idle <= 0 {
		c.idle = DefaultUDPIdle
	}
	return c
}

// validateAll fills in every spec and checks what only this Manager knows:
// an ID and a host address name one listener, and no two listeners ask for
// the same protocol, address and port. The first of two clashing specs keeps
// running; every later one fails and names the one it clashes with, so a
// working exposure is never taken down by a new one. owners[i] says spec i
// is the one that owns its key (its first use), whose running state the key
// names.
func validateAll(desired []Spec) (checks []checked, errs []error, owners []bool) {
	out := make([]checked, len(desired))
	errs = make([]error, len(desired))
	owners = make([]bool, len(desired))
	keys := map[listenerKey]int{}
	binds := map[string]int{}
	for i, s := range desired {
		c := fill(s)
		out[i] = c
		if j, seen := keys[c.key()]; seen {
			errs[i] = fmt.Errorf("name: %q on %s is used by an earlier exposure (#%d)", s.Name, netip.AddrPortFrom(c.host, c.port()), j)
			continue
		}
		keys[c.key()] = i
		owners[i] = true
		if c.port() == 0 {
			continue // the OS picks a free port: nothing to clash with
		}
		if j, seen := binds[c.bindKey()]; seen {
			errs[i] = fmt.Errorf("hostPort: %s %s is already published by exposure %q", c.Proto, c.hostAddrPort(), desired[j].Name)
			continue
		}
		binds[c.bindKey()] = i
	}
	return out, errs, owners
}

// guestAddr is where a connection for t goes now ("" = nowhere yet): for
// an IPv6 caller (v6) the guest's IPv6 address where it has one, else its
// IPv4 address, as for every IPv4 caller; a fixed target the same way
// (its one address when it has one family only).
func (m *Manager) guestAddr(t spec.Target, v6 bool) string {
	if !t.IsVM() {
		if (v6 || !t.Addr.IsValid()) && t.Addr6.IsValid() {
			return t.Addr6.String()
		}
		return t.Addr.String()
	}
	if v6 && m.resolve6 != nil {
		if a := m.resolve6(t.VM); a != "" {
			return a
		}
	}
	return m.resolve(t.VM)
}

// fromIPv6 reports whether a caller came over IPv6 (a v4-mapped address on
// a dual-stack listener is an IPv4 caller).
func fromIPv6(a netip.AddrPort) bool {
	return a.Addr().IsValid() && !a.Addr().Unmap().Is4()
}
