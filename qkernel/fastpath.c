/* QKernel's compiled fast path: the seccomp receiver loop, answering the per-request socket option
 * calls of TSoR's local path without Python.
 *
 * A server like nginx (Debian's default tcp_nopush) sets TCP_CORK on and off around every response.
 * On a local-path socket (an AF_UNIX end underneath, which has no TCP options) QKernel must answer
 * those calls itself, and through Python each answer cost the supervisor several times what it
 * costs here: a readlink, a 4-byte process_vm_readv and two ioctls (supervisor CPU per 10k nginx
 * requests before and after: bench/README.md, "TSoR", "What the numbers say (issue 13)").
 *
 * qfp_serve() blocks in SECCOMP_IOCTL_NOTIF_RECV (called through ctypes, so without the GIL) and
 * answers setsockopt(fd, IPPROTO_TCP, TCP_NODELAY or TCP_CORK, ...) when fd's socket inode is in
 * the table of local-path sockets Python keeps here (qfp_add / qfp_remove); the value is recorded
 * as TCP records it (0 or 1), and Python reads it back for getsockopt (qfp_get). Every other
 * notification is copied to the caller and qfp_serve returns: Python dispatches it as before.
 * Anything unexpected (a bad pointer, a table miss) also goes to Python, which knows every rule.
 *
 * sendmsg/sendmmsg are trapped in a sandbox TSoR serves only for what a local-path end (an AF_UNIX
 * socket underneath, where TCP has none) would carry and TCP does not: file descriptors and
 * credentials in a control buffer. Here every call on any other fd, and every sendmsg on an end
 * without a control buffer, is let through at once (CONTINUE); the rest goes to Python, which sends
 * the bytes and drops the control as TCP does. The inodes of the ends are a second table (qfp_end_*).
 * A thread that rewrites its msghdr between this check and the kernel's own read of it meets the
 * ends' SO_PASSRIGHTS 0 (EPERM, Linux 6.16+): never an fd across. Where the kernel has no
 * SO_PASSRIGHTS (strict), every sendmsg on an end goes to Python, which sends it itself: no second
 * read of the task's memory for a thread to race.
 *
 * qfp_held_elsewhere() is TSoR's check before it swaps a connecting socket (tsor/_sys.py has the
 * same in Python): one readlink per fd of the task and a read of each epoll set's fdinfo, a
 * third of the connect handler's time in Python when the task holds a few dozen fds (wrk).
 */
#define _GNU_SOURCE
#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <linux/seccomp.h>
#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/ioctl.h>
#include <sys/socket.h>
#include <sys/uio.h>
#include <unistd.h>

#define CAPACITY (1 << 16)          /* local-path sockets one sandbox holds at once, at most */
#define EMPTY 0
#define TOMBSTONE ((uint64_t)-1)

struct entry { uint64_t ino; int32_t nodelay, cork; };

static struct entry table[CAPACITY];
static struct entry ends[CAPACITY];  /* local-path ends: only .ino is used */
static int nr_sendmsg = -1, nr_sendmmsg = -1;
static int ends_strict;              /* every sendmsg on an end to Python: the kernel cannot refuse fds */
static pthread_mutex_t lock = PTHREAD_MUTEX_INITIALIZER;
static int nr_setsockopt = -1;
static uint32_t audit_arch;
static uint64_t answered;           /* calls answered here (tests and `quark` diagnostics read it) */

#ifndef SECCOMP_IOCTL_NOTIF_RECV
#define SECCOMP_IOCTL_NOTIF_RECV _IOWR('!', 0, struct seccomp_notif)
#define SECCOMP_IOCTL_NOTIF_SEND _IOWR('!', 1, struct seccomp_notif_resp)
#define SECCOMP_IOCTL_NOTIF_ID_VALID _IOW('!', 2, __u64)
#endif
#ifndef SECCOMP_USER_NOTIF_FLAG_CONTINUE
#define SECCOMP_USER_NOTIF_FLAG_CONTINUE (1UL << 0)
#endif

static struct entry *find_in(struct entry *t, uint64_t ino, int for_insert) {
    uint64_t h = (ino * 0x9E3779B97F4A7C15ull) >> 48;
    struct entry *grave = NULL;
    for (int i = 0; i < CAPACITY; i++) {
        struct entry *e = &t[(h + i) & (CAPACITY - 1)];
        if (e->ino == ino) return e;
        if (e->ino == TOMBSTONE) { if (!grave) grave = e; continue; }
        if (e->ino == EMPTY) return for_insert ? (grave ? grave : e) : NULL;
    }
    return for_insert ? grave : NULL;
}

static struct entry *find(uint64_t ino, int for_insert) { return find_in(table, ino, for_insert); }

void qfp_init_send(int sendmsg_nr, int sendmmsg_nr, int strict) {
    nr_sendmsg = sendmsg_nr; nr_sendmmsg = sendmmsg_nr; ends_strict = strict;
}

/* 0 recorded; -1 the table is full (Python then answers that end's sendmsg calls itself). */
int qfp_end_add(uint64_t ino) {
    pthread_mutex_lock(&lock);
    struct entry *e = find_in(ends, ino, 1);
    if (e) e->ino = ino;
    pthread_mutex_unlock(&lock);
    return e ? 0 : -1;
}

void qfp_end_remove(uint64_t ino) {
    pthread_mutex_lock(&lock);
    struct entry *e = find_in(ends, ino, 0);
    if (e) e->ino = TOMBSTONE;
    pthread_mutex_unlock(&lock);
}

static int is_end(uint64_t ino) {
    pthread_mutex_lock(&lock);
    int found = find_in(ends, ino, 0) != NULL;
    pthread_mutex_unlock(&lock);
    return found;
}

void qfp_init(int setsockopt_nr, uint32_t arch) { nr_setsockopt = setsockopt_nr; audit_arch = arch; }

/* 0 recorded; -1 the table is full (Python keeps the socket's options itself). */
int qfp_add(uint64_t ino, int nodelay, int cork) {
    pthread_mutex_lock(&lock);
    struct entry *e = find(ino, 1);
    if (e) { e->ino = ino; e->nodelay = !!nodelay; e->cork = !!cork; }
    pthread_mutex_unlock(&lock);
    return e ? 0 : -1;
}

void qfp_remove(uint64_t ino) {
    pthread_mutex_lock(&lock);
    struct entry *e = find(ino, 0);
    if (e) e->ino = TOMBSTONE;
    pthread_mutex_unlock(&lock);
}

/* The recorded value of TCP_NODELAY (1) or TCP_CORK (3), or -1 when the socket is not here. */
int qfp_get(uint64_t ino, int opt) {
    pthread_mutex_lock(&lock);
    struct entry *e = find(ino, 0);
    int v = e ? (opt == 1 ? e->nodelay : e->cork) : -1;
    pthread_mutex_unlock(&lock);
    return v;
}

int qfp_set(uint64_t ino, int opt, int value) {
    pthread_mutex_lock(&lock);
    struct entry *e = find(ino, 0);
    if (e) { if (opt == 1) e->nodelay = !!value; else e->cork = !!value; }
    pthread_mutex_unlock(&lock);
    return e ? 0 : -1;
}

uint64_t qfp_answered(void) { return answered; }

static uint64_t socket_inode(uint32_t pid, int fd) {
    char path[64], link[64];
    snprintf(path, sizeof path, "/proc/%u/fd/%d", pid, fd);
    ssize_t n = readlink(path, link, sizeof link - 1);
    if (n <= 9 || strncmp(link, "socket:[", 8) != 0) return 0;
    link[n] = 0;
    return strtoull(link + 8, NULL, 10);
}

static int let_through(int listener, struct seccomp_notif *n) {
    struct seccomp_notif_resp r = {.id = n->id, .flags = SECCOMP_USER_NOTIF_FLAG_CONTINUE};
    if (ioctl(listener, SECCOMP_IOCTL_NOTIF_SEND, &r) == 0) __atomic_add_fetch(&answered, 1, __ATOMIC_RELAXED);
    return 1;
}

/* sendmsg/sendmmsg: 1 let through here; 0 for Python (an end's call with a control buffer, any
 * sendmmsg on an end, anything unreadable). */
static int try_send(int listener, struct seccomp_notif *n) {
    int fd = (int)n->data.args[0];
    uint64_t ino = fd >= 0 ? socket_inode(n->pid, fd) : 0;
    if (!ino || !is_end(ino)) return let_through(listener, n);
    if (n->data.nr != nr_sendmsg || ends_strict) return 0;
    uint64_t controllen;   /* struct msghdr's msg_controllen, at 40 on 64-bit */
    struct iovec local = {&controllen, sizeof controllen};
    struct iovec remote = {(void *)(uintptr_t)(n->data.args[1] + 40), sizeof controllen};
    if (process_vm_readv((pid_t)n->pid, &local, 1, &remote, 1, 0) != sizeof controllen) return 0;
    return controllen == 0 ? let_through(listener, n) : 0;
}

/* 1 answered here; 0 for Python. */
static int try_answer(int listener, struct seccomp_notif *n) {
    if (n->data.arch != audit_arch) return 0;
    if ((int)n->data.nr == nr_sendmsg || (int)n->data.nr == nr_sendmmsg) return try_send(listener, n);
    if (n->data.nr != nr_setsockopt) return 0;
    int fd = (int)n->data.args[0], level = (int)n->data.args[1], opt = (int)n->data.args[2];
    if (fd < 0 || level != 6 /* IPPROTO_TCP */ || (opt != 1 && opt != 3)) return 0;
    uint64_t ino = socket_inode(n->pid, fd);
    if (!ino || qfp_get(ino, opt) < 0) return 0;
    struct seccomp_notif_resp r = {.id = n->id};
    if ((uint32_t)n->data.args[4] < sizeof(int)) {
        r.error = -EINVAL;   /* as tcp_setsockopt */
    } else {
        int value;
        struct iovec local = {&value, sizeof value}, remote = {(void *)(uintptr_t)n->data.args[3], sizeof value};
        if (process_vm_readv((pid_t)n->pid, &local, 1, &remote, 1, 0) != sizeof value) return 0;
        /* the pid may have died and been reused while we read: only act for a live request */
        if (ioctl(listener, SECCOMP_IOCTL_NOTIF_ID_VALID, &n->id) != 0) return 1;
        qfp_set(ino, opt, value);
    }
    if (ioctl(listener, SECCOMP_IOCTL_NOTIF_SEND, &r) == 0) __atomic_add_fetch(&answered, 1, __ATOMIC_RELAXED);
    return 1;   /* answered, or abandoned by the task (ENOENT): nothing more to do either way */
}

/* Receive until a notification Python must handle: 0 with *out filled, or -errno from RECV. */
int qfp_serve(int listener, struct seccomp_notif *out) {
    for (;;) {
        memset(out, 0, sizeof *out);   /* the kernel requires it zeroed */
        if (ioctl(listener, SECCOMP_IOCTL_NOTIF_RECV, out) != 0) return -errno;
        if (!try_answer(listener, out)) return 0;
    }
}

/* Does the epoll set at /proc/PID/fdinfo/NAME watch the file of socket inode `ino`? Its lines read
 * "tfd: N events: E data: D pos:P ino:HEX sdev:S". 1 yes, 0 no, -1 unreadable. */
static int epoll_watches(uint32_t pid, const char *name, uint64_t ino) {
    char path[320];
    snprintf(path, sizeof path, "/proc/%u/fdinfo/%s", pid, name);
    int f = open(path, O_RDONLY | O_CLOEXEC);
    if (f < 0) return -1;
    size_t cap = 1 << 16, len = 0;
    char *buf = malloc(cap + 1);
    if (!buf) { close(f); return -1; }
    for (;;) {
        if (len == cap) {
            char *more = realloc(buf, 2 * cap + 1);
            if (!more) { free(buf); close(f); return -1; }
            buf = more;
            cap *= 2;
        }
        ssize_t n = read(f, buf + len, cap - len);
        if (n < 0) { free(buf); close(f); return -1; }
        if (n == 0) break;
        len += (size_t)n;
    }
    close(f);
    buf[len] = 0;
    char want[32];
    int wl = snprintf(want, sizeof want, " ino:%llx", (unsigned long long)ino);
    int found = 0;
    for (char *line = buf; line && *line && !found; ) {
        char *end = strchr(line, '\n');
        if (end) *end = 0;
        if (strncmp(line, "tfd:", 4) == 0) {
            char *p = strstr(line, want);
            if (p && (p[wl] == 0 || p[wl] == ' ' || p[wl] == '\t')) found = 1;
        }
        line = end ? end + 1 : NULL;
    }
    free(buf);
    return found;
}

/* Is the socket of inode `ino` at the task's `fd` reachable another way: another fd number (a dup)
 * or an entry of an epoll set? 1 yes, 0 no, -1 the task's fds cannot be read (treat as yes). */
int qfp_held_elsewhere(uint32_t pid, int fd, uint64_t ino) {
    char path[64], want[48], link[64];
    snprintf(path, sizeof path, "/proc/%u/fd", pid);
    int dfd = open(path, O_RDONLY | O_DIRECTORY | O_CLOEXEC);
    if (dfd < 0) return -1;
    DIR *d = fdopendir(dfd);
    if (!d) { close(dfd); return -1; }
    int wl = snprintf(want, sizeof want, "socket:[%llu]", (unsigned long long)ino);
    int found = 0;
    struct dirent *e;
    while (!found && (e = readdir(d)) != NULL) {
        if (e->d_name[0] < '0' || e->d_name[0] > '9' || atoi(e->d_name) == fd) continue;
        ssize_t n = readlinkat(dfd, e->d_name, link, sizeof link - 1);
        if (n < 0) continue;   /* closed meanwhile */
        link[n] = 0;
        if (n == wl && memcmp(link, want, (size_t)wl) == 0) found = 1;
        else if (strcmp(link, "anon_inode:[eventpoll]") == 0 && epoll_watches(pid, e->d_name, ino) == 1) found = 1;
    }
    closedir(d);
    return found;
}

/* The values of `n` socket options of `fd` in one call (TSoR reads some twenty of a connecting
 * socket to carry those the application set; through Python each read cost a few microseconds
 * more than the syscall): option i lands at vals + i * 64, lens[i] is its length or -errno. */
void qfp_sockopts(int fd, int n, const int *levels, const int *opts, unsigned char *vals, int *lens) {
    for (int i = 0; i < n; i++) {
        socklen_t len = 64;
        lens[i] = getsockopt(fd, levels[i], opts[i], vals + (size_t)i * 64, &len) == 0 ? (int)len : -errno;
    }
}
