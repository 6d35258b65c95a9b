package proxy

import (
	"fmt"
	"net/netip"
	"strconv"
	"strings"
	"time"

	"github.com/brokkr/brokkr/bpf"
)

// DefaultUDPIdle is how long a UDP flow lives without traffic when the spec
// does not say.
const DefaultUDPIdle = 60 * time.Second

// checked is a Spec after validation, with its host address parsed and its
// defaults filled in.
type checked struct {
	Spec
	host netip.Addr // unmapped; the zero of the family for "any"
	idle time.Duration
}

// bindKey is what two exposures must not share: one socket per protocol,
// address and port.
func (c checked) bindKey() string {
	return c.Protocol + " " + netip.AddrPortFrom(c.host, uint16(c.HostPort)).String()
}

// listenKey says which changes need a new socket. MaxConns and UDPIdle are
// not in it: a changed cap or idle timeout is applied in place, without
// dropping the listener or its connections.
func (c checked) listenKey() string {
	return c.bindKey() + " -> " + c.VM + ":" + strconv.Itoa(c.GuestPort)
}

// hostAddrPort is the address the listener binds.
func (c checked) hostAddrPort() string {
	return netip.AddrPortFrom(c.host, uint16(c.HostPort)).String()
}

// validate checks one spec on its own. Errors name the field as the config
// file spells it.
func validate(s Spec) (checked, error) {
	c := checked{Spec: s}
	if err := bpf.ValidName(s.ID); err != nil {
		return c, fmt.Errorf("name: %w", err)
	}
	if s.VM == "" {
		return c, fmt.Errorf("vm: empty (the resolver needs a VM to find the guest address)")
	}
	switch strings.ToLower(s.Protocol) {
	case "tcp", "udp":
		c.Protocol = strings.ToLower(s.Protocol)
	case "":
		return c, fmt.Errorf("protocol: empty, want tcp or udp")
	default:
		return c, fmt.Errorf("protocol: %q is not tcp or udp", s.Protocol)
	}
	switch s.HostAddress {
	case "":
		c.host = netip.IPv4Unspecified()
	default:
		a, err := netip.ParseAddr(s.HostAddress)
		if err != nil || a.Zone() != "" {
			return c, fmt.Errorf("hostAddress: %q is not an IP address", s.HostAddress)
		}
		c.host = a.Unmap()
	}
	// HostPort 0 is allowed and means "the OS picks" (tests and benchmarks use
	// it; Status.BoundAddr says what was picked). The daemon's config
	// validation refuses 0, as the contract asks for 1..65535.
	if s.HostPort < 0 || s.HostPort > 65535 {
		return c, fmt.Errorf("hostPort: %d is out of range 1..65535 (0 = any free port)", s.HostPort)
	}
	if s.GuestPort < 1 || s.GuestPort > 65535 {
		return c, fmt.Errorf("guestPort: %d is out of range 1..65535", s.GuestPort)
	}
	if s.MaxConns < 0 {
		return c, fmt.Errorf("maxConns: %d is negative (0 = unlimited)", s.MaxConns)
	}
	if s.UDPIdle < 0 {
		return c, fmt.Errorf("udpIdle: %v is negative (0 = %v)", s.UDPIdle, DefaultUDPIdle)
	}
	c.idle = s.UDPIdle
	if c.idle == 0 {
		c.idle = DefaultUDPIdle
	}
	return c, nil
}

// validateAll checks every spec and the rules between them: IDs are unique,
// and no two exposures ask for the same protocol, address and port. The first
// of two clashing specs keeps running; every later one fails and names the
// one it clashes with, so a working exposure is never taken down by a new one.
// owners[i] says spec i is the one that owns its ID (its first use, with a
// valid name), which is the spec whose running state and counters the ID
// names, even when the spec itself is invalid.
func validateAll(desired []Spec) (checks []checked, errs []error, owners []bool) {
	out := make([]checked, len(desired))
	errs = make([]error, len(desired))
	owners = make([]bool, len(desired))
	ids := map[string]int{}
	binds := map[string]int{}
	for i, s := range desired {
		c, err := validate(s)
		out[i] = c
		if err != nil {
			errs[i] = err
			// A bad port is still a claim on the ID: a later spec with the
			// same ID is a duplicate either way.
			if bpf.ValidName(s.ID) == nil {
				if _, seen := ids[s.ID]; !seen {
					ids[s.ID] = i
					owners[i] = true
				}
			}
			continue
		}
		if j, seen := ids[s.ID]; seen {
			errs[i] = fmt.Errorf("name: %q is used by an earlier exposure (#%d)", s.ID, j)
			continue
		}
		ids[s.ID] = i
		owners[i] = true
		if c.HostPort == 0 {
			continue // the OS picks a free port: nothing to clash with
		}
		if j, seen := binds[c.bindKey()]; seen {
			errs[i] = fmt.Errorf("hostPort: %s %s is already published by exposure %q", c.Protocol, c.hostAddrPort(), desired[j].ID)
			continue
		}
		binds[c.bindKey()] = i
	}
	return out, errs, owners
}
