// SPDX-License-Identifier: GPL-2.0
/* TCP_NODELAY and TCP_CORK on local-path ends without a trapped syscall (tsor/sockopt_offload.py
 * says why and how the ends come to be in the cgroup these programs are attached to).
 *
 * A local-path end is an AF_UNIX socket, which has no TCP options: the kernel answers
 * setsockopt(SOL_TCP, TCP_CORK) on it with EOPNOTSUPP. These cgroup programs take the two options
 * on an AF_UNIX socket and keep their values as bits in the socket's own BPF storage (freed with
 * the socket: nothing to clean up), so a value set reads back as it does on TCP. Anything else —
 * another option or level, a TCP socket, a buffer too short for an int — is the kernel's.
 *
 * Built by `make install` (clang -target bpf), loaded by tsor/sockopt_offload.py through
 * qlib/libbpf.py; the programs' names carry the version it knows them by (a newer one replaces
 * older ones). */
#include <linux/bpf.h>
#include <linux/in.h>
#include <linux/tcp.h>
#include <bpf/bpf_helpers.h>

#define AF_UNIX 1           /* <sys/socket.h> is not for the BPF target */

enum { NODELAY_BIT = 1, CORK_BIT = 2 };

/* A store to one context field. The kernel accepts only 32-bit stores to optlen and retval; a
 * volatile store keeps clang from merging two neighbouring ones into one 64-bit store. */
#define CTX_SET(field, value) (*(volatile __s32 *)&(field) = (value))

/* per socket: the option bits set on it */
struct {
	__uint(type, BPF_MAP_TYPE_SK_STORAGE);
	__uint(map_flags, BPF_F_NO_PREALLOC);
	__type(key, int);
	__type(value, __u32);
} quark_sko SEC(".maps");

/* The option's bit, or 0 unless this is TCP_NODELAY or TCP_CORK on an AF_UNIX socket with room
 * for an int (a short one gets the kernel's answer, as the trap would give EINVAL). A cgroup sockopt
 * program runs for the cgroup of the process that made the socket, not the caller's. */
static __always_inline __u32 option_bit(struct bpf_sockopt *ctx)
{
	__u32 bit;

	if (ctx->level != IPPROTO_TCP)      /* SOL_TCP */
		return 0;
	if (ctx->optname == TCP_NODELAY)
		bit = NODELAY_BIT;
	else if (ctx->optname == TCP_CORK)
		bit = CORK_BIT;
	else
		return 0;
	if (ctx->sk->family != AF_UNIX || ctx->optlen < (int)sizeof(int))
		return 0;
	return bit;
}

/* setsockopt: record the value and set optlen to -1, which tells the kernel "answered: return 0
 * without running your handler". Returning 1 without that lets the kernel's handler run. */
SEC("cgroup/setsockopt")
int quark_sko2_set(struct bpf_sockopt *ctx)
{
	__u32 bit = option_bit(ctx);
	int *optval = ctx->optval;

	if (!bit || (void *)(optval + 1) > ctx->optval_end)
		return 1;
	int value = *optval;
	__u32 *bits = bpf_sk_storage_get(&quark_sko, ctx->sk, 0, BPF_SK_STORAGE_GET_F_CREATE);

	if (!bits)                          /* no memory for it: the kernel's EOPNOTSUPP */
		return 1;
	*bits = value ? *bits | bit : *bits & ~bit;   /* any non-zero is on, as on TCP */
	CTX_SET(ctx->optlen, -1);
	return 1;
}

/* getsockopt, which runs after the kernel's handler refused with EOPNOTSUPP: the recorded value
 * as an int (1 or 0; a fresh end reads 0), optlen 4, no error. */
SEC("cgroup/getsockopt")
int quark_sko2_get(struct bpf_sockopt *ctx)
{
	__u32 bit = option_bit(ctx);
	int *optval = ctx->optval;

	if (!bit || (void *)(optval + 1) > ctx->optval_end)
		return 1;
	__u32 *bits = bpf_sk_storage_get(&quark_sko, ctx->sk, 0, 0);

	*optval = bits && (*bits & bit);
	CTX_SET(ctx->optlen, sizeof(int));
	CTX_SET(ctx->retval, 0);
	return 1;
}

char LICENSE[] SEC("license") = "GPL";
