package fleet_test

import (
	"testing"

	"github.com/brokkr/brokkr/daemon/fleet"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

func TestParseFleetFile(t *testing.T) {
	docs, err := fleet.ParseFleetFile([]byte(`nodes:
  h1:
    exposures: [{name: a, target: 10.213.0.9, guestPort: 1, hostPort: 2}]
  h2: {}
`))
	require.NoError(t, err)
	assert.Len(t, docs, 2)
	assert.Contains(t, string(docs["h1"]), "hostPort: 2")

	_, err = fleet.ParseFleetFile([]byte(`nodes:
  h1:
    exposures: [{name: a, target: 10.213.0.9, guestPort: 1, hostPort: 70000}]
  h2: {stateDir: /x}
  bad/name: {}
`))
	require.Error(t, err)
	for _, want := range []string{"nodes.h1.exposures[0].hostPort:", "nodes.h2.stateDir: not allowed", `nodes.bad/name: "bad/name" is not a node name`} {
		assert.Contains(t, err.Error(), want)
	}
	_, err = fleet.ParseFleetFile([]byte("node: {}\n"))
	assert.ErrorContains(t, err, "not a fleet file")
	_, err = fleet.ParseFleetFile([]byte("nodes: {}\n"))
	assert.ErrorContains(t, err, "nodes: is required")
}

func TestNodeKeys(t *testing.T) {
	k := fleet.NodeKeys("/brokkr", "h1")
	assert.Equal(t, fleet.Keys{Dir: "/brokkr/nodes/h1/", Desired: "/brokkr/nodes/h1/desired", Status: "/brokkr/nodes/h1/status", Alive: "/brokkr/nodes/h1/alive"}, k)
	assert.Equal(t, "/nodes/h1/desired", fleet.NodeKeys("/", "h1").Desired)
}
