/* Exercises QKernel's platforms with real process behaviour. One mode per argv[1]; prints what it
 * saw and exits 0 only if everything matched. Built by the tests into a temporary directory.
 *
 *   threads N M     N threads each make M trapped calls (getsockopt, sysinfo) at once
 *   fork-exec SELF  fork+exec, vfork+exec and clone3-then-fork of SELF "child", which checks the
 *                   filter is inherited (bpf denied, sysinfo trapped)
 *   eintr           SIGALRM (no SA_RESTART) during a held getsockopt -> EINTR, quickly
 *   restart         SIGALRM (SA_RESTART) during a held getsockopt -> restarted, succeeds
 *   exit-pending    a thread is held in getsockopt while the process exits
 *   other-threads   a held getsockopt in one thread; another thread's sysinfo calls still finish
 *   sysinfo         prints totalram and mem_unit
 */
#define _GNU_SOURCE
#include <errno.h>
#include <linux/sched.h>
#include <pthread.h>
#include <sched.h>
#include <signal.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/syscall.h>
#include <sys/sysinfo.h>
#include <sys/time.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

static int sock;
static int failures;

static double now(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return ts.tv_sec + ts.tv_nsec / 1e9;
}

static int sndbuf(void) {
    int v = 0;
    socklen_t len = sizeof v;
    if (getsockopt(sock, SOL_SOCKET, SO_TYPE, &v, &len) != 0) return -errno;
    return v;
}

static void check(int ok, const char *what) {
    if (!ok) { failures++; printf("FAIL %s (errno %d)\n", what, errno); }
}

static int iterations;
static int expected_sndbuf;

static void *thread_main(void *arg) {
    (void)arg;
    for (int i = 0; i < iterations; i++) {
        struct sysinfo si;
        if (sndbuf() != expected_sndbuf || sysinfo(&si) != 0 || si.totalram == 0)
            __atomic_add_fetch(&failures, 1, __ATOMIC_SEQ_CST);
    }
    return NULL;
}

static int mode_threads(int n, int m) {
    pthread_t t[256];
    iterations = m;
    expected_sndbuf = sndbuf();
    for (int i = 0; i < n; i++) check(pthread_create(&t[i], NULL, thread_main, NULL) == 0, "pthread_create");
    for (int i = 0; i < n; i++) pthread_join(t[i], NULL);
    printf("threads %d x %d calls, failures %d\n", n, m, failures);
    return failures != 0;
}

static int mode_child(void) {
    struct sysinfo si;
    errno = 0;
    check(syscall(SYS_bpf, 0, NULL, 0) == -1 && errno == EPERM, "bpf denied in child");
    check(sysinfo(&si) == 0, "sysinfo in child");
    check(sndbuf() > 0, "getsockopt in child");
    printf("child %d totalram %lu\n", getpid(), (unsigned long)si.totalram * si.mem_unit);
    return failures != 0;
}

static int wait_ok(pid_t pid) {
    int status;
    return waitpid(pid, &status, 0) == pid && WIFEXITED(status) && WEXITSTATUS(status) == 0;
}

static int mode_fork_exec(const char *self) {
    pid_t pid = fork();
    if (pid == 0) { execl(self, self, "child", NULL); _exit(127); }
    check(pid > 0 && wait_ok(pid), "fork+exec child");

    pid = vfork();
    if (pid == 0) { execl(self, self, "child", NULL); _exit(127); }
    check(pid > 0 && wait_ok(pid), "vfork+exec child");

    /* clone3 is refused with ENOSYS so that callers fall back to clone(2), whose flags the filter sees */
    struct clone_args ca;
    memset(&ca, 0, sizeof ca);
    ca.exit_signal = SIGCHLD;
    errno = 0;
    long r = syscall(SYS_clone3, &ca, sizeof ca);
    if (r == 0) _exit(0);
    check(r == -1 && errno == ENOSYS, "clone3 -> ENOSYS");
    pid = fork();   /* glibc tries clone3 first and falls back */
    if (pid == 0) { execl(self, self, "child", NULL); _exit(127); }
    check(pid > 0 && wait_ok(pid), "fork after clone3 ENOSYS");

    /* a new user namespace is refused through clone(2) */
    errno = 0;
    r = syscall(SYS_clone, CLONE_NEWUSER | SIGCHLD, 0, 0, 0, 0);
    if (r == 0) _exit(0);
    check(r == -1 && errno == EPERM, "clone(CLONE_NEWUSER) -> EPERM");
    printf("fork-exec failures %d\n", failures);
    return failures != 0;
}

static void on_alarm(int sig) { (void)sig; }

static int mode_signal(int restart) {
    struct sigaction sa;
    memset(&sa, 0, sizeof sa);
    sa.sa_handler = on_alarm;
    sa.sa_flags = restart ? SA_RESTART : 0;
    sigaction(SIGALRM, &sa, NULL);
    struct itimerval it = {{0, 0}, {0, 200000}};
    setitimer(ITIMER_REAL, &it, NULL);
    double t0 = now();
    int r = sndbuf();
    double dt = now() - t0;
    printf("%s: result %d after %.3fs\n", restart ? "restart" : "eintr", r, dt);
    if (restart) return !(r > 0 && dt > 0.2);
    return !(r == -EINTR && dt < 1.0);
}

static void *held_call(void *arg) {
    (void)arg;
    sndbuf();
    return NULL;
}

static int mode_exit_pending(void) {
    pthread_t t;
    pthread_create(&t, NULL, held_call, NULL);
    usleep(200000);
    printf("exiting with a pending notification\n");
    fflush(stdout);
    exit(0);
}

static int mode_other_threads(void) {
    pthread_t t;
    pthread_create(&t, NULL, held_call, NULL);
    usleep(100000);
    double t0 = now();
    for (int i = 0; i < 200; i++) {
        struct sysinfo si;
        check(sysinfo(&si) == 0, "sysinfo while another thread is held");
    }
    double dt = now() - t0;
    printf("other-threads: 200 sysinfo in %.3fs while a getsockopt is held\n", dt);
    check(dt < 1.0, "other threads not stalled");
    pthread_join(t, NULL);
    return failures != 0;
}

int main(int argc, char **argv) {
    sock = socket(AF_INET, SOCK_STREAM, 0);
    setvbuf(stdout, NULL, _IOLBF, 0);
    if (argc < 2) return 2;
    const char *m = argv[1];
    if (!strcmp(m, "threads") && argc == 4) return mode_threads(atoi(argv[2]), atoi(argv[3]));
    if (!strcmp(m, "fork-exec") && argc == 3) return mode_fork_exec(argv[2]);
    if (!strcmp(m, "child")) return mode_child();
    if (!strcmp(m, "eintr")) return mode_signal(0);
    if (!strcmp(m, "restart")) return mode_signal(1);
    if (!strcmp(m, "exit-pending")) return mode_exit_pending();
    if (!strcmp(m, "other-threads")) return mode_other_threads();
    if (!strcmp(m, "sysinfo")) {
        struct sysinfo si;
        if (sysinfo(&si) != 0) return 1;
        printf("totalram %lu mem_unit %u\n", (unsigned long)si.totalram, si.mem_unit);
        return 0;
    }
    return 2;
}
