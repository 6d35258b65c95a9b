package daemon

import (
	"syscall"

	"github.com/brokkr/brokkr/daemon/config"
	"github.com/brokkr/brokkr/internal/spec"
)

// noFileLimit is this process's RLIMIT_NOFILE (soft, the one that fails an
// open); a variable so a test can stage a small one.
var noFileLimit = func() (uint64, error) {
	var l syscall.Rlimit
	err := syscall.Getrlimit(syscall.RLIMIT_NOFILE, &l)
	return l.Cur, err
}

// budgetWarning is m's descriptor-budget warning against brokkrd's own
// limit, or "".
func budgetWarning(m *spec.Desired) string {
	n, err := noFileLimit()
	if err != nil {
		return ""
	}
	return config.DescriptorBudget(m, n)
}
