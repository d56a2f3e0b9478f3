"""Inside the container: what can it do to host processes it knows the pids of?

    python3 signal_probe.py '{"name": host_pid, ...}'

For each pid: kill(pid, 0) (signal 0: the permission check, nothing delivered), PTRACE_SEIZE (no
stop; released when this probe exits), pidfd_open (a handle, no permission needed) and through it
pidfd_send_signal(0) and pidfd_getfd (steal an fd: ptrace rights needed), and opening
/proc/PID/{mem,environ} and the /proc/PID/exe link. Prints {name: {check: "ok" | errno name}}.
"""
import ctypes
import errno
import json
import os
import sys

libc = ctypes.CDLL(None, use_errno=True)
libc.syscall.restype = ctypes.c_long
PTRACE_SEIZE, SYS_PTRACE, SYS_PIDFD_OPEN, SYS_PIDFD_SEND_SIGNAL, SYS_PIDFD_GETFD = 0x4206, 101, 434, 424, 438


def name(e):
    return errno.errorcode.get(e, str(e))


def call(f):
    try:
        f()
        return "ok"
    except OSError as e:
        return name(e.errno)


def ptrace_seize(pid):
    if libc.syscall(SYS_PTRACE, PTRACE_SEIZE, pid, 0, 0) < 0:
        raise OSError(ctypes.get_errno(), "ptrace")


def pidfd(pid, then=None):
    fd = libc.syscall(SYS_PIDFD_OPEN, pid, 0)
    if fd < 0:
        raise OSError(ctypes.get_errno(), "pidfd_open")
    try:
        if then == "signal" and libc.syscall(SYS_PIDFD_SEND_SIGNAL, fd, 0, None, 0) < 0:
            raise OSError(ctypes.get_errno(), "pidfd_send_signal")
        if then == "getfd":
            got = libc.syscall(SYS_PIDFD_GETFD, fd, 0, 0)
            if got < 0:
                raise OSError(ctypes.get_errno(), "pidfd_getfd")
            os.close(got)
    finally:
        os.close(fd)


out = {}
for who, pid in json.loads(sys.argv[1]).items():
    out[who] = {"kill0": call(lambda: os.kill(pid, 0)), "ptrace": call(lambda: ptrace_seize(pid)),
                "pidfd_open": call(lambda: pidfd(pid)),
                "pidfd_signal": call(lambda: pidfd(pid, "signal")),
                "pidfd_getfd": call(lambda: pidfd(pid, "getfd")),
                "mem": call(lambda: os.close(os.open(f"/proc/{pid}/mem", os.O_RDONLY))),
                "environ": call(lambda: os.close(os.open(f"/proc/{pid}/environ", os.O_RDONLY))),
                "exe": call(lambda: os.readlink(f"/proc/{pid}/exe"))}
print(json.dumps(out))
