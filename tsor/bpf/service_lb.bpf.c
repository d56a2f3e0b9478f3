// SPDX-License-Identifier: GPL-2.0
/* Services chosen at connect() (tsor/service_lb.py says what the path is and why): a cgroup
 * connect4 program on the unified hierarchy's root rewrites a quark pod's TCP connect() to a
 * Service ClusterIP:port into a connect() to one of its ready endpoints, chosen at random as
 * kube-proxy chooses (a Service with sessionAffinity: ClientIP: the endpoint the same pod had,
 * while it has connected within the timeout), and a getpeername4 program makes that socket's
 * getpeername() answer the ClusterIP:port it dialled. A Service with no ready endpoint refuses the connect (ECONNREFUSED,
 * as kube-proxy's REJECT rule answers). The connection itself is then the kernel's, between the
 * two pods' own addresses: the sockmap path (sockmap.bpf.c) carries it when both are quark pods
 * of this node, the node's packet filters see it as the pod-to-pod connection it is.
 *
 * Built by `make install` (clang -target bpf), loaded by tsor/service_lb.py through
 * qlib/libbpf.py. The programs' names carry the version tsor/service_lb.py knows them by; the
 * maps' layouts are the ones it reads and writes. IPv4 TCP only: everything else is left to the
 * node (kube-proxy's NAT). */
#include <linux/bpf.h>
#include <bpf/bpf_helpers.h>

#define SOCK_STREAM 1
#define IPPROTO_TCP 6
#define ECONNREFUSED 111

/* network namespaces of the quark pods registered with tsord (cookie -> 1): whose connects are
 * looked at; every other socket of the node is left as it is */
struct {
	__uint(type, BPF_MAP_TYPE_HASH);
	__uint(max_entries, 16384);
	__uint(map_flags, BPF_F_NO_PREALLOC);
	__type(key, __u64);
	__type(value, __u8);
} quark_lb_netns SEC(".maps");

/* ports in network order, as the context gives them (the low 16 bits of user_port) */
struct service_key {
	__u32 ip4;
	__u16 port;
	__u16 pad;
};

struct service {
	__u32 count;          /* ready endpoints (0: it refuses connections) */
	__u32 affinity_s;     /* sessionAffinity: ClientIP's timeout in seconds; 0: none */
};

/* a Service port -> its endpoints' count and affinity */
struct {
	__uint(type, BPF_MAP_TYPE_HASH);
	__uint(max_entries, 65536);
	__uint(map_flags, BPF_F_NO_PREALLOC);
	__type(key, struct service_key);
	__type(value, struct service);
} quark_lb_svcs SEC(".maps");

struct backend_key {
	__u32 ip4;
	__u16 port;
	__u16 index;          /* 0 .. count - 1 */
};

struct endpoint {
	__u32 ip4;
	__u16 port;
	__u16 pad;
};

/* (Service port, index) -> an endpoint. tsord writes a Service's endpoints before its count when
 * they grow, and its count before it deletes endpoints when they shrink: an index below the count
 * read is there, but for a race with a change in flight, which leaves the connect to the node */
struct {
	__uint(type, BPF_MAP_TYPE_HASH);
	__uint(max_entries, 262144);
	__uint(map_flags, BPF_F_NO_PREALLOC);
	__type(key, struct backend_key);
	__type(value, struct endpoint);
} quark_lb_backs SEC(".maps");

/* sessionAffinity: ClientIP: (the client pod, by its network namespace's cookie; the Service port)
 * -> the endpoint it was given and when it last connected. kube-proxy keys it by the client's
 * address, which a socket has not chosen yet at connect(): a pod's namespace holds its address. */
struct affinity_key {
	__u64 netns;
	__u32 ip4;
	__u16 port;
	__u16 pad;
};

struct affinity {
	__u64 last_ns;        /* bpf_ktime_get_ns() of its last connect */
	__u32 ip4;
	__u16 port;
	__u16 index;          /* where it was among the endpoints: checked against them on reuse */
};

struct {
	__uint(type, BPF_MAP_TYPE_LRU_HASH);
	__uint(max_entries, 65536);
	__type(key, struct affinity_key);
	__type(value, struct affinity);
} quark_lb_sticky SEC(".maps");

/* a socket whose connect was rewritten: the ClusterIP and port it dialled; freed with the socket */
struct {
	__uint(type, BPF_MAP_TYPE_SK_STORAGE);
	__uint(map_flags, BPF_F_NO_PREALLOC);
	__type(key, int);
	__type(value, struct endpoint);
} quark_lb_origs SEC(".maps");

#define CTX_U32(field) (*(volatile __u32 *)&(field))

SEC("cgroup/connect4")
int quark_lb2_conn(struct bpf_sock_addr *ctx)
{
	if (CTX_U32(ctx->type) != SOCK_STREAM || CTX_U32(ctx->protocol) != IPPROTO_TCP)
		return 1;
	__u64 netns = bpf_get_netns_cookie(ctx);

	if (!bpf_map_lookup_elem(&quark_lb_netns, &netns))
		return 1;
	struct bpf_sock *sk = ctx->sk;

	if (!sk)
		return 1;
	struct service_key key = {.ip4 = CTX_U32(ctx->user_ip4), .port = (__u16)CTX_U32(ctx->user_port)};
	struct service *svc = bpf_map_lookup_elem(&quark_lb_svcs, &key);
	struct endpoint *orig;

	if (!svc) {
		/* not a Service: a socket connected again after a rewritten connect answers its own peer */
		orig = bpf_sk_storage_get(&quark_lb_origs, sk, 0, 0);
		if (orig)
			orig->ip4 = 0;
		return 1;
	}
	__u32 n = svc->count, affinity_s = svc->affinity_s;

	if (n == 0) {                 /* no ready endpoint: refused, as kube-proxy's REJECT answers */
		bpf_set_retval(-ECONNREFUSED);
		return 0;
	}
	struct backend_key bkey = {.ip4 = key.ip4, .port = key.port, .index = bpf_get_prandom_u32() % n};
	struct affinity_key akey = {.netns = netns, .ip4 = key.ip4, .port = key.port};
	__u64 now = bpf_ktime_get_ns();
	struct affinity *stuck = 0;
	struct endpoint *ep;

	if (affinity_s) {             /* the endpoint this pod had, if still there and not timed out */
		stuck = bpf_map_lookup_elem(&quark_lb_sticky, &akey);
		if (stuck && stuck->index < n && now - stuck->last_ns < (__u64)affinity_s * 1000000000ULL) {
			struct backend_key skey = {.ip4 = key.ip4, .port = key.port, .index = stuck->index};

			ep = bpf_map_lookup_elem(&quark_lb_backs, &skey);
			if (ep && ep->ip4 == stuck->ip4 && ep->port == stuck->port)
				bkey.index = stuck->index;
		}
	}
	ep = bpf_map_lookup_elem(&quark_lb_backs, &bkey);
	if (!ep)                      /* the Service changing under us: the node's NAT decides */
		return 1;
	if (affinity_s) {
		struct affinity now_stuck = {.last_ns = now, .ip4 = ep->ip4, .port = ep->port, .index = bkey.index};

		bpf_map_update_elem(&quark_lb_sticky, &akey, &now_stuck, BPF_ANY);
	}
	orig = bpf_sk_storage_get(&quark_lb_origs, sk, 0, BPF_SK_STORAGE_GET_F_CREATE);
	if (!orig)                    /* no memory for it: not rewritten (getpeername could not answer) */
		return 1;
	orig->ip4 = key.ip4;
	orig->port = key.port;
	ctx->user_ip4 = ep->ip4;
	ctx->user_port = ep->port;
	return 1;
}

SEC("cgroup/getpeername4")
int quark_lb2_peer(struct bpf_sock_addr *ctx)
{
	struct bpf_sock *sk = ctx->sk;

	if (!sk)
		return 1;
	struct endpoint *orig = bpf_sk_storage_get(&quark_lb_origs, sk, 0, 0);

	if (orig && orig->ip4) {
		ctx->user_ip4 = orig->ip4;
		ctx->user_port = orig->port;
	}
	return 1;                     /* (getpeername4 programs must return 1) */
}

char LICENSE[] SEC("license") = "GPL";
