// SPDX-License-Identifier: GPL-2.0
/* A quark pod's connection takes its path at connect() (tsor/service_lb.py and tsor/remote_path.py
 * say what each path is and why). A cgroup connect4 program on the unified hierarchy's root:
 * - a Service ClusterIP:port becomes one of its ready endpoints, chosen at random as kube-proxy
 *   chooses (a Service with sessionAffinity: ClientIP: the endpoint the same pod had, while it has
 *   connected within the timeout); no ready endpoint refuses the connect (ECONNREFUSED, as
 *   kube-proxy's REJECT rule answers);
 * - then a pod of another node that this node has an RDMA link to (the remote map, by pod CIDR),
 *   where NetworkPolicy allows it (tsord's verdict, cached per pod namespace, endpoint and route
 *   generation; none yet: native, and the miss noted for tsord), is dialled at this node's pump
 *   listener instead: the compiled pump (tsor/transport/rdma_pump.c) accepts it, finds where it was
 *   going in the conns map (which a sock_ops program fills once the connection is established), and
 *   carries it over the link to the far node's pump, which connects to the pod itself;
 * - everything else is untouched.
 * A getpeername4 program makes a rewritten socket's getpeername() answer what it dialled, and a
 * server pod's accept()/getpeername() of a connection the far pump made answer the client pod's
 * address (the peers map, which that pump fills before it connects).
 * The connection between pods of this node is then the kernel's own, spliced by the sockmap path
 * (sockmap.bpf.c) when both are quark pods, seen by the node's packet filters as pod-to-pod.
 *
 * Built by `make install` (clang -target bpf), loaded by tsor/service_lb.py through
 * qlib/libbpf.py. The programs' names carry the version tsor/service_lb.py knows them by; the
 * maps' layouts are the ones it, tsor/remote_path.py and the pump read and write. IPv4 TCP only:
 * everything else is left to the node (kube-proxy's NAT, the kernel's routing). */
#include <linux/bpf.h>
#include <bpf/bpf_helpers.h>
#include <bpf/bpf_endian.h>

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

/* a socket whose connect was rewritten: what it dialled (ClusterIP or pod), and when it was sent
 * to the pump, the pod it goes to and over which link; freed with the socket */
struct orig {
	__u32 ip4;            /* 0: not rewritten (a socket connected again) */
	__u16 port;
	__u16 link;
	__u32 target_ip4;
	__u16 target_port;
	__u16 pumped;
};

struct {
	__uint(type, BPF_MAP_TYPE_SK_STORAGE);
	__uint(map_flags, BPF_F_NO_PREALLOC);
	__type(key, int);
	__type(value, struct orig);
} quark_lb_origs SEC(".maps");

/* another node's pod CIDR -> this node's pump listener and the link to that node (tsord writes an
 * entry while the link is up) */
struct remote_key {
	__u32 prefixlen;
	__u32 ip4;
};

struct remote {
	__u32 pump_ip4;
	__u16 pump_port;      /* network order */
	__u16 link;           /* the pump's link id */
};

struct {
	__uint(type, BPF_MAP_TYPE_LPM_TRIE);
	__uint(max_entries, 4096);
	__uint(map_flags, BPF_F_NO_PREALLOC);
	__type(key, struct remote_key);
	__type(value, struct remote);
} quark_lb_remote SEC(".maps");

/* the pump's link id -> connections it has room for now (channel slots free, less a reserve); a
 * pumped connect takes one, the pump writes the count again as its slots change. None: native (a
 * connection past what the link can carry takes the stack rather than a reset) */
struct {
	__uint(type, BPF_MAP_TYPE_ARRAY);
	__uint(max_entries, 1024);
	__type(key, __u32);
	__type(value, __s32);
} quark_lb_room SEC(".maps");

/* [0]: the pump's listening socket, while it listens: the kernel takes it out when it closes (tsord
 * gone), and from then on connects to other nodes are native, not refused */
struct {
	__uint(type, BPF_MAP_TYPE_SOCKMAP);
	__uint(max_entries, 1);
	__type(key, __u32);
	__type(value, __u64);
} quark_lb_pump SEC(".maps");

/* NetworkPolicy's verdict for (client pod by its namespace, endpoint) at a route generation */
struct verdict_key {
	__u64 netns;
	__u32 ip4;
	__u16 port;
	__u16 pad;
};

struct verdict {
	__u32 generation;
	__u32 allow;
};

struct {
	__uint(type, BPF_MAP_TYPE_HASH);
	__uint(max_entries, 65536);
	__uint(map_flags, BPF_F_NO_PREALLOC);
	__type(key, struct verdict_key);
	__type(value, struct verdict);
} quark_lb_policy SEC(".maps");

/* the verdicts connects found missing (or of an older generation): tsord decides them */
struct {
	__uint(type, BPF_MAP_TYPE_LRU_HASH);
	__uint(max_entries, 4096);
	__type(key, struct verdict_key);
	__type(value, __u32);
} quark_lb_misses SEC(".maps");

/* [0]: the route generation verdicts must carry, and whether NetworkPolicy applies at all */
struct config {
	__u32 generation;
	__u32 policy;         /* 0: no NetworkPolicy (routes from a file): every pumped connect allowed */
};

struct {
	__uint(type, BPF_MAP_TYPE_ARRAY);
	__uint(max_entries, 1);
	__type(key, __u32);
	__type(value, struct config);
} quark_lb_config SEC(".maps");

/* a connection sent to the pump, by the client pod's own address: where it goes (the sock_ops
 * program writes it once established, before the pump's accept returns; the pump takes it out) */
struct conn_key {
	__u32 ip4;
	__u16 port;           /* network order */
	__u16 pad;
};

struct conn {
	__u32 ip4;
	__u16 port;           /* network order */
	__u16 link;
};

struct {
	__uint(type, BPF_MAP_TYPE_LRU_HASH);
	__uint(max_entries, 65536);
	__type(key, struct conn_key);
	__type(value, struct conn);
} quark_lb_conns SEC(".maps");

/* a connection the far node's pump made to a pod here, by the pod's end (its address and the
 * pump's, ports in network order): the client pod's address, which accept() and getpeername()
 * answer (the pump writes it before it connects and deletes it when the connection ends) */
struct peer_key {
	__u32 local_ip4;
	__u32 remote_ip4;
	__u16 local_port;
	__u16 remote_port;
};

struct {
	__uint(type, BPF_MAP_TYPE_LRU_HASH);
	__uint(max_entries, 65536);
	__type(key, struct peer_key);
	__type(value, struct endpoint);
} quark_lb_peers SEC(".maps");

#define CTX_U32(field) (*(volatile __u32 *)&(field))

/* Whether NetworkPolicy lets this pod's connect to `ep` skip the node's filters (into the pump);
 * no verdict of this generation yet: not now (native), and tsord is asked through the misses map */
static __always_inline int allowed(__u64 netns, __u32 ip4, __u16 port)
{
	__u32 zero = 0;
	struct config *cfg = bpf_map_lookup_elem(&quark_lb_config, &zero);

	if (!cfg)
		return 0;
	if (!cfg->policy)
		return 1;
	struct verdict_key key = {.netns = netns, .ip4 = ip4, .port = port};
	struct verdict *v = bpf_map_lookup_elem(&quark_lb_policy, &key);

	if (v && v->generation == cfg->generation)
		return v->allow;
	__u32 one = 1;

	bpf_map_update_elem(&quark_lb_misses, &key, &one, BPF_NOEXIST);
	return 0;
}

/* One of the link's free channels for this connect; none: native. Concurrent connects may take a
 * few past zero before they see it (the pump's reserve covers them). */
static __always_inline int pump_listens(void)
{
	__u32 zero = 0;
	struct bpf_sock *listener = bpf_map_lookup_elem(&quark_lb_pump, &zero);

	if (!listener)
		return 0;
	bpf_sk_release(listener);
	return 1;
}

static __always_inline int room_taken(__u32 link)
{
	__s32 *room = bpf_map_lookup_elem(&quark_lb_room, &link);

	if (!room || *room <= 0)
		return 0;
	__sync_fetch_and_add(room, -1);
	return 1;
}

SEC("cgroup/connect4")
int quark_lb3_conn(struct bpf_sock_addr *ctx)
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
	struct orig *orig = bpf_sk_storage_get(&quark_lb_origs, sk, 0, 0);

	if (orig) {                   /* a socket connected again answers its own peer unless rewritten now */
		orig->ip4 = 0;
		orig->pumped = 0;
	}
	struct endpoint target = {.ip4 = key.ip4, .port = key.port};
	struct service *svc = bpf_map_lookup_elem(&quark_lb_svcs, &key);

	if (svc) {
		__u32 n = svc->count, affinity_s = svc->affinity_s;

		if (n == 0) {         /* no ready endpoint: refused, as kube-proxy's REJECT answers */
			bpf_set_retval(-ECONNREFUSED);
			return 0;
		}
		struct backend_key bkey = {.ip4 = key.ip4, .port = key.port, .index = bpf_get_prandom_u32() % n};
		struct affinity_key akey = {.netns = netns, .ip4 = key.ip4, .port = key.port};
		__u64 now = bpf_ktime_get_ns();
		struct affinity *stuck = 0;
		struct endpoint *ep;

		if (affinity_s) {     /* the endpoint this pod had, if still there and not timed out */
			stuck = bpf_map_lookup_elem(&quark_lb_sticky, &akey);
			if (stuck && stuck->index < n && now - stuck->last_ns < (__u64)affinity_s * 1000000000ULL) {
				struct backend_key skey = {.ip4 = key.ip4, .port = key.port, .index = stuck->index};

				ep = bpf_map_lookup_elem(&quark_lb_backs, &skey);
				if (ep && ep->ip4 == stuck->ip4 && ep->port == stuck->port)
					bkey.index = stuck->index;
			}
		}
		ep = bpf_map_lookup_elem(&quark_lb_backs, &bkey);
		if (!ep)              /* the Service changing under us: the node's NAT decides */
			return 1;
		if (affinity_s) {
			struct affinity now_stuck = {.last_ns = now, .ip4 = ep->ip4, .port = ep->port, .index = bkey.index};

			bpf_map_update_elem(&quark_lb_sticky, &akey, &now_stuck, BPF_ANY);
		}
		target.ip4 = ep->ip4;
		target.port = ep->port;
	}
	struct remote_key rkey = {.prefixlen = 32, .ip4 = target.ip4};
	struct remote *remote = bpf_map_lookup_elem(&quark_lb_remote, &rkey);
	int pumped = remote && pump_listens() && allowed(netns, target.ip4, target.port) && room_taken(remote->link);

	if (!svc && !pumped)
		return 1;
	orig = bpf_sk_storage_get(&quark_lb_origs, sk, 0, BPF_SK_STORAGE_GET_F_CREATE);
	if (!orig)                    /* no memory for it: not rewritten (getpeername could not answer) */
		return 1;
	orig->ip4 = key.ip4;
	orig->port = key.port;
	if (pumped) {
		orig->target_ip4 = target.ip4;
		orig->target_port = target.port;
		orig->link = remote->link;
		orig->pumped = 1;
		ctx->user_ip4 = remote->pump_ip4;
		ctx->user_port = remote->pump_port;
	} else {
		ctx->user_ip4 = target.ip4;
		ctx->user_port = target.port;
	}
	return 1;
}

SEC("cgroup/getpeername4")
int quark_lb3_peer(struct bpf_sock_addr *ctx)
{
	struct bpf_sock *sk = ctx->sk;

	if (!sk)
		return 1;
	struct orig *orig = bpf_sk_storage_get(&quark_lb_origs, sk, 0, 0);

	if (orig && orig->ip4) {
		ctx->user_ip4 = orig->ip4;
		ctx->user_port = orig->port;
		return 1;
	}
	/* a pod's end of a connection the far node's pump made to it: the client pod's address */
	__u64 netns = bpf_get_netns_cookie(ctx);

	if (!bpf_map_lookup_elem(&quark_lb_netns, &netns))
		return 1;
	struct peer_key pkey = {
		.local_ip4 = sk->src_ip4,
		.remote_ip4 = CTX_U32(ctx->user_ip4),
		.local_port = bpf_htons((__u16)sk->src_port),
		.remote_port = (__u16)CTX_U32(ctx->user_port),
	};
	struct endpoint *client = bpf_map_lookup_elem(&quark_lb_peers, &pkey);

	if (client) {
		ctx->user_ip4 = client->ip4;
		ctx->user_port = client->port;
	}
	return 1;                     /* (getpeername4 programs must return 1) */
}

/* A connection sent to the pump, once established (before the pump's accept() can return it):
 * where it goes, by the client's own address, for the pump */
SEC("sockops")
int quark_lb3_ops(struct bpf_sock_ops *ops)
{
	if (CTX_U32(ops->op) != BPF_SOCK_OPS_ACTIVE_ESTABLISHED_CB)
		return 1;
	struct bpf_sock *sk = ops->sk;

	if (!sk)
		return 1;
	struct orig *orig = bpf_sk_storage_get(&quark_lb_origs, sk, 0, 0);

	if (!orig || !orig->pumped)
		return 1;
	struct conn_key key = {.ip4 = CTX_U32(ops->local_ip4), .port = bpf_htons((__u16)CTX_U32(ops->local_port))};
	struct conn value = {.ip4 = orig->target_ip4, .port = orig->target_port, .link = orig->link};

	bpf_map_update_elem(&quark_lb_conns, &key, &value, BPF_ANY);
	return 1;
}

char LICENSE[] SEC("license") = "GPL";
