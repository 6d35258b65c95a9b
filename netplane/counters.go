package netplane

import (
	"github.com/brokkr/brokkr/bpf"
	"github.com/brokkr/brokkr/netplane/nft"
)

// slotFeed moves one exposure's counters from the event-fed fallback into
// its exposure_stats_v2 slot, which outlives the table and the daemon. Two
// sources, two rules:
//   - the nft counters (accepted and refused, named; the bytes per
//     direction, of the exposure's exp-bytes elements) are absolute in the
//     kernel and outlive the daemon: the slot remembers what it was fed from
//     them (Slot.FeedKernelTotals, Slot.FeedKernelBytes), so a restart
//     neither rebases nor doubles them and what the kernel counted while no
//     daemon ran is counted;
//   - the cap slow path's decisions are this process's and start from zero
//     with it: fed as they grow from zero.
type slotFeed struct {
	slot     *bpf.Slot
	proto    uint32
	hostPort uint16
	last     nft.ExposureCounters // the slow path's part, as last fed
}

// feed adds cur into the slot. Active is the kernel path's share, set to
// what conntrack holds now.
func (f *slotFeed) feed(cur nft.ExposureCounters) {
	f.slot.SetKernelActive(cur.Active)
	f.slot.FeedKernelTotals(cur.KernelAccepted, cur.KernelRefused)
	f.slot.FeedKernelBytes(cur.BytesIn, cur.BytesOut)
	slowA, slowR := cur.Accepted-cur.KernelAccepted, cur.Refused-cur.KernelRefused
	f.slot.AddAccepted(delta(f.last.Accepted, slowA))
	f.slot.AddRefused(delta(f.last.Refused, slowR))
	f.last = nft.ExposureCounters{Accepted: slowA, Refused: slowR}
}

// delta of a monotonic counter that may have restarted from zero.
func delta(last, cur uint64) uint64 {
	if cur >= last {
		return cur - last
	}
	return cur
}
