/* Calls every syscall quark's base policy denies, with arguments that are harmless even when the
 * call reaches a real kernel with every capability (nonexistent paths, bad fds, invalid magic),
 * and prints "NAME ERRNO" per call (0: it succeeded). Built static so it runs in a bare rootfs. */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <linux/sched.h>
#include <sched.h>
#include <signal.h>
#include <stdio.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/personality.h>
#include <sys/syscall.h>
#include <sys/wait.h>
#include <unistd.h>

#define NOPATH "/nonexistent-quark"
#define SYS_open_tree_attr_ 467   /* newer than these headers */

static void report(const char *name, long r) {
    printf("%s %d\n", name, r == -1 ? errno : 0);
}

#define CALL(name, ...) do { errno = 0; report(#name, syscall(SYS_##name, __VA_ARGS__)); } while (0)

/* Calls that create a process or change this one run in a child, which exits with the errno. */
static void in_child(const char *name, long nr, long a0) {
    pid_t pid = fork();
    if (pid == 0) {
        errno = 0;
        long r = syscall(nr, a0, 0, 0, 0, 0);
        if (r == 0) _exit(0);          /* the new child of clone/clone3 */
        if (r > 0) { waitpid(r, NULL, 0); _exit(0); }
        _exit(errno);
    }
    int status;
    waitpid(pid, &status, 0);
    printf("%s %d\n", name, WIFEXITED(status) ? WEXITSTATUS(status) : 255);
}

int main(void) {
    setvbuf(stdout, NULL, _IOLBF, 0);
    CALL(init_module, NULL, 0, "");
    CALL(finit_module, -1, "", 0);
    CALL(delete_module, "quark_nonexistent", O_NONBLOCK);
    CALL(kexec_load, 0, 0, NULL, 0xdead0000UL);
    CALL(kexec_file_load, -1, -1, 0, NULL, 0);
    CALL(reboot, 0, 0, 0, NULL);
    CALL(swapon, NOPATH, 0);
    CALL(swapoff, NOPATH);
    CALL(settimeofday, NULL, NULL);
    CALL(clock_settime, 0, NULL);
    CALL(adjtimex, NULL);                          /* EFAULT with CAP_SYS_TIME: nothing set */
    CALL(clock_adjtime, 0, NULL);
    CALL(acct, NOPATH);
    CALL(iopl, 4);                                 /* level > 3: EINVAL */
    CALL(ioperm, 65536, 1, 0);                     /* beyond the port range: EINVAL */
    CALL(syslog, -1, NULL, 0);                     /* no such action: EINVAL */
    CALL(sethostname, NULL, 65);                   /* longer than a name: EINVAL */
    CALL(setdomainname, NULL, 65);
    CALL(quotactl, 0, NULL, 0, NULL);
    CALL(quotactl_fd, -1, 0, 0, NULL);
    CALL(lookup_dcookie, 0, NULL, 0);
    CALL(bpf, -1, NULL, 0);
    CALL(perf_event_open, NULL, 0, -1, -1, 0);
    CALL(userfaultfd, ~0);
    CALL(io_uring_setup, 1, NULL);
    CALL(io_uring_enter, -1, 0, 0, 0, NULL, 0);
    CALL(io_uring_register, -1, 0, NULL, 0);
    CALL(keyctl, -1, 0, 0, 0, 0);
    CALL(add_key, NULL, NULL, NULL, 0, 0);
    CALL(request_key, NULL, NULL, NULL, 0);
    CALL(open_by_handle_at, -1, NULL, 0);
    CALL(ptrace, 7 /* PTRACE_CONT */, -1, 0, 0);
    CALL(process_vm_readv, getpid(), NULL, 0, NULL, 0, 0);
    CALL(process_vm_writev, getpid(), NULL, 0, NULL, 0, 0);
    CALL(mount, "none", NOPATH, "tmpfs", 0, NULL);
    CALL(umount2, NOPATH, 0);
    CALL(pivot_root, NOPATH, NOPATH);
    CALL(move_mount, -1, NOPATH, -1, NOPATH, 0);
    CALL(open_tree, -1, NOPATH, 0);
    errno = 0;
    report("open_tree_attr", syscall(SYS_open_tree_attr_, -1, NOPATH, 0, NULL, 0));
    CALL(mount_setattr, -1, NOPATH, 0, NULL, 0);
    CALL(fsopen, "quark_nonexistent_fs", 0);
    CALL(fsconfig, -1, 0, NULL, NULL, 0);
    CALL(fsmount, -1, 0, 0);
    CALL(fspick, -1, NOPATH, 0);
    CALL(setns, -1, 0);
    /* KSM opt-ins: one anonymous page offered (harmless where allowed), and merge-any switched off */
    void *page = mmap(NULL, 4096, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    CALL(madvise, page, 4096, 12 /* MADV_MERGEABLE */);
    CALL(prctl, 67 /* PR_SET_MEMORY_MERGE */, 0, 0, 0, 0);
    in_child("unshare", SYS_unshare, CLONE_NEWUSER);
    in_child("clone", SYS_clone, CLONE_NEWUSER | SIGCHLD);
    struct clone_args ca;
    memset(&ca, 0, sizeof ca);
    ca.exit_signal = SIGCHLD;
    pid_t pid = fork();
    if (pid == 0) {
        errno = 0;
        long r = syscall(SYS_clone3, &ca, sizeof ca);
        if (r == 0) _exit(0);
        if (r > 0) { waitpid(r, NULL, 0); _exit(0); }
        _exit(errno);
    }
    int status;
    waitpid(pid, &status, 0);
    printf("clone3 %d\n", WIFEXITED(status) ? WEXITSTATUS(status) : 255);
    errno = 0;
    int old = personality(0xffffffff);
    report("personality", personality(ADDR_NO_RANDOMIZE));
    personality(old);
    return 0;
}
