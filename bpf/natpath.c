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
#include "natflow.h"

#define NF_INET_PRE_ROUTING 0
#define NF_INET_LOCAL_OUT 3
#define NFCT_PTRMASK (~7UL)
#define IP_CT_IS_REPLY 3
#define IP_CT_NEW 2

extern void *bpf_cast_to_kern_ctx(void *) __ksym;
extern int bpf_dynptr_from_skb(struct sk_buff *skb, __u64 flags, struct bpf_dynptr *ptr__uninit) __ksym;
extern void *bpf_dynptr_slice(const struct bpf_dynptr *ptr, __u32 offset, void *buffer__opt, __u32 buffer__szk) __ksym;
extern void *bpf_rdonly_cast(const void *obj, __u32 btf_id) __ksym;


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

static __always_inline int flow_alive(__u64 ctp, struct nat_flow *f)
{
	struct nf_conn *ct = conn(ctp);
	return alive_as(ct->ct_general.use.refs.counter, ct->status, &ct->tuplehash[0].tuple, ct->timeout, f);
}


// first_packet reports whether the flow f, found for a conntrack entry not
// confirmed yet, was tracked by this very packet: another copy of these
// programs at the same hook ran first (while an upgrade attaches the new
// programs before it detaches the old ones, both run). The same original
// tuple and, for TCP, the same initial sequence number tell it from a
// leftover of a dead entry whose memory was reused.
static __always_inline int first_packet(struct nf_conn *ct, struct nat_flow *f, struct pkt *p)
{
	if (!same_tuple(&ct->tuplehash[0].tuple, f))
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
	if (f)
		return on_flow(ctp, f, st, lim, &p, reply);
	if (reply)
		return NF_ACCEPT; // a flow that predates the programs
	int fresh = ctinfo == IP_CT_NEW && (p.proto == IPPROTO_UDP || (p.tcp_flags & (TH_SYN | TH_ACK)) == TH_SYN);
	int v = new_flow(ctp, &ct->tuplehash[0].tuple, slot, st, lim, &p, hook == NF_INET_PRE_ROUTING, fresh);
	if (v == V_DENIED) {
		// A dropped new entry is never confirmed: each is counted once.
		if (ctinfo == IP_CT_NEW)
			count_denied(slot);
		return NF_DROP;
	}
	if (v != V_REFUSED)
		return v;
	// A guest caller's packets are bridged straight to the target
	// (br_netfilter) and never reach the reflector: drop them.
	if (hook == NF_INET_PRE_ROUTING && in_guest_net(&p))
		return NF_DROP;
	struct nat_flow nf = {.slot = slot, .gen = lim->gen, .flags = F_REFUSED};
	nf.next_seq[0] = p.seq + 1; // for first_packet
	if (track(ctp, &ct->tuplehash[0].tuple, &nf))
		return NF_DROP;
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

static __always_inline int refused_here(struct __sk_buff *skb)
{
	struct sk_buff *k = bpf_cast_to_kern_ctx(skb);
	__u64 ctp = k->_nfct & NFCT_PTRMASK;
	if (!ctp)
		return 0;
	struct nat_flow *f = bpf_map_lookup_elem(&nat_flows, &ctp);
	if (!f || !(f->flags & F_REFUSED))
		return 0;
	if (!same_tuple(&conn(ctp)->tuplehash[0].tuple, f)) {
		// A refused flow's entry outlives its conntrack entry (conntrack
		// kills an entry whose only reply is a RST at once) until the
		// next sweep, and the memory goes straight to the next
		// connection: this SYN is another caller's (the socket path's,
		// the proxy's, a guest's), not one to refuse. The leftover holds
		// no place; forget it.
		bpf_map_delete_elem(&nat_flows, &ctp);
		return 0;
	}
	return 1;
}

// brk_nat_reflect answers a refused caller's SYN (reflect, natflow.h).
SEC("tc")
int brk_nat_reflect(struct __sk_buff *skb)
{
	return reflect(skb);
}

// brk_nat_arm: see arm_sweep (natflow.h).
SEC("tc")
int brk_nat_arm(struct __sk_buff *skb)
{
	return arm_sweep();
}

char __license[] SEC("license") = "GPL";
