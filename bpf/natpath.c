//go:build ignore

// SPDX-License-Identifier: GPL-2.0
//
// The nat path's per-connection logic, all in the kernel: admission against
// the exposure's cap, release when the flow ends, and counting, written into
// the exposure's slot of exposure_stats. nft does the DNAT and marks the
// connection (ct mark = owner bit | slot+1); these programs only read that
// mark. Why these hooks: docs/ARCHITECTURE.md, "The nat path".
//
//   brk_nat_pre, brk_nat_out  netfilter (PREROUTING and LOCAL_OUT, right
//                             after DNAT; each program is attached for IPv4
//                             and for IPv6, one link per family and hook):
//                             every packet of a marked connection, both
//                             directions, passes exactly one of them, with or
//                             without br_netfilter. One code path serves both
//                             families: the packet's tuple is read into a
//                             struct pkt from either header.
//   brk_nat_reflect           tc egress on the bridge: a refused TCP caller's
//                             SYN is turned into the RST the guest would send
//                             and handed back to the bridge's ingress, so
//                             conntrack un-NATs it to the caller.
//   one sweeping timer        every 2 s walks the flows and checks that each
//                             one's conntrack entry is still alive: a flow
//                             conntrack forgets (timeouts, UDP, flushes)
//                             gives its place back and is forgotten; open
//                             flows' bytes move into their slots. (This
//                             kernel has no ftrace, so no fentry on
//                             nf_ct_destroy; one timer, not one per flow,
//                             keeps a short connection free of timer work.)
//   brk_nat_arm               run once by the loader (BPF_PROG_TEST_RUN), after
//                             the links: (re)arms the sweeping timer with this
//                             object's sweep. A bpf_timer runs the program that
//                             set its callback, so without this an upgrade would
//                             keep the previous binary's sweep running (and its
//                             program loaded) for as long as the pinned map.
#include "vmlinux.h"
#include <bpf/bpf_helpers.h>
#include <bpf/bpf_core_read.h>
#include <bpf/bpf_endian.h>
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
#define NF_INET_PRE_ROUTING 0
#define NF_INET_LOCAL_OUT 3
#define BPF_F_INGRESS 1
#define NFCT_PTRMASK (~7UL)
#define IP_CT_IS_REPLY 3
#define IP_CT_NEW 2

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

extern void *bpf_cast_to_kern_ctx(void *) __ksym;

// A packet as the programs need it, read from an IPv4 or an IPv6 header.
struct pkt {
	__u8 proto;
	__u8 tcp_flags;
	__u8 v6;
	__u32 saddr[4]; // the source address: IPv4 in saddr[0], IPv6 whole
	__u32 seq;
	__u32 payload;
};

// allowed reports whether the caller of p may reach the exposure at slot
// of generation gen.
static __always_inline int allowed(__u32 slot, __u32 gen, struct pkt *p)
{
	__u32 *r = bpf_map_lookup_elem(&allow_restricted, &slot);
	if (!r || *r != gen + 1)
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

extern int bpf_dynptr_from_skb(struct sk_buff *skb, __u64 flags, struct bpf_dynptr *ptr__uninit) __ksym;
extern void *bpf_dynptr_slice(const struct bpf_dynptr *ptr, __u32 offset, void *buffer__opt, __u32 buffer__szk) __ksym;
extern void *bpf_rdonly_cast(const void *obj, __u32 btf_id) __ksym;

#define PKT_SKIP 0 // not one brokkr accounts (ICMP, another protocol): let it on
#define PKT_OK 1
#define PKT_BAD -1 // IPv6: the TCP/UDP header is behind a header not walked

// read_l4 reads the TCP or UDP header at off (the packet is len bytes).
static __always_inline int read_l4(struct bpf_dynptr *d, __u32 off, __u32 len, struct pkt *p, __u8 *buf)
{
	if (p->proto == IPPROTO_TCP) {
		struct tcphdr *th = bpf_dynptr_slice(d, off, buf, sizeof(struct tcphdr));
		if (!th)
			return p->v6 ? PKT_BAD : PKT_SKIP;
		__u32 hl = off + th->doff * 4;
		p->payload = len > hl ? len - hl : 0;
		p->seq = bpf_ntohl(th->seq);
		p->tcp_flags = ((__u8 *)th)[13];
		return PKT_OK;
	}
	if (p->proto == IPPROTO_UDP) {
		__u32 hl = off + 8;
		if (len < hl)
			return p->v6 ? PKT_BAD : PKT_SKIP;
		p->payload = len - hl;
		p->tcp_flags = 0;
		return PKT_OK;
	}
	return PKT_SKIP;
}

// read_pkt reads the IPv4 or IPv6 header and the L4 header of skb (its
// data starts at the network header in these hooks): PKT_OK for a TCP or
// UDP packet brokkr accounts, PKT_SKIP for one it lets on uncounted.
//
// IPv6: up to EXTHDR_MAX hop-by-hop, routing and destination-options
// headers are skipped (each is (hdrlen + 1) * 8 bytes). Any other header
// before TCP or UDP (a fragment header, AH, ESP, more than EXTHDR_MAX) is
// PKT_BAD, and the packet is dropped: conntrack and nft see past such
// headers and mark the connection, so letting it on would carry it past
// the cap, allowFrom and the counters. (conntrack reassembles fragments
// before these hooks, so a fragment header here is rare.) ICMPv6 (errors
// conntrack relates to the connection, Packet Too Big among them) goes on.
static __always_inline int read_pkt(struct sk_buff *skb, struct pkt *p)
{
	struct bpf_dynptr d;
	__u8 buf[sizeof(struct ipv6hdr)];
	__u32 len = skb->len;
	if (len < sizeof(struct iphdr) + 8 || bpf_dynptr_from_skb(skb, 0, &d))
		return PKT_SKIP;
	__u8 *b = bpf_dynptr_slice(&d, 0, buf, 1);
	if (!b)
		return PKT_SKIP;
	__u8 version = *b >> 4;
	if (version == 4) {
		struct iphdr *ip = bpf_dynptr_slice(&d, 0, buf, sizeof(struct iphdr));
		if (!ip)
			return PKT_SKIP;
		__u32 ihl = ip->ihl * 4;
		p->proto = ip->protocol;
		p->saddr[0] = ip->saddr;
		if (ihl < sizeof(struct iphdr) || ihl > 60)
			return PKT_SKIP;
		return read_l4(&d, ihl, len, p, buf);
	}
	if (version != 6)
		return PKT_SKIP;
	p->v6 = 1;
	struct ipv6hdr *ip6 = bpf_dynptr_slice(&d, 0, buf, sizeof(struct ipv6hdr));
	if (!ip6)
		return PKT_BAD;
	__builtin_memcpy(p->saddr, &ip6->saddr, 16);
	__u8 nh = ip6->nexthdr;
	__u32 off = sizeof(struct ipv6hdr);
#pragma unroll
	for (int i = 0; i < EXTHDR_MAX; i++) {
		if (nh != NEXTHDR_HOP && nh != NEXTHDR_ROUTING && nh != NEXTHDR_DEST)
			break;
		struct ipv6_opt_hdr *h = bpf_dynptr_slice(&d, off, buf, sizeof(struct ipv6_opt_hdr));
		if (!h)
			return PKT_BAD;
		nh = h->nexthdr;
		off += (h->hdrlen + 1) * 8;
	}
	p->proto = nh;
	if (nh == IPPROTO_TCP || nh == IPPROTO_UDP)
		return read_l4(&d, off, len, p, buf);
	if (nh == IPPROTO_ICMPV6)
		return PKT_SKIP;
	return PKT_BAD;
}

// conn is the conntrack entry at ctp, readable by plain loads (faulting
// loads are caught, as in a probe read, but without a helper call).
static __always_inline struct nf_conn *conn(__u64 ctp)
{
	return bpf_rdonly_cast((void *)ctp, bpf_core_type_id_kernel(struct nf_conn));
}

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

// same_tuple reports whether ct's original tuple is the one the flow was
// tracked with: conntrack entries live in a SLAB_TYPESAFE_BY_RCU cache, so
// the entry at a flow's key may since be another connection's.
static __always_inline int same_tuple(struct nf_conn *ct, struct nat_flow *f)
{
	struct nf_conntrack_tuple *t = &ct->tuplehash[0].tuple;
	if (t->src.u3.ip != f->saddr || t->dst.u3.ip != f->daddr || t->src.u.all != f->sport ||
	    t->dst.u.all != f->dport || t->dst.protonum != f->proto)
		return 0;
	int v6 = t->src.l3num == AF_INET6;
	if (v6 != f->v6)
		return 0;
	return !v6 || addr_hash(t) == f->addr6;
}

// flow_alive reports whether the conntrack entry at ctp is still the flow's
// live, unexpired entry.
static __always_inline int flow_alive(__u64 ctp, struct nat_flow *f)
{
	struct nf_conn *ct = conn(ctp);
	if (ct->ct_general.use.refs.counter == 0)
		return 0;
	if (ct->status & (1UL << IPS_DYING_BIT))
		return 0;
	if (!same_tuple(ct, f))
		return 0;
	// Not confirmed yet: the connection's first packet is still on its way
	// through the hooks (or held in a queue), and until conntrack confirms
	// the entry its timeout is a duration, not a point in time.
	if (!(ct->status & (1UL << IPS_CONFIRMED_BIT)))
		return 1;
	__s32 left = (__s32)(ct->timeout - (__u32)bpf_jiffies64());
	return left > 0;
}

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

// track inserts the flow; 0 on success.
static __always_inline int track(__u64 ctp, struct nf_conn *ct, struct nat_flow *nf)
{
	struct nf_conntrack_tuple *t = &ct->tuplehash[0].tuple;
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

// first_packet reports whether the flow f, found for a conntrack entry not
// confirmed yet, was tracked by this very packet: another copy of these
// programs at the same hook ran first (while an upgrade attaches the new
// programs before it detaches the old ones, both run). The same original
// tuple and, for TCP, the same initial sequence number tell it from a
// leftover of a dead entry whose memory was reused.
static __always_inline int first_packet(struct nf_conn *ct, struct nat_flow *f, struct pkt *p)
{
	if (!same_tuple(ct, f))
		return 0;
	return p->proto != IPPROTO_TCP || f->next_seq[0] == p->seq + 1;
}

static __always_inline int account(struct bpf_nf_ctx *ctx, int hook)
{
	struct sk_buff *skb = ctx->skb;
	unsigned long nfct = skb->_nfct;
	__u64 ctp = nfct & NFCT_PTRMASK;
	if (!ctp)
		return NF_ACCEPT;
	struct nf_conn *ct = conn(ctp);
	__u32 mark = ct->mark;
	if (!(mark & BRK_MARK_OWNED))
		return NF_ACCEPT;
	__u32 id = mark & BRK_MARK_ID_MASK;
	if (id == 0 || id > EXPOSURE_SLOTS)
		return NF_ACCEPT;
	__u32 slot = id - 1;
	struct exposure_stat *st = bpf_map_lookup_elem(&exposure_stats, &slot);
	struct exposure_limit *lim = bpf_map_lookup_elem(&exposure_limits, &slot);
	if (!st || !lim)
		return NF_ACCEPT;
	struct pkt p = {};
	int r = read_pkt(skb, &p);
	if (r == PKT_BAD)
		return NF_DROP; // see read_pkt
	if (r != PKT_OK)
		return NF_ACCEPT;
	int ctinfo = nfct & 7;
	int reply = ctinfo >= IP_CT_IS_REPLY;

	struct nat_flow *f = bpf_map_lookup_elem(&nat_flows, &ctp);
	if (f && !(ct->status & (1UL << IPS_CONFIRMED_BIT)) && !first_packet(ct, f, &p)) {
		// An entry for a conntrack entry not confirmed yet is a
		// leftover: its entry died and the memory was reused before the
		// flow's timer noticed. Settle it and start afresh.
		settle(&ctp, f);
		f = 0;
	}
	if (!f) {
		if (reply)
			return NF_ACCEPT; // a flow that predates the programs
		// allowFrom, before admission: a caller from elsewhere is dropped
		// (no RST, a firewall's behaviour), takes no place of the cap and
		// wakes nothing; so is any packet of its that no admitted flow
		// owns (conntrack picks up a mid-stream ACK as a new entry too).
		// Each new conntrack entry counts once in denied. Host-local
		// callers (LOCAL_OUT) are the host's own processes and are not
		// restricted (README, "allowFrom").
		if (hook == NF_INET_PRE_ROUTING && !allowed(slot, lim->gen, &p)) {
			struct exposure_deny *dn = bpf_map_lookup_elem(&exposure_denied, &slot);
			if (dn && ctinfo == IP_CT_NEW)
				__sync_fetch_and_add(&dn->denied, 1);
			return NF_DROP;
		}
		int fresh = ctinfo == IP_CT_NEW && (p.proto == IPPROTO_UDP || (p.tcp_flags & (TH_SYN | TH_ACK)) == TH_SYN);
		if (!fresh)
			return NF_ACCEPT;
		struct nat_flow nf = {.slot = slot, .gen = lim->gen};
		brk_wake(slot);
		if (brk_admit(st, lim)) {
			nf.flags = F_OPEN;
			nf.next_seq[0] = p.seq + 1;
			if (p.proto == IPPROTO_UDP)
				nf.pend[0] = p.payload; // the first datagram, counted like the rest
			if (track(ctp, ct, &nf)) {
				// Lost a race with the same entry, or the table is
				// full: never hold a place nobody will give back.
				brk_release(st, lim);
				__sync_fetch_and_add(&st->accepted, -1);
				struct nat_flow *again = bpf_map_lookup_elem(&nat_flows, &ctp);
				if (again)
					return NF_ACCEPT;
				__sync_fetch_and_add(&st->refused, 1);
				return NF_DROP;
			}
			return NF_ACCEPT;
		}
		__sync_fetch_and_add(&st->refused, 1);
		// A guest caller's packets are bridged straight to the target
		// (br_netfilter) and never reach the reflector: drop them. UDP
		// is dropped too.
		if (p.proto != IPPROTO_TCP || (hook == NF_INET_PRE_ROUTING && in_guest_net(&p)))
			return NF_DROP;
		nf.flags = F_REFUSED;
		nf.next_seq[0] = p.seq + 1; // for first_packet
		if (track(ctp, ct, &nf))
			return NF_DROP;
		return NF_ACCEPT;
	}
	if (f->flags & F_REFUSED) {
		// Only the SYN goes on, to be reflected; anything else of a
		// refused flow stops here.
		if (!reply && (p.tcp_flags & (TH_SYN | TH_ACK)) == TH_SYN)
			return NF_ACCEPT;
		return reply ? NF_ACCEPT : NF_DROP;
	}
	if (f->gen != lim->gen)
		return NF_ACCEPT; // the slot was given to another exposure since

	if (reply && !(f->flags & F_REPLIED))
		__sync_fetch_and_or(&f->flags, F_REPLIED);
	if (p.proto == IPPROTO_UDP) {
		acc(f, reply, p.payload);
		return NF_ACCEPT;
	}
	__u8 fl = p.tcp_flags;
	if (reply && (fl & TH_SYN) && !(f->flags & F_SEQ_REPL)) {
		f->next_seq[1] = p.seq + 1;
		__sync_fetch_and_or(&f->flags, F_SEQ_REPL);
	}
	if (p.payload) {
		__u32 start = p.seq + ((fl & TH_SYN) ? 1 : 0);
		if (reply && !(f->flags & F_SEQ_REPL)) {
			acc(f, 1, p.payload);
			f->next_seq[1] = start + p.payload;
			__sync_fetch_and_or(&f->flags, F_SEQ_REPL);
		} else {
			advance(f, st, reply, start + p.payload);
		}
	}
	if (fl & TH_RST) {
		// The guest refusing the connection (RST before any SYN-ACK)
		// is a caller admitted but not carried.
		if (reply && !(f->flags & F_SEQ_REPL) && !(__sync_fetch_and_or(&f->flags, F_DROPPED) & F_DROPPED))
			__sync_fetch_and_add(&st->dropped, 1);
		release(f, st, lim);
		bpf_map_delete_elem(&nat_flows, &ctp);
		return NF_ACCEPT;
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
	return NF_ACCEPT;
}

SEC("netfilter")
int brk_nat_pre(struct bpf_nf_ctx *ctx)
{
	return account(ctx, NF_INET_PRE_ROUTING);
}

SEC("netfilter")
int brk_nat_out(struct bpf_nf_ctx *ctx)
{
	return account(ctx, NF_INET_LOCAL_OUT);
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
// extension headers: one with them was dropped by brk_nat_pre), with the
// RST the guest would send.
SEC("tc")
int brk_nat_reflect(struct __sk_buff *skb)
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

	struct sk_buff *k = bpf_cast_to_kern_ctx(skb);
	__u64 ctp = k->_nfct & NFCT_PTRMASK;
	if (!ctp)
		return TC_ACT_OK;
	struct nat_flow *f = bpf_map_lookup_elem(&nat_flows, &ctp);
	if (!f || !(f->flags & F_REFUSED))
		return TC_ACT_OK;
	if (!same_tuple(conn(ctp), f)) {
		// A refused flow's entry outlives its conntrack entry (conntrack
		// kills an entry whose only reply is a RST at once) until the
		// next sweep, and the memory goes straight to the next
		// connection: this SYN is another caller's (the socket path's,
		// the proxy's, a guest's), not one to refuse. The leftover holds
		// no place; forget it.
		bpf_map_delete_elem(&nat_flows, &ctp);
		return TC_ACT_OK;
	}

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

// brk_nat_arm hands the sweeping timer to this object's sweep: the timer
// is made once per pinned map (EBUSY after that), and setting its callback
// again replaces the program it runs, dropping the previous binary's. The
// loader runs it after the links are attached, so the sweep that runs is
// always the one of the programs attached. Returns 0 when armed.
SEC("tc")
int brk_nat_arm(struct __sk_buff *skb)
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

char __license[] SEC("license") = "GPL";
