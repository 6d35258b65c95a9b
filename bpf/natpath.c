//go:build ignore

// SPDX-License-Identifier: GPL-2.0
//
// The nat path's per-connection logic, all in the kernel: admission against
// the exposure's cap, release when the flow ends, and counting, written into
// the exposure's slot of exposure_stats. nft does the DNAT and marks the
// connection (ct mark = owner bit | slot+1); these programs only read that
// mark. Why these hooks: docs/ARCHITECTURE.md, "The nat path".
//
//   brk_nat_pre, brk_nat_out  netfilter (IPv4 PREROUTING and LOCAL_OUT, right
//                             after DNAT): every packet of a marked
//                             connection, both directions, passes exactly one
//                             of them, with or without br_netfilter.
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
#define ETH_HLEN 14
#define IPPROTO_TCP 6
#define IPPROTO_UDP 17
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
	__u16 sport, dport;
	__u8 proto;
	__u8 pad[3];
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

// allowed reports whether a caller from saddr (IPv4, network order) may
// reach the exposure at slot of generation gen.
static __always_inline int allowed(__u32 slot, __u32 gen, __u32 saddr)
{
	__u32 *r = bpf_map_lookup_elem(&allow_restricted, &slot);
	if (!r || *r != gen + 1)
		return 1;
	struct allow_key k = {.prefixlen = 32 + 128, .slot = slot};
	k.addr[10] = 0xff;
	k.addr[11] = 0xff;
	__builtin_memcpy(&k.addr[12], &saddr, 4);
	__u32 *v = bpf_map_lookup_elem(&allow_from, &k);
	return v && *v == gen;
}

extern void *bpf_cast_to_kern_ctx(void *) __ksym;

struct pkt {
	__u8 proto;
	__u8 tcp_flags;
	__u32 saddr;
	__u32 seq;
	__u32 payload;
};

extern int bpf_dynptr_from_skb(struct sk_buff *skb, __u64 flags, struct bpf_dynptr *ptr__uninit) __ksym;
extern void *bpf_dynptr_slice(const struct bpf_dynptr *ptr, __u32 offset, void *buffer__opt, __u32 buffer__szk) __ksym;
extern void *bpf_rdonly_cast(const void *obj, __u32 btf_id) __ksym;

// read_pkt reads the IPv4 and L4 headers of skb (its data starts at the
// network header in these hooks); 0 when it is not a TCP or UDP packet
// brokkr can account.
static __always_inline int read_pkt(struct sk_buff *skb, struct pkt *p)
{
	struct bpf_dynptr d;
	__u8 buf[sizeof(struct iphdr) + sizeof(struct tcphdr)];
	__u32 len = skb->len;
	if (len < sizeof(struct iphdr) + 8 || bpf_dynptr_from_skb(skb, 0, &d))
		return 0;
	struct iphdr *ip = bpf_dynptr_slice(&d, 0, buf, sizeof(struct iphdr));
	if (!ip || ip->version != 4)
		return 0;
	__u32 ihl = ip->ihl * 4;
	p->proto = ip->protocol;
	p->saddr = ip->saddr;
	if (ihl < sizeof(struct iphdr) || ihl > 60)
		return 0;
	if (p->proto == IPPROTO_TCP) {
		struct tcphdr *th = bpf_dynptr_slice(&d, ihl, buf, sizeof(struct tcphdr));
		if (!th)
			return 0;
		__u32 hl = ihl + th->doff * 4;
		p->payload = len > hl ? len - hl : 0;
		p->seq = bpf_ntohl(th->seq);
		p->tcp_flags = ((__u8 *)th)[13];
		return 1;
	}
	if (p->proto == IPPROTO_UDP) {
		__u32 hl = ihl + 8;
		p->payload = len > hl ? len - hl : 0;
		p->tcp_flags = 0;
		return 1;
	}
	return 0;
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

static __always_inline int in_guest_net(__u32 saddr)
{
	__u32 k = 0;
	struct nat_cfg *c = bpf_map_lookup_elem(&nat_config, &k);
	return c && c->guest_mask && (saddr & c->guest_mask) == c->guest_net;
}

#define RECHECK_NS (2ULL * 1000000000ULL)

// same_tuple reports whether ct's original tuple is the one the flow was
// tracked with: conntrack entries live in a SLAB_TYPESAFE_BY_RCU cache, so
// the entry at a flow's key may since be another connection's.
static __always_inline int same_tuple(struct nf_conn *ct, struct nat_flow *f)
{
	struct nf_conntrack_tuple *t = &ct->tuplehash[0].tuple;
	return t->src.u3.ip == f->saddr && t->dst.u3.ip == f->daddr && t->src.u.all == f->sport &&
	       t->dst.u.all == f->dport && t->dst.protonum == f->proto;
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
	if (!read_pkt(skb, &p))
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
		if (hook == NF_INET_PRE_ROUTING && !allowed(slot, lim->gen, p.saddr)) {
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
		if (p.proto != IPPROTO_TCP || (hook == NF_INET_PRE_ROUTING && in_guest_net(p.saddr)))
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

SEC("tc")
int brk_nat_reflect(struct __sk_buff *skb)
{
	void *data = (void *)(long)skb->data;
	void *end = (void *)(long)skb->data_end;
	struct ethhdr *eth = data;
	if ((void *)(eth + 1) > end || eth->h_proto != bpf_htons(ETH_P_IP))
		return TC_ACT_OK;
	struct iphdr *ip = (void *)(eth + 1);
	if ((void *)(ip + 1) > end || ip->protocol != IPPROTO_TCP || ip->ihl != 5)
		return TC_ACT_OK;
	struct tcphdr *th = (void *)(ip + 1);
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

	// The RST the guest would send: from the guest to the caller (as the
	// packet now stands, after NAT), acknowledging the SYN.
	__u8 mac_guest[6], mac_br[6];
	__builtin_memcpy(mac_guest, eth->h_dest, 6);
	__builtin_memcpy(mac_br, eth->h_source, 6);
	__u32 saddr = ip->saddr, daddr = ip->daddr;
	__u16 sport = th->source, dport = th->dest;
	__u32 ack = bpf_htonl(bpf_ntohl(th->seq) + 1);

	if (bpf_skb_change_tail(skb, ETH_HLEN + 40, 0))
		return TC_ACT_SHOT;
	data = (void *)(long)skb->data;
	end = (void *)(long)skb->data_end;
	eth = data;
	ip = (void *)(eth + 1);
	th = (void *)(ip + 1);
	if ((void *)(th + 1) > end)
		return TC_ACT_SHOT;

	__builtin_memcpy(eth->h_dest, mac_br, 6);
	__builtin_memcpy(eth->h_source, mac_guest, 6);
	ip->tot_len = bpf_htons(40);
	ip->id = 0;
	ip->frag_off = bpf_htons(0x4000);
	ip->ttl = 64;
	ip->saddr = daddr;
	ip->daddr = saddr;
	ip->check = 0;
	ip->check = csum_fold(csum_add16(0, (__u16 *)ip, 10));

	__builtin_memset(th, 0, sizeof(*th));
	th->source = dport;
	th->dest = sport;
	th->ack_seq = ack;
	th->doff = 5;
	th->rst = 1;
	th->ack = 1;
	struct pseudo ph = {.saddr = daddr, .daddr = saddr, .proto = IPPROTO_TCP, .len = bpf_htons(20)};
	__u32 sum = csum_add16(0, (__u16 *)&ph, 6);
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
