/* 64-byte TCP ping-pong and connection set-up timing for bench/tsor.py.
 *   pingpong server PORT                 echo 64-byte messages, one thread per connection
 *   pingpong rtt IP PORT N               N round trips on one connection: prints p50 p99 (us)
 *   pingpong rttmsg IP PORT N            the same, the client sending with sendmsg (as memcached's
 *                                        replies go): what a trapped sendmsg costs a TSoR sandbox
 *   pingpong connect IP PORT N           N x (connect, 1-byte echo, close): prints p50 p99 (us)
 */
#include <arpa/inet.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/uio.h>
#include <time.h>
#include <unistd.h>

static double now_us(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec * 1e6 + t.tv_nsec / 1e3;
}

static int cmp(const void *a, const void *b) {
    double x = *(const double *)a, y = *(const double *)b;
    return x < y ? -1 : x > y;
}

static int sendmsg_all(int fd, char *buf, int n) {
    for (int done = 0; done < n;) {
        struct iovec iov = {buf + done, (size_t)(n - done)};
        struct msghdr m = {.msg_iov = &iov, .msg_iovlen = 1};
        int r = sendmsg(fd, &m, 0);
        if (r <= 0) return -1;
        done += r;
    }
    return 0;
}

static int full(int fd, char *buf, int n, int rd) {
    for (int done = 0; done < n;) {
        int r = rd ? read(fd, buf + done, n - done) : write(fd, buf + done, n - done);
        if (r <= 0) return -1;
        done += r;
    }
    return 0;
}

static void *echo(void *arg) {
    int fd = (int)(long)arg, one = 1;
    char buf[64];
    setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
    for (;;) {
        int r = read(fd, buf, sizeof buf);
        if (r <= 0 || full(fd, buf, r, 0) < 0) break;
    }
    close(fd);
    return NULL;
}

static int dial(const char *ip, int port) {
    struct sockaddr_in a = {.sin_family = AF_INET, .sin_port = htons(port)};
    inet_pton(AF_INET, ip, &a.sin_addr);
    int fd = socket(AF_INET, SOCK_STREAM, 0), one = 1;
    if (connect(fd, (struct sockaddr *)&a, sizeof a) < 0) { perror("connect"); exit(1); }
    setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
    return fd;
}

int main(int argc, char **argv) {
    if (argc == 3 && !strcmp(argv[1], "server")) {
        struct sockaddr_in a = {.sin_family = AF_INET, .sin_port = htons(atoi(argv[2]))};
        int l = socket(AF_INET, SOCK_STREAM, 0), one = 1;
        setsockopt(l, SOL_SOCKET, SO_REUSEADDR, &one, sizeof one);
        if (bind(l, (struct sockaddr *)&a, sizeof a) < 0 || listen(l, 512) < 0) { perror("listen"); return 1; }
        for (;;) {
            int c = accept(l, NULL, NULL);
            pthread_t t;
            if (c >= 0) { pthread_create(&t, NULL, echo, (void *)(long)c); pthread_detach(t); }
        }
    }
    if (argc != 5) { fprintf(stderr, "usage: see the source\n"); return 2; }
    int n = atoi(argv[4]), port = atoi(argv[3]);
    double *lat = calloc(n, sizeof *lat);
    char buf[64] = {0};
    if (!strcmp(argv[1], "rtt") || !strcmp(argv[1], "rttmsg")) {
        int fd = dial(argv[2], port), with_msg = !strcmp(argv[1], "rttmsg");
        for (int i = 0; i < n + 1000; i++) {   /* 1000 warm-up round trips */
            double t0 = now_us();
            if ((with_msg ? sendmsg_all(fd, buf, 64) : full(fd, buf, 64, 0)) < 0 || full(fd, buf, 64, 1) < 0) {
                perror("rtt");
                return 1;
            }
            if (i >= 1000) lat[i - 1000] = now_us() - t0;
        }
    } else {
        for (int i = 0; i < n; i++) {
            double t0 = now_us();
            int fd = dial(argv[2], port);
            if (full(fd, buf, 1, 0) < 0 || full(fd, buf, 1, 1) < 0) { perror("echo"); return 1; }
            lat[i] = now_us() - t0;
            close(fd);
        }
    }
    qsort(lat, n, sizeof *lat, cmp);
    printf("%.1f %.1f\n", lat[n / 2], lat[n * 99 / 100]);
    return 0;
}
