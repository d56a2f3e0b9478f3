/* quark's front end: the `quark` and `containerd-shim-quark-v1` on PATH.
 *
 * Why it is C: a runc-compatible manager runs `quark create`, `start`, `state`, `kill` and
 * `delete` for every container, and CPython needs ~20 ms to start before it runs a line, which is
 * on its own more than runc needs for a whole `start` (~4 ms). This program starts in well under
 * a millisecond and hands the call to the sandbox factory (qvisor/factory.py), a pre-imported
 * quark that forks a worker to run it: argv, environment and umask in one SOCK_SEQPACKET message,
 * stdin, stdout, stderr and the working directory as fds. It holds no logic of quark's own: the
 * verbs the factory does not serve, and every call when no factory answers or it declines, exec
 * the Python CLI (QUARK_PY, fixed at build time) with the same argv, which behaves exactly as
 * before (and starts a factory on its first create).
 *
 * Run as containerd-shim-quark-v1 (a link to this program), it hands containerd's `... start` and
 * `... delete` to the factory the same way (the shim's server is then forked from a pre-imported
 * worker), and execs the Python shim (QUARK_SHIM_PY) for everything else.
 *
 * The wire format is qvisor/factory.py's encode_request/decode_request; keep the two in step.
 */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <unistd.h>

#if !defined(QUARK_PY) || !defined(QUARK_SHIM_PY)
#error "build with -DQUARK_PY=... -DQUARK_SHIM_PY=... (the venv's console scripts; make frontend)"
#endif

#define MAGIC "quark-factory/2"
#define SHIM "containerd-shim-quark-v1"
#define MAX_REQUEST (1 << 20)   /* factory.MAX_REQUEST */

extern char **environ;

static const char *served[] = {"create", "start", "state", "kill", "delete", "pause", "resume", "ps",
                               "list", "snapshot", NULL};                    /* factory.SERVED */
static const char *detach_flags[] = {"-d", "--detach", NULL};               /* cli._DETACH_FLAGS */
static const char *value_flags[] = {"--root", "--log", "--log-format", "--platform", "--rootless",
                                    NULL};                                   /* cli._VALUE_FLAGS */

static const char *python_program = QUARK_PY;

static void run_python(char **argv)
{
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

/* the verb, found as cli._verb_of finds it: the first argument that is not a flag or a flag's value */
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

static int detached(int argc, char **argv)
{
    for (int i = 1; i < argc; i++)
        if (in(argv[i], detach_flags))
            return 1;
    return 0;
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
        /* factory.served: `run -d` too (a foreground run waits and forwards signals: the CLI's) */
        if (verb && !in(verb, served) && !(strcmp(verb, "run") == 0 && detached(argc, argv)))
            verb = NULL;
    }
    if ((off && strcmp(off, "0") == 0) || !verb)
        run_python(argv);

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
    do
        n = recv(s, reply, sizeof reply - 1, 0);
    while (n < 0 && errno == EINTR);
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
