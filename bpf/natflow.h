// SPDX-License-Identifier: GPL-2.0
//
// The nat path's flows, shared by its two sets of programs: natpath.c
// (BPF netfilter programs, 6.4+) and nattc.c (tc programs on the bridge
// with the conntrack kfuncs, for kernels before netfilter programs:
// Debian 12's 6.1). Both keep the same pinned maps, so a kernel upgrade
// or a daemon of either kind finds the flows, caps and counts where the
// other left them; what differs is only how a program finds a packet's
// conntrack entry and how the sweep reads it (docs/ARCHITECTURE.md,
// "The nat path"). A program that includes this defines flow_alive (how
// its sweep reads an entry) and has included vmlinux.h and libbpf's
// headers.
#ifndef BROKKR_NATFLOW_H
#define BROKKR_NATFLOW_H

#include "exposure.h"
#include "denied.h"
#include "wake.h"
#include "ctmark.h" // the ct mark's layout, generated from bpf/ctmark

#define NF_DROP 0
#define NF_ACCEPT 1
#define TC_ACT_OK 0
#define TC_ACT_SHOT 2
#define ETH_P_IP 0x0800
#define ETH_P_IPV6 0x86DD
#define AF_INET6 10
#define ETH_HLEN 14
#define IPPROTO_TCP 6
#define IPPROTO_UDP 17
#define IPPROTO_ICMPV6 58
#define NEXTHDR_HOP 0
#define NEXTHDR_ROUTING 43
#define NEXTHDR_DEST 60
#define EXTHDR_MAX 3 // IPv6 extension headers walked before the TCP/UDP header
#define BPF_F_INGRESS 1

#define TH_FIN 0x01
#define TH_SYN 0x02
#define TH_RST 0x04
#define TH_ACK 0x10


// nat_flow.flags
#define F_OPEN 0x01      // holds a place of the cap
#define F_RELEASED 0x02  // gave it back
#define F_REFUSED 0x04   // over the cap: the reflector answers its SYN
#define F_FIN_ORIG 0x08
#define F_FIN_REPL 0x10
#define F_REPLIED 0x20   // the guest answered
#define F_SEQ_REPL 0x40  // next_seq[1] is known
#define F_DROPPED 0x80   // counted in dropped
#define F_DENIED 0x100   // a caller allowFrom keeps out, counted once (nattc.c)

struct nat_flow {
	__u32 slot;
	__u32 gen;
	__u32 flags;
	__u32 next_seq[2]; // TCP: the highest sequence end seen, per direction
	// The conntrack entry's original tuple: conntrack entries live in a
	// SLAB_TYPESAFE_BY_RCU cache, so the timer tells "still ours" from
	// "freed and reused" by comparing it.
	__u32 saddr, daddr;
	// For an IPv6 flow saddr and daddr hold the first word of each address
	// and addr6 a hash of both whole addresses: the value keeps the layout
	// of the pinned map (an earlier binary's flows are IPv4, v6 = 0).
	__u16 sport, dport;
	__u8 proto;
	__u8 v6; // 1: an IPv6 flow
	__u8 pad[2];
	__u32 addr6;
	// Payload bytes counted into the flow and not yet into the slot: the
	// slot's words are shared by every flow of the exposure on every CPU,
	// so a packet touches only its flow's line; flush moves these into the
	// slot when the flow ends and at every sweep while it lasts.
	__u64 pend[2];
};

// Keyed by the conntrack entry's address: both hooks reach it without
// reading the tuple, and an entry lives as long as its conntrack entry
// (the sweep deletes it once that is gone).
struct {
	__uint(type, BPF_MAP_TYPE_HASH);
	__uint(map_flags, BPF_F_NO_PREALLOC);
	__uint(max_entries, 1 << 20);
	__type(key, __u64);
	__type(value, struct nat_flow);
	__uint(pinning, LIBBPF_PIN_BY_NAME);
} nat_flows SEC(".maps");

// The sweep's timer. brk_nat_arm starts it (every load does, so the newest
// program's sweep runs); then it re-arms itself, and lives as long as the
// pinned map. The layout is the pinned map's: it stays as it was.
struct nat_sweeper {
	struct bpf_timer timer;
	__u32 started; // armed once (an older binary's programs test it)
	__u32 pad;
	__u64 sweeps; // for tests and operators: the sweep is running
};

struct {
	__uint(type, BPF_MAP_TYPE_ARRAY);
	__uint(max_entries, 1);
	__type(key, __u32);
	__type(value, struct nat_sweeper);
	__uint(pinning, LIBBPF_PIN_BY_NAME);
} nat_sweep SEC(".maps");

struct nat_cfg {
	__u32 guest_net;  // the bridge subnet, network byte order
	__u32 guest_mask; // its mask, network byte order
};

struct {
	__uint(type, BPF_MAP_TYPE_ARRAY);
	__uint(max_entries, 1);
	__type(key, __u32);
	__type(value, struct nat_cfg);
	__uint(pinning, LIBBPF_PIN_BY_NAME);
} nat_config SEC(".maps");

// The bridge's IPv6 subnet (a map of its own: nat_config keeps its layout).
struct nat_cfg6 {
	__u32 guest_net[4];  // network byte order
	__u32 guest_mask[4]; // all zero: no IPv6 subnet
};

struct {
	__uint(type, BPF_MAP_TYPE_ARRAY);
	__uint(max_entries, 1);
	__type(key, __u32);
	__type(value, struct nat_cfg6);
	__uint(pinning, LIBBPF_PIN_BY_NAME);
} nat_config6 SEC(".maps");

// allowFrom (docs/ARCHITECTURE.md, "allowFrom"): an LPM trie of every
// restricted exposure's prefixes, keyed by the counter slot and the source
// address (IPv4 as v4-mapped IPv6, so one trie holds both families), and
// per slot whether the exposure is restricted at all. Both carry the slot's
// generation (exposure_limits.gen) they were written for: what a deleted
// exposure left in a slot never restricts, nor admits for, the next owner.
struct allow_key {
	__u32 prefixlen; // 32 (the slot) + the prefix's bits in the 128-bit address
	__u32 slot;
	__u8 addr[16];
};

struct {
	__uint(type, BPF_MAP_TYPE_LPM_TRIE);
	__uint(map_flags, BPF_F_NO_PREALLOC);
	__uint(max_entries, 1 << 20);
	__type(key, struct allow_key);
	__type(value, __u32); // the slot's generation
	__uint(pinning, LIBBPF_PIN_BY_NAME);
} allow_from SEC(".maps");

#define allow_restricted allow_restricted_v2 // sized by the slots (exposure.h)
struct {
	__uint(type, BPF_MAP_TYPE_ARRAY);
	__uint(max_entries, EXPOSURE_SLOTS);
	__type(key, __u32);
	__type(value, __u32); // the generation + 1 of a restricted slot; 0 = not restricted
	__uint(pinning, LIBBPF_PIN_BY_NAME);
} allow_restricted SEC(".maps");

// A packet as the programs need it, read from an IPv4 or an IPv6 header.
struct pkt {
	__u8 proto;
	__u8 tcp_flags;
	__u8 v6;
	__u32 saddr[4]; // the source address: IPv4 in saddr[0], IPv6 whole
	__u32 daddr[4]; // the destination (read by nattc.c only: its ct lookup)
	__u16 sport, dport; // network byte order (nattc.c only)
	__u32 seq;
	__u32 payload;
};

// allowed reports whether the caller of p may reach the exposure at slot,
// whose limits are lim. The slot's generation is read only for a slot
// that is restricted at all: the limits' line is written by every
// admission and release, and most slots are not restricted.
static __always_inline int allowed(__u32 slot, struct exposure_limit *lim, struct pkt *p)
{
	__u32 *r = bpf_map_lookup_elem(&allow_restricted, &slot);
	if (!r || !*r)
		return 1;
	__u32 gen = lim->gen;
	if (*r != gen + 1)
		return 1;
	struct allow_key k = {.prefixlen = 32 + 128, .slot = slot};
	if (p->v6) {
		__builtin_memcpy(k.addr, p->saddr, 16);
	} else {
		k.addr[10] = 0xff;
		k.addr[11] = 0xff;
		__builtin_memcpy(&k.addr[12], &p->saddr[0], 4);
	}
	__u32 *v = bpf_map_lookup_elem(&allow_from, &k);
	return v && *v == gen;
}

// What a program does with a packet (the netfilter verdicts' values).
#define V_DROP 0
#define V_PASS 1
#define V_REFUSED 2 // a refused TCP caller's SYN: answer it with the guest's RST
#define V_DENIED 3  // a caller allowFrom keeps out: drop it, and count it in denied once per entry

#define PKT_SKIP 0 // not one brokkr accounts (ICMP, another protocol): let it on
#define PKT_OK 1
#define PKT_BAD -1 // IPv6: the TCP/UDP header is behind a header not walked

static __always_inline void acc(struct nat_flow *f, int reply, __u64 n)
{
	if (n)
		__sync_fetch_and_add(&f->pend[reply & 1], n);
}

// flush adds what the flow counted since the last flush to the slot: what
// is read is what is taken off, so bytes counted meanwhile on another CPU
// wait for the next flush and none is lost or doubled.
static __always_inline void flush(struct nat_flow *f, struct exposure_stat *st)
{
	__u64 in = *(volatile __u64 *)&f->pend[0];
	__u64 out = *(volatile __u64 *)&f->pend[1];
	if (in) {
		__sync_fetch_and_add(&f->pend[0], -in);
		__sync_fetch_and_add(&st->bytes_in, in);
	}
	if (out) {
		__sync_fetch_and_add(&f->pend[1], -out);
		__sync_fetch_and_add(&st->bytes_out, out);
	}
}

// advance counts TCP payload by how far the stream's sequence end moved, so
// a retransmitted segment is never counted twice.
static __always_inline void advance(struct nat_flow *f, struct exposure_stat *st, int reply, __u32 end)
{
	for (int i = 0; i < 4; i++) {
		__u32 old = *(volatile __u32 *)&f->next_seq[reply & 1];
		__s32 d = (__s32)(end - old);
		if (d <= 0)
			return;
		if (__sync_val_compare_and_swap(&f->next_seq[reply & 1], old, end) == old) {
			acc(f, reply, (__u32)d);
			return;
		}
	}
}

static __always_inline void release(struct nat_flow *f, struct exposure_stat *st, struct exposure_limit *lim)
{
	flush(f, st);
	__u32 old = __sync_fetch_and_or(&f->flags, F_RELEASED);
	if ((old & F_OPEN) && !(old & F_RELEASED))
		brk_release(st, lim);
}

// in_guest_net reports whether p comes from the bridge subnet of its family.
static __always_inline int in_guest_net(struct pkt *p)
{
	__u32 k = 0;
	if (!p->v6) {
		struct nat_cfg *c = bpf_map_lookup_elem(&nat_config, &k);
		return c && c->guest_mask && (p->saddr[0] & c->guest_mask) == c->guest_net;
	}
	struct nat_cfg6 *c = bpf_map_lookup_elem(&nat_config6, &k);
	if (!c || !c->guest_mask[0])
		return 0;
#pragma unroll
	for (int i = 0; i < 4; i++)
		if ((p->saddr[i] & c->guest_mask[i]) != c->guest_net[i])
			return 0;
	return 1;
}

#define RECHECK_NS (2ULL * 1000000000ULL)

// addr_hash folds both whole addresses of an IPv6 tuple into a word (FNV-1a
// over the words): what a flow keeps of them beside their first words.
static __always_inline __u32 addr_hash(struct nf_conntrack_tuple *t)
{
	__u32 h = 0x811c9dc5;
#pragma unroll
	for (int i = 0; i < 4; i++) {
		h = (h ^ t->src.u3.all[i]) * 0x01000193;
		h = (h ^ t->dst.u3.all[i]) * 0x01000193;
	}
	return h;
}

// same_tuple reports whether t, a conntrack entry's original tuple, is the
// one the flow was tracked with: conntrack entries live in a
// SLAB_TYPESAFE_BY_RCU cache, so the entry at a flow's key may since be
// another connection's.
static __always_inline int same_tuple(struct nf_conntrack_tuple *t, struct nat_flow *f)
{
	if (t->src.u3.ip != f->saddr || t->dst.u3.ip != f->daddr || t->src.u.all != f->sport ||
	    t->dst.u.all != f->dport || t->dst.protonum != f->proto)
		return 0;
	int v6 = t->src.l3num == AF_INET6;
	if (v6 != f->v6)
		return 0;
	return !v6 || addr_hash(t) == f->addr6;
}

// alive_as reports whether a conntrack entry read as refs, status, its
// original tuple t and timeout is still the flow's live, unexpired entry.
static __always_inline int alive_as(int refs, unsigned long status, struct nf_conntrack_tuple *t, __u32 timeout, struct nat_flow *f)
{
	if (refs == 0)
		return 0;
	if (status & (1UL << IPS_DYING_BIT))
		return 0;
	if (!same_tuple(t, f))
		return 0;
	// Not confirmed yet: the connection's first packet is still on its way
	// through the hooks (or held in a queue), and until conntrack confirms
	// the entry its timeout is a duration, not a point in time.
	if (!(status & (1UL << IPS_CONFIRMED_BIT)))
		return 1;
	__s32 left = (__s32)(timeout - (__u32)bpf_jiffies64());
	return left > 0;
}

// flow_alive reports whether the conntrack entry at ctp is still the
// flow's live, unexpired entry: each program set reads the entry its way.
static __always_inline int flow_alive(__u64 ctp, struct nat_flow *f);


// settle gives back the place of a flow whose conntrack entry is gone, and
// forgets the flow.
static __always_inline void settle(__u64 *key, struct nat_flow *f)
{
	__u32 slot = f->slot;
	struct exposure_stat *st = bpf_map_lookup_elem(&exposure_stats, &slot);
	struct exposure_limit *lim = bpf_map_lookup_elem(&exposure_limits, &slot);
	if (st && lim && f->gen == lim->gen && (f->flags & F_OPEN)) {
		release(f, st, lim);
		// A TCP caller admitted but never answered: the guest was not
		// there. (A UDP flow may be one-way by design.)
		if (f->proto == IPPROTO_TCP && !(f->flags & F_REPLIED) && !(__sync_fetch_and_or(&f->flags, F_DROPPED) & F_DROPPED))
			__sync_fetch_and_add(&st->dropped, 1);
	}
	bpf_map_delete_elem(&nat_flows, key);
}

static long sweep_one(void *map, __u64 *key, struct nat_flow *f, void *ctx)
{
	if (!flow_alive(*key, f)) {
		settle(key, f);
		return 0;
	}
	__u32 slot = f->slot;
	struct exposure_stat *st = bpf_map_lookup_elem(&exposure_stats, &slot);
	struct exposure_limit *lim = bpf_map_lookup_elem(&exposure_limits, &slot);
	if (st && lim && f->gen == lim->gen)
		flush(f, st);
	return 0;
}

static int sweep(void *map, __u32 *key, struct nat_sweeper *s)
{
	bpf_for_each_map_elem(&nat_flows, sweep_one, 0, 0);
	__sync_fetch_and_add(&s->sweeps, 1);
	bpf_timer_start(&s->timer, RECHECK_NS, 0);
	return 0;
}

// track inserts the flow, for the conntrack entry at ctp whose original
// tuple is t; 0 on success.
static __always_inline int track(__u64 ctp, struct nf_conntrack_tuple *t, struct nat_flow *nf)
{
	nf->saddr = t->src.u3.ip;
	nf->daddr = t->dst.u3.ip;
	nf->sport = t->src.u.all;
	nf->dport = t->dst.u.all;
	nf->proto = t->dst.protonum;
	nf->v6 = t->src.l3num == AF_INET6;
	nf->addr6 = nf->v6 ? addr_hash(t) : 0;
	if (bpf_map_update_elem(&nat_flows, &ctp, nf, BPF_NOEXIST))
		return -1;
	return 0;
}

// count_denied counts one caller allowFrom kept out of slot.
static __always_inline void count_denied(__u32 slot)
{
	struct exposure_deny *dn = bpf_map_lookup_elem(&exposure_denied, &slot);
	if (dn)
		__sync_fetch_and_add(&dn->denied, 1);
}

// new_flow decides the caller's packet p of a marked connection (the
// entry at ctp, original tuple t, the exposure's slot) no flow is kept
// for. restricted: allowFrom applies (not a host-local caller); fresh: it
// may begin a flow (UDP, or a TCP SYN). V_REFUSED is a TCP caller over the
// cap, whose SYN the program answers (or hands on to be answered);
// V_DENIED one allowFrom keeps out, which each program set counts in
// denied once per conntrack entry, as it can tell one.
static __always_inline int new_flow(__u64 ctp, struct nf_conntrack_tuple *t, __u32 slot, struct exposure_stat *st,
				    struct exposure_limit *lim, struct pkt *p, int restricted, int fresh)
{
	// allowFrom, before admission: a caller from elsewhere is dropped
	// (no RST, a firewall's behaviour), takes no place of the cap and
	// wakes nothing; so is any packet of its that no admitted flow owns
	// (conntrack picks up a mid-stream ACK as a new entry too). Host-local
	// callers are the host's own processes and are not restricted
	// (README, "allowFrom").
	if (restricted && !allowed(slot, lim, p))
		return V_DENIED;
	if (!fresh)
		return V_PASS;
	struct nat_flow nf = {.slot = slot, .gen = lim->gen};
	brk_wake(slot);
	if (brk_admit(st, lim)) {
		nf.flags = F_OPEN;
		nf.next_seq[0] = p->seq + 1;
		if (p->proto == IPPROTO_UDP)
			nf.pend[0] = p->payload; // the first datagram, counted like the rest
		if (track(ctp, t, &nf)) {
			// Lost a race with the same entry, or the table is full:
			// never hold a place nobody will give back.
			brk_release(st, lim);
			__sync_fetch_and_add(&st->accepted, -1);
			struct nat_flow *again = bpf_map_lookup_elem(&nat_flows, &ctp);
			if (again)
				return V_PASS;
			__sync_fetch_and_add(&st->refused, 1);
			return V_DROP;
		}
		return V_PASS;
	}
	__sync_fetch_and_add(&st->refused, 1);
	return p->proto == IPPROTO_TCP ? V_REFUSED : V_DROP;
}

// on_flow accounts packet p of the admitted or refused flow f (key ctp):
// counting, and the release at the end of the connection.
static __always_inline int on_flow(__u64 ctp, struct nat_flow *f, struct exposure_stat *st, struct exposure_limit *lim,
				   struct pkt *p, int reply)
{
	if (f->flags & F_REFUSED) {
		// Only the SYN goes on, to be reflected; anything else of a
		// refused flow stops here.
		if (!reply && (p->tcp_flags & (TH_SYN | TH_ACK)) == TH_SYN)
			return V_PASS;
		return reply ? V_PASS : V_DROP;
	}
	// Whether the slot was given to another exposure since matters only
	// where the slot is touched: at the flow's end (a FIN or a RST, below)
	// and at a flush (whose bytes, counted into the flow meanwhile, stay
	// there: the sweep's flush and settle check the generation too). What
	// a packet writes before that is the flow's own. So the slot's limits
	// are not read on every packet: every admission and release writes
	// their line, from whichever CPU, and reading it cost a packet of a
	// flow 20-60 ns here (BENCHMARKS.md, "The nat path's per-packet cost").
	if (reply && !(f->flags & F_REPLIED))
		__sync_fetch_and_or(&f->flags, F_REPLIED);
	if (p->proto == IPPROTO_UDP) {
		acc(f, reply, p->payload);
		return V_PASS;
	}
	__u8 fl = p->tcp_flags;
	if (reply && (fl & TH_SYN) && !(f->flags & F_SEQ_REPL)) {
		f->next_seq[1] = p->seq + 1;
		__sync_fetch_and_or(&f->flags, F_SEQ_REPL);
	}
	if (p->payload) {
		__u32 start = p->seq + ((fl & TH_SYN) ? 1 : 0);
		if (reply && !(f->flags & F_SEQ_REPL)) {
			acc(f, 1, p->payload);
			f->next_seq[1] = start + p->payload;
			__sync_fetch_and_or(&f->flags, F_SEQ_REPL);
		} else {
			advance(f, st, reply, start + p->payload);
		}
	}
	if ((fl & (TH_RST | TH_FIN)) && f->gen != lim->gen)
		return V_PASS; // the slot was given to another exposure since
	if (fl & TH_RST) {
		// The guest refusing the connection (RST before any SYN-ACK)
		// is a caller admitted but not carried.
		if (reply && !(f->flags & F_SEQ_REPL) && !(__sync_fetch_and_or(&f->flags, F_DROPPED) & F_DROPPED))
			__sync_fetch_and_add(&st->dropped, 1);
		release(f, st, lim);
		bpf_map_delete_elem(&nat_flows, &ctp);
		return V_PASS;
	}
	if (fl & TH_FIN) {
		__u32 mine = reply ? F_FIN_REPL : F_FIN_ORIG;
		__u32 other = reply ? F_FIN_ORIG : F_FIN_REPL;
		__u32 old = __sync_fetch_and_or(&f->flags, mine);
		if (old & other) {
			release(f, st, lim);
			// Nothing of the flow is counted after both FINs, and a late
			// segment is no SYN, so it is never admitted again: the
			// entry (and its timer) can go now rather than with
			// conntrack's TIME_WAIT.
			bpf_map_delete_elem(&nat_flows, &ctp);
		}
	}
	return V_PASS;
}

static __always_inline __u32 csum_add16(__u32 sum, const __u16 *w, int n)
{
	for (int i = 0; i < n; i++)
		sum += w[i];
	return sum;
}

static __always_inline __u16 csum_fold(__u32 sum)
{
	sum = (sum & 0xffff) + (sum >> 16);
	sum = (sum & 0xffff) + (sum >> 16);
	return ~sum;
}

struct pseudo {
	__u32 saddr;
	__u32 daddr;
	__u8 zero;
	__u8 proto;
	__u16 len;
};

struct pseudo6 {
	__u32 saddr[4];
	__u32 daddr[4];
	__u32 len;
	__u8 zero[3];
	__u8 proto;
};

// brk_nat_reflect answers a refused caller's SYN, IPv4 or IPv6 (without

// refused_here reports whether skb, a plain TCP SYN about to leave for a
// guest, is a refused caller's.
static __always_inline int refused_here(struct __sk_buff *skb);

static __always_inline int reflect(struct __sk_buff *skb)
{
	void *data = (void *)(long)skb->data;
	void *end = (void *)(long)skb->data_end;
	struct ethhdr *eth = data;
	if ((void *)(eth + 1) > end)
		return TC_ACT_OK;
	// The caller's and the guest's addresses (IPv4 in [0]), as the SYN
	// now stands, after NAT.
	__u32 caller[4] = {}, guest[4] = {};
	struct tcphdr *th;
	int v6 = 0;
	if (eth->h_proto == bpf_htons(ETH_P_IP)) {
		struct iphdr *ip = (void *)(eth + 1);
		if ((void *)(ip + 1) > end || ip->protocol != IPPROTO_TCP || ip->ihl != 5)
			return TC_ACT_OK;
		caller[0] = ip->saddr;
		guest[0] = ip->daddr;
		th = (void *)(ip + 1);
	} else if (eth->h_proto == bpf_htons(ETH_P_IPV6)) {
		struct ipv6hdr *ip6 = (void *)(eth + 1);
		if ((void *)(ip6 + 1) > end || ip6->nexthdr != IPPROTO_TCP)
			return TC_ACT_OK;
		__builtin_memcpy(caller, &ip6->saddr, 16);
		__builtin_memcpy(guest, &ip6->daddr, 16);
		th = (void *)(ip6 + 1);
		v6 = 1;
	} else {
		return TC_ACT_OK;
	}
	if ((void *)(th + 1) > end || !th->syn || th->ack)
		return TC_ACT_OK;

	if (!refused_here(skb))
		return TC_ACT_OK;

	// The RST the guest would send: from the guest to the caller,
	// acknowledging the SYN.
	__u8 mac_guest[6], mac_br[6];
	__builtin_memcpy(mac_guest, eth->h_dest, 6);
	__builtin_memcpy(mac_br, eth->h_source, 6);
	__u16 sport = th->source, dport = th->dest;
	__u32 ack = bpf_htonl(bpf_ntohl(th->seq) + 1);

	__u32 l3 = v6 ? sizeof(struct ipv6hdr) : sizeof(struct iphdr);
	if (bpf_skb_change_tail(skb, ETH_HLEN + l3 + sizeof(struct tcphdr), 0))
		return TC_ACT_SHOT;
	data = (void *)(long)skb->data;
	end = (void *)(long)skb->data_end;
	eth = data;
	if ((void *)(eth + 1) > end)
		return TC_ACT_SHOT;
	__builtin_memcpy(eth->h_dest, mac_br, 6);
	__builtin_memcpy(eth->h_source, mac_guest, 6);
	__u32 sum;
	if (v6) {
		struct ipv6hdr *ip6 = (void *)(eth + 1);
		th = (void *)(ip6 + 1);
		if ((void *)(th + 1) > end)
			return TC_ACT_SHOT;
		*(__u32 *)ip6 = bpf_htonl(0x60000000); // version 6, no class, no flow label
		ip6->payload_len = bpf_htons(sizeof(struct tcphdr));
		ip6->nexthdr = IPPROTO_TCP;
		ip6->hop_limit = 64;
		__builtin_memcpy(&ip6->saddr, guest, 16);
		__builtin_memcpy(&ip6->daddr, caller, 16);
		struct pseudo6 ph = {.len = bpf_htonl(sizeof(struct tcphdr)), .proto = IPPROTO_TCP};
		__builtin_memcpy(ph.saddr, guest, 16);
		__builtin_memcpy(ph.daddr, caller, 16);
		sum = csum_add16(0, (__u16 *)&ph, sizeof(ph) / 2);
	} else {
		struct iphdr *ip = (void *)(eth + 1);
		th = (void *)(ip + 1);
		if ((void *)(th + 1) > end)
			return TC_ACT_SHOT;
		ip->tot_len = bpf_htons(40);
		ip->id = 0;
		ip->frag_off = bpf_htons(0x4000);
		ip->ttl = 64;
		ip->saddr = guest[0];
		ip->daddr = caller[0];
		ip->check = 0;
		ip->check = csum_fold(csum_add16(0, (__u16 *)ip, 10));
		struct pseudo ph = {.saddr = guest[0], .daddr = caller[0], .proto = IPPROTO_TCP, .len = bpf_htons(20)};
		sum = csum_add16(0, (__u16 *)&ph, sizeof(ph) / 2);
	}

	__builtin_memset(th, 0, sizeof(*th));
	th->source = dport;
	th->dest = sport;
	th->ack_seq = ack;
	th->doff = 5;
	th->rst = 1;
	th->ack = 1;
	sum = csum_add16(sum, (__u16 *)th, 10);
	th->check = csum_fold(sum);

	bpf_csum_level(skb, BPF_CSUM_LEVEL_RESET);
	return bpf_redirect(skb->ifindex, BPF_F_INGRESS);
}

#define EBUSY 16

// arm_sweep (each program set's brk_*_arm) hands the sweeping timer to this
// object's sweep: the timer is made once per pinned map (EBUSY after that),
// and setting its callback again replaces the program it runs, dropping
// the previous binary's. The loader runs it after the programs are
// attached, so the sweep that runs is always the one of the programs
// attached. Returns 0 when armed.
static __always_inline int arm_sweep(void)
{
	__u32 k = 0;
	struct nat_sweeper *s = bpf_map_lookup_elem(&nat_sweep, &k);
	if (!s)
		return 1;
	long err = bpf_timer_init(&s->timer, &nat_sweep, 1 /* CLOCK_MONOTONIC */);
	if (err && err != -EBUSY)
		return 2;
	if (bpf_timer_set_callback(&s->timer, sweep))
		return 3;
	if (bpf_timer_start(&s->timer, RECHECK_NS, 0))
		return 4;
	// An older binary's programs start the timer themselves unless
	// started is set: keep them from touching it.
	__sync_fetch_and_or(&s->started, 1);
	return 0;
}

#endif
