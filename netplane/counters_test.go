package netplane

import (
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/brokkr/brokkr/bpf"
	"github.com/brokkr/brokkr/netplane/nft"
)

// The fallback's feed: the nft counters (accepted, refused and the bytes)
// are fed from what the slot last took from them, across a restart too (a
// new slotFeed on the same slot is a new daemon): nothing rebased, nothing
// doubled, and what the kernel counted meanwhile is counted. The slow
// path's part is the process's own.
func TestSlotFeedIsExactAcrossARestart(t *testing.T) {
	store := bpf.NewInMemory("test")
	defer store.Close()
	slot, err := store.Attach("web-http", bpf.ProtoTCP, 8080)
	require.NoError(t, err)
	defer slot.Release(true)

	f := &slotFeed{slot: slot}
	f.feed(nft.ExposureCounters{Accepted: 40, Refused: 3, KernelAccepted: 40, KernelRefused: 3, BytesIn: 500, BytesOut: 700, Active: 2})
	c := slot.Read()
	assert.EqualValues(t, 40, c.Accepted, "a new exposure's counters start with its slot: all of it counts")
	assert.EqualValues(t, 3, c.Refused)
	assert.EqualValues(t, 500, c.BytesIn, "bytes: a new exposure's counters start with its slot too")
	assert.EqualValues(t, 700, c.BytesOut)
	assert.EqualValues(t, 2, c.Active)

	f.feed(nft.ExposureCounters{Accepted: 47, Refused: 4, KernelAccepted: 45, KernelRefused: 4, BytesIn: 600, BytesOut: 900, Active: 1})
	c = slot.Read()
	assert.EqualValues(t, 47, c.Accepted, "5 by the kernel, 2 by the slow path")
	assert.EqualValues(t, 4, c.Refused)
	assert.EqualValues(t, 600, c.BytesIn)
	assert.EqualValues(t, 900, c.BytesOut)
	assert.EqualValues(t, 1, c.Active, "the gauge follows down")

	// A new daemon: its slow path starts from zero; the kernel counters went
	// on (3 admitted, 1 refused, 50 and 60 bytes while no daemon ran).
	f = &slotFeed{slot: slot}
	f.feed(nft.ExposureCounters{Accepted: 48, Refused: 5, KernelAccepted: 48, KernelRefused: 5, BytesIn: 650, BytesOut: 960})
	c = slot.Read()
	assert.EqualValues(t, 50, c.Accepted, "what the kernel admitted while no daemon ran is counted, once")
	assert.EqualValues(t, 5, c.Refused)
	assert.EqualValues(t, 650, c.BytesIn, "what the kernel counted while no daemon ran is counted, once")
	assert.EqualValues(t, 960, c.BytesOut)
	f.feed(nft.ExposureCounters{Accepted: 50, Refused: 5, KernelAccepted: 49, KernelRefused: 5, BytesIn: 680, BytesOut: 960})
	c = slot.Read()
	assert.EqualValues(t, 52, c.Accepted, "1 by the kernel, 1 by the new slow path")
	assert.EqualValues(t, 680, c.BytesIn)

	// The table re-created the exposure's counters: they start again at 0.
	f.feed(nft.ExposureCounters{Accepted: 3, KernelAccepted: 2, Active: 1})
	c = slot.Read()
	assert.EqualValues(t, 54, c.Accepted, "a named counter that went backwards restarted from zero")
}
