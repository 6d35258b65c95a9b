package netplane

import (
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/brokkr/brokkr/bpf"
	"github.com/brokkr/brokkr/netplane/nft"
)

func TestSlotFeedAddsDeltasOverABaseline(t *testing.T) {
	store := bpf.NewInMemory("test")
	defer store.Close()
	slot, err := store.Attach("web-http", bpf.ProtoTCP, 8080)
	require.NoError(t, err)
	defer slot.Release(true)
	slot.AddAccepted(100) // what a previous daemon left in the slot
	slot.AddBytes(1000, 2000)

	f := &slotFeed{slot: slot}
	f.feed(nft.ExposureCounters{Accepted: 40, Refused: 3, BytesIn: 500, BytesOut: 700, Active: 2})
	c := slot.Read()
	assert.Equal(t, uint64(100), c.Accepted, "the first read is a baseline for totals")
	assert.Equal(t, uint64(1000), c.BytesIn)
	assert.Equal(t, uint64(2), c.Active, "active is re-added after the daemon's ResetActive")

	f.feed(nft.ExposureCounters{Accepted: 45, Refused: 4, BytesIn: 600, BytesOut: 900, Active: 1})
	c = slot.Read()
	assert.Equal(t, uint64(105), c.Accepted)
	assert.Equal(t, uint64(1), c.Refused)
	assert.Equal(t, uint64(1100), c.BytesIn)
	assert.Equal(t, uint64(2200), c.BytesOut)
	assert.Equal(t, uint64(1), c.Active, "the gauge follows down")

	// The table re-created the exposure's counters: they start again at 0.
	f.feed(nft.ExposureCounters{Accepted: 2, Active: 1})
	c = slot.Read()
	assert.Equal(t, uint64(107), c.Accepted, "a counter that went backwards restarted from zero")
	assert.Equal(t, uint64(1), c.Active)
}
