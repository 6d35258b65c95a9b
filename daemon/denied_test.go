package daemon

import (
	"context"
	"encoding/json"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/brokkr/brokkr/bpf"
)

// denied (callers allowFrom turned away, counted into exposure_denied by
// the nat path's program and the proxy) reaches the status JSON and the
// metric from the shared slot.
func TestDeniedReachesStatusAndMetrics(t *testing.T) {
	r := newRig(t, rigConfig)
	slot, err := r.store.Attach("ext", bpf.ProtoTCP, 2222)
	require.NoError(t, err)
	defer slot.Release(false)
	slot.AddDenied(5)
	r.d.Pass(context.Background())
	e := expo(r.d.Status(), "ext")
	assert.EqualValues(t, 5, e.Denied)
	b, err := json.Marshal(e)
	require.NoError(t, err)
	assert.Contains(t, string(b), `"denied":5`)

	slot.AddDenied(1) // read at each request, not at the last pass
	c := serve(t, r)
	text, err := c.Metrics(context.Background())
	require.NoError(t, err)
	assert.Contains(t, text, `brokkr_exposure_denied_total{exposure="ext"} 6`)
	assert.Contains(t, text, `brokkr_exposure_denied_total{exposure="web-auto"} 0`)
}
