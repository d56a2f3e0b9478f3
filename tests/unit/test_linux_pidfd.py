"""qlib.linux's pidfds of threads: QKernel takes a trapped task's fds through a pidfd of the task that
trapped, which is often not its process's first thread (a server's accept threads)."""
from __future__ import annotations

import os
import threading

from qlib import linux as L


def test_a_pidfd_of_a_thread_reaches_its_process_fds():
    """On 6.9+ with PIDFD_THREAD; before it (Debian 12's 6.1: the cgroup v2 lane runs this) through the
    process's pidfd, where a pidfd of the thread itself fails with EINVAL. Without that fallback every
    socket call a non-main thread trapped went unanswered there."""
    r, w = os.pipe()
    tid, ready, done = [], threading.Event(), threading.Event()

    def thread() -> None:
        tid.append(threading.get_native_id())
        ready.set()
        done.wait(10)
    t = threading.Thread(target=thread)
    t.start()
    try:
        assert ready.wait(10) and tid[0] != os.getpid()
        pidfd = L.pidfd_open_thread(tid[0])
        try:
            dup = L.pidfd_getfd(pidfd, w)
        finally:
            os.close(pidfd)
        os.write(dup, b"x")
        os.close(dup)
        assert os.read(r, 1) == b"x"
    finally:
        done.set()
        t.join()
        os.close(r)
        os.close(w)

