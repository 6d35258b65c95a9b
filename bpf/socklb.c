//go:build ignore

// SPDX-License-Identifier: GPL-2.0
//
// The socket path: host-local callers (loopback or a host address, in the
// namespace brokkrd manages) are sent to the guest by rewriting the
// destination when their socket connects, so no packet is NATed or copied.
// Admission, release and counting write the exposure's slot, against the
// same cap as the nat path and the proxy (exposure.h).
//
//   connect4/6      translate and admit (TCP, connected UDP); past the cap
//                   the connect fails with ECONNREFUSED
//   sendmsg4/6      the same for unconnected UDP, per datagram
//
// An IPv6 caller goes to the guest's IPv6 address when the exposure has one
// (sock_targets6); else a dual-stack socket goes to its IPv4 address
// through a v4-mapped one (connect only: the kernel refuses a sendmsg6
// rewritten to a v4-mapped address), and an IPV6_V6ONLY socket is left
// alone.
//   recvmsg4/6      UDP replies appear to come from the address dialled
//   getpeername4/6  the caller sees the address it dialled
//   sock_release    gives the place back when the caller closes
//   sockops         TCP: the place back when the connection ends, payload
//                   bytes and the guest-refused count at that moment
//   cgroup_skb      UDP payload bytes, per datagram of a translated socket
//
// A translated socket carries its state in sk_storage (sock_socks).
#include "vmlinux.h"
#include <bpf/bpf_helpers.h>
#include <bpf/bpf_core_read.h>
#include <bpf/bpf_endian.h>
#include "socklb.h"
#include "wake.h"

// v6only reports whether an AF_INET6 socket refuses v4-mapped peers.
static __always_inline int v6only(struct bpf_sock *sk, __u8 proto)
{
	struct sock *s;
	if (proto == IPPROTO_TCP)
		s = (struct sock *)bpf_skc_to_tcp6_sock(sk);
	else
		s = (struct sock *)bpf_skc_to_udp6_sock(sk);
	return s && BPF_CORE_READ_BITFIELD(s, __sk_common.skc_ipv6only);
}

// translate rewrites the destination of a caller's connect or datagram when
// it is an exposure, admitting it against the exposure's cap. a is the
// destination as IPv6; v6 says which view of ctx to rewrite.
static __always_inline int translate(struct bpf_sock_addr *ctx, const __u32 a[4], int v6, int connect)
{
	__u8 proto = ctx->protocol;
	if (proto != IPPROTO_TCP && proto != IPPROTO_UDP)
		return SK_ALLOW;
	__u16 port = ctx->user_port;
	struct bpf_sock *sk = ctx->sk;
	if (!sk)
		return SK_ALLOW;
	struct sock_xlate *x = bpf_sk_storage_get(&sock_socks, sk, 0, 0);
	struct sock_key k;
	struct sock_target *t = find(&k, a, port, proto);
	// native: an IPv6 caller to the guest's IPv6 address. Otherwise an
	// IPv6 caller needs a v4-mapped address: connect only (the kernel
	// refuses a sendmsg6 rewritten to one, ENOTSUPP), never IPV6_V6ONLY.
	struct sock_target6 *t6 = 0;
	if (t && v6) {
		t6 = bpf_map_lookup_elem(&sock_targets6, &k);
		if (t6 && is_zero6(t6->guest_ip6))
			t6 = 0;
	}
	int native = t6 != 0;
	if (!t || (v6 && !native && (!connect || v6only(sk, proto)))) {
		// A socket connecting somewhere else is no longer the
		// exposure's caller. (A datagram elsewhere changes nothing.)
		if (x && connect) {
			release_x(x);
			forget(sk, x);
		}
		return SK_ALLOW;
	}
	struct sock_xlate6 *x6 = 0;
	if (native) {
		// Made before admission: no place is ever held for a socket
		// whose translation could not be remembered.
		x6 = bpf_sk_storage_get(&sock_socks6, sk, 0, BPF_SK_STORAGE_GET_F_CREATE);
		if (!x6) {
			__u32 slot = t->slot;
			struct exposure_stat *st = bpf_map_lookup_elem(&exposure_stats, &slot);
			if (st)
				__sync_fetch_and_add(&st->refused, 1);
			bpf_set_retval(-ECONNREFUSED);
			return SK_REFUSE;
		}
	}
	__u32 slot = t->slot;
	struct exposure_stat *st = bpf_map_lookup_elem(&exposure_stats, &slot);
	struct exposure_limit *lim = bpf_map_lookup_elem(&exposure_limits, &slot);
	if (!st || !lim)
		return SK_ALLOW;
	int holds = x && (x->flags & (X_OPEN | X_RELEASED)) == X_OPEN && x->slot == slot && x->gen == lim->gen;
	if (!holds) {
		// No address of the family the caller goes to: like a guest
		// that cannot be reached.
		if ((t->flags & T_DOWN) || (!native && !t->guest_ip4)) {
			__sync_fetch_and_add(&st->dropped, 1);
			bpf_set_retval(-ECONNREFUSED);
			return SK_REFUSE;
		}
		if (x)
			release_x(x);
		brk_wake(slot);
		if (!brk_admit(st, lim)) {
			__sync_fetch_and_add(&st->refused, 1);
			bpf_set_retval(-ECONNREFUSED);
			return SK_REFUSE;
		}
		if (!x)
			x = bpf_sk_storage_get(&sock_socks, sk, 0, BPF_SK_STORAGE_GET_F_CREATE);
		if (!x) {
			// No memory to remember the socket: never hold a place
			// nobody would give back.
			brk_release(st, lim);
			__sync_fetch_and_add(&st->accepted, -1);
			__sync_fetch_and_add(&st->refused, 1);
			bpf_set_retval(-ECONNREFUSED);
			return SK_REFUSE;
		}
		x->slot = slot;
		x->gen = lim->gen;
		x->flags = X_OPEN;
	}
	__builtin_memcpy(x->orig, a, 16);
	x->orig_port = port;
	x->guest_port = t->guest_port;
	if (native && x6) {
		x->guest_ip4 = 0;
		__builtin_memcpy(x6->guest_ip6, t6->guest_ip6, 16);
		ctx->user_ip6[0] = t6->guest_ip6[0];
		ctx->user_ip6[1] = t6->guest_ip6[1];
		ctx->user_ip6[2] = t6->guest_ip6[2];
		ctx->user_ip6[3] = t6->guest_ip6[3];
	} else {
		forget(sk, x);
		x->guest_ip4 = t->guest_ip4;
		if (v6) {
			ctx->user_ip6[0] = 0;
			ctx->user_ip6[1] = 0;
			ctx->user_ip6[2] = bpf_htonl(0xffff);
			ctx->user_ip6[3] = t->guest_ip4;
		} else {
			ctx->user_ip4 = t->guest_ip4;
		}
	}
	ctx->user_port = t->guest_port;
	return SK_ALLOW;
}

static __always_inline int translate4(struct bpf_sock_addr *ctx, int connect)
{
	if (!in_scope(ctx))
		return SK_ALLOW;
	__u32 a[4] = {0, 0, bpf_htonl(0xffff), ctx->user_ip4};
	return translate(ctx, a, 0, connect);
}

static __always_inline int translate6(struct bpf_sock_addr *ctx, int connect)
{
	if (!in_scope(ctx))
		return SK_ALLOW;
	__u32 a[4] = {ctx->user_ip6[0], ctx->user_ip6[1], ctx->user_ip6[2], ctx->user_ip6[3]};
	return translate(ctx, a, 1, connect);
}

SEC("cgroup/connect4")
int brk_sock_connect4(struct bpf_sock_addr *ctx) { return translate4(ctx, 1); }

SEC("cgroup/connect6")
int brk_sock_connect6(struct bpf_sock_addr *ctx) { return translate6(ctx, 1); }

SEC("cgroup/sendmsg4")
int brk_sock_sendmsg4(struct bpf_sock_addr *ctx) { return translate4(ctx, 0); }

SEC("cgroup/sendmsg6")
int brk_sock_sendmsg6(struct bpf_sock_addr *ctx) { return translate6(ctx, 0); }

// untranslate shows the caller the address it dialled where the kernel
// reports the guest's (a datagram's source, the peer).
static __always_inline void untranslate(struct bpf_sock_addr *ctx, int v6)
{
	struct bpf_sock *sk = ctx->sk;
	if (!sk)
		return;
	struct sock_xlate *x = bpf_sk_storage_get(&sock_socks, sk, 0, 0);
	if (!x || ctx->user_port != x->guest_port)
		return;
	if (v6) {
		__u32 a[4] = {ctx->user_ip6[0], ctx->user_ip6[1], ctx->user_ip6[2], ctx->user_ip6[3]};
		struct sock_xlate6 *x6 = bpf_sk_storage_get(&sock_socks6, sk, 0, 0);
		if (x6 && !is_zero6(x6->guest_ip6)) {
			if (!eq6(a, x6->guest_ip6))
				return;
		} else if (!x->guest_ip4 || a[0] || a[1] || a[2] != bpf_htonl(0xffff) || a[3] != x->guest_ip4) {
			return;
		}
		ctx->user_ip6[0] = x->orig[0];
		ctx->user_ip6[1] = x->orig[1];
		ctx->user_ip6[2] = x->orig[2];
		ctx->user_ip6[3] = x->orig[3];
	} else {
		if (!x->guest_ip4 || ctx->user_ip4 != x->guest_ip4 || !is_mapped(x->orig))
			return;
		ctx->user_ip4 = x->orig[3];
	}
	ctx->user_port = x->orig_port;
}

SEC("cgroup/recvmsg4")
int brk_sock_recvmsg4(struct bpf_sock_addr *ctx)
{
	untranslate(ctx, 0);
	return 1;
}

SEC("cgroup/recvmsg6")
int brk_sock_recvmsg6(struct bpf_sock_addr *ctx)
{
	untranslate(ctx, 1);
	return 1;
}

SEC("cgroup/getpeername4")
int brk_sock_getpeername4(struct bpf_sock_addr *ctx)
{
	untranslate(ctx, 0);
	return 1;
}

SEC("cgroup/getpeername6")
int brk_sock_getpeername6(struct bpf_sock_addr *ctx)
{
	untranslate(ctx, 1);
	return 1;
}

SEC("cgroup/sock_release")
int brk_sock_release(struct bpf_sock *sk)
{
	struct sock_xlate *x = bpf_sk_storage_get(&sock_socks, sk, 0, 0);
	if (x)
		release_x(x);
	return 1;
}

// tcp_done_counts adds a finished TCP connection's payload: what the caller
// sent once (retransmissions excluded) and what it received (less the
// peer's FIN, which takes a sequence number).
static __always_inline void tcp_done_counts(struct bpf_sock *sk, struct sock_xlate *x, __u32 old_state)
{
	__u32 f = __sync_fetch_and_or(&x->flags, X_COUNTED);
	if (f & X_COUNTED)
		return;
	__u32 slot = x->slot;
	struct exposure_stat *st = bpf_map_lookup_elem(&exposure_stats, &slot);
	struct exposure_limit *lim = bpf_map_lookup_elem(&exposure_limits, &slot);
	if (!st || !lim || lim->gen != x->gen)
		return;
	if (old_state == BPF_TCP_SYN_SENT) {
		// Never connected: the guest refused or could not be reached.
		__sync_fetch_and_add(&st->dropped, 1);
		return;
	}
	struct tcp_sock *tp = bpf_skc_to_tcp_sock(sk);
	if (!tp)
		return;
	__u64 sent = tp->bytes_sent - tp->bytes_retrans;
	__u64 recv = tp->bytes_received;
	unsigned long skflags = tp->inet_conn.icsk_inet.sk.__sk_common.skc_flags;
	if ((skflags & (1UL << bpf_core_enum_value(enum sock_flags, SOCK_DONE))) && recv)
		recv--;
	if (sent)
		__sync_fetch_and_add(&st->bytes_in, sent);
	if (recv)
		__sync_fetch_and_add(&st->bytes_out, recv);
}

SEC("sockops")
int brk_sock_ops(struct bpf_sock_ops *skops)
{
	struct bpf_sock *sk = skops->sk;
	if (!sk)
		return 1;
	switch (skops->op) {
	case BPF_SOCK_OPS_TCP_CONNECT_CB: {
		struct sock_xlate *x = bpf_sk_storage_get(&sock_socks, sk, 0, 0);
		if (x && (x->flags & (X_OPEN | X_RELEASED)) == X_OPEN) {
			x->flags &= ~X_COUNTED;
			bpf_sock_ops_cb_flags_set(skops, skops->bpf_sock_ops_cb_flags | BPF_SOCK_OPS_STATE_CB_FLAG);
		}
		break;
	}
	case BPF_SOCK_OPS_STATE_CB: {
		if (skops->args[1] != BPF_TCP_CLOSE)
			break;
		struct sock_xlate *x = bpf_sk_storage_get(&sock_socks, sk, 0, 0);
		if (!x || !(x->flags & X_OPEN))
			break;
		tcp_done_counts(sk, x, skops->args[0]);
		release_x(x);
		break;
	}
	}
	return 1;
}

// udp_guest6 reads an IPv6 datagram's header: whether it is UDP (no
// extension headers: a guest's reply carries none) between a socket
// translated to x6's guest address and that guest.
static __always_inline int udp_guest6(struct __sk_buff *skb, struct bpf_sock *sk, int ingress, struct udphdr *uh)
{
	struct sock_xlate6 *x6 = bpf_sk_storage_get(&sock_socks6, sk, 0, 0);
	if (!x6 || is_zero6(x6->guest_ip6))
		return 0;
	struct ipv6hdr ip6;
	if (bpf_skb_load_bytes(skb, 0, &ip6, sizeof(ip6)) || ip6.nexthdr != IPPROTO_UDP ||
	    bpf_skb_load_bytes(skb, sizeof(ip6), uh, sizeof(*uh)))
		return 0;
	__u32 peer[4];
	__builtin_memcpy(peer, ingress ? (void *)&ip6.saddr : (void *)&ip6.daddr, 16);
	return eq6(peer, x6->guest_ip6);
}

// udp_count adds a UDP datagram's payload between a translated socket and
// its guest. Everything else leaves after the first test.
static __always_inline int udp_count(struct __sk_buff *skb, int ingress)
{
	struct bpf_sock *sk = skb->sk;
	if (!sk || (skb->protocol != bpf_htons(ETH_P_IP) && skb->protocol != bpf_htons(ETH_P_IPV6)))
		return 1;
	sk = bpf_sk_fullsock(sk);
	if (!sk || sk->protocol != IPPROTO_UDP)
		return 1;
	struct sock_xlate *x = bpf_sk_storage_get(&sock_socks, sk, 0, 0);
	if (!x || (x->flags & (X_OPEN | X_RELEASED)) != X_OPEN)
		return 1;
	struct udphdr uh;
	if (skb->protocol == bpf_htons(ETH_P_IPV6)) {
		if (!udp_guest6(skb, sk, ingress, &uh))
			return 1;
	} else {
		struct iphdr ip;
		if (!x->guest_ip4 || bpf_skb_load_bytes(skb, 0, &ip, sizeof(ip)))
			return 1;
		__u32 hl = ip.ihl * 4;
		if (ip.protocol != IPPROTO_UDP || bpf_skb_load_bytes(skb, hl, &uh, sizeof(uh)))
			return 1;
		if (ingress ? ip.saddr != x->guest_ip4 : ip.daddr != x->guest_ip4)
			return 1;
	}
	if (ingress ? uh.source != x->guest_port : uh.dest != x->guest_port)
		return 1;
	__u32 slot = x->slot;
	struct exposure_stat *st = bpf_map_lookup_elem(&exposure_stats, &slot);
	struct exposure_limit *lim = bpf_map_lookup_elem(&exposure_limits, &slot);
	if (!st || !lim || lim->gen != x->gen)
		return 1;
	__u32 n = bpf_ntohs(uh.len);
	if (n <= 8)
		return 1;
	if (ingress)
		__sync_fetch_and_add(&st->bytes_out, n - 8);
	else
		__sync_fetch_and_add(&st->bytes_in, n - 8);
	return 1;
}

SEC("cgroup_skb/ingress")
int brk_sock_ingress(struct __sk_buff *skb) { return udp_count(skb, 1); }

SEC("cgroup_skb/egress")
int brk_sock_egress(struct __sk_buff *skb) { return udp_count(skb, 0); }

char __license[] SEC("license") = "GPL";
