// Package proxy is brokkr's userspace fallback for published ports: one
// listener per exposure, a per-exposure connection cap, splice(2) between the
// caller and the guest, and counters in the shared exposure_stats map.
package proxy

import (
	"net/netip"
	"time"

	"github.com/brokkr/brokkr/bpf"
	"github.com/brokkr/brokkr/internal/spec"
)

// Spec is one listener the proxy should carry. The daemon builds it from
// the validated model (config.Compile), so its fields are trusted; tests
// build it directly.
type Spec struct {
	ID          string        // exposure name; names the counter slot
	Target      spec.Target   // a VM (its address from the Resolver) or a fixed address
	Protocol    spec.Proto    // tcp or udp
	HostAddress netip.Addr    // address to bind (the zero Addr = 0.0.0.0, every IPv4 address)
	HostPort    int           // 1..65535; 0 lets the OS pick (tests)
	GuestPort   int           // 1..65535
	MaxConns    int           // 0 = unlimited; the daemon passes 256 by default
	UDPIdle     time.Duration // idle timeout of a UDP flow; 0 = 60 s
}

// Resolver returns the guest's current address for a VM ("" = none yet).
// It is called per connection, so it must be cheap.
type Resolver func(vm string) string

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
