package config

import (
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

func TestDescriptorBudgetNamesTheProxiedExposures(t *testing.T) {
	c, m, err := Load([]byte(`
exposures:
  - {name: px, target: 10.213.0.200, guestPort: 80, hostPort: 80, mode: proxy, maxConns: 200}
  - {name: auto-any, target: 10.213.0.200, guestPort: 80, hostPort: 81, maxConns: 150}
  - {name: auto-lo, target: 10.213.0.200, guestPort: 80, hostPort: 82, hostAddress: 127.0.0.1, maxConns: 100}
  - {name: nat, target: 10.213.0.200, guestPort: 80, hostPort: 83, mode: nat, maxConns: 100000}
`))
	require.NoError(t, err)
	// 2 × (200 + 150 + 100) = 900: nat's cap costs the daemon nothing.
	assert.Empty(t, DescriptorBudget(m, 900))
	w := DescriptorBudget(m, 899)
	assert.Contains(t, w, "2 × 450 = 900")
	assert.Contains(t, w, "899")
	assert.Contains(t, w, "px (200), auto-any (150), auto-lo (100)")
	assert.NotContains(t, w, "nat")

	c.Exposures[1].MaxConns = intp(0)
	m, errs := Compile(c)
	require.Empty(t, errs)
	w = DescriptorBudget(m, DefaultNoFile)
	assert.Contains(t, w, "without a cap")
	assert.Contains(t, w, "auto-any")
	assert.NotContains(t, w, "px")
}

// A port range's listeners and held ports are descriptors too.
func TestDescriptorBudgetCountsThePortRanges(t *testing.T) {
	_, m, err := Load([]byte(`
exposures:
  - {name: px, target: 10.213.0.200, guestPort: 80, hostPort: 80, mode: proxy, maxConns: 100}
  - {name: games, target: 10.213.0.200, guestPort: 80, hostPort: "30000-34095", mode: nat, maxConns: 0}
`))
	require.NoError(t, err)
	// 2 × 100 + 2 × 4096 = 8392.
	assert.Empty(t, DescriptorBudget(m, 8392))
	w := DescriptorBudget(m, 8391)
	assert.Contains(t, w, "2 × 100 = 200 descriptors, and the port ranges' listeners and held ports up to 8192 (games (8192))")
	assert.Contains(t, w, "8391")
}
