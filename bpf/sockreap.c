//go:build ignore

// SPDX-License-Identifier: GPL-2.0
//
// The socket path's counterpart of the nat path's conntrack flush: when an
// exposure's guest changes or the exposure goes, a host-local caller's
// socket that the connect hook sent to the old guest would go on talking to
// it (a connected UDP socket for good: cilium/cilium#12859). These socket
// iterators close such sockets (bpf_sock_destroy, Linux 6.5): a TCP
// connection is reset (ECONNABORTED here, a RST to the old guest) and its
// close hook gives the place back and counts its bytes; a connected UDP
// socket gets ECONNABORTED at its next call and is disconnected, its place
// given back here. A socket whose exposure still sends it where it went is
// left alone. The daemon runs them, in the managed namespace, after a pass
// that changed or deleted a translation; each socket closed writes one
// byte to the iterator's output.
#include "vmlinux.h"
#include <bpf/bpf_helpers.h>
#include <bpf/bpf_core_read.h>
#include <bpf/bpf_endian.h>
#include "socklb.h"

#define TCP_ESTABLISHED 1

extern int bpf_sock_destroy(struct sock_common *sk) __ksym;

// stale reports whether the translation x of sk no longer holds: the
// address dialled is no exposure now, or one that sends callers elsewhere
// (another guest address of the family the socket was sent to, another
// port), or the slot went to another exposure.
static __always_inline int stale(struct sock *sk, struct sock_xlate *x, __u8 proto)
{
	struct sock_key k;
	struct sock_target *t = find(&k, x->orig, x->orig_port, proto);
	if (!t || (t->flags & T_DOWN))
		return 1;
	if (t->guest_port != x->guest_port || t->slot != x->slot)
		return 1;
	if (x->guest_ip4) {
		if (t->guest_ip4 != x->guest_ip4)
			return 1;
	} else {
		// Sent to the guest's IPv6 address (live checked it has one).
		struct sock_xlate6 *x6 = bpf_sk_storage_get(&sock_socks6, sk, 0, 0);
		struct sock_target6 *t6 = bpf_map_lookup_elem(&sock_targets6, &k);
		if (!x6 || !t6 || !eq6(t6->guest_ip6, x6->guest_ip6))
			return 1;
	}
	__u32 slot = x->slot;
	struct exposure_limit *lim = bpf_map_lookup_elem(&exposure_limits, &slot);
	return !lim || lim->gen != x->gen;
}

// live is the socket's translation when it holds a place and was sent to
// a guest (its IPv4 address, or its IPv6 one in sock_socks6).
static __always_inline struct sock_xlate *live(struct sock *sk)
{
	struct sock_xlate *x = bpf_sk_storage_get(&sock_socks, sk, 0, 0);
	if (!x || (x->flags & (X_OPEN | X_RELEASED)) != X_OPEN)
		return 0;
	if (!x->guest_ip4) {
		struct sock_xlate6 *x6 = bpf_sk_storage_get(&sock_socks6, sk, 0, 0);
		if (!x6 || is_zero6(x6->guest_ip6))
			return 0;
	}
	return x;
}

SEC("iter/tcp")
int brk_sock_reap_tcp(struct bpf_iter__tcp *ctx)
{
	struct sock_common *skc = ctx->sk_common;
	if (!skc)
		return 0;
	struct tcp_sock *tp = bpf_skc_to_tcp_sock(skc);
	if (!tp)
		return 0; // a request or time-wait socket: no caller's
	struct sock *sk = (struct sock *)tp;
	struct sock_xlate *x = live(sk);
	if (!x || !stale(sk, x, IPPROTO_TCP))
		return 0;
	if (bpf_sock_destroy(skc))
		return 0;
	// The close hook (sockops, TCP_CLOSE) counted the bytes and gave the
	// place back; this is a no-op unless it did not run.
	release_x(x);
	bpf_seq_write(ctx->meta->seq, "t", 1);
	return 0;
}

SEC("iter/udp")
int brk_sock_reap_udp(struct bpf_iter__udp *ctx)
{
	struct udp_sock *udp = ctx->udp_sk;
	if (!udp)
		return 0;
	struct sock *sk = (struct sock *)udp;
	// Connected sockets only: an unconnected one is translated again at
	// every sendmsg, so it follows the exposure by itself.
	if (sk->__sk_common.skc_state != TCP_ESTABLISHED)
		return 0;
	struct sock_xlate *x = live(sk);
	if (!x || !stale(sk, x, IPPROTO_UDP))
		return 0;
	if (bpf_sock_destroy((struct sock_common *)sk))
		return 0;
	release_x(x); // no close follows: the socket stays open, disconnected
	x->guest_ip4 = 0;
	struct sock_xlate6 *x6 = bpf_sk_storage_get(&sock_socks6, sk, 0, 0);
	if (x6)
		__builtin_memset(x6->guest_ip6, 0, 16);
	bpf_seq_write(ctx->meta->seq, "u", 1);
	return 0;
}

char __license[] SEC("license") = "GPL";
