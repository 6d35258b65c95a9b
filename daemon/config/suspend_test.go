package config

import (
	"encoding/json"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/brokkr/brokkr/internal/spec"
)

func TestPowerSuspendedAndIdleSuspend(t *testing.T) {
	c, err := Parse([]byte(`
vms:
  - {name: a, kernel: /k, power: suspended}
  - {name: b, kernel: /k, idleSuspend: 10m}
  - {name: c, kernel: /k, idleSuspend: 0}
  - {name: d, kernel: /k}
`))
	require.NoError(t, err)
	m, errs := Compile(c)
	require.Empty(t, errs)
	assert.Equal(t, spec.PowerSuspended, m.VMs[0].Power)
	assert.Equal(t, 10*time.Minute, m.VMs[1].IdleSuspend)
	assert.Zero(t, m.VMs[2].IdleSuspend, "0 is never")
	assert.Zero(t, m.VMs[3].IdleSuspend, "the default is never")

	b, err := json.Marshal(c)
	require.NoError(t, err)
	back, err := Parse(b)
	require.NoError(t, err, "desired.json keeps idleSuspend")
	assert.Equal(t, c, back)
}

func TestBadIdleSuspendNamesItsField(t *testing.T) {
	got := errorsOf(t, `
vms:
  - {name: a, kernel: /k, idleSuspend: soon}
  - {name: b, kernel: /k, idleSuspend: -1m}
  - {name: c, kernel: /k, idleSuspend: 1s}
  - {name: d, kernel: /k, power: asleep}
`)
	assert.Equal(t, []string{
		`vms[0].idleSuspend: "soon" is not a duration (like 10m or 90s; 0 = never)`,
		`vms[1].idleSuspend: "-1m" is negative (0 = never)`,
		`vms[2].idleSuspend: "1s" is shorter than 5s (0 = never)`,
		`vms[3].power: "asleep" is not one of running, stopped, suspended`,
	}, got)
}
