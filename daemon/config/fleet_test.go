package config

import (
	"os"
	"strings"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

func TestFleetSectionDefaultsAndAbsence(t *testing.T) {
	c, err := Parse([]byte("vms: []\n"))
	require.NoError(t, err)
	assert.Nil(t, c.Fleet, "no section: single host")

	c, err = Parse([]byte("fleet: {endpoints: [http://10.0.0.5:2379], prefix: /x/}\n"))
	require.NoError(t, err)
	host, _ := os.Hostname()
	assert.Equal(t, host, c.Fleet.Node)
	assert.Equal(t, "/x", c.Fleet.Prefix, "one spelling, no trailing /")
	assert.Equal(t, DefaultLeaseTTL, *c.Fleet.LeaseTTL)
}

func TestFleetSectionErrorsNameTheField(t *testing.T) {
	_, err := Parse([]byte(`fleet:
  endpoints: [10.0.0.5:2379]
  node: a/b
  prefix: brokkr
  cert: /c.pem
  user: u
  leaseTTL: 1
`))
	require.Error(t, err)
	msg := err.Error()
	for _, want := range []string{"fleet.endpoints[0]:", "fleet.node:", "fleet.prefix:", "fleet.cert:", "fleet.password:", "fleet.leaseTTL:"} {
		assert.Contains(t, msg, want)
	}
	_, err = Parse([]byte("fleet: {}\n"))
	assert.ErrorContains(t, err, "fleet.endpoints: is required")
}

func TestParseDocumentAllowsOnlyTheDesiredState(t *testing.T) {
	c, err := ParseDocument([]byte(`{"exposures": [{"name": "e", "target": "10.213.0.9", "guestPort": 1, "hostPort": 2}]}`))
	require.NoError(t, err, "JSON is YAML")
	assert.Len(t, c.Exposures, 1)

	_, err = ParseDocument([]byte("stateDir: /tmp/x\nfleet: {endpoints: [http://a:1]}\nvms: []\n"))
	require.Error(t, err)
	assert.Contains(t, err.Error(), "stateDir: not allowed in a fleet document")
	assert.Contains(t, err.Error(), "fleet: not allowed")

	_, err = ParseDocument([]byte("exposures:\n  - {name: e, target: 10.213.0.9, guestPort: 1, hostPort: 70000}\n"))
	require.Error(t, err)
	assert.True(t, strings.HasPrefix(err.Error(), "exposures[0].hostPort:"), err.Error())
}
