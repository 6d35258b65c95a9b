// SPDX-License-Identifier: GPL-2.0 OR BSD-2-Clause
//
// The maps every brokkr BPF object shares, pinned by name under bpfDir so
// the stats object, the nat-path programs, the socket-path programs and the
// daemon all open the same instance.
//
// exposure_stats is the external contract (field names and layout are what
// `bpftool map dump` prints); a changed layout or size gets a new map name,
// since a pinned map cannot be resized. The maps sized by the slots are v2
// (exposure_stats_v2 and the rest): v1's layout with 131,072 slots where v1
// had 16,384. A daemon that finds the v1 maps copies them into v2
// (bpf/migrate.go). The C code keeps the plain names: the defines below
// make the maps' (pinned) names the v2 ones.
// exposure_limits carries what only brokkr reads: the cap, the slot's
// generation and the proxy's share of `active`. Both are BPF_F_MMAPABLE so
// the daemon and the proxy update them with atomic instructions on mapped
// memory (docs/ARCHITECTURE.md, "Counters").
#ifndef BROKKR_EXPOSURE_H
#define BROKKR_EXPOSURE_H

#define EXPOSURE_NAME_LEN 64
#define EXPOSURE_SLOTS 131072 // 1 << 17: bpf.Slots, spec.MaxExposures

#define exposure_stats exposure_stats_v2
#define exposure_limits exposure_limits_v2

struct exposure_stat {
	char name[EXPOSURE_NAME_LEN]; // exposure name, NUL-padded; empty = free slot
	__u32 protocol;               // IPPROTO_TCP (6) or IPPROTO_UDP (17)
	__u32 host_port;
	__u64 active;   // gauge: connections/flows open now, every path
	__u64 accepted; // total admitted
	__u64 refused;  // total turned away by the cap
	__u64 dropped;  // total accepted but not carried (guest unreachable, no address)
	__u64 bytes_in;  // payload, caller -> guest
	__u64 bytes_out; // payload, guest -> caller
};

struct {
	__uint(type, BPF_MAP_TYPE_ARRAY);
	__uint(map_flags, BPF_F_MMAPABLE);
	__uint(max_entries, EXPOSURE_SLOTS);
	__type(key, __u32);
	__type(value, struct exposure_stat);
	__uint(pinning, LIBBPF_PIN_BY_NAME);
} exposure_stats SEC(".maps");

struct exposure_limit {
	__u32 cap;          // connections at once; 0 = unlimited
	__u32 gen;          // bumped whenever the slot is given to an exposure
	__u64 proxy_active; // the userspace proxy's share of active
	__u64 kernel_active; // the kernel paths' share of active
	__u64 reserved;
};

struct {
	__uint(type, BPF_MAP_TYPE_ARRAY);
	__uint(map_flags, BPF_F_MMAPABLE);
	__uint(max_entries, EXPOSURE_SLOTS);
	__type(key, __u32);
	__type(value, struct exposure_limit);
	__uint(pinning, LIBBPF_PIN_BY_NAME);
} exposure_limits SEC(".maps");

#define BRK_ADMIT_TRIES 64

// brk_admit takes one place of the slot's cap: an atomic compare-and-
// increment of the shared active gauge, so every path (kernel, socket,
// proxy) admits against the same count and parallel callers on several
// CPUs cannot overshoot. Returns 1 when admitted.
static __always_inline int brk_admit(struct exposure_stat *st, struct exposure_limit *lim)
{
	__u32 cap = lim->cap;
	for (int i = 0; i < BRK_ADMIT_TRIES; i++) {
		__u64 cur = *(volatile __u64 *)&st->active;
		if (cap && cur >= cap)
			return 0;
		if (__sync_val_compare_and_swap(&st->active, cur, cur + 1) == cur) {
			__sync_fetch_and_add(&lim->kernel_active, 1);
			__sync_fetch_and_add(&st->accepted, 1);
			return 1;
		}
	}
	return 0;
}

// brk_release gives back a place taken by brk_admit.
static __always_inline void brk_release(struct exposure_stat *st, struct exposure_limit *lim)
{
	__sync_fetch_and_add(&st->active, -1);
	__sync_fetch_and_add(&lim->kernel_active, -1);
}

#endif
