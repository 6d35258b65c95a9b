// Package proxy is brokkr's userspace fallback for published ports: one
// listener per exposure, a per-exposure connection cap, splice(2) between the
// caller and the guest, and counters in the shared exposure_stats_v2 map.
package proxy

import (
	"net/netip"
	"time"

	"github.com/brokkr/brokkr/bpf"
	"github.com/brokkr/brokkr/internal/spec"
)

// Spec is one listener the proxy should carry: the model's exposure
// (validated by config.Compile, so trusted here; its Name names the counter
// slot) and the address this listener binds, one of the exposure's
// ProxyBinds. HostPort 0 lets the OS pick (tests and benchmarks;
// Status.BoundAddr says what was picked).
//
// A port range is one listener per port and address, all counting into
// the exposure's one slot and cap: Port is the port of the range this
// listener binds (0: HostPort, a single port).
type Spec struct {
	spec.Exposure
	Listen  netip.Addr    // the zero Addr = 0.0.0.0, every IPv4 address
	Port    uint16        // the port of HostPorts this listener binds; 0: HostPort
	UDPIdle time.Duration // idle timeout of a UDP flow; 0 = 60 s
}

// Specs are the listeners of exposure e on address addr: one, or one per
// port of a range.
func Specs(e spec.Exposure, addr netip.Addr) []Spec {
	if !e.IsRange() {
		return []Spec{{Exposure: e, Listen: addr}}
	}
	out := make([]Spec, 0, e.PortCount())
	for _, p := range e.HostPorts() {
		out = append(out, Spec{Exposure: e, Listen: addr, Port: p})
	}
	return out
}

// Resolver returns the guest's current address for a VM ("" = none yet).
// It is called per connection, so it must be cheap.
type Resolver func(vm string) string

// WithResolver6 gives the guests' IPv6 addresses: a caller that came over
// IPv6 is carried to the guest's IPv6 address where resolve6 has one (so
// the guest sees an IPv6 connection), else to its IPv4 address.
func WithResolver6(resolve6 Resolver) Option { return func(m *Manager) { m.resolve6 = resolve6 } }

// State values of Status.State (the model's set).
const (
	StateActive  = spec.StateActive
	StatePending = spec.StatePending
	StateFailed  = spec.StateFailed
)

// Status is one exposure's row after a Converge.
type Status struct {
	ID        string
	State     spec.ExposureState
	Reason    string // why failed/pending, or a warning such as "out of descriptors"
	BoundAddr string // the address actually bound (host port 0 resolved)
	Counters  bpf.Counters
}
