//go:build ignore

// SPDX-License-Identifier: GPL-2.0 OR BSD-2-Clause
//
// exposure_stats: one array entry per published port, shared by the kernel
// fast path (netplane writes its nft/conntrack figures here) and the userspace
// proxy (which adds to the entries through a shared mmap, no syscall per
// event). The value type carries BTF so `bpftool map dump pinned ...` prints
// named fields. Changing this layout means a new map name (exposure_stats_v2).
#include "vmlinux.h"
#include <bpf/bpf_helpers.h>

#define EXPOSURE_NAME_LEN 64
#define EXPOSURE_SLOTS 16384

struct exposure_stat {
	char name[EXPOSURE_NAME_LEN]; // exposure name, NUL-padded; empty = free slot
	__u32 protocol;               // IPPROTO_TCP (6) or IPPROTO_UDP (17)
	__u32 host_port;
	__u64 active;   // gauge: connections/flows open now
	__u64 accepted; // total admitted
	__u64 refused;  // total turned away by the cap
	__u64 dropped;  // total accepted but not carried (guest unreachable, no address)
	__u64 bytes_in;  // caller -> guest
	__u64 bytes_out; // guest -> caller
};

struct {
	__uint(type, BPF_MAP_TYPE_ARRAY);
	__uint(map_flags, BPF_F_MMAPABLE);
	__uint(max_entries, EXPOSURE_SLOTS);
	__type(key, __u32);
	__type(value, struct exposure_stat);
	__uint(pinning, LIBBPF_PIN_BY_NAME);
} exposure_stats SEC(".maps");

char __license[] SEC("license") = "Dual BSD/GPL";
