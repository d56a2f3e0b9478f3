// SPDX-License-Identifier: GPL-2.0
/* The sockmap local path's kernel side (tsor/sockmap.py says what the path is and the rules that
 * keep it safe): a SOCK_OPS program on the unified hierarchy's root puts each end of a connection
 * between two registered quark pods into `quark_smap_pairs` when it becomes established, and an
 * SK_MSG program on that map hands each sendmsg of such an end to its peer's receive queue.
 *
 * Built by `make install` (clang -target bpf), loaded by tsor/sockmap.py through qlib/libbpf.py.
 * The programs' names carry the version tsor/sockmap.py knows them by: a tsord taking over finds
 * them attached by name. The maps' key and value layouts are the ones tsor/sockmap.py reads and
 * writes. IPv4 only (and IPv4-mapped ends of AF_INET6 sockets); everything else takes the stack. */
#include <linux/bpf.h>
#include <bpf/bpf_helpers.h>
#include <bpf/bpf_endian.h>

/* <sys/socket.h> is not for the BPF target; these are the kernel's numbers */
#define AF_INET 2
#define AF_INET6 10

enum way { WAY_UNDECIDED, WAY_STACK, WAY_REDIRECT };

/* An end as its own socket sees it: the key it is inserted under. remote_port is as the context
 * gives it (network order in the high 16 bits), local_port too (host order): the peer's key is
 * made from the same fields, swapped and converted. */
struct pair_key {
	__u32 local_ip4;
	__u32 remote_ip4;
	__u32 local_port;
	__u32 remote_port;
};

/* address of a registered quark pod -> its network namespace's cookie (tsord keeps it) */
struct {
	__uint(type, BPF_MAP_TYPE_HASH);
	__uint(max_entries, 16384);
	__uint(map_flags, BPF_F_NO_PREALLOC);
	__type(key, __u32);
	__type(value, __u64);
} quark_smap_addrs SEC(".maps");

/* the carried ends; a user-space lookup answers the socket's cookie (a u64 value) */
struct {
	__uint(type, BPF_MAP_TYPE_SOCKHASH);
	__uint(max_entries, 65536);
	__type(key, struct pair_key);
	__type(value, __u64);
} quark_smap_pairs SEC(".maps");

/* each end's way (enum way), decided on its first message; freed with the socket */
struct {
	__uint(type, BPF_MAP_TYPE_SK_STORAGE);
	__uint(map_flags, BPF_F_NO_PREALLOC);
	__type(key, int);
	__type(value, __u32);
} quark_smap_ways SEC(".maps");

/* A context field read as one 32-bit load. The kernel rewrites context loads and refuses most
 * narrower ones; a volatile read keeps clang from turning `port >> 16` into a 16-bit load. */
#define CTX_U32(field) (*(volatile __u32 *)&(field))

/* Both addresses of an AF_INET6 end are IPv4-mapped (::ffff:a.b.c.d: a dual-stack listener's
 * connection from an IPv4 peer, as Go's and Java's servers make by default); then remote_ip4 and
 * local_ip4 read the socket's IPv4 addresses. A truly IPv6 end holds a placeholder there. */
static __always_inline int ipv4_mapped(const __u32 *ip6)
{
	return CTX_U32(ip6[0]) == 0 && CTX_U32(ip6[1]) == 0 && CTX_U32(ip6[2]) == bpf_htonl(0x0000ffff);
}

/* On an end becoming established: into the pairs map when both addresses are registered quark
 * pods' and the local one is registered for this socket's network namespace. Two pods' loopback
 * connections, or an address reused in another namespace, never enter; an existing entry is never
 * replaced (BPF_NOEXIST). */
SEC("sockops")
int quark_smap2_ops(struct bpf_sock_ops *ops)
{
	__u32 op = CTX_U32(ops->op);

	if (op != BPF_SOCK_OPS_ACTIVE_ESTABLISHED_CB) {
		if (op != BPF_SOCK_OPS_PASSIVE_ESTABLISHED_CB)
			return 1;
		/* Data already queued before it was established (TCP Fast Open data in the SYN): a
		 * later redirected message could be read before it, so this end takes the stack. */
		if (ops->bytes_received)
			return 1;
	}
	__u32 family = CTX_U32(ops->family);

	if (family == AF_INET6) {
		if (!ipv4_mapped(ops->local_ip6) || !ipv4_mapped(ops->remote_ip6))
			return 1;
	} else if (family != AF_INET) {
		return 1;
	}
	__u64 netns = bpf_get_netns_cookie(ops);
	__u32 local = CTX_U32(ops->local_ip4), remote = CTX_U32(ops->remote_ip4);
	__u64 *cookie = bpf_map_lookup_elem(&quark_smap_addrs, &local);

	if (!cookie || *cookie != netns)          /* not a pod's, or another namespace's address */
		return 1;
	if (!bpf_map_lookup_elem(&quark_smap_addrs, &remote))
		return 1;
	struct pair_key key = {
		.local_ip4 = local,
		.remote_ip4 = remote,
		.local_port = CTX_U32(ops->local_port),
		.remote_port = CTX_U32(ops->remote_port),
	};
	bpf_sock_hash_update(ops, &quark_smap_pairs, &key, BPF_NOEXIST);
	return 1;
}

/* Each sendmsg of an end in the pairs map: to the peer end's receive queue (the key reversed) if
 * the end's first message went there, through the stack if its first message did. The first
 * message decides and the choice sticks: otherwise a message sent through the stack before the
 * peer's end was inserted could be read after a later, redirected one. The kernel copies the
 * map's programs into each end's psock when it enters the map, so an end keeps this program, and
 * with it this storage map and its way, for its life, whatever program a later tsord attaches. */
SEC("sk_msg")
int quark_smap2_msg(struct sk_msg_md *msg)
{
	/* only ends the sock_ops program put in the map come here: IPv4, or IPv4-mapped AF_INET6 */
	__u32 family = CTX_U32(msg->family);

	if (family != AF_INET && family != AF_INET6)
		return SK_PASS;
	struct bpf_sock *sk = msg->sk;

	if (!sk)
		return SK_PASS;
	__u32 *way = bpf_sk_storage_get(&quark_smap_ways, sk, 0, BPF_SK_STORAGE_GET_F_CREATE);

	if (!way)                                 /* no memory for it: the stack */
		return SK_PASS;
	__u32 decided = *way;

	if (decided == WAY_STACK)
		return SK_PASS;
	struct pair_key peer = {                  /* the peer's own key: its local address is our remote */
		.local_ip4 = CTX_U32(msg->remote_ip4),
		.remote_ip4 = CTX_U32(msg->local_ip4),
		.local_port = bpf_ntohs(CTX_U32(msg->remote_port) >> 16),          /* its port, host order */
		.remote_port = (__u32)bpf_htons(CTX_U32(msg->local_port)) << 16,   /* ours, network << 16 */
	};

	if (bpf_msg_redirect_hash(msg, &quark_smap_pairs, &peer, BPF_F_INGRESS) == SK_PASS) {
		if (decided != WAY_REDIRECT)
			*way = WAY_REDIRECT;
		return SK_PASS;
	}
	/* Undecided: the stack from now on. Decided for redirect and the peer gone from the map (it
	 * closed): the stack too, where its kernel answers with a reset as it would have. */
	if (decided == WAY_UNDECIDED)
		*way = WAY_STACK;
	return SK_PASS;
}

char LICENSE[] SEC("license") = "GPL";
