package daemon

import (
	"errors"
	"fmt"
	"net/netip"
	"slices"

	"github.com/brokkr/brokkr/internal/spec"
	"github.com/brokkr/brokkr/netplane/hold"
)

// Port ownership. Every exposure whose host side no proxy listener binds
// (nat, and auto where the kernel paths carry it) holds its host side with
// a bound socket (package hold), taken before the engines see the exposure:
// a port a host program already holds fails the exposure, naming the
// program, and the exposure gets no DNAT element and no socket-path
// translation, so the program's callers are never taken from it; once the
// port frees, the next pass takes it. A held port cannot be bound by a host
// program. The proxy's listeners hold their own ports.

// Holds is the seam to package hold.
type Holds interface {
	Sync(want map[string][]hold.Side) map[string]error
	Take(sides []hold.Side) error
	Check(sd hold.Side) error
}

// takePorts holds e's host sides before it is published on its own (an API
// change between passes); an error says why it cannot be.
func (d *Daemon) takePorts(e spec.Exposure) error {
	if d.opts.Holds == nil {
		return nil
	}
	return d.opts.Holds.Take(hostSides(e, d.opts.IPv6Loopback, d.sock != nil))
}

// hostSides are the host sides e holds: one per address and per port of a
// range, but none of a family the proxy listens on for e (a proxy
// listener there binds the port itself, and auto's 127.0.0.1 could not be
// bound beside a held 0.0.0.0): all of proxy mode's and of an auto
// exposure the proxy carries wholly, auto's IPv4 ones where loopback
// callers go through the proxy, the IPv6 ones where the proxy carries the
// IPv6 callers on ::.
func hostSides(e spec.Exposure, ipv6, sock bool) []hold.Side {
	binds := e.ProxyBinds(ipv6, sock)
	proxied4 := slices.ContainsFunc(binds, netip.Addr.Is4)
	proxied6 := slices.ContainsFunc(binds, netip.Addr.Is6)
	var sides []hold.Side
	for _, a := range e.HostAddrs(ipv6) {
		if (a.Is4() && proxied4) || (a.Is6() && proxied6) {
			continue
		}
		for _, p := range e.HostPorts() {
			sides = append(sides, hold.Side{Addr: a, Proto: string(e.Proto), Port: p})
		}
	}
	return sides
}

// holdPorts holds the host sides of m's exposures and returns m without the
// exposures that could not take theirs (m itself is not changed), and those
// exposures' parts for the status. selfHeld is set when one waits for a
// listener of this very process (a proxy listener the pass will close).
func (d *Daemon) holdPorts(m *spec.Desired) (engines *spec.Desired, parts map[string]part, selfHeld bool) {
	if d.opts.Holds == nil {
		return m, nil, false
	}
	want := map[string][]hold.Side{}
	for _, e := range m.Exposures {
		if s := hostSides(e, d.opts.IPv6Loopback, d.sock != nil); len(s) > 0 {
			want[e.Name] = s
		}
	}
	failed := d.opts.Holds.Sync(want)
	if len(failed) == 0 {
		return m, nil, false
	}
	parts = map[string]part{}
	out := *m
	out.Exposures = make([]spec.Exposure, 0, len(m.Exposures))
	for _, e := range m.Exposures {
		err, ok := failed[e.Name]
		if !ok {
			out.Exposures = append(out.Exposures, e)
			continue
		}
		var iu *hold.InUseError
		if errors.As(err, &iu) && iu.Self {
			parts[e.Name] = part{"port", spec.StatePending, fmt.Sprintf("%s: waiting for brokkrd's own listener to close", iu.Side)}
			selfHeld = true
			continue
		}
		parts[e.Name] = part{"port", spec.StateFailed, err.Error()}
	}
	return &out, parts, selfHeld
}

// portWarnings names the exposures of m whose host side a host program
// holds now (apply, also --dry-run): they would be failed until it frees.
func (d *Daemon) portWarnings(m *spec.Desired) []string {
	if d.opts.Holds == nil {
		return nil
	}
	var out []string
	for _, e := range m.Exposures {
		var inUse []error
		for _, sd := range hostSides(e, d.opts.IPv6Loopback, d.sock != nil) {
			err := d.opts.Holds.Check(sd)
			var iu *hold.InUseError
			if errors.As(err, &iu) && iu.Self {
				continue
			}
			if err != nil {
				inUse = append(inUse, err)
			}
		}
		if e.IsRange() && len(inUse) > 1 {
			// A range names its first port in use and counts the others.
			inUse = []error{fmt.Errorf("%w (and %d more of its ports)", inUse[0], len(inUse)-1)}
		}
		for _, err := range inUse {
			out = append(out, fmt.Sprintf("exposure %s: %v: it stays failed (no DNAT, the holder keeps its callers) until the port frees", e.Name, err))
		}
	}
	return out
}
