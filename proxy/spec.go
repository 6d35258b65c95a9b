// Package proxy is brokkr's userspace fallback for published ports: one
// listener per exposure, a per-exposure connection cap, splice(2) between the
// caller and the guest, and counters in the shared exposure_stats map.
package proxy

import (
	"time"

	"github.com/brokkr/brokkr/bpf"
)

// Spec is one exposure the proxy should carry. The daemon builds it from the
// config; tests build it directly.
type Spec struct {
	ID          string        // exposure name; unique; names the counter slot
	VM          string        // passed to the Resolver to find the guest address
	Protocol    string        // "tcp" or "udp"
	HostAddress string        // address to bind ("" or "0.0.0.0" = any IPv4, "::" = any, "127.0.0.1", ...)
	HostPort    int           // 1..65535; 0 lets the OS pick (tests)
	GuestPort   int           // 1..65535
	MaxConns    int           // 0 = unlimited; the daemon passes 256 by default
	UDPIdle     time.Duration // idle timeout of a UDP flow; 0 = 60 s
}

// Resolver returns the guest's current address for a VM ("" = none yet).
// It is called per connection, so it must be cheap.
type Resolver func(vm string) string

// State values of Status.State.
const (
	StateActive  = "active"
	StatePending = "pending"
	StateFailed  = "failed"
)

// Status is one exposure's row after a Converge.
type Status struct {
	ID        string
	State     string // active | pending | failed
	Reason    string // why failed/pending, or a warning such as "out of descriptors"
	BoundAddr string // the address actually bound (host port 0 resolved)
	Counters  bpf.Counters
}
