// SPDX-License-Identifier: GPL-2.0
//
// The socket path's maps and lookups, shared by socklb.c (the cgroup hooks)
// and sockreap.c (the iterators that close sockets whose exposure moved):
// both objects open the same maps, pinned by name under bpfDir.
#ifndef BROKKR_SOCKLB_H
#define BROKKR_SOCKLB_H

#include "exposure.h"

#define IPPROTO_TCP 6
#define IPPROTO_UDP 17
#define ECONNREFUSED 111
#define ETH_P_IP 0x0800
#define ETH_P_IPV6 0x86DD

#define SK_ALLOW 1
#define SK_REFUSE 0

struct sock_key {
	__u32 addr[4]; // host address as IPv6 (IPv4 v4-mapped); zero = any host-local address
	__u16 port;    // host port, network byte order
	__u8 proto;
	__u8 pad;
};

#define T_DOWN 0x01 // the guest cannot be reached: refuse at once, counted as dropped

struct sock_target {
	__u32 guest_ip4;  // network byte order
	__u16 guest_port; // network byte order
	__u16 flags;
	__u32 slot;
	__u32 pad;
};

struct {
	__uint(type, BPF_MAP_TYPE_HASH);
	__uint(max_entries, 65536);
	__type(key, struct sock_key);
	__type(value, struct sock_target);
	__uint(pinning, LIBBPF_PIN_BY_NAME);
} sock_targets SEC(".maps");

// The guest's IPv6 address for an exposure of sock_targets (same key),
// where it has one. A map of its own, so sock_targets keeps the layout an
// earlier binary pinned.
struct sock_target6 {
	__u32 guest_ip6[4]; // network byte order
};

struct {
	__uint(type, BPF_MAP_TYPE_HASH);
	__uint(max_entries, 65536);
	__type(key, struct sock_key);
	__type(value, struct sock_target6);
	__uint(pinning, LIBBPF_PIN_BY_NAME);
} sock_targets6 SEC(".maps");

// The managed namespace's own addresses besides loopback: a wildcard
// exposure translates connects to them.
struct {
	__uint(type, BPF_MAP_TYPE_HASH);
	__uint(max_entries, 4096);
	__type(key, __u32[4]);
	__type(value, __u8);
	__uint(pinning, LIBBPF_PIN_BY_NAME);
} sock_local SEC(".maps");

struct sock_cfg {
	__u64 netns_cookie; // the managed namespace; 0 = translate nothing
};

struct {
	__uint(type, BPF_MAP_TYPE_ARRAY);
	__uint(max_entries, 1);
	__type(key, __u32);
	__type(value, struct sock_cfg);
	__uint(pinning, LIBBPF_PIN_BY_NAME);
} sock_config SEC(".maps");

// sock_xlate.flags
#define X_OPEN 0x01     // holds a place of the cap
#define X_RELEASED 0x02 // gave it back
#define X_COUNTED 0x04  // TCP: bytes added at the end of the connection

struct sock_xlate {
	__u32 slot;
	__u32 gen;
	__u32 flags;
	__u32 orig[4];    // the address dialled, as IPv6 (IPv4 v4-mapped)
	__u16 orig_port;  // network byte order
	__u16 guest_port; // network byte order
	__u32 guest_ip4;  // network byte order
};

struct {
	__uint(type, BPF_MAP_TYPE_SK_STORAGE);
	__uint(map_flags, BPF_F_NO_PREALLOC);
	__type(key, int);
	__type(value, struct sock_xlate);
	__uint(pinning, LIBBPF_PIN_BY_NAME);
} sock_socks SEC(".maps");

// A socket translated to the guest's IPv6 address (sock_xlate.guest_ip4 is
// 0 then). Beside sock_socks rather than in it: sockets an earlier binary
// translated keep their sock_socks entries across an upgrade.
struct sock_xlate6 {
	__u32 guest_ip6[4]; // network byte order; zero: not translated to IPv6
};

struct {
	__uint(type, BPF_MAP_TYPE_SK_STORAGE);
	__uint(map_flags, BPF_F_NO_PREALLOC);
	__type(key, int);
	__type(value, struct sock_xlate6);
	__uint(pinning, LIBBPF_PIN_BY_NAME);
} sock_socks6 SEC(".maps");

static __always_inline int in_scope(void *ctx)
{
	__u32 k = 0;
	struct sock_cfg *c = bpf_map_lookup_elem(&sock_config, &k);
	return c && c->netns_cookie && bpf_get_netns_cookie(ctx) == c->netns_cookie;
}

static __always_inline int is_mapped(const __u32 a[4])
{
	return a[0] == 0 && a[1] == 0 && a[2] == bpf_htonl(0xffff);
}

static __always_inline int is_local(const __u32 a[4])
{
	if (is_mapped(a) && (bpf_ntohl(a[3]) >> 24) == 127)
		return 1;
	if (a[0] == 0 && a[1] == 0 && a[2] == 0 && a[3] == bpf_htonl(1))
		return 1;
	return bpf_map_lookup_elem(&sock_local, (void *)a) != 0;
}

static __always_inline int is_zero6(const __u32 a[4])
{
	return !(a[0] | a[1] | a[2] | a[3]);
}

static __always_inline int eq6(const __u32 a[4], const __u32 b[4])
{
	return a[0] == b[0] && a[1] == b[1] && a[2] == b[2] && a[3] == b[3];
}

// find looks the destination up: the exact host address, else the
// wildcard for a local one. k is left holding the key that matched.
static __always_inline struct sock_target *find(struct sock_key *k, const __u32 a[4], __u16 port, __u8 proto)
{
	__builtin_memset(k, 0, sizeof(*k));
	k->port = port;
	k->proto = proto;
	__builtin_memcpy(k->addr, a, 16);
	struct sock_target *t = bpf_map_lookup_elem(&sock_targets, k);
	if (t)
		return t;
	if (!is_local(a))
		return 0;
	__builtin_memset(k->addr, 0, 16);
	return bpf_map_lookup_elem(&sock_targets, k);
}

// forget marks a socket as no longer translated (it connects elsewhere).
static __always_inline void forget(struct bpf_sock *sk, struct sock_xlate *x)
{
	x->guest_ip4 = 0;
	struct sock_xlate6 *x6 = bpf_sk_storage_get(&sock_socks6, sk, 0, 0);
	if (x6)
		__builtin_memset(x6->guest_ip6, 0, 16);
}

static __always_inline void release_x(struct sock_xlate *x)
{
	__u32 old = __sync_fetch_and_or(&x->flags, X_RELEASED);
	if (!(old & X_OPEN) || (old & X_RELEASED))
		return;
	__u32 slot = x->slot;
	struct exposure_stat *st = bpf_map_lookup_elem(&exposure_stats, &slot);
	struct exposure_limit *lim = bpf_map_lookup_elem(&exposure_limits, &slot);
	if (st && lim && lim->gen == x->gen)
		brk_release(st, lim);
}

#endif
