/* quark's front end: the `quark` and `containerd-shim-quark-v1` on PATH.
 *
 * Why it is C: a runc-compatible manager runs `quark create`, `start`, `state`, `kill` and
 * `delete` for every container, and CPython's start before it runs a line is on its own longer
 * than runc's whole `start` (both measured: bench/README.md, "Start-up and supervisor memory").
 * This program starts at once and hands the call to the sandbox factory (qvisor/factory/), a
 * pre-imported quark that forks a worker to run it: argv, environment and umask in one
 * SOCK_SEQPACKET message, stdin, stdout, stderr and the working directory as fds. It holds no
 * logic of quark's own: the verbs the factory does not serve, and every call when no factory
 * answers or it declines, exec the Python CLI (QUARK_PY, fixed at build time) with the same argv,
 * which behaves exactly as before (and starts a factory on its first create).
 *
 * A foreground `run` waits for its container: the worker tells this program its pid first (a "P"
 * message), and this program forwards the signals `quark run` forwards (SIGHUP, SIGINT, SIGQUIT,
 * SIGTERM, SIGUSR1, SIGUSR2) to it through a pidfd; the worker's `run` sends them on to the
 * container, proxies its terminal and deletes it when it exits, as the CLI's does.
 *
 * Run as containerd-shim-quark-v1 (a link to this program), it hands containerd's `... start` and
 * `... delete` to the factory the same way (the shim's server is then forked from a pre-imported
 * worker), and execs the Python shim (QUARK_SHIM_PY) for everything else.
 *
 * One verb skips the factory: `quark [--root DIR] start ID` (no other flag) goes straight to the
 * container's supervisor, as the CLI's `start` does after its checks (direct_start): the trip
 * through the factory and a worker alone cost about as much as runc's whole `start` (before and
 * after: bench/README.md, "Start-up and supervisor memory"). The
 * supervisor answers "fallback" for what only the CLI does (poststart hooks, the refusal of a
 * container not in the created state) before it does anything, and this program then takes the
 * usual way.
 *
 * The wire format is qvisor/factory/wire.py's encode_request/decode_request; keep the two in step.
 */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <signal.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/syscall.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <unistd.h>

#if !defined(QUARK_PY) || !defined(QUARK_SHIM_PY)
#error "build with -DQUARK_PY=... -DQUARK_SHIM_PY=... (the venv's console scripts; make frontend)"
#endif

#define MAGIC "quark-factory/2"
#define SHIM "containerd-shim-quark-v1"
#define MAX_REQUEST (1 << 20)   /* factory/wire.py: MAX_REQUEST */

extern char **environ;

static const char *served[] = {"create", "start", "state", "kill", "delete", "pause", "resume", "ps",
                               "list", "snapshot", "run", NULL};             /* cli.SERVED */
static const char *value_flags[] = {"--root", "--log", "--log-format", "--platform", "--rootless",
                                    NULL};                                   /* cli.VALUE_FLAGS */
/* what `quark run` forwards to its container (qvisor/commands/run.py: FORWARDED) */
static const int forwarded[] = {SIGHUP, SIGINT, SIGQUIT, SIGTERM, SIGUSR1, SIGUSR2, 0};

static const char *python_program = QUARK_PY;

/* Signal forwarding for `run` (cli.forwards_signals): caught from the start, as runc's run catches
 * them before it creates anything; until the worker's pid is known they wait in `pending`, then
 * each goes to the worker through its pidfd (no reused pid can get one). */
static int forwarding;
static volatile sig_atomic_t worker_pidfd = -1;
static volatile sig_atomic_t pending;   /* bit N: signal N came before the worker's pid */

static void run_python(char **argv)
{
    if (forwarding) {   /* the CLI forwards for itself: back to the defaults, then what waited */
        struct sigaction dfl = {.sa_handler = SIG_DFL};
        for (const int *sig = forwarded; *sig; sig++)
            sigaction(*sig, &dfl, NULL);
        for (const int *sig = forwarded; *sig; sig++)
            if (pending & (1 << *sig))
                raise(*sig);
    }
    execv(python_program, argv);
    fprintf(stderr, "quark: cannot run %s: %s\n", python_program, strerror(errno));
    _exit(127);
}

static int in(const char *s, const char **list)
{
    for (; *list; list++)
        if (strcmp(s, *list) == 0)
            return 1;
    return 0;
}

/* the verb, found as cli.verb_of finds it: the first argument that is not a flag or a flag's value */
static const char *verb_of(int argc, char **argv)
{
    for (int i = 1; i < argc; i++) {
        if (in(argv[i], value_flags))
            i++;
        else if (argv[i][0] != '-')
            return argv[i];
    }
    return NULL;
}

static char *buf;
static size_t len;

static int put(const char *s)
{
    size_t n = strlen(s) + 1;   /* with its NUL, which separates fields */
    if (len + n > MAX_REQUEST)
        return -1;
    memcpy(buf + len, s, n);
    len += n;
    return 0;
}

static int put_count(long n)
{
    char tmp[32];
    snprintf(tmp, sizeof tmp, "%ld", n);
    return put(tmp);
}

static void forward(int sig)
{
    int saved = errno;
    if (worker_pidfd >= 0)
        syscall(SYS_pidfd_send_signal, (int)worker_pidfd, sig, NULL, 0);
    else
        pending |= 1 << sig;
    errno = saved;
}

static void forward_signals(void)
{
    struct sigaction sa = {.sa_handler = forward};
    sigemptyset(&sa.sa_mask);
    for (const int *s = forwarded; *s; s++)
        sigaction(*s, &sa, NULL);
}

/* the worker's pid came ("P<pid>"): forward to it from now on, the signals that waited first */
static void forward_to(pid_t pid)
{
    sigset_t all, old;
    sigfillset(&all);
    sigprocmask(SIG_BLOCK, &all, &old);
    worker_pidfd = (int)syscall(SYS_pidfd_open, pid, 0);
    for (const int *s = forwarded; *s; s++)
        if (pending & (1 << *s) && worker_pidfd >= 0)
            syscall(SYS_pidfd_send_signal, (int)worker_pidfd, *s, NULL, 0);
    pending = 0;
    sigprocmask(SIG_SETMASK, &old, NULL);
}

/* the control socket's protocol (qvisor/channel.py): one JSON object a line */
#define SV_SOCK "sv.sock"                                                   /* state.SOCK_NAME */
#define DEFAULT_ROOT "/run/quark"                                           /* cli.DEFAULT_ROOT */

/* The value of "error" in a reply json.dumps wrote (ASCII: \uXXXX for the rest), unescaped into out. */
static void json_error(const char *reply, char *out, size_t size)
{
    const char *p = strstr(reply, "\"error\": \"");
    size_t n = 0;
    if (!p) {
        snprintf(out, size, "start failed");
        return;
    }
    for (p += 10; *p && *p != '"' && n + 4 < size; p++) {
        if (*p != '\\') {
            out[n++] = *p;
            continue;
        }
        switch (*++p) {
        case 'n': out[n++] = '\n'; break;
        case 't': out[n++] = '\t'; break;
        case 'r': out[n++] = '\r'; break;
        case 'b': out[n++] = '\b'; break;
        case 'f': out[n++] = '\f'; break;
        case 'u': {
            unsigned c = 0;
            if (sscanf(p + 1, "%4x", &c) != 1) {
                out[n] = 0;
                return;
            }
            p += 4;
            if (c < 0x80) {
                out[n++] = (char)c;
            } else if (c < 0x800) {
                out[n++] = (char)(0xc0 | c >> 6);
                out[n++] = (char)(0x80 | (c & 0x3f));
            } else {   /* (a surrogate pair comes out as two replacement-worthy halves: rare in errors) */
                out[n++] = (char)(0xe0 | c >> 12);
                out[n++] = (char)(0x80 | ((c >> 6) & 0x3f));
                out[n++] = (char)(0x80 | (c & 0x3f));
            }
            break;
        }
        case 0: p--; break;
        default: out[n++] = *p;   /* \" \\ \/ */
        }
    }
    out[n] = 0;
}

/* `quark [--root DIR] start ID`: ask the supervisor to start; 0 or 1 as the CLI exits, or -1 when
 * nothing was started and the usual way must run the verb (not this form of the call, no supervisor
 * socket, or the supervisor's "fallback"). */
static int direct_start(int argc, char **argv)
{
    const char *root = DEFAULT_ROOT;
    int i = 1;
    if (i + 1 < argc && strcmp(argv[i], "--root") == 0) {
        root = argv[i + 1];
        i += 2;
    } else if (i < argc && strncmp(argv[i], "--root=", 7) == 0) {
        root = argv[i++] + 7;
    }
    if (argc - i != 2 || strcmp(argv[i], "start") != 0)
        return -1;
    const char *id = argv[i + 1];
    if (!*id || *id == '-' || strchr(id, '/') || strcmp(id, ".") == 0 || strcmp(id, "..") == 0)
        return -1;   /* the CLI says what is wrong with it */
    struct sockaddr_un addr = {.sun_family = AF_UNIX};
    if (snprintf(addr.sun_path, sizeof addr.sun_path, "%s/%s/" SV_SOCK, root, id) >= (int)sizeof addr.sun_path)
        return -1;
    int s = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
    if (s < 0)
        return -1;
    if (connect(s, (struct sockaddr *)&addr, sizeof addr) < 0) {
        close(s);
        return -1;   /* no such container, or it has stopped: the CLI's words for it */
    }
    static const char request[] = "{\"op\": \"start\", \"direct\": true}\n";
    ssize_t w;
    do
        w = send(s, request, sizeof request - 1, MSG_NOSIGNAL);
    while (w < 0 && errno == EINTR);
    if (w != (ssize_t)sizeof request - 1) {
        close(s);
        return -1;   /* nothing (whole) reached it: nothing started */
    }
    static char reply[65536];
    size_t n = 0;
    while (n < sizeof reply - 1 && !memchr(reply, '\n', n)) {
        ssize_t r = recv(s, reply + n, sizeof reply - 1 - n, 0);
        if (r < 0 && errno == EINTR)
            continue;
        if (r <= 0)
            break;
        n += (size_t)r;
    }
    close(s);
    reply[n] = 0;
    if (strstr(reply, "\"fallback\": true"))
        return -1;
    if (strstr(reply, "\"ok\": true"))
        return 0;
    if (!memchr(reply, '\n', n)) {   /* qvisor/client.py's words for a supervisor gone mid-call */
        fprintf(stderr, "quark: the container's supervisor closed the connection\n");
        return 1;
    }
    char message[4096];
    json_error(reply, message, sizeof message);
    fprintf(stderr, "quark: %s\n", message);
    return 1;
}

int main(int argc, char **argv)
{
    const char *off = getenv("QUARK_FACTORY");
    const char *base = strrchr(argv[0], '/');
    int is_shim = strcmp(base ? base + 1 : argv[0], SHIM) == 0;
    const char *prog = is_shim ? SHIM : "quark";
    const char *verb;
    if (is_shim) {
        python_program = QUARK_SHIM_PY;
        /* shim.main._served_by_factory */
        verb = argc > 1 && (strcmp(argv[argc - 1], "start") == 0 || strcmp(argv[argc - 1], "delete") == 0)
               ? argv[argc - 1] : NULL;
    } else {
        verb = verb_of(argc, argv);
        if (verb && !in(verb, served))   /* cli.served_by_factory */
            verb = NULL;
    }
    if ((off && strcmp(off, "0") == 0) || !verb)
        run_python(argv);
    forwarding = !is_shim && strcmp(verb, "run") == 0;   /* cli.forwards_signals */
    if (forwarding)
        forward_signals();
    if (!is_shim && strcmp(verb, "start") == 0) {
        int code = direct_start(argc, argv);
        if (code >= 0)
            return code;
    }

    const char *dir = getenv("QUARK_FACTORY_DIR");
    struct sockaddr_un addr = {.sun_family = AF_UNIX};
    if (snprintf(addr.sun_path, sizeof addr.sun_path, "%s/factory.sock", dir && *dir ? dir : "/run/quark")
        >= (int)sizeof addr.sun_path)
        run_python(argv);

    buf = malloc(MAX_REQUEST);
    if (!buf)
        run_python(argv);
    long envc = 0;
    for (char **e = environ; *e; e++)
        if (strchr(*e, '='))
            envc++;
    int bad = put(MAGIC) || put(prog) || put_count(argc - 1);
    for (int i = 1; i < argc && !bad; i++)
        bad = put(argv[i]);
    bad = bad || put_count(envc);
    for (char **e = environ; *e && !bad; e++)
        if (strchr(*e, '='))
            bad = put(*e);
    mode_t mask = umask(022);
    umask(mask);
    char tmp[16];
    snprintf(tmp, sizeof tmp, "%o", (unsigned)mask);
    if (bad || put(tmp))
        run_python(argv);
    len--;   /* the last field has no separator after it */

    int s = socket(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC, 0);
    if (s < 0 || connect(s, (struct sockaddr *)&addr, sizeof addr) < 0)
        run_python(argv);   /* no factory: the Python CLI runs the verb (and a create starts one) */
    int cwd = open(".", O_PATH | O_DIRECTORY | O_CLOEXEC);
    if (cwd < 0)
        run_python(argv);
    int fds[4] = {0, 1, 2, cwd};
    char control[CMSG_SPACE(sizeof fds)];
    memset(control, 0, sizeof control);
    struct iovec iov = {.iov_base = buf, .iov_len = len};
    struct msghdr msg = {.msg_iov = &iov, .msg_iovlen = 1, .msg_control = control,
                         .msg_controllen = sizeof control};
    struct cmsghdr *c = CMSG_FIRSTHDR(&msg);
    c->cmsg_level = SOL_SOCKET;
    c->cmsg_type = SCM_RIGHTS;
    c->cmsg_len = CMSG_LEN(sizeof fds);
    memcpy(CMSG_DATA(c), fds, sizeof fds);
    ssize_t sent;
    do
        sent = sendmsg(s, &msg, MSG_NOSIGNAL);
    while (sent < 0 && errno == EINTR);
    if (sent != (ssize_t)len)
        run_python(argv);   /* e.g. a closed stdio fd (EBADF): let the CLI deal with it */
    close(cwd);

    char reply[4096];
    ssize_t n;
    for (;;) {
        do
            n = recv(s, reply, sizeof reply - 1, 0);
        while (n < 0 && errno == EINTR);
        if (!(n > 1 && reply[0] == 'P'))
            break;
        reply[n] = 0;
        if (forwarding)
            forward_to((pid_t)atoi(reply + 1));
    }
    if ((n > 0 && reply[0] == 'F') || (n < 0 && errno == ECONNRESET)) {
        close(s);
        run_python(argv);   /* declined, or the factory exited with the request still queued */
    }
    if (n > 1 && reply[0] == 'X') {
        reply[n] = 0;
        return atoi(reply + 1) & 0xff;
    }
    /* the worker ran (part of) the verb and died: running it again could do it twice */
    fprintf(stderr, "%s: %s: the factory's worker ended without an exit status\n", prog, verb);
    return 1;
}
