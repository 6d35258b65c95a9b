package config

import (
	"fmt"
	"strings"

	"github.com/brokkr/brokkr/internal/spec"
)

// DefaultNoFile is brokkrd's descriptor limit under the shipped systemd unit
// (LimitNOFILE in dist/brokkrd.service): what an offline check assumes.
const DefaultNoFile = 65536

// DescriptorBudget warns when the proxied exposures' caps could take more
// descriptors than nofile (brokkrd's RLIMIT_NOFILE): a carried connection
// holds two, the caller's and the guest's. The caps exist so the proxy can
// never starve the rest of the daemon; a sum of caps past the limit (or an
// unlimited one) gives that up. "" when the budget holds.
//
// An exposure counts when the proxy may carry it (spec.Exposure.ProxyBinds
// without the socket path, which may fail to attach): its listeners share
// its one cap.
//
// A port range also holds a descriptor per port of it and host address: a
// listener of the proxy or a held port (at most, every address of both
// families). Those are counted beside the caps, and named, where there are
// ranges.
func DescriptorBudget(m *spec.Desired, nofile uint64) string {
	var sum, ports uint64
	var named, unlimited, ranges []string
	for _, e := range m.Exposures {
		if e.IsRange() {
			n := uint64(e.PortCount()) * 2 // both families, or a loopback listener beside a held port
			ports += n
			ranges = append(ranges, fmt.Sprintf("%s (%d)", e.Name, n))
		}
		if len(e.ProxyBinds(false, false)) == 0 {
			continue
		}
		if e.MaxConns <= 0 {
			unlimited = append(unlimited, e.Name)
			continue
		}
		sum += uint64(e.MaxConns)
		named = append(named, fmt.Sprintf("%s (%d)", e.Name, e.MaxConns))
	}
	switch {
	case len(unlimited) > 0:
		return fmt.Sprintf("descriptor budget: proxied exposures without a cap (maxConns 0) can take every one of brokkrd's %d descriptors: %s; give them a maxConns",
			nofile, strings.Join(unlimited, ", "))
	case 2*sum > nofile && ports == 0:
		return fmt.Sprintf("descriptor budget: at their caps the proxied exposures hold 2 × %d = %d descriptors, more than brokkrd's RLIMIT_NOFILE of %d: %s; lower maxConns or raise LimitNOFILE",
			sum, 2*sum, nofile, strings.Join(named, ", "))
	case 2*sum+ports > nofile:
		return fmt.Sprintf("descriptor budget: at their caps the proxied exposures hold 2 × %d = %d descriptors, and the port ranges' listeners and held ports up to %d (%s), more than brokkrd's RLIMIT_NOFILE of %d: %s; lower maxConns, shorten the ranges or raise LimitNOFILE",
			sum, 2*sum, ports, strings.Join(ranges, ", "), nofile, strings.Join(named, ", "))
	}
	return ""
}
