package ctmark

import (
	"os"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

// The committed C header is what this package generates: the nat path's
// programs read the mark with the layout the nft rules set it with.
func TestHeaderIsGenerated(t *testing.T) {
	b, err := os.ReadFile("../ctmark.h")
	require.NoError(t, err, "go generate ./bpf/... writes it")
	assert.Equal(t, Header(), string(b), "bpf/ctmark.h is stale: go generate ./bpf/...")
}

func TestLayoutBitsDoNotOverlap(t *testing.T) {
	assert.Zero(t, IDMask&Owned)
	assert.Zero(t, (IDMask|Owned)&Closed)
	assert.Equal(t, ^uint32(0), IDMask|Owned|Closed)
	assert.Equal(t, Owned|1, Of(0))
	assert.Equal(t, IDMask, ID(MaxSlots), "the last slot's id fills the id bits")
}
