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
func DescriptorBudget(m *spec.Desired, nofile uint64) string {
	var sum uint64
	var named, unlimited []string
	for _, e := range m.Exposures {
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
	case 2*sum > nofile:
		return fmt.Sprintf("descriptor budget: at their caps the proxied exposures hold 2 × %d = %d descriptors, more than brokkrd's RLIMIT_NOFILE of %d: %s; lower maxConns or raise LimitNOFILE",
			sum, 2*sum, nofile, strings.Join(named, ", "))
	}
	return ""
}
