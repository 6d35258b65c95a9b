package netplane

import (
	"github.com/brokkr/brokkr/bpf"
	"github.com/brokkr/brokkr/netplane/nft"
)

// slotFeed moves one exposure's counters from the event-fed fallback into
// its exposure_stats_v2 slot, which outlives the table and the daemon. Three
// sources, three rules:
//   - the nft named counters (accepted, refused) are absolute in the kernel
//     and outlive the daemon: the slot remembers what it was fed from them
//     (Slot.FeedKernelTotals), so a restart neither rebases nor doubles
//     them and what the kernel admitted while no daemon ran is counted;
//   - the cap slow path's decisions are this process's and start from zero
//     with it: fed as they grow from zero;
//   - bytes are conntrack accounting of live entries plus the ended ones
//     this process saw: the first read after a start is their baseline
//     (the previous daemon fed the live entries up to its last read; what
//     an entry carried after that, or a connection that ended while no
//     daemon ran, is not counted; never doubled, never backwards).
type slotFeed struct {
	slot     *bpf.Slot
	proto    uint32
	hostPort uint16
	last     nft.ExposureCounters // the slow path's part and the bytes, as last fed
	seen     bool
}

// feed adds cur into the slot. Active is the kernel path's share, set to
// what conntrack holds now.
func (f *slotFeed) feed(cur nft.ExposureCounters) {
	f.slot.SetKernelActive(cur.Active)
	f.slot.FeedKernelTotals(cur.KernelAccepted, cur.KernelRefused)
	slowA, slowR := cur.Accepted-cur.KernelAccepted, cur.Refused-cur.KernelRefused
	f.slot.AddAccepted(delta(f.last.Accepted, slowA))
	f.slot.AddRefused(delta(f.last.Refused, slowR))
	if f.seen {
		f.slot.AddBytes(delta(f.last.BytesIn, cur.BytesIn), delta(f.last.BytesOut, cur.BytesOut))
	}
	f.seen = true
	f.last = nft.ExposureCounters{Accepted: slowA, Refused: slowR, BytesIn: cur.BytesIn, BytesOut: cur.BytesOut}
}

// delta of a monotonic counter that may have restarted from zero.
func delta(last, cur uint64) uint64 {
	if cur >= last {
		return cur - last
	}
	return cur
}
