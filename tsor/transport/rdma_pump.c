/* TSoR's compiled rdma data plane: the per-link pump of tsor/transport/rdma.py in C against libibverbs.
 *
 * Same wire protocol, byte for byte (rdma.py's docstring is its description): rings of `ring` bytes
 * per slot, RDMA_WRITE_WITH_IMM (imm = slot, bit 31 = FIN), byte credits per channel and receive-WR /
 * control-ring credits per link, control records `!BHHIIH` + payload in slot 0. A link of this pump
 * talks to a link of rdma.py's engine (tests/unit/test_rdma_ring.py's "compiled" case runs them
 * against each other on a real device).
 *
 * One pthread (the engine) owns every link's QP, CQ and completion channel and the pump's ends of the
 * applications' socketpairs; it waits in epoll_wait on the channel fds (non-blocking, events taken
 * without waiting) and the sockets, and never touches Python: tsord's threads run whatever it does.
 * tsord (tsor/transport/rdma_pump.py) keeps the control plane: it opens the device by name, exchanges
 * the set-up info over the authenticated tsord connection, decides routing and policy, and reads the
 * counters. Its calls take the engine's mutex (ctypes releases the GIL around them); what the engine
 * has to tell it (a peer opened a connection, an open was answered, a link went down) is written as
 * a message on the event stream socket tsord gave it, with the application's end of a new
 * connection as a plain fd number (same process: ownership passes with the message).
 *
 * The kernel-chosen path (tsor/remote_path.py) adds a listener: a quark pod's connect() to a pod of
 * another node is dialled here by the cgroup programs (tsor/bpf/service_lb.bpf.c), and the engine
 * accepts it, reads where it was going from the programs' conns map (by the client's address), and
 * opens a channel to that node with the socket itself as the channel's end: no Python and no
 * socketpair on that side. On the far side an OPEN for a pod registered here (the sockmap path's
 * address map) is connected to by the engine itself, from the node's address, after it wrote the
 * client pod's address into the peers map (what the pod's accept() answers as its peer); the entry
 * is deleted when the channel goes. No Python on either side of such a connection.
 *
 * Objects that epoll may still name are freed only by the engine thread after the batch that could
 * name them (the graveyard): a channel or link dropped by a tsord call while the engine waits in
 * epoll_wait is marked dead and skipped.
 */
#define _GNU_SOURCE
#include <arpa/inet.h>
#include <errno.h>
#include <fcntl.h>
#include <infiniband/verbs.h>
#include <linux/bpf.h>
#include <netinet/in.h>
#include <pthread.h>
#include <stdarg.h>
#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/epoll.h>
#include <sys/eventfd.h>
#include <sys/mman.h>
#include <sys/random.h>
#include <sys/socket.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

#define FIN (1u << 31)
#define CTL_SIZE 15                 /* !BHHIIH */
enum { OPEN = 1, ACCEPT, REFUSE, CREDIT, RESET, RESET_ACK, CTL_CREDIT, RELEASE };
#define RESERVE_WRS 4
#define RESERVE_BYTES (4 * CTL_SIZE)
#define MAX_WRITE (1024 * 1024)
#define CQ_BATCH 64
#define SIGNAL_EVERY 16
#define MAX_CTL_PAYLOAD 4096
#define MAX_CTL_QUEUED 4096
#define STALL_NS (10LL * 1000000000LL)
#define STALL_CHECK_MS 1000
#define PUMP_SNDBUF (1 << 20)
#define MAX_LINKS 1024
#define ROOM_RESERVE 8              /* channels kept back from the programs' room count: connects racing it */
/* the QP's attributes: rdma.py's pyverbs provider uses the same (tsor/verbs/pyverbs_provider.py) */
#define RNR_RETRY_INFINITE 7
#define MIN_RNR_TIMER 12
#define QP_TIMEOUT 14
#define RETRY_CNT 7

enum { OPENING, ACCEPTING, OPEN_, CLOSING };
enum { R_PROTOCOL, R_STALLED, R_VERBS, R_NONE };      /* why a link went down (pe_stats.resets) */
enum { EV_ACCEPT = 1, EV_OPENED, EV_DOWN };            /* messages on the event socket */
enum { H_LINK = 1, H_CHAN, H_EVENTS, H_LISTEN };

struct pe_info {            /* rdma.py's SetupInfo, plus what tsord needs to know of the port */
    uint32_t qpn, psn;
    uint8_t gid[16];
    uint32_t lid;
    uint64_t addr;
    uint32_t rkey, ring, slots, rq_depth, max_msg;
};

/* accepted: connections the listener took and opened a channel for; unclaimed: ones it reset (no
 * entry in the conns map, or no usable link or slot for it) */
struct pe_stats { uint64_t bytes_sent, bytes_received, resets[3], accepted, unclaimed; };

struct pe_event {           /* header of one event message; `len` bytes of payload follow */
    uint32_t type;
    int32_t link;
    uint32_t slot, gen;
    int64_t token;
    int32_t fd, code;
    uint32_t len, pad;
};

struct buf { uint8_t *p; size_t head, len, cap; };   /* bytes [head, len) are queued */

struct link;
struct chan {
    int kind;
    struct link *link;
    uint32_t slot;
    uint16_t gen;
    int fd, state;
    uint64_t base, tx_sent, tx_acked, rx_tail, rx_head, rx_credited;
    bool fin_tx, fin_rx, shut, reset_pending, reading, writing, greeting, registered, dead;
    bool credit_due, blocked, marked;
    bool pumped;            /* its end is a TCP socket (the listener's, or the engine's connect): resets end it with RST */
    bool connecting;        /* accepting: the engine's connect to the pod is in progress */
    bool has_peer_key;
    uint8_t peer_key[12];   /* the peers map's entry to delete when it goes (struct peer_key) */
    int inflight;
    int64_t token;          /* opening: the opener's token, until answered */
    struct chan *next_dead;
};

struct link {
    int kind, id;
    struct pe *pe;
    struct ibv_context *ctx;
    struct ibv_pd *pd;
    struct ibv_comp_channel *cc;
    struct ibv_cq *cq;
    struct ibv_qp *qp;
    struct ibv_mr *rx_mr, *tx_mr;
    uint8_t *rx, *tx;
    size_t size;
    uint32_t ring, slots, sq_depth, rq_depth, max_write;
    int port, gid_index, parity, unacked_events;
    bool up, closed, dead, watching, room_dirty;
    struct pe_info info, remote;
    struct chan **chans;
    uint16_t *gens;
    bool *unreleased;
    struct chan **pending;      /* channels with news in one batch of completions */
    uint32_t cursor, n_credit_due, n_blocked, n_channels;
    struct chan **wr_ch;        /* posted writes by wr_id % sq_depth: wr_ids [wr_done, wr_next) are out */
    uint64_t wr_next, wr_done;
    uint32_t sq_used;
    uint64_t imm_sent, peer_rq_total, rq_posted, rq_reported;
    uint64_t ctl_sent, ctl_acked, ctl_rx, ctl_reported;
    struct buf ctl_in, ctl_out;
    uint32_t ctl_queued;
    int64_t starved_since;      /* ns, 0: not starved */
    struct link *next_dead;
};

struct listener {
    int kind;               /* H_LISTEN */
    int fd, conns, peers;   /* the listening socket; the programs' conns and peers maps (-1: none) */
    int addrs;              /* the sockmap path's address map: the pods of this node (-1: none) */
    int room;               /* the programs' room map: connections each link can take now (-1: none) */
    uint32_t bind_ip;       /* where the engine's connects to pods come from (network order) */
};

struct pe {
    pthread_mutex_t mu;
    pthread_t thread;
    int ep, bell, events, events_kind;
    bool running, events_watched;
    struct buf evq;
    struct link *links[MAX_LINKS];
    struct pe_stats stats;
    struct chan *dead_chans;
    struct link *dead_links;
    struct listener lsn;
    bool room_dirty;        /* some link's room_dirty is set */
};

static int64_t now_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return ts.tv_sec * 1000000000LL + ts.tv_nsec;
}

static void seterr(char *err, int n, const char *fmt, ...) {
    if (!err || n <= 0) return;
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(err, n, fmt, ap);
    va_end(ap);
}

/* ---- byte queues ---------------------------------------------------------------------------- */
static bool buf_put(struct buf *b, const void *p, size_t n) {
    if (b->head && b->head == b->len) b->head = b->len = 0;
    if (b->len + n > b->cap) {
        if (b->head) {
            memmove(b->p, b->p + b->head, b->len - b->head);
            b->len -= b->head;
            b->head = 0;
        }
        if (b->len + n > b->cap) {
            size_t cap = b->cap ? b->cap : 4096;
            while (cap < b->len + n) cap *= 2;
            uint8_t *q = realloc(b->p, cap);
            if (!q) return false;
            b->p = q;
            b->cap = cap;
        }
    }
    memcpy(b->p + b->len, p, n);
    b->len += n;
    return true;
}

static size_t buf_size(const struct buf *b) { return b->len - b->head; }

static void put16(uint8_t *p, uint16_t v) { p[0] = v >> 8; p[1] = v; }
static void put32(uint8_t *p, uint32_t v) { p[0] = v >> 24; p[1] = v >> 16; p[2] = v >> 8; p[3] = v; }
static uint16_t get16(const uint8_t *p) { return (uint16_t)(p[0] << 8 | p[1]); }
static uint32_t get32(const uint8_t *p) { return (uint32_t)p[0] << 24 | (uint32_t)p[1] << 16 | (uint32_t)p[2] << 8 | p[3]; }

/* the BPF maps the kernel-chosen path shares with the cgroup programs */
static int map_call(int cmd, int fd, const void *key, void *value) {
    union bpf_attr a;
    memset(&a, 0, sizeof a);
    a.map_fd = (uint32_t)fd;
    a.key = (uint64_t)(uintptr_t)key;
    a.value = (uint64_t)(uintptr_t)value;
    return (int)syscall(__NR_bpf, cmd, &a, sizeof a);
}

/* how many more connections the link can open from this side, for the programs' room map */
static void room_changed(struct link *l) {
    l->room_dirty = true;
    l->pe->room_dirty = true;
}

static void publish_room(struct link *l) {
    l->room_dirty = false;
    if (l->pe->lsn.room < 0) return;
    int32_t room = 0;
    for (uint32_t s = 1; l->up && !l->closed && s < l->slots; s++)
        if (s % 2 == (uint32_t)l->parity && !l->chans[s] && !l->unreleased[s]) room++;
    room = room > ROOM_RESERVE ? room - ROOM_RESERVE : 0;
    uint32_t key = (uint32_t)l->id;
    map_call(BPF_MAP_UPDATE_ELEM, l->pe->lsn.room, &key, &room);
}

static void pack_ctl(uint8_t *p, int kind, uint32_t slot, uint32_t gen, uint32_t v1, uint32_t v2, uint32_t n) {
    p[0] = kind;
    put16(p + 1, slot);
    put16(p + 3, gen);
    put32(p + 5, v1);
    put32(p + 9, v2);
    put16(p + 13, n);
}

/* a running total the peer reports modulo 2^32, carried on from ours */
static uint64_t advance(uint64_t total, uint32_t reported) {
    return total + (uint32_t)(reported - (uint32_t)total);
}

/* ---- events to tsord ------------------------------------------------------------------------ */
/* The event socket is a stream that tsord's reader thread drains: what it cannot take now waits in
 * pe->evq (the engine never blocks on tsord: tsord's calls wait on the engine's mutex) */
static void flush_events(struct pe *pe) {
    while (buf_size(&pe->evq)) {
        ssize_t n = send(pe->events, pe->evq.p + pe->evq.head, buf_size(&pe->evq), MSG_DONTWAIT | MSG_NOSIGNAL);
        if (n < 0) {
            if (errno == EINTR) continue;
            if (errno != EAGAIN) pe->evq.head = pe->evq.len;   /* tsord is gone: nobody reads them */
            break;
        }
        pe->evq.head += n;
    }
    bool want = buf_size(&pe->evq) > 0;
    if (want != pe->events_watched) {
        struct epoll_event e = {.events = EPOLLOUT, .data.ptr = &pe->events_kind};
        epoll_ctl(pe->ep, want ? EPOLL_CTL_ADD : EPOLL_CTL_DEL, pe->events, &e);
        pe->events_watched = want;
    }
}

static bool emit(struct pe *pe, uint32_t type, int link, uint32_t slot, uint32_t gen, int64_t token, int fd,
                 int code, const void *payload, uint32_t len) {
    struct pe_event ev = {type, link, slot, gen, token, fd, code, len, 0};
    if (!buf_put(&pe->evq, &ev, sizeof ev) || (len && !buf_put(&pe->evq, payload, len))) return false;
    flush_events(pe);
    return true;
}

/* ---- epoll ---------------------------------------------------------------------------------- */
static void interest(struct chan *ch) {
    struct pe *pe = ch->link->pe;
    uint32_t want = (ch->reading ? EPOLLIN : 0) | (ch->writing ? EPOLLOUT : 0);
    if (ch->fd < 0) return;
    if (!want) {   /* not watched at all: epoll would still report HUP/ERR, level-triggered, forever */
        if (ch->registered) epoll_ctl(pe->ep, EPOLL_CTL_DEL, ch->fd, NULL);
        ch->registered = false;
        return;
    }
    struct epoll_event e = {.events = want, .data.ptr = ch};
    epoll_ctl(pe->ep, ch->registered ? EPOLL_CTL_MOD : EPOLL_CTL_ADD, ch->fd, &e);
    ch->registered = true;
}

/* ---- channels ------------------------------------------------------------------------------- */
static void down(struct link *l, int reason, const char *fmt, ...);

static struct chan *chan_new(struct link *l, uint32_t slot, uint16_t gen, int fd, int state) {
    struct chan *ch = calloc(1, sizeof *ch);
    if (!ch) return NULL;
    ch->kind = H_CHAN;
    ch->link = l;
    ch->slot = slot;
    ch->gen = gen;
    ch->fd = fd;
    ch->state = state;
    ch->base = (uint64_t)slot * l->ring;
    l->chans[slot] = ch;
    l->n_channels++;
    return ch;
}

/* the channel leaves the link's table; it is freed once no epoll batch can name it */
static void chan_drop(struct link *l, struct chan *ch) {
    if (l->chans[ch->slot] == ch) {
        l->chans[ch->slot] = NULL;
        l->n_channels--;
        room_changed(l);
    }
    if (ch->credit_due) { ch->credit_due = false; l->n_credit_due--; }
    if (ch->blocked) { ch->blocked = false; l->n_blocked--; }
    if (ch->dead) return;
    ch->dead = true;
    ch->next_dead = l->pe->dead_chans;
    l->pe->dead_chans = ch;
}

static int socketpair_for(int *ours, int *app) {
    int sv[2];
    if (socketpair(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0, sv) < 0) return -1;
    int sz = PUMP_SNDBUF;
    fcntl(sv[0], F_SETFL, fcntl(sv[0], F_GETFL) | O_NONBLOCK);
    setsockopt(sv[0], SOL_SOCKET, SO_SNDBUF, &sz, sizeof sz);
    *ours = sv[0];
    *app = sv[1];
    return 0;
}

static void close_sock(struct chan *ch) {
    if (ch->fd < 0) return;
    ch->reading = ch->writing = false;
    interest(ch);
    close(ch->fd);
    ch->fd = -1;
}

static void ctl(struct link *l, int kind, uint32_t slot, uint32_t gen, uint32_t v1, uint32_t v2,
                const void *payload, uint32_t n);

/* end a TCP socket with a reset, as the connection's peer failing would */
static void linger0(int fd) {
    struct linger lg = {1, 0};
    setsockopt(fd, SOL_SOCKET, SO_LINGER, &lg, sizeof lg);
}

static void abort_chan(struct chan *ch) {
    struct link *l = ch->link;
    if (ch->pumped && ch->fd >= 0) linger0(ch->fd);
    if (ch->token) {   /* the opener waits: tell it no */
        emit(l->pe, EV_OPENED, l->id, ch->slot, ch->gen, ch->token, -1, 0, NULL, 0);
        ch->token = 0;
    }
    close_sock(ch);
    ch->state = CLOSING;
    if (ch->credit_due) { ch->credit_due = false; l->n_credit_due--; }
}

/* our application's socket failed: drop the connection, and tell the peer */
static void reset_chan(struct chan *ch) {
    if (ch->state == CLOSING) return;
    abort_chan(ch);
    ch->reset_pending = true;
    ctl(ch->link, RESET, ch->slot, ch->gen, 0, 0, NULL, 0);
}

/* ---- posting -------------------------------------------------------------------------------- */
static int64_t budget(struct link *l) {
    int64_t a = (int64_t)(l->peer_rq_total - l->imm_sent), b = (int64_t)l->sq_depth - l->sq_used;
    return a < b ? a : b;
}

/* a write with immediate of n bytes at `off` of the send region to the same offset of the peer's
 * receive region; false when the link went down */
static bool post(struct link *l, struct chan *ch, uint64_t off, uint32_t n, uint32_t imm) {
    uint64_t wr_id = l->wr_next++;
    l->wr_ch[wr_id % l->sq_depth] = ch;
    struct ibv_sge sge = {(uintptr_t)(l->tx + off), n, l->tx_mr->lkey};
    struct ibv_send_wr wr = {0}, *bad;
    wr.wr_id = wr_id;
    wr.sg_list = n ? &sge : NULL;
    wr.num_sge = n ? 1 : 0;
    wr.opcode = IBV_WR_RDMA_WRITE_WITH_IMM;
    /* a completion retires every write before it: FINs and every SIGNAL_EVERY-th write ask for one */
    wr.send_flags = (imm & FIN) || wr_id % SIGNAL_EVERY == 0 ? IBV_SEND_SIGNALED : 0;
    wr.imm_data = htonl(imm);
    wr.wr.rdma.remote_addr = l->remote.addr + off;
    wr.wr.rdma.rkey = l->remote.rkey;
    int rc = ibv_post_send(l->qp, &wr, &bad);
    if (rc) {
        l->wr_next--;
        down(l, R_VERBS, "post failed: %s", strerror(rc));
        return false;
    }
    l->sq_used++;
    l->imm_sent++;
    if (ch) ch->inflight++;
    return true;
}

static void update(struct chan *ch);

/* ---- the pump: application socket -> ring ---------------------------------------------------- */
static void readable(struct chan *ch) {
    struct link *l = ch->link;
    uint64_t ring = l->ring;
    for (int i = 0; i < 4; i++) {   /* a few batches, then let the other channels have their turn */
        int64_t free_ = (int64_t)ring - (int64_t)(ch->tx_sent - ch->tx_acked);
        if (free_ <= 0 || budget(l) <= RESERVE_WRS) break;
        uint64_t off = ch->tx_sent % ring;
        uint64_t n = (uint64_t)free_;
        if (n > ring - off) n = ring - off;
        if (n > l->max_write) n = l->max_write;
        uint64_t pos = ch->base + off;
        ssize_t got = recv(ch->fd, l->tx + pos, n, MSG_DONTWAIT);
        if (got < 0) {
            if (errno == EAGAIN || errno == EINTR) break;
            reset_chan(ch);
            return;
        }
        if (got == 0) {
            ch->fin_tx = true;
            if (!post(l, ch, pos, 0, ch->slot | FIN)) return;
            break;
        }
        if (!post(l, ch, pos, (uint32_t)got, ch->slot)) return;
        ch->tx_sent += got;
        l->pe->stats.bytes_sent += got;
        if ((uint64_t)got < n) break;
    }
    update(ch);
}

/* ---- the pump: ring -> application socket ---------------------------------------------------- */
static void deliver(struct chan *ch) {
    struct link *l = ch->link;
    uint64_t ring = l->ring;
    while (ch->rx_head < ch->rx_tail) {
        uint64_t off = ch->rx_head % ring;
        uint64_t n = ch->rx_tail - ch->rx_head;
        if (n > ring - off) n = ring - off;
        ssize_t sent = send(ch->fd, l->rx + ch->base + off, n, MSG_DONTWAIT | MSG_NOSIGNAL);
        if (sent < 0) {
            if (errno == EAGAIN || errno == EINTR) break;
            reset_chan(ch);
            return;
        }
        ch->rx_head += sent;
        l->pe->stats.bytes_received += sent;
        if ((uint64_t)sent < n) break;
    }
    if (ch->rx_head - ch->rx_credited > ring / 2 && !ch->fin_rx && !ch->credit_due) {
        ch->credit_due = true;
        l->n_credit_due++;
    }
    if (ch->fin_rx && ch->rx_head == ch->rx_tail && !ch->shut) {
        ch->shut = true;
        shutdown(ch->fd, SHUT_WR);
    }
    update(ch);
}

static void release(struct chan *ch) {
    /* the channel is over here: tell the opener it may use the slot again (if it was the peer's) */
    struct link *l = ch->link;
    if (ch->slot % 2 != (uint32_t)l->parity) ctl(l, RELEASE, ch->slot, ch->gen, 0, 0, NULL, 0);
}

/* register for what the channel waits for now; free its slot once it is done */
static void update(struct chan *ch) {
    struct link *l = ch->link;
    if (ch->state == OPEN_ && ch->rx_head == ch->rx_tail && ch->fin_rx && ch->fin_tx && ch->inflight == 0) {
        close_sock(ch);
        chan_drop(l, ch);
        release(ch);
        return;
    }
    if (ch->state == CLOSING) {
        if (!ch->reset_pending && ch->inflight == 0 && l->chans[ch->slot] == ch) {
            chan_drop(l, ch);
            release(ch);
        }
        return;
    }
    bool can_read = ch->state == OPEN_ && !ch->fin_tx && ch->tx_sent - ch->tx_acked < l->ring;
    bool want_read = can_read && budget(l) > RESERVE_WRS;
    if (can_read && !want_read && !ch->blocked) {   /* until completions or the peer's report give WRs back */
        ch->blocked = true;
        l->n_blocked++;
    }
    bool want_write = ch->state == OPEN_ && ch->rx_head < ch->rx_tail;
    if (want_read != ch->reading || want_write != ch->writing) {
        ch->reading = want_read;
        ch->writing = want_write;
        interest(ch);
    }
}

static void unblock(struct link *l) {
    if (!l->n_blocked || budget(l) <= RESERVE_WRS) return;
    for (uint32_t s = 1; s < l->slots && l->n_blocked; s++) {
        struct chan *ch = l->chans[s];
        if (ch && ch->blocked) {
            ch->blocked = false;
            l->n_blocked--;
            update(ch);
            if (!l->up) return;
        }
    }
}

/* something waits to be sent that only the peer's link credits can let out */
static bool starved(struct link *l) {
    if (!(buf_size(&l->ctl_out) || l->n_credit_due || l->n_blocked)) return false;
    int64_t room = (int64_t)l->ring - (int64_t)(l->ctl_sent - l->ctl_acked) - RESERVE_BYTES;
    if (budget(l) <= RESERVE_WRS) return true;
    if (buf_size(&l->ctl_out)) {
        uint32_t first = CTL_SIZE + get16(l->ctl_out.p + l->ctl_out.head + 13);
        return (int64_t)first > room;
    }
    return false;
}

static void check_stall(struct link *l, int64_t now) {
    if (!l->up || !starved(l)) {
        l->starved_since = 0;
    } else if (!l->starved_since) {
        l->starved_since = now;
    } else if (now - l->starved_since >= STALL_NS) {
        down(l, R_STALLED, "the peer granted no link credits for %lld s", (long long)((now - l->starved_since) / 1000000000LL));
    }
}

/* ---- the control channel -------------------------------------------------------------------- */
static void ctl(struct link *l, int kind, uint32_t slot, uint32_t gen, uint32_t v1, uint32_t v2,
                const void *payload, uint32_t n) {
    if (!l->up) return;
    if (l->ctl_queued >= MAX_CTL_QUEUED) {
        /* only a peer that withholds the control ring's credit lets records pile up */
        down(l, R_STALLED, "%d control records wait for credit", MAX_CTL_QUEUED);
        return;
    }
    uint8_t h[CTL_SIZE];
    pack_ctl(h, kind, slot, gen, v1, v2, n);
    if (!buf_put(&l->ctl_out, h, CTL_SIZE) || (n && !buf_put(&l->ctl_out, payload, n))) {
        down(l, R_VERBS, "out of memory for control records");
        return;
    }
    l->ctl_queued++;
}

/* bytes of the control stream, `at` bytes past what was already sent, into the send ring's slot 0 */
static void ctl_copy(struct link *l, uint64_t at, const uint8_t *p, size_t n) {
    uint64_t off = (l->ctl_sent + at) % l->ring, first = n < l->ring - off ? n : l->ring - off;
    memcpy(l->tx + off, p, first);
    memcpy(l->tx, p + first, n - first);
}

/* post what is queued for the control channel as one write (two at the ring's end) */
static void flush_ctl(struct link *l) {
    uint64_t ring = l->ring;
    bool report = l->ctl_rx - l->ctl_reported > ring / 2 || l->rq_posted - l->rq_reported > l->rq_depth / 2;
    if (!l->up || !(report || buf_size(&l->ctl_out) || l->n_credit_due)) return;
    int64_t free_ = (int64_t)ring - (int64_t)(l->ctl_sent - l->ctl_acked);
    int64_t b = budget(l);
    uint8_t rec[CTL_SIZE];
    uint64_t n = 0;
    if (report && b >= 2 && free_ >= CTL_SIZE) {
        pack_ctl(rec, CTL_CREDIT, 0, 0, (uint32_t)l->ctl_rx, (uint32_t)l->rq_posted, 0);
        ctl_copy(l, n, rec, CTL_SIZE);
        n = CTL_SIZE;
        l->ctl_reported = l->ctl_rx;
        l->rq_reported = l->rq_posted;
    }
    if (b > 3) {
        int64_t room = free_ - RESERVE_BYTES;
        while (buf_size(&l->ctl_out)) {
            uint8_t *r = l->ctl_out.p + l->ctl_out.head;
            size_t len = CTL_SIZE + get16(r + 13);
            if ((int64_t)(n + len) > room) break;
            ctl_copy(l, n, r, len);
            n += len;
            l->ctl_out.head += len;
            l->ctl_queued--;
        }
        for (uint32_t s = 1; s < l->slots && l->n_credit_due; s++) {
            struct chan *ch = l->chans[s];
            if (!ch || !ch->credit_due) continue;
            if ((int64_t)(n + CTL_SIZE) > room) break;
            pack_ctl(rec, CREDIT, s, ch->gen, (uint32_t)ch->rx_head, 0, 0);
            ctl_copy(l, n, rec, CTL_SIZE);
            n += CTL_SIZE;
            ch->rx_credited = ch->rx_head;
            ch->credit_due = false;
            l->n_credit_due--;
        }
    }
    if (!n) return;
    uint64_t off = l->ctl_sent % ring, first = n < ring - off ? n : ring - off;
    l->ctl_sent += n;
    if (post(l, NULL, off, first, 0) && first < n) post(l, NULL, 0, n - first, 0);
}

static void violation(struct link *l, const char *why) {
    down(l, R_PROTOCOL, "the peer broke the protocol: %s", why);
}

static void answer(struct link *l, struct chan *ch, bool ok) {
    if (ok) {
        ch->state = OPEN_;
        ctl(l, ACCEPT, ch->slot, ch->gen, 0, 0, NULL, 0);
        if (l->up) update(ch);
    } else {
        close_sock(ch);
        chan_drop(l, ch);
        ctl(l, REFUSE, ch->slot, ch->gen, 0, 0, NULL, 0);   /* a REFUSE releases the slot too */
    }
    flush_ctl(l);
}

/* one end of an OPEN's JSON payload ({"src": ["a.b.c.d", port], "dst": [...]}, as rdma.py and take()
 * write it): false where it is not that */
static bool payload_end(const uint8_t *payload, uint32_t n, const char *name, struct sockaddr_in *out) {
    char text[MAX_CTL_PAYLOAD + 1], ip[INET_ADDRSTRLEN];
    memcpy(text, payload, n);
    text[n] = 0;
    char *p = strstr(text, name);
    if (!p || !(p = strchr(p + strlen(name), '"'))) return false;
    char *end = strchr(++p, '"');
    if (!end || end - p >= (long)sizeof ip) return false;
    memcpy(ip, p, (size_t)(end - p));
    ip[end - p] = 0;
    p = strchr(end, ',');
    char *after;
    unsigned long port = p ? strtoul(p + 1, &after, 10) : 0;
    if (!p || after == p + 1 || port == 0 || port > 65535) return false;
    memset(out, 0, sizeof *out);
    out->sin_family = AF_INET;
    out->sin_port = htons((uint16_t)port);
    return inet_pton(AF_INET, ip, &out->sin_addr) == 1;
}

/* The kernel-chosen path's far side: an OPEN for a pod of this node (the sockmap path's address map)
 * is connected to here, from the node's address, the client pod's address written to the peers map
 * first (the pod's accept() answers it). The connection is accepted once the connect completes
 * (connected()). false: not such an OPEN (tsord answers it). */
static bool connect_pod(struct link *l, uint32_t slot, uint32_t gen, const uint8_t *payload, uint32_t n) {
    struct pe *pe = l->pe;
    struct sockaddr_in src, dst, me = {.sin_family = AF_INET};
    uint64_t cookie;
    if (pe->lsn.addrs < 0 || pe->lsn.peers < 0 || !payload_end(payload, n, "\"dst\"", &dst) ||
        !payload_end(payload, n, "\"src\"", &src) ||
        map_call(BPF_MAP_LOOKUP_ELEM, pe->lsn.addrs, &dst.sin_addr.s_addr, &cookie) != 0)
        return false;
    me.sin_addr.s_addr = pe->lsn.bind_ip;
    socklen_t len = sizeof me;
    int fd = socket(AF_INET, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0);
    struct { uint32_t local_ip4, remote_ip4; uint16_t local_port, remote_port; } key;
    struct { uint32_t ip4; uint16_t port, pad; } client = {src.sin_addr.s_addr, src.sin_port, 0};
    struct chan *ch = NULL;
    if (fd < 0 || bind(fd, (struct sockaddr *)&me, sizeof me) < 0 ||
        getsockname(fd, (struct sockaddr *)&me, &len) < 0)
        goto refuse;
    key.local_ip4 = dst.sin_addr.s_addr;
    key.remote_ip4 = me.sin_addr.s_addr;
    key.local_port = dst.sin_port;
    key.remote_port = me.sin_port;
    if (map_call(BPF_MAP_UPDATE_ELEM, pe->lsn.peers, &key, &client) != 0) goto refuse;
    int sz = PUMP_SNDBUF;
    setsockopt(fd, SOL_SOCKET, SO_SNDBUF, &sz, sizeof sz);
    if (connect(fd, (struct sockaddr *)&dst, sizeof dst) < 0 && errno != EINPROGRESS) {
        map_call(BPF_MAP_DELETE_ELEM, pe->lsn.peers, &key, NULL);
        goto refuse;
    }
    if (!(ch = chan_new(l, slot, gen, fd, ACCEPTING))) {
        map_call(BPF_MAP_DELETE_ELEM, pe->lsn.peers, &key, NULL);
        goto refuse;
    }
    ch->pumped = ch->connecting = ch->has_peer_key = true;
    memcpy(ch->peer_key, &key, sizeof ch->peer_key);
    ch->writing = true;   /* writable: the connect is done */
    interest(ch);
    return true;
refuse:
    if (fd >= 0) close(fd);
    ctl(l, REFUSE, slot, gen, 0, 0, NULL, 0);
    return true;
}


/* the engine's connect to a pod completed (or failed): the peer's OPEN is answered */
static void connected(struct chan *ch) {
    int err = 0;
    socklen_t len = sizeof err;
    if (getsockopt(ch->fd, SOL_SOCKET, SO_ERROR, &err, &len) < 0) err = errno;
    if (err == EINPROGRESS || err == EALREADY) return;
    ch->connecting = ch->writing = false;
    interest(ch);
    answer(ch->link, ch, err == 0);
}

static void opened(struct link *l, uint32_t slot, uint32_t gen, const uint8_t *payload, uint32_t n) {
    if (slot % 2 == (uint32_t)l->parity) {
        char why[64];
        snprintf(why, sizeof why, "the peer opened slot %u, one of ours", slot);
        return violation(l, why);
    }
    if (l->chans[slot]) {   /* the peer opens a slot again only after our RELEASE of it */
        char why[96];
        snprintf(why, sizeof why, "the peer opened slot %u again before it was released", slot);
        return violation(l, why);
    }
    if (connect_pod(l, slot, gen, payload, n)) return;
    int ours, app;
    if (socketpair_for(&ours, &app) < 0) {
        ctl(l, REFUSE, slot, gen, 0, 0, NULL, 0);
        return;
    }
    struct chan *ch = chan_new(l, slot, gen, ours, ACCEPTING);
    if (!ch) {
        close(ours);
        close(app);
        ctl(l, REFUSE, slot, gen, 0, 0, NULL, 0);
        return;
    }
    /* tsord answers with pe_answer (or pe_link_fail where the payload makes no sense) */
    if (!emit(l->pe, EV_ACCEPT, l->id, slot, gen, 0, app, 0, payload, n)) {
        close(app);
        answer(l, ch, false);
    }
}

/* one control record; false once a bad one took the link down */
static bool record(struct link *l, int kind, uint32_t slot, uint32_t gen, uint32_t v1, uint32_t v2,
                   const uint8_t *payload, uint32_t n) {
    char why[128];
    if (kind == CTL_CREDIT) {
        uint64_t acked = advance(l->ctl_acked, v1), rq_total = advance(l->peer_rq_total, v2);
        if (acked > l->ctl_sent || rq_total - l->imm_sent > l->remote.rq_depth) {
            violation(l, "credit for more than was sent or posted");
            return false;
        }
        l->ctl_acked = acked;
        l->peer_rq_total = rq_total;
        unblock(l);
        return l->up;
    }
    if (kind < OPEN || kind > RELEASE) {
        snprintf(why, sizeof why, "control record %d for slot %u: unknown record type %d", kind, slot, kind);
        violation(l, why);
        return false;
    }
    if (slot == 0 || slot >= l->slots) {
        snprintf(why, sizeof why, "control record %d for slot %u: slot %u out of range", kind, slot, slot);
        violation(l, why);
        return false;
    }
    struct chan *ch = l->chans[slot];
    if (ch && ch->gen != gen && kind != OPEN) ch = NULL;
    switch (kind) {
    case OPEN:
        opened(l, slot, gen, payload, n);
        return l->up;
    case RELEASE:
        if (slot % 2 == (uint32_t)l->parity && gen == l->gens[slot]) {
            l->unreleased[slot] = false;
            room_changed(l);
        }
        return true;
    case RESET:
        ctl(l, RESET_ACK, slot, gen, 0, 0, NULL, 0);
        if (ch) {
            abort_chan(ch);
            update(ch);
        }
        return l->up;
    }
    if (!ch) return true;   /* a late record for a connection already gone */
    if (kind == CREDIT) {
        uint64_t acked = advance(ch->tx_acked, v1);
        if (acked > ch->tx_sent) {
            snprintf(why, sizeof why, "control record %d for slot %u: credit for %llu bytes never sent", kind, slot,
                     (unsigned long long)(acked - ch->tx_sent));
            violation(l, why);
            return false;
        }
        ch->tx_acked = acked;
        update(ch);
    } else if (kind == ACCEPT && ch->state == OPENING) {
        ch->state = OPEN_;
        if (ch->token)   /* (the listener's channels have no opener waiting) */
            emit(l->pe, EV_OPENED, l->id, slot, ch->gen, ch->token, -1, 1, NULL, 0);
        ch->token = 0;
        update(ch);
    } else if (kind == REFUSE && ch->state == OPENING) {
        abort_chan(ch);
        chan_drop(l, ch);
        l->unreleased[slot] = false;
        room_changed(l);
    } else if (kind == RESET_ACK && ch->reset_pending) {
        ch->reset_pending = false;
        update(ch);
    }
    return l->up;
}

/* act on the complete control records received; false once a bad one took the link down */
static bool control(struct link *l) {
    struct buf *b = &l->ctl_in;
    while (buf_size(b) >= CTL_SIZE) {
        const uint8_t *r = b->p + b->head;
        uint32_t n = get16(r + 13);
        if (n > MAX_CTL_PAYLOAD) {
            char why[64];
            snprintf(why, sizeof why, "a control record of %u bytes", n);
            violation(l, why);
            return false;
        }
        if (buf_size(b) < CTL_SIZE + n) break;
        b->head += CTL_SIZE + n;
        if (!record(l, r[0], get16(r + 1), get16(r + 3), get32(r + 5), get32(r + 9), r + CTL_SIZE, n)) return false;
    }
    return true;
}

/* ---- completions ---------------------------------------------------------------------------- */
static void mark(struct link *l, struct chan *ch, uint32_t *np) {
    if (!ch->marked) {
        ch->marked = true;
        l->pending[(*np)++] = ch;
    }
}

static void completions(struct link *l, struct ibv_wc *wcs, int n) {
    uint64_t ring = l->ring;
    uint32_t np = 0;
    char why[128];
    for (int i = 0; i < n && l->up; i++) {
        struct ibv_wc *wc = &wcs[i];
        if (wc->status != IBV_WC_SUCCESS) {
            down(l, R_VERBS, "work request failed: %s", ibv_wc_status_str(wc->status));
            break;
        }
        if (wc->opcode == IBV_WC_RECV_RDMA_WITH_IMM) {
            struct ibv_recv_wr wr = {0}, *bad;
            int rc = ibv_post_recv(l->qp, &wr, &bad);
            if (rc) {
                down(l, R_VERBS, "post_recv failed: %s", strerror(rc));
                break;
            }
            l->rq_posted++;
            uint32_t imm = ntohl(wc->imm_data), slot = imm & ~FIN;
            if (slot >= l->slots) {
                snprintf(why, sizeof why, "a write for slot %u of %u", slot, l->slots);
                violation(l, why);
                break;
            }
            if (slot == 0) {
                uint64_t off = l->ctl_rx % ring;
                if (off + wc->byte_len > ring || l->ctl_rx + wc->byte_len - l->ctl_reported > ring) {
                    snprintf(why, sizeof why, "%u control bytes past the ring or its credit", wc->byte_len);
                    violation(l, why);
                    break;
                }
                if (!buf_put(&l->ctl_in, l->rx + off, wc->byte_len)) {
                    down(l, R_VERBS, "out of memory for control records");
                    break;
                }
                l->ctl_rx += wc->byte_len;
                if (!control(l)) break;
                continue;
            }
            struct chan *ch = l->chans[slot];
            if (!ch || ch->state != OPEN_) continue;   /* a closing channel's last bytes: nobody reads them */
            if (ch->rx_tail % ring + wc->byte_len > ring || ch->rx_tail + wc->byte_len - ch->rx_credited > ring) {
                snprintf(why, sizeof why, "%u bytes for slot %u past its ring or its credit", wc->byte_len, slot);
                violation(l, why);
                break;
            }
            ch->rx_tail += wc->byte_len;
            if (imm & FIN) ch->fin_rx = true;
            mark(l, ch, &np);
        } else {
            while (l->wr_done <= wc->wr_id && l->wr_done < l->wr_next) {
                struct chan *ch = l->wr_ch[l->wr_done % l->sq_depth];
                l->wr_done++;
                l->sq_used--;
                if (ch) {
                    ch->inflight--;
                    if (ch->inflight == 0 && l->chans[ch->slot] == ch) mark(l, ch, &np);
                }
            }
        }
    }
    for (uint32_t i = 0; i < np; i++) {
        struct chan *ch = l->pending[i];
        ch->marked = false;
        if (!l->up || ch->dead || l->chans[ch->slot] != ch) continue;
        if (ch->state == OPEN_) deliver(ch);
        else update(ch);
    }
}

static void on_cq(struct link *l) {
    struct ibv_cq *cq;
    void *cqctx;
    while (ibv_get_cq_event(l->cc, &cq, &cqctx) == 0) l->unacked_events++;
    if (l->unacked_events >= 256) {
        ibv_ack_cq_events(l->cq, l->unacked_events);
        l->unacked_events = 0;
    }
    struct ibv_wc wcs[CQ_BATCH];
    while (l->up) {
        int n = ibv_poll_cq(l->cq, CQ_BATCH, wcs);
        if (n < 0) return down(l, R_VERBS, "poll_cq failed");
        if (n < CQ_BATCH) {
            if (ibv_req_notify_cq(l->cq, 0)) return down(l, R_VERBS, "req_notify_cq failed");
            int m = ibv_poll_cq(l->cq, CQ_BATCH - n, wcs + n);   /* what came between the poll and the arming */
            if (m < 0) return down(l, R_VERBS, "poll_cq failed");
            n += m;
            if (n < CQ_BATCH) {
                completions(l, wcs, n);
                break;
            }
        }
        completions(l, wcs, n);
    }
    if (l->up) {
        unblock(l);
        if (l->up) flush_ctl(l);
    }
}

/* ---- the greeting --------------------------------------------------------------------------- */
/* the accepting channel's first byte: the listener's GREETING (it took the connection), or end of
 * file (it never will) */
static void greeted(struct chan *ch) {
    struct link *l = ch->link;
    uint8_t first;
    ssize_t got = recv(ch->fd, &first, 1, MSG_DONTWAIT);
    if (got < 0 && (errno == EAGAIN || errno == EINTR)) return;
    ch->reading = ch->greeting = false;
    interest(ch);
    answer(l, ch, got == 1 && first == 1);
}

/* ---- the end of a link ---------------------------------------------------------------------- */
static void down(struct link *l, int reason, const char *fmt, ...) {
    if (!l->up) return;
    l->up = false;
    room_changed(l);
    char why[256];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(why, sizeof why, fmt, ap);
    va_end(ap);
    if (reason != R_NONE && !l->closed) l->pe->stats.resets[reason]++;
    if (l->watching) {
        epoll_ctl(l->pe->ep, EPOLL_CTL_DEL, l->cc->fd, NULL);
        l->watching = false;
    }
    uint32_t n = l->n_channels;
    for (uint32_t s = 1; s < l->slots; s++) {
        struct chan *ch = l->chans[s];
        if (!ch) continue;
        abort_chan(ch);
        chan_drop(l, ch);
    }
    if (!l->closed) {
        char msg[320];
        int len = snprintf(msg, sizeof msg, "%s: %u connections reset", why, n);
        emit(l->pe, EV_DOWN, l->id, 0, 0, 0, -1, reason, msg, (uint32_t)len);
    }
}

static void link_free(struct link *l) {
    if (l->qp) ibv_destroy_qp(l->qp);
    if (l->rx_mr) ibv_dereg_mr(l->rx_mr);
    if (l->tx_mr) ibv_dereg_mr(l->tx_mr);
    if (l->cq) {
        if (l->unacked_events) ibv_ack_cq_events(l->cq, l->unacked_events);
        ibv_destroy_cq(l->cq);
    }
    if (l->cc) ibv_destroy_comp_channel(l->cc);
    if (l->pd) ibv_dealloc_pd(l->pd);
    if (l->ctx) ibv_close_device(l->ctx);
    if (l->rx) munmap(l->rx, l->size);
    if (l->tx) munmap(l->tx, l->size);
    free(l->chans);
    free(l->gens);
    free(l->unreleased);
    free(l->pending);
    free(l->wr_ch);
    free(l->ctl_in.p);
    free(l->ctl_out.p);
    free(l);
}

static void link_close(struct link *l) {
    if (l->closed) return;
    l->closed = true;
    l->pe->links[l->id] = NULL;
    down(l, R_NONE, "closed");   /* drops every channel: a link has channels only while it is up */
    publish_room(l);             /* none: its id's connects are native until a new link has it */
    l->dead = true;
    l->next_dead = l->pe->dead_links;
    l->pe->dead_links = l;
}

/* ---- the engine thread ---------------------------------------------------------------------- */
static void reap(struct pe *pe) {
    while (pe->dead_chans) {
        struct chan *ch = pe->dead_chans;
        pe->dead_chans = ch->next_dead;
        if (ch->has_peer_key && pe->lsn.peers >= 0) map_call(BPF_MAP_DELETE_ELEM, pe->lsn.peers, ch->peer_key, NULL);
        free(ch);
    }
    while (pe->dead_links) {
        struct link *l = pe->dead_links;
        pe->dead_links = l->next_dead;
        link_free(l);
    }
}

static void on_listener(struct pe *pe);

static void *run(void *arg) {
    struct pe *pe = arg;
    struct epoll_event evs[64];
    int64_t next_check = now_ns() + STALL_CHECK_MS * 1000000LL;
    pthread_mutex_lock(&pe->mu);
    while (pe->running) {
        int64_t wait_ms = (next_check - now_ns()) / 1000000LL;
        pthread_mutex_unlock(&pe->mu);
        int n = epoll_wait(pe->ep, evs, 64, wait_ms < 0 ? 0 : (int)wait_ms + 1);
        pthread_mutex_lock(&pe->mu);
        for (int i = 0; i < n && pe->running; i++) {
            void *p = evs[i].data.ptr;
            if (!p) {   /* the bell */
                uint64_t v;
                if (read(pe->bell, &v, sizeof v) < 0) {}
                continue;
            }
            if (*(int *)p == H_EVENTS) {
                flush_events(pe);
                continue;
            }
            if (*(int *)p == H_LISTEN) {
                on_listener(pe);
                continue;
            }
            if (*(int *)p == H_LINK) {
                struct link *l = p;
                if (!l->dead && l->up) on_cq(l);
                continue;
            }
            struct chan *ch = p;
            struct link *l = ch->link;
            if (ch->dead || l->dead || !l->up) continue;
            uint32_t e = evs[i].events;
            if (ch->state == ACCEPTING && ch->connecting) {
                connected(ch);
            } else if (ch->state == ACCEPTING && ch->greeting) {
                greeted(ch);
            } else {
                if (ch->reading && e & (EPOLLIN | EPOLLHUP | EPOLLERR)) readable(ch);
                if (!ch->dead && l->up && ch->writing && e & (EPOLLOUT | EPOLLHUP | EPOLLERR)) deliver(ch);
            }
            if (l->up) flush_ctl(l);
        }
        int64_t now = now_ns();
        if (now >= next_check) {
            for (int i = 1; i < MAX_LINKS; i++)
                if (pe->links[i]) check_stall(pe->links[i], now);
            next_check = now + STALL_CHECK_MS * 1000000LL;
        }
        if (pe->room_dirty) {
            pe->room_dirty = false;
            for (int i = 1; i < MAX_LINKS; i++)
                if (pe->links[i] && pe->links[i]->room_dirty) publish_room(pe->links[i]);
        }
        reap(pe);
    }
    pthread_mutex_unlock(&pe->mu);
    return NULL;
}

/* ---- tsord's calls (any thread; each takes the engine's mutex) ------------------------------ */
struct pe *pe_new(int events) {
    struct pe *pe = calloc(1, sizeof *pe);
    if (!pe) return NULL;
    pthread_mutex_init(&pe->mu, NULL);
    pe->events = events;
    pe->events_kind = H_EVENTS;
    pe->lsn = (struct listener){H_LISTEN, -1, -1, -1, -1, -1, 0};
    pe->running = true;
    pe->ep = epoll_create1(EPOLL_CLOEXEC);
    pe->bell = eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC);
    struct epoll_event e = {.events = EPOLLIN, .data.ptr = NULL};
    if (pe->ep < 0 || pe->bell < 0 || epoll_ctl(pe->ep, EPOLL_CTL_ADD, pe->bell, &e) < 0 ||
        pthread_create(&pe->thread, NULL, run, pe) != 0) {
        int err = errno;
        if (pe->ep >= 0) close(pe->ep);
        if (pe->bell >= 0) close(pe->bell);
        free(pe);
        errno = err;
        return NULL;
    }
    pthread_setname_np(pe->thread, "tsor-rdma-pump");
    return pe;
}

void pe_free(struct pe *pe) {
    pthread_mutex_lock(&pe->mu);
    pe->running = false;
    for (int i = 1; i < MAX_LINKS; i++)
        if (pe->links[i]) link_close(pe->links[i]);
    uint64_t one = 1;
    if (write(pe->bell, &one, sizeof one) < 0) {}
    pthread_mutex_unlock(&pe->mu);
    pthread_join(pe->thread, NULL);
    reap(pe);
    close(pe->ep);
    close(pe->bell);
    if (pe->lsn.fd >= 0) close(pe->lsn.fd);
    if (pe->lsn.conns >= 0) close(pe->lsn.conns);
    if (pe->lsn.peers >= 0) close(pe->lsn.peers);
    if (pe->lsn.addrs >= 0) close(pe->lsn.addrs);
    if (pe->lsn.room >= 0) close(pe->lsn.room);
    free(pe->evq.p);
    pthread_mutex_destroy(&pe->mu);
    free(pe);
}

static struct ibv_context *open_by_name(const char *name) {
    int n;
    struct ibv_device **list = ibv_get_device_list(&n);
    if (!list) return NULL;
    struct ibv_context *ctx = NULL;
    for (int i = 0; i < n; i++)
        if (!strcmp(ibv_get_device_name(list[i]), name)) {
            ctx = ibv_open_device(list[i]);
            break;
        }
    if (!ctx && !errno) errno = ENODEV;
    ibv_free_device_list(list);
    return ctx;
}

/* a new QP to a peer node on `dev`'s `port` with GID `gid_index`: its set-up info in *out; the link's
 * id (> 0), or -1 with err filled */
int pe_link_new(struct pe *pe, const char *dev, int port, int gid_index, uint32_t ring, uint32_t slots,
                uint32_t sq_depth, uint32_t rq_depth, struct pe_info *out, char *err, int errlen) {
    if (slots < 2 || slots > 65536 || ring < 4096 || ring > (1u << 30) || !sq_depth || !rq_depth) {
        seterr(err, errlen, "ring sizes out of range");
        return -1;
    }
    struct link *l = calloc(1, sizeof *l);
    if (!l) {
        seterr(err, errlen, "out of memory");
        return -1;
    }
    l->kind = H_LINK;
    l->pe = pe;
    l->ring = ring;
    l->slots = slots;
    l->sq_depth = sq_depth;
    l->rq_depth = rq_depth;
    l->port = port;
    l->gid_index = gid_index;
    l->size = (size_t)ring * slots;
    l->chans = calloc(slots, sizeof *l->chans);
    l->gens = calloc(slots, sizeof *l->gens);
    l->unreleased = calloc(slots, sizeof *l->unreleased);
    l->pending = calloc(slots, sizeof *l->pending);
    l->wr_ch = calloc(sq_depth, sizeof *l->wr_ch);
    l->wr_next = l->wr_done = 1;
    const char *step = "memory";
    struct ibv_port_attr pa;
    union ibv_gid gid;
    if (!l->chans || !l->gens || !l->unreleased || !l->pending || !l->wr_ch) goto fail;
    step = "open the device";
    if (!(l->ctx = open_by_name(dev))) goto fail;
    step = "query the port";
    if ((errno = ibv_query_port(l->ctx, port, &pa))) goto fail;
    step = "query the GID";
    if (ibv_query_gid(l->ctx, port, gid_index, &gid)) goto fail;
    step = "allocate a PD";
    if (!(l->pd = ibv_alloc_pd(l->ctx))) goto fail;
    step = "create a completion channel";
    if (!(l->cc = ibv_create_comp_channel(l->ctx))) goto fail;
    fcntl(l->cc->fd, F_SETFL, fcntl(l->cc->fd, F_GETFL) | O_NONBLOCK);
    step = "create a CQ";
    if (!(l->cq = ibv_create_cq(l->ctx, sq_depth + rq_depth + 64, NULL, l->cc, 0))) goto fail;
    step = "create a QP";
    struct ibv_qp_init_attr qia = {.send_cq = l->cq, .recv_cq = l->cq, .qp_type = IBV_QPT_RC, .sq_sig_all = 0,
                                   .cap = {.max_send_wr = sq_depth, .max_recv_wr = rq_depth,
                                           .max_send_sge = 1, .max_recv_sge = 1}};
    if (!(l->qp = ibv_create_qp(l->pd, &qia))) goto fail;
    step = "map the rings";
    l->rx = mmap(NULL, l->size, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    l->tx = mmap(NULL, l->size, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (l->rx == MAP_FAILED || l->tx == MAP_FAILED) {
        if (l->rx == MAP_FAILED) l->rx = NULL;
        if (l->tx == MAP_FAILED) l->tx = NULL;
        goto fail;
    }
    step = "register the rings";
    if (!(l->rx_mr = ibv_reg_mr(l->pd, l->rx, l->size, IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_REMOTE_WRITE)))
        goto fail;
    if (!(l->tx_mr = ibv_reg_mr(l->pd, l->tx, l->size, IBV_ACCESS_LOCAL_WRITE))) goto fail;
    step = "bring the QP to INIT";
    struct ibv_qp_attr a = {.qp_state = IBV_QPS_INIT, .pkey_index = 0, .port_num = port,
                            .qp_access_flags = IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_REMOTE_WRITE};
    if ((errno = ibv_modify_qp(l->qp, &a, IBV_QP_STATE | IBV_QP_PKEY_INDEX | IBV_QP_PORT | IBV_QP_ACCESS_FLAGS)))
        goto fail;
    step = "post receives";
    for (uint32_t i = 0; i < rq_depth; i++) {
        struct ibv_recv_wr wr = {0}, *bad;
        if ((errno = ibv_post_recv(l->qp, &wr, &bad))) goto fail;
    }
    uint32_t psn;
    if (getrandom(&psn, sizeof psn, 0) != sizeof psn) psn = (uint32_t)now_ns();
    l->max_write = pa.max_msg_sz < MAX_WRITE ? pa.max_msg_sz : MAX_WRITE;
    l->info = (struct pe_info){.qpn = l->qp->qp_num, .psn = psn & 0xFFFFFF, .lid = pa.lid,
                               .addr = (uintptr_t)l->rx, .rkey = l->rx_mr->rkey, .ring = ring, .slots = slots,
                               .rq_depth = rq_depth, .max_msg = l->max_write};
    memcpy(l->info.gid, gid.raw, 16);
    l->rq_posted = l->rq_reported = rq_depth;
    pthread_mutex_lock(&pe->mu);
    int id = 0;
    for (int i = 1; i < MAX_LINKS; i++)
        if (!pe->links[i]) {
            id = i;
            break;
        }
    if (id) {
        l->id = id;
        pe->links[id] = l;
    }
    pthread_mutex_unlock(&pe->mu);
    if (!id) {
        errno = EMFILE;
        step = "find a free link id";
        goto fail;
    }
    *out = l->info;
    return id;
fail:
    seterr(err, errlen, "%s: %s: %s", dev, step, strerror(errno ? errno : EINVAL));
    link_free(l);
    return -1;
}

static struct link *find(struct pe *pe, int id) {
    return id > 0 && id < MAX_LINKS ? pe->links[id] : NULL;
}

/* connect the QP to the peer's (RTR, then RTS) and start pumping; parity: which slots we open (1:
 * odd). 0, or -1 with err filled */
int pe_link_connect(struct pe *pe, int id, const struct pe_info *remote, int parity, char *err, int errlen) {
    pthread_mutex_lock(&pe->mu);
    struct link *l = find(pe, id);
    int rc = -1;
    if (!l) {
        seterr(err, errlen, "no such link");
        goto out;
    }
    struct ibv_port_attr pa;
    int qe = ibv_query_port(l->ctx, l->port, &pa);
    if (qe) {
        seterr(err, errlen, "query the port: %s", strerror(qe));
        goto out;
    }
    bool global = false;
    for (int i = 0; i < 16; i++) global |= remote->gid[i] != 0;
    struct ibv_qp_attr a = {.qp_state = IBV_QPS_RTR, .path_mtu = pa.active_mtu, .dest_qp_num = remote->qpn,
                            .rq_psn = remote->psn & 0xFFFFFF, .max_dest_rd_atomic = 1, .min_rnr_timer = MIN_RNR_TIMER};
    a.ah_attr.port_num = l->port;
    a.ah_attr.dlid = remote->lid;
    a.ah_attr.is_global = global;
    if (global) {   /* RoCE: a GRH to the peer's GID */
        memcpy(a.ah_attr.grh.dgid.raw, remote->gid, 16);
        a.ah_attr.grh.sgid_index = l->gid_index;
        a.ah_attr.grh.hop_limit = 64;
    }
    int e = ibv_modify_qp(l->qp, &a, IBV_QP_STATE | IBV_QP_AV | IBV_QP_PATH_MTU | IBV_QP_DEST_QPN | IBV_QP_RQ_PSN |
                                         IBV_QP_MAX_DEST_RD_ATOMIC | IBV_QP_MIN_RNR_TIMER);
    if (e) {
        seterr(err, errlen, "modify_qp to RTR: %s", strerror(e));
        goto out;
    }
    struct ibv_qp_attr b = {.qp_state = IBV_QPS_RTS, .sq_psn = l->info.psn, .timeout = QP_TIMEOUT,
                            .retry_cnt = RETRY_CNT, .rnr_retry = RNR_RETRY_INFINITE, .max_rd_atomic = 1};
    e = ibv_modify_qp(l->qp, &b, IBV_QP_STATE | IBV_QP_SQ_PSN | IBV_QP_TIMEOUT | IBV_QP_RETRY_CNT | IBV_QP_RNR_RETRY |
                                     IBV_QP_MAX_QP_RD_ATOMIC);
    if (e) {
        seterr(err, errlen, "modify_qp to RTS: %s", strerror(e));
        goto out;
    }
    l->remote = *remote;
    l->parity = parity;
    l->peer_rq_total = remote->rq_depth;
    l->up = true;
    publish_room(l);
    struct epoll_event ev = {.events = EPOLLIN, .data.ptr = l};
    if (epoll_ctl(pe->ep, EPOLL_CTL_ADD, l->cc->fd, &ev) < 0 || ibv_req_notify_cq(l->cq, 0)) {
        seterr(err, errlen, "watch the completion channel: %s", strerror(errno));
        l->up = false;
        goto out;
    }
    l->watching = true;
    rc = 0;
out:
    pthread_mutex_unlock(&pe->mu);
    return rc;
}

/* a new channel of ours in `slot` (from free_slot) with `fd` as its end, and the OPEN asking the
 * peer for it; NULL: no memory (nothing changed) */
static struct chan *open_slot(struct link *l, uint32_t slot, int fd, const void *payload, uint32_t n) {
    struct chan *ch = chan_new(l, slot, (uint16_t)(l->gens[slot] + 1), fd, OPENING);
    if (!ch) return NULL;
    l->gens[slot] = ch->gen;
    l->unreleased[slot] = true;
    room_changed(l);
    ctl(l, OPEN, slot, ch->gen, 0, 0, payload, n);
    flush_ctl(l);
    return ch;
}

static int free_slot(struct link *l) {
    for (uint32_t i = 0; i < l->slots; i++) {
        uint32_t s = (l->cursor + i) % l->slots;
        if (s && s % 2 == (uint32_t)l->parity && !l->chans[s] && !l->unreleased[s]) {
            l->cursor = s + 1;
            return (int)s;
        }
    }
    return -1;
}

/* ---- the kernel-chosen path's listener -------------------------------------------------------- */
static void set_socket(int fd) {
    int sz = PUMP_SNDBUF;
    fcntl(fd, F_SETFL, fcntl(fd, F_GETFL) | O_NONBLOCK);
    setsockopt(fd, SOL_SOCKET, SO_SNDBUF, &sz, sizeof sz);
}

/* one accepted connection: a channel to the node the conns map names, or a reset */
static void take(struct pe *pe, int fd) {
    struct sockaddr_in peer;
    socklen_t len = sizeof peer;
    struct { uint32_t ip4; uint16_t port, pad; } key = {0, 0, 0};
    struct { uint32_t ip4; uint16_t port, link; } to;
    struct link *l = NULL;
    int slot = -1;
    if (getpeername(fd, (struct sockaddr *)&peer, &len) == 0 && peer.sin_family == AF_INET) {
        key.ip4 = peer.sin_addr.s_addr;
        key.port = peer.sin_port;
        if (map_call(BPF_MAP_LOOKUP_ELEM, pe->lsn.conns, &key, &to) == 0) {
            map_call(BPF_MAP_DELETE_ELEM, pe->lsn.conns, &key, NULL);
            l = to.link > 0 && to.link < MAX_LINKS ? pe->links[to.link] : NULL;
            slot = l && l->up && !l->dead ? free_slot(l) : -1;
        }
    }
    if (slot < 0) {   /* not a connection the programs sent here, or no way to carry it now */
        pe->stats.unclaimed++;
        linger0(fd);
        close(fd);
        return;
    }
    char src[INET_ADDRSTRLEN], dst[INET_ADDRSTRLEN], payload[128];
    struct in_addr d = {to.ip4};
    inet_ntop(AF_INET, &peer.sin_addr, src, sizeof src);
    inet_ntop(AF_INET, &d, dst, sizeof dst);
    int n = snprintf(payload, sizeof payload, "{\"src\": [\"%s\", %u], \"dst\": [\"%s\", %u]}", src,
                     ntohs(peer.sin_port), dst, ntohs(to.port));
    set_socket(fd);
    struct chan *ch = open_slot(l, (uint32_t)slot, fd, payload, (uint32_t)n);
    if (!ch) {
        pe->stats.unclaimed++;
        linger0(fd);
        close(fd);
        return;
    }
    ch->pumped = true;
    pe->stats.accepted++;
}

static void on_listener(struct pe *pe) {
    for (int i = 0; i < 64 && pe->lsn.fd >= 0; i++) {   /* a batch, then the links get their turn */
        int fd = accept4(pe->lsn.fd, NULL, NULL, SOCK_CLOEXEC);
        if (fd < 0) return;   /* EAGAIN: none left (the listener is non-blocking) */
        take(pe, fd);
    }
}

/* the kernel-chosen path's maps: the programs' conns map (the listener reads where each connection
 * goes), peers map (written before the engine connects to a pod, deleted when the channel goes) and
 * the sockmap path's address map (the pods of this node, which the engine connects to from
 * `bind_ip`, network order) and the room map (each link's free channels, which connects take and
 * the engine writes again as they change); duplicated here. 0, or -1 with errno. */
int pe_maps(struct pe *pe, int conns, int peers, int addrs, int room, uint32_t bind_ip) {
    int fds[4] = {conns, peers, addrs, room}, dup[4];
    for (int i = 0; i < 4; i++) {
        dup[i] = fcntl(fds[i], F_DUPFD_CLOEXEC, 0);
        if (dup[i] < 0) {
            int err = errno;
            while (i--) close(dup[i]);
            errno = err;
            return -1;
        }
    }
    pthread_mutex_lock(&pe->mu);
    int *mine[4] = {&pe->lsn.conns, &pe->lsn.peers, &pe->lsn.addrs, &pe->lsn.room};
    for (int i = 0; i < 4; i++) {
        if (*mine[i] >= 0) close(*mine[i]);
        *mine[i] = dup[i];
    }
    pe->lsn.bind_ip = bind_ip;
    for (int i = 1; i < MAX_LINKS; i++)   /* links already up: their room now */
        if (pe->links[i]) publish_room(pe->links[i]);
    pthread_mutex_unlock(&pe->mu);
    return 0;
}

/* the kernel-chosen path: accept connections on `fd` (a listening TCP socket; the engine takes it
 * over) once pe_maps gave the conns map. 0, or -1 with errno. */
int pe_listen(struct pe *pe, int fd) {
    pthread_mutex_lock(&pe->mu);
    int rc = -1;
    struct epoll_event e = {.events = EPOLLIN, .data.ptr = &pe->lsn};
    if (pe->lsn.fd >= 0 || pe->lsn.conns < 0) {
        errno = pe->lsn.fd >= 0 ? EBUSY : EINVAL;
    } else {
        fcntl(fd, F_SETFL, fcntl(fd, F_GETFL) | O_NONBLOCK);
        if (epoll_ctl(pe->ep, EPOLL_CTL_ADD, fd, &e) == 0) {
            pe->lsn.fd = fd;
            rc = 0;
        }
    }
    pthread_mutex_unlock(&pe->mu);
    return rc;
}

/* ask the peer for a connection (payload: the OPEN's, rdma.py's JSON {src, dst}). The application's
 * end goes to *app_fd at once and belongs to the caller; an EV_OPENED with the caller's token (> 0)
 * says whether the peer took it (code 1) or not. 1, or 0: no free slot, or the link is down. */
int pe_open(struct pe *pe, int id, int64_t token, const void *payload, uint32_t n, int *app_fd) {
    int rc = 0;
    if (n > MAX_CTL_PAYLOAD || token <= 0) return 0;
    pthread_mutex_lock(&pe->mu);
    struct link *l = find(pe, id);
    int slot = l && l->up ? free_slot(l) : -1;
    int ours, app;
    if (slot < 0 || socketpair_for(&ours, &app) < 0) goto out;
    struct chan *ch = open_slot(l, (uint32_t)slot, ours, payload, n);
    if (!ch) {
        close(ours);
        close(app);
        goto out;
    }
    ch->token = token;
    rc = 1;
    *app_fd = app;
out:
    pthread_mutex_unlock(&pe->mu);
    return rc;
}

/* the opener gave up waiting: reset the channel if it is still opening */
void pe_cancel(struct pe *pe, int id, int64_t token) {
    pthread_mutex_lock(&pe->mu);
    struct link *l = find(pe, id);
    for (uint32_t s = 1; l && l->up && s < l->slots; s++) {
        struct chan *ch = l->chans[s];
        if (ch && ch->token == token && ch->state == OPENING) {
            ch->token = 0;
            reset_chan(ch);
            if (l->up) flush_ctl(l);
            break;
        }
    }
    pthread_mutex_unlock(&pe->mu);
}

/* the answer to an EV_ACCEPT: 0 refuse, 1 accept, 2 the listener's side writes GREETING first (that
 * byte accepts, end of file refuses; a later 1 is then ignored) */
void pe_answer(struct pe *pe, int id, uint32_t slot, uint32_t gen, int how) {
    pthread_mutex_lock(&pe->mu);
    struct link *l = find(pe, id);
    struct chan *ch = l && l->up && slot < l->slots ? l->chans[slot] : NULL;
    if (ch && ch->gen == gen && ch->state == ACCEPTING && !(how == 1 && ch->greeting)) {
        if (how == 2) {
            ch->reading = ch->greeting = true;
            interest(ch);
        } else {
            answer(l, ch, how == 1);
        }
    }
    pthread_mutex_unlock(&pe->mu);
}

/* tsord found the peer's OPEN unreadable: a protocol violation */
void pe_link_fail(struct pe *pe, int id, const char *why) {
    pthread_mutex_lock(&pe->mu);
    struct link *l = find(pe, id);
    if (l) violation(l, why);
    pthread_mutex_unlock(&pe->mu);
}

/* -1: no such link; else bit 0: up, bits 1..: open connections */
int pe_link_state(struct pe *pe, int id) {
    pthread_mutex_lock(&pe->mu);
    struct link *l = find(pe, id);
    int rc = l ? (int)(l->n_channels << 1 | l->up) : -1;
    pthread_mutex_unlock(&pe->mu);
    return rc;
}

void pe_link_close(struct pe *pe, int id) {
    pthread_mutex_lock(&pe->mu);
    struct link *l = find(pe, id);
    if (l) {
        link_close(l);
        uint64_t one = 1;   /* the engine frees it after its current batch */
        if (write(pe->bell, &one, sizeof one) < 0) {}
    }
    pthread_mutex_unlock(&pe->mu);
}

void pe_get_stats(struct pe *pe, struct pe_stats *out) {
    pthread_mutex_lock(&pe->mu);
    *out = pe->stats;
    pthread_mutex_unlock(&pe->mu);
}
