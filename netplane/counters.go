package netplane

import (
	"github.com/brokkr/brokkr/bpf"
	"github.com/brokkr/brokkr/netplane/nft"
)

// slotFeed moves one exposure's kernel counters into its exposure_stats
// slot. The kernel counters are absolute and restart from zero whenever the
// table re-creates the exposure's counters; the slot is a running total that
// outlives both the table and the daemon. So the feed adds the difference
// since the last value it saw, and a value that went backwards is taken as
// a restart from zero.
type slotFeed struct {
	slot     *bpf.Slot
	proto    uint32
	hostPort uint16
	last     nft.ExposureCounters
	seen     bool
}

// feed adds cur into the slot. On the first read after the process
// started, the totals (accepted, refused, bytes) are only a baseline: the
// slot already holds them from the previous daemon. Active is the kernel
// path's share, set to what conntrack holds now.
func (f *slotFeed) feed(cur nft.ExposureCounters) {
	f.slot.SetKernelActive(cur.Active)
	if !f.seen {
		f.seen = true
		f.last = cur
		return
	}
	f.slot.AddAccepted(delta(f.last.Accepted, cur.Accepted))
	f.slot.AddRefused(delta(f.last.Refused, cur.Refused))
	f.slot.AddBytes(delta(f.last.BytesIn, cur.BytesIn), delta(f.last.BytesOut, cur.BytesOut))
	f.last = cur
}

// delta of a monotonic counter that may have restarted from zero.
func delta(last, cur uint64) uint64 {
	if cur >= last {
		return cur - last
	}
	return cur
}
