// SPDX-License-Identifier: GPL-2.0 OR BSD-2-Clause
//
// exposure_denied: per counter slot (the index of exposure_stats), the
// callers allowFrom turned away, on every path. A map of its own beside
// exposure_stats, so that map's layout (the external contract) stays as it
// is: `bpftool map dump pinned .../exposure_denied_v2` prints {"denied": N}
// per slot. Zeroed with the slot; BPF_F_MMAPABLE so the proxy counts with
// an atomic add on mapped memory, as it does into exposure_stats.
#ifndef BROKKR_DENIED_H
#define BROKKR_DENIED_H

#include "exposure.h"

#define exposure_denied exposure_denied_v2 // sized by the slots (exposure.h)

struct exposure_deny {
	__u64 denied; // callers turned away by allowFrom
};

struct {
	__uint(type, BPF_MAP_TYPE_ARRAY);
	__uint(map_flags, BPF_F_MMAPABLE);
	__uint(max_entries, EXPOSURE_SLOTS);
	__type(key, __u32);
	__type(value, struct exposure_deny);
	__uint(pinning, LIBBPF_PIN_BY_NAME);
} exposure_denied SEC(".maps");

#endif
