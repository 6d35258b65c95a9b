//go:build ignore

// SPDX-License-Identifier: GPL-2.0
//
// The nat path on kernels without BPF netfilter programs (before 6.4;
// Debian 12's 6.1): the same admission, release and counting as natpath.c,
// on the same pinned maps (natflow.h), from tc programs on the guest
// bridge that find a packet's conntrack entry with the conntrack kfuncs
// (5.18). Every exposure's guest is on the bridge, so every packet of a
// published connection crosses it, once each way. Why these hooks:
// docs/ARCHITECTURE.md, "The nat path on kernels before 6.4".
//
//   brk_nattc_egress   tc egress on the bridge: the packets the host sends
//                      to a guest. A caller's packet, after DNAT (routed or
//                      host-local), is admitted, restricted by allowFrom
//                      and counted here; a refused caller's SYN is turned
//                      into the guest's RST at once (natflow.h, reflect).
//   brk_nattc_ingress  tc ingress on the bridge: the packets a guest sends
//                      up to the host; a guest's answers are counted here.
//   the sweep          natflow.h's, every 2 s; it reads a conntrack entry
//                      by probe reads (bpf_rdonly_cast is 6.2).
//   brk_nattc_arm      run once by the loader: (re)arms the sweep (natflow.h,
//                      arm_sweep).
//
// With br_netfilter loaded, a guest calling another guest's exposure is
// bridged from port to port past the bridge's own hooks: that caller is
// neither capped nor counted here (README, "Kernels").
#include "vmlinux.h"
#include <bpf/bpf_helpers.h>
#include <bpf/bpf_core_read.h>
#include <bpf/bpf_endian.h>
#include "natflow.h"

// The conntrack kfuncs (net/netfilter/nf_conntrack_bpf.c; a module on
// Debian's kernels). Their options are bpf_ct_opts as 6.1 has it, 12
// bytes, which later kernels accept too: a struct of its own, since
// vmlinux.h's (this kernel's) has fields 6.1 lacks, and every field of a
// vmlinux.h struct is relocated, and fails to relocate, on 6.1.
struct ct_opts {
	__s32 netns_id;
	__s32 error;
	__u8 l4proto;
	__u8 dir;
	__u8 reserved[2];
};
#define CURRENT_NETNS -1
extern struct nf_conn *bpf_skb_ct_lookup(struct __sk_buff *skb_ctx, struct bpf_sock_tuple *bpf_tuple, __u32 tuple__sz,
					 struct ct_opts *opts, __u32 opts__sz) __ksym;
extern void bpf_ct_release(struct nf_conn *ct) __ksym;

#define IP_OFFSET 0x1fff

// read_l4 reads the TCP or UDP header at off of a packet whose IP part
// ends at end (both from the start of the frame).
static __always_inline int read_l4(struct __sk_buff *skb, __u32 off, __u32 end, struct pkt *p)
{
	if (p->proto == IPPROTO_TCP) {
		struct tcphdr th;
		if (bpf_skb_load_bytes(skb, off, &th, sizeof(th)))
			return PKT_SKIP;
		__u32 hl = off + th.doff * 4;
		p->payload = end > hl ? end - hl : 0;
		p->seq = bpf_ntohl(th.seq);
		p->tcp_flags = ((__u8 *)&th)[13];
		p->sport = th.source;
		p->dport = th.dest;
		return PKT_OK;
	}
	if (p->proto == IPPROTO_UDP) {
		struct udphdr uh;
		if (bpf_skb_load_bytes(skb, off, &uh, sizeof(uh)))
			return PKT_SKIP;
		p->payload = end > off + 8 ? end - off - 8 : 0;
		p->sport = uh.source;
		p->dport = uh.dest;
		return PKT_OK;
	}
	return PKT_SKIP;
}

// read_pkt reads a frame's IPv4 or IPv6 header and its TCP or UDP header,
// with both addresses and ports: the tuple the entry is looked up by. The
// IP part's length is the header's (a frame may be padded), or the frame's
// for a packet too big for the field (BIG TCP). A packet without ports
// (a later fragment, an IPv6 one behind a fragment header) cannot be tied
// to its entry and goes on uncounted; an IPv6 packet with more extension
// headers than are walked is PKT_BAD.
static __always_inline int read_pkt(struct __sk_buff *skb, struct pkt *p)
{
	__u32 end = skb->len;
	if (skb->protocol == bpf_htons(ETH_P_IP)) {
		struct iphdr ip;
		if (bpf_skb_load_bytes(skb, ETH_HLEN, &ip, sizeof(ip)))
			return PKT_SKIP;
		__u32 ihl = ip.ihl * 4;
		if (ihl < sizeof(struct iphdr) || ihl > 60 || (ip.frag_off & bpf_htons(IP_OFFSET)))
			return PKT_SKIP;
		__u32 tot = bpf_ntohs(ip.tot_len);
		if (tot && ETH_HLEN + tot < end)
			end = ETH_HLEN + tot;
		p->proto = ip.protocol;
		p->saddr[0] = ip.saddr;
		p->daddr[0] = ip.daddr;
		return read_l4(skb, ETH_HLEN + ihl, end, p);
	}
	if (skb->protocol != bpf_htons(ETH_P_IPV6))
		return PKT_SKIP;
	struct ipv6hdr ip6;
	if (bpf_skb_load_bytes(skb, ETH_HLEN, &ip6, sizeof(ip6)))
		return PKT_SKIP;
	p->v6 = 1;
	__builtin_memcpy(p->saddr, &ip6.saddr, 16);
	__builtin_memcpy(p->daddr, &ip6.daddr, 16);
	__u32 plen = bpf_ntohs(ip6.payload_len);
	if (plen && ETH_HLEN + sizeof(ip6) + plen < end)
		end = ETH_HLEN + sizeof(ip6) + plen;
	__u8 nh = ip6.nexthdr;
	__u32 off = ETH_HLEN + sizeof(ip6);
#pragma unroll
	for (int i = 0; i < EXTHDR_MAX; i++) {
		if (nh != NEXTHDR_HOP && nh != NEXTHDR_ROUTING && nh != NEXTHDR_DEST)
			break;
		struct ipv6_opt_hdr h;
		if (bpf_skb_load_bytes(skb, off, &h, sizeof(h)))
			return PKT_SKIP;
		nh = h.nexthdr;
		off += (h.hdrlen + 1) * 8;
	}
	// More headers than are walked: no honest packet has them, and one
	// that does could carry a caller past the cap, allowFrom and the
	// counters (natpath.c drops it too). A fragment goes on uncounted.
	if (nh == NEXTHDR_HOP || nh == NEXTHDR_ROUTING || nh == NEXTHDR_DEST)
		return PKT_BAD;
	p->proto = nh;
	return read_l4(skb, off, end, p);
}

// lookup finds the conntrack entry with the tuple src:sport -> dst:dport
// (in either direction); the caller releases it.
static __always_inline struct nf_conn *lookup(struct __sk_buff *skb, struct pkt *p, __u32 *src, __u16 sport, __u32 *dst, __u16 dport)
{
	struct bpf_sock_tuple t = {};
	__u32 len;
	if (p->v6) {
		__builtin_memcpy(t.ipv6.saddr, src, 16);
		__builtin_memcpy(t.ipv6.daddr, dst, 16);
		t.ipv6.sport = sport;
		t.ipv6.dport = dport;
		len = sizeof(t.ipv6);
	} else {
		t.ipv4.saddr = src[0];
		t.ipv4.daddr = dst[0];
		t.ipv4.sport = sport;
		t.ipv4.dport = dport;
		len = sizeof(t.ipv4);
	}
	struct ct_opts o = {.netns_id = CURRENT_NETNS, .l4proto = p->proto};
	return bpf_skb_ct_lookup(skb, &t, len, &o, sizeof(o));
}

// is_tuple reports whether t is src:sport -> dst:dport.
static __always_inline int is_tuple(struct nf_conntrack_tuple *t, struct pkt *p, __u32 *src, __u16 sport, __u32 *dst, __u16 dport)
{
	if (t->src.u.all != sport || t->dst.u.all != dport)
		return 0;
	if (!p->v6)
		return t->src.u3.ip == src[0] && t->dst.u3.ip == dst[0];
#pragma unroll
	for (int i = 0; i < 4; i++)
		if (t->src.u3.all[i] != src[i] || t->dst.u3.all[i] != dst[i])
			return 0;
	return 1;
}

// slot_of finds the exposure's slot from ct's mark (0 when ct is not one
// brokkr published).
static __always_inline int slot_of(struct nf_conn *ct, __u32 *slot)
{
	__u32 mark = ct->mark;
	if (!(mark & BRK_MARK_OWNED))
		return 0;
	__u32 id = mark & BRK_MARK_ID_MASK;
	if (id == 0 || id > EXPOSURE_SLOTS)
		return 0;
	*slot = id - 1;
	return 1;
}

// stale reports whether f, found at ct's address, is a dead entry's
// leftover: the memory was reused by another connection (another tuple),
// or by the same tuple's next connection (a SYN of another initial
// sequence number) before the sweep noticed.
static __always_inline int stale(struct nf_conn *ct, struct nat_flow *f, struct pkt *p)
{
	if (!same_tuple(&ct->tuplehash[0].tuple, f))
		return 1;
	return p->proto == IPPROTO_TCP && (p->tcp_flags & (TH_SYN | TH_ACK)) == TH_SYN && !(f->flags & F_REFUSED) &&
	       f->next_seq[0] != p->seq + 1;
}

// toward_guest decides a packet the host sends to a guest, of the entry ct.
static __always_inline int toward_guest(struct __sk_buff *skb, struct nf_conn *ct, struct pkt *p)
{
	__u32 slot;
	if (!slot_of(ct, &slot))
		return V_PASS;
	// A caller's packet after DNAT is the entry's reply tuple turned
	// round; anything else is a guest's answer routed on to another guest
	// (a hairpin), counted where it left its guest.
	if (!is_tuple(&ct->tuplehash[1].tuple, p, p->daddr, p->dport, p->saddr, p->sport))
		return V_PASS;
	struct exposure_stat *st = bpf_map_lookup_elem(&exposure_stats, &slot);
	struct exposure_limit *lim = bpf_map_lookup_elem(&exposure_limits, &slot);
	if (!st || !lim)
		return V_PASS;
	__u64 ctp = (__u64)ct;
	struct nat_flow *f = bpf_map_lookup_elem(&nat_flows, &ctp);
	if (f && stale(ct, f, p)) {
		settle(&ctp, f);
		f = 0;
	}
	// A host-local caller's packet was made here (no input device): the
	// host's own processes are not restricted by allowFrom.
	int restricted = skb->ingress_ifindex != 0;
	if (f && (f->flags & F_DENIED)) {
		if (restricted && !allowed(slot, lim, p))
			return V_DROP;
		bpf_map_delete_elem(&nat_flows, &ctp); // allowed since
		f = 0;
	}
	if (f)
		return on_flow(ctp, f, st, lim, p, 0);
	int fresh = p->proto == IPPROTO_UDP || (p->tcp_flags & (TH_SYN | TH_ACK)) == TH_SYN;
	int v = new_flow(ctp, &ct->tuplehash[0].tuple, slot, st, lim, p, restricted, fresh);
	if (v != V_DENIED)
		return v;
	// The entry outlives the drop here (conntrack confirmed it before
	// these hooks), so it is counted once, by a flow that marks it, as the
	// netfilter hooks count a new entry once.
	struct nat_flow nf = {.slot = slot, .gen = lim->gen, .flags = F_DENIED};
	if (!track(ctp, &ct->tuplehash[0].tuple, &nf))
		count_denied(slot);
	return V_DROP;
}

// from_guest counts a packet a guest sends, of the entry ct.
static __always_inline void from_guest(struct nf_conn *ct, struct pkt *p)
{
	__u32 slot;
	if (!slot_of(ct, &slot))
		return;
	if (!is_tuple(&ct->tuplehash[1].tuple, p, p->saddr, p->sport, p->daddr, p->dport))
		return; // a guest calling an exposure: its caller's side
	struct exposure_stat *st = bpf_map_lookup_elem(&exposure_stats, &slot);
	struct exposure_limit *lim = bpf_map_lookup_elem(&exposure_limits, &slot);
	if (!st || !lim)
		return;
	__u64 ctp = (__u64)ct;
	struct nat_flow *f = bpf_map_lookup_elem(&nat_flows, &ctp);
	if (!f)
		return; // a flow that predates the programs
	if (!same_tuple(&ct->tuplehash[0].tuple, f)) {
		settle(&ctp, f);
		return;
	}
	on_flow(ctp, f, st, lim, p, 1);
}

SEC("tc")
int brk_nattc_egress(struct __sk_buff *skb)
{
	struct pkt p = {};
	int r = read_pkt(skb, &p);
	if (r == PKT_BAD)
		return TC_ACT_SHOT; // see read_pkt
	if (r != PKT_OK)
		return TC_ACT_OK;
	struct nf_conn *ct = lookup(skb, &p, p.daddr, p.dport, p.saddr, p.sport);
	if (!ct)
		return TC_ACT_OK;
	int v = toward_guest(skb, ct, &p);
	bpf_ct_release(ct);
	if (v == V_REFUSED) {
		// reflect reads the headers in place. A SYN it cannot answer
		// (IPv4 options, a pull that failed) is dropped: never carried
		// past the cap.
		__u32 need = ETH_HLEN + sizeof(struct ipv6hdr) + sizeof(struct tcphdr);
		bpf_skb_pull_data(skb, need < skb->len ? need : skb->len);
		int r = reflect(skb);
		return r == TC_ACT_OK ? TC_ACT_SHOT : r;
	}
	return v == V_DROP ? TC_ACT_SHOT : TC_ACT_OK;
}

SEC("tc")
int brk_nattc_ingress(struct __sk_buff *skb)
{
	struct pkt p = {};
	if (read_pkt(skb, &p) != PKT_OK)
		return TC_ACT_OK;
	struct nf_conn *ct = lookup(skb, &p, p.saddr, p.sport, p.daddr, p.dport);
	if (!ct)
		return TC_ACT_OK;
	from_guest(ct, &p);
	bpf_ct_release(ct);
	return TC_ACT_OK;
}

// The sweep reads an entry by probe reads: before 6.2 there is no
// bpf_rdonly_cast, and a freed entry's memory stays a conntrack entry's
// (SLAB_TYPESAFE_BY_RCU), so a read is always safe and same_tuple tells
// whose it is.
static __always_inline int flow_alive(__u64 ctp, struct nat_flow *f)
{
	struct nf_conn *ct = (struct nf_conn *)ctp;
	int refs = BPF_CORE_READ(ct, ct_general.use.refs.counter);
	unsigned long status = BPF_CORE_READ(ct, status);
	__u32 timeout = BPF_CORE_READ(ct, timeout);
	struct nf_conntrack_tuple t = {};
	if (bpf_core_read(&t, sizeof(t), &ct->tuplehash[0].tuple))
		return 0;
	return alive_as(refs, status, &t, timeout, f);
}

// A refused caller's SYN is answered as soon as it is refused.
static __always_inline int refused_here(struct __sk_buff *skb)
{
	return 1;
}

// brk_nattc_arm: see arm_sweep (natflow.h).
SEC("tc")
int brk_nattc_arm(struct __sk_buff *skb)
{
	return arm_sweep();
}

char __license[] SEC("license") = "GPL";
