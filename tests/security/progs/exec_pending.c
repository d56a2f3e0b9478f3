/* A trapped connect() that is still waiting for QKernel's answer when its task exits or execs.
 *
 *   exec_pending leader|thread|exit
 *
 * One thread calls connect() on a sockaddr in the global `buf` (QKernel's test handler holds it for
 * a second, then tries to act on it: write into `buf`, answer). Meanwhile another thread execve()s
 * this binary again (`leader`: the waiting thread is the thread-group leader, whose pid the exec'ing
 * thread inherits; `thread`: the waiting thread is not the leader), or the process exits (`exit`).
 * Built static and non-PIE, so `buf` has the same address in the new image: `after` waits past the
 * handler's delay and checks that nothing was written into it and no fd appeared (the socket is
 * close-on-exec, so the new image has exactly the fds the old one started with).
 */
#define _GNU_SOURCE
#include <arpa/inet.h>
#include <dirent.h>
#include <netinet/in.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <unistd.h>

static unsigned char buf[256];  /* .bss: zero in every new image, at a fixed address */
static char *self;
static char nfds[16];   /* fds at start, for the new image to compare with */

static void do_connect(void) {
    struct sockaddr_in *a = (struct sockaddr_in *)buf;
    a->sin_family = AF_INET;
    a->sin_port = htons(1);
    a->sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    int fd = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
    connect(fd, (struct sockaddr *)a, sizeof *a);   /* held by the handler; never returns here */
}

static void *connect_thread(void *arg) {
    (void)arg;
    do_connect();
    return NULL;
}

static void *exec_thread(void *arg) {
    (void)arg;
    usleep(200000);
    execl(self, self, "after", nfds, (char *)NULL);
    perror("execl");
    _exit(3);
}

static int count_fds(void) {
    int n = 0;
    DIR *d = opendir("/proc/self/fd");
    struct dirent *e;
    while ((e = readdir(d)))
        if (e->d_name[0] != '.') n++;
    closedir(d);
    return n - 1;   /* the directory's own fd */
}

int main(int argc, char **argv) {
    self = "/proc/self/exe";
    if (argc < 2) return 2;
    const char *mode = argv[1];
    snprintf(nfds, sizeof nfds, "%d", count_fds());
    pthread_t t;
    if (!strcmp(mode, "leader")) {
        pthread_create(&t, NULL, exec_thread, NULL);
        do_connect();
        return 4;
    }
    if (!strcmp(mode, "thread")) {
        pthread_create(&t, NULL, connect_thread, NULL);
        usleep(200000);
        execl(self, self, "after", nfds, (char *)NULL);
        return 3;
    }
    if (!strcmp(mode, "exit")) {
        pthread_create(&t, NULL, connect_thread, NULL);
        usleep(200000);
        _exit(0);
    }
    if (!strcmp(mode, "after")) {
        usleep(1500000);    /* past the handler's 1 s hold */
        int dirty = 0;
        for (size_t i = 0; i < sizeof buf; i++) dirty |= buf[i];
        int fds = count_fds();
        int before = argc > 2 ? atoi(argv[2]) : -1;
        printf("after: buf %s, fds %d (before exec %d)\n", dirty ? "WRITTEN" : "clean", fds, before);
        return dirty || fds != before ? 1 : 0;
    }
    return 2;
}
