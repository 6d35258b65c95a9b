// SPDX-License-Identifier: GPL-2.0 OR BSD-2-Clause
//
// Waking a suspended VM on its first caller (docs/ARCHITECTURE.md,
// "Suspend and resume"). exposure_wake says per counter slot whether the
// exposure's VM is asleep; the daemon sets it when the VM starts to
// suspend and clears it once the VM runs again. The first new flow (nat
// path) or connect (socket path) of an asleep slot flips it to waking and
// puts one record in wake_events, which the daemon waits on: one event per
// wake, not per packet. The flow itself goes on as any other (admitted
// against the cap, counted accepted): its SYN finds no guest and is lost,
// and the caller's retransmission reaches the resumed guest. Its own maps,
// beside exposure_stats and exposure_limits, so neither layout changes.
#ifndef BROKKR_WAKE_H
#define BROKKR_WAKE_H

#define exposure_wake exposure_wake_v2 // sized by the slots (exposure.h)

#define BRK_AWAKE 0
#define BRK_ASLEEP 1
#define BRK_WAKING 2

struct {
	__uint(type, BPF_MAP_TYPE_ARRAY);
	__uint(max_entries, EXPOSURE_SLOTS);
	__type(key, __u32);
	__type(value, __u32);
	__uint(pinning, LIBBPF_PIN_BY_NAME);
} exposure_wake SEC(".maps");

struct wake_event {
	__u32 slot;
	__u32 reserved;
};

struct {
	__uint(type, BPF_MAP_TYPE_RINGBUF);
	__uint(max_entries, 4096); // 256 events; one per wake
	__uint(pinning, LIBBPF_PIN_BY_NAME);
} wake_events SEC(".maps");

// brk_wake asks for the wake of slot's VM if it is asleep and nobody asked
// yet: the compare-and-swap lets one caller of many (on any CPU) send the
// event. A full ring gives the flag back, so the next caller asks again.
static __always_inline void brk_wake(__u32 slot)
{
	__u32 *st = bpf_map_lookup_elem(&exposure_wake, &slot);
	if (!st || *(volatile __u32 *)st != BRK_ASLEEP)
		return;
	if (__sync_val_compare_and_swap(st, BRK_ASLEEP, BRK_WAKING) != BRK_ASLEEP)
		return;
	struct wake_event *ev = bpf_ringbuf_reserve(&wake_events, sizeof(*ev), 0);
	if (!ev) {
		__sync_val_compare_and_swap(st, BRK_WAKING, BRK_ASLEEP);
		return;
	}
	ev->slot = slot;
	ev->reserved = 0;
	bpf_ringbuf_submit(ev, 0);
}

#endif
