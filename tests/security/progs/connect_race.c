/* connect() whose sockaddr another thread rewrites while the call is in flight (trapped by QKernel:
 * between the notification and the kernel's own read of the address there is a window).
 *
 *   connect_race ITERATIONS
 *
 * Two listeners on 127.0.0.1 (ports A and B). A racer thread flips the shared sockaddr's port
 * between A and B without pause; the main thread connects through it ITERATIONS times. For every
 * connection it finds which listener really got it (the kernel's truth) and checks that what the
 * (trapped) getpeername/getsockname calls answer, and where the bytes go, agree with it.
 * Prints `connects N to_a N to_b N mismatches N` and exits 1 on any mismatch.
 */
#define _GNU_SOURCE
#include <arpa/inet.h>
#include <errno.h>
#include <netinet/in.h>
#include <poll.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <unistd.h>

static struct sockaddr_in shared;
static atomic_int stop;
static unsigned short port_a, port_b;

static void *racer(void *arg) {
    (void)arg;
    volatile unsigned short *p = &shared.sin_port;
    while (!atomic_load_explicit(&stop, memory_order_relaxed)) {
        *p = port_b;
        *p = port_a;
    }
    return NULL;
}

static int listener(unsigned short *port) {
    int s = socket(AF_INET, SOCK_STREAM | SOCK_NONBLOCK, 0);
    struct sockaddr_in a = {.sin_family = AF_INET, .sin_addr.s_addr = htonl(INADDR_LOOPBACK)};
    socklen_t l = sizeof a;
    if (bind(s, (struct sockaddr *)&a, sizeof a) || listen(s, 64) || getsockname(s, (struct sockaddr *)&a, &l)) {
        perror("listener");
        exit(2);
    }
    *port = a.sin_port;
    return s;
}

int main(int argc, char **argv) {
    int n = argc > 1 ? atoi(argv[1]) : 1000;
    int la = listener(&port_a), lb = listener(&port_b);
    shared.sin_family = AF_INET;
    shared.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    shared.sin_port = port_a;
    pthread_t t;
    pthread_create(&t, NULL, racer, NULL);
    int to_a = 0, to_b = 0, bad = 0, done = 0;
    for (int i = 0; i < n; i++) {
        int c = socket(AF_INET, SOCK_STREAM, 0);
        if (connect(c, (struct sockaddr *)&shared, sizeof shared)) {
            perror("connect");
            bad++;
            close(c);
            continue;
        }
        struct pollfd pf[2] = {{la, POLLIN, 0}, {lb, POLLIN, 0}};
        if (poll(pf, 2, 5000) <= 0) {
            fprintf(stderr, "iteration %d: no listener got the connection\n", i);
            bad++;
            close(c);
            continue;
        }
        int got_b = !(pf[0].revents & POLLIN);
        int s = accept(got_b ? lb : la, NULL, NULL);
        struct sockaddr_in peer, local, srv_peer;
        socklen_t l1 = sizeof peer, l2 = sizeof local, l3 = sizeof srv_peer;
        getpeername(c, (struct sockaddr *)&peer, &l1);
        getsockname(c, (struct sockaddr *)&local, &l2);
        getpeername(s, (struct sockaddr *)&srv_peer, &l3);
        char x = 'q', y = 0;
        int ok = s >= 0 && peer.sin_port == (got_b ? port_b : port_a) && local.sin_port == srv_peer.sin_port &&
                 write(c, &x, 1) == 1 && read(s, &y, 1) == 1 && y == 'q';
        if (!ok) {
            fprintf(stderr, "iteration %d: kernel connected to %s, getpeername says port %d\n", i, got_b ? "B" : "A",
                    ntohs(peer.sin_port));
            bad++;
        }
        got_b ? to_b++ : to_a++;
        done++;
        close(s);
        close(c);
    }
    atomic_store(&stop, 1);
    pthread_join(t, NULL);
    printf("connects %d to_a %d to_b %d mismatches %d\n", done, to_a, to_b, bad);
    return bad ? 1 : 0;
}
