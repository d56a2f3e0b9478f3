"""TCP semantics checks run inside quark containers (tests/integration/test_tsor_semantics.py).

    tsor_semantics.py server PORT           listeners on PORT.. PORT+3 (see Server), forever
    tsor_semantics.py client SERVER_IP SERVER_IP6 PORT OUT.json
                                            every check against the server; results to OUT.json

The client reports, per check, {"ok": bool, "detail": ..., "path": "unix"|"tcp"} where path is
what the socket really is underneath (TSoR's local path hands out AF_UNIX), which the app itself
can only learn from /proc/net/unix, never from the socket API.
"""
from __future__ import annotations

import ctypes
import errno
import fcntl
import json
import os
import select
import socket
import struct
import subprocess
import sys
import threading
import time
import traceback
import zlib

libc = ctypes.CDLL(None, use_errno=True)
SO_DOMAIN, SO_PROTOCOL = 39, 38


def real_kind(fd: int) -> str:
    # What the kernel really holds: a TCP socket of this pod's network namespace is listed in
    # /proc/net/tcp(6) by its inode; a local-path end (AF_UNIX, made in tsord's namespace) is not.
    # (Not SO_PEERCRED, which quark answers as TCP does on every TSoR socket.)
    ino = os.fstat(fd).st_ino
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            with open(table) as f:
                if any(line.split()[9] == str(ino) for line in f.readlines()[1:]):
                    return "tcp"
        except OSError:
            pass
    return "unix"


# ---- server --------------------------------------------------------------------------------------

def describe(conn: socket.socket, listener: socket.socket) -> dict:
    fl = fcntl.fcntl(conn.fileno(), fcntl.F_GETFL)
    fdfl = fcntl.fcntl(conn.fileno(), fcntl.F_GETFD)
    return {"nonblock": bool(fl & os.O_NONBLOCK), "cloexec": bool(fdfl & fcntl.FD_CLOEXEC),
            "sockname": list(conn.getsockname()[:2]), "peername": list(conn.getpeername()[:2]),
            "domain": conn.getsockopt(socket.SOL_SOCKET, SO_DOMAIN),
            "type": conn.getsockopt(socket.SOL_SOCKET, socket.SO_TYPE),
            "protocol": conn.getsockopt(socket.SOL_SOCKET, SO_PROTOCOL),
            "kind": real_kind(conn.fileno())}


def serve_conn(conn: socket.socket, info: dict) -> None:
    conn.setblocking(True)
    with conn:
        cmd = b""
        while not cmd.endswith(b"\n"):
            c = conn.recv(1)
            if not c:
                return
            cmd += c
        cmd = cmd.strip()
        if cmd == b"echo":
            while data := conn.recv(65536):
                conn.sendall(data)
        elif cmd == b"info":
            conn.sendall(json.dumps(info).encode())
        elif cmd == b"count":
            n, crc = 0, 0
            while data := conn.recv(1 << 20):
                n += len(data)
                crc = zlib.crc32(data, crc)
            conn.sendall(f"{n} {crc}".encode())
        elif cmd == b"halfclose":
            n = 0
            while data := conn.recv(65536):
                n += len(data)
            conn.sendall(f"got {n} then EOF".encode())


def accept_raw(lst: socket.socket, flags: int | None) -> socket.socket:
    """accept (flags None) or accept4(flags) through libc, so the flags are exactly ours."""
    if flags is None:
        fd = libc.accept(lst.fileno(), None, None)
    else:
        fd = libc.accept4(lst.fileno(), None, None, flags)
    if fd < 0:
        raise OSError(ctypes.get_errno(), os.strerror(ctypes.get_errno()))
    return socket.socket(fileno=fd)


def server(port: int) -> None:
    # PORT: blocking accept4(SOCK_CLOEXEC) (Python's accept); PORT+1: accept4(NONBLOCK|CLOEXEC);
    # PORT+2: plain accept(); PORT+3: IPv6 dual-stack; PORT+4: non-blocking listener in epoll.
    def loop(lst: socket.socket, flags) -> None:
        while True:
            conn = accept_raw(lst, flags) if flags != "py" else lst.accept()[0]
            info = describe(conn, lst)
            threading.Thread(target=serve_conn, args=(conn, info), daemon=True).start()

    specs = [(socket.AF_INET, "0.0.0.0", port, "py"),
             (socket.AF_INET, "0.0.0.0", port + 1, socket.SOCK_NONBLOCK | socket.SOCK_CLOEXEC),
             (socket.AF_INET, "0.0.0.0", port + 2, None),
             (socket.AF_INET6, "::", port + 3, "py")]
    for fam, host, p, flags in specs:
        lst = socket.socket(fam, socket.SOCK_STREAM)
        lst.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        lst.bind((host, p))
        lst.listen(128)
        threading.Thread(target=loop, args=(lst, flags), daemon=True).start()
    ep_lst = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    ep_lst.bind(("0.0.0.0", port + 4))
    ep_lst.listen(128)
    ep_lst.setblocking(False)
    ep = select.epoll()
    ep.register(ep_lst.fileno(), select.EPOLLIN)
    print("ready", flush=True)
    with open("/out/server-ready", "w") as f:
        f.write("ready")
    while True:
        for _fd, _ev in ep.poll():
            try:
                conn, _ = ep_lst.accept()
            except BlockingIOError:
                continue
            info = describe(conn, ep_lst)
            threading.Thread(target=serve_conn, args=(conn, info), daemon=True).start()


# ---- client --------------------------------------------------------------------------------------

class Client:
    def __init__(self, ip: str, ip6: str, port: int) -> None:
        self.ip, self.ip6, self.port = ip, ip6, port

    def dial(self, cmd: bytes, port: int | None = None, ip: str | None = None,
             fam=socket.AF_INET) -> socket.socket:
        s = socket.socket(fam, socket.SOCK_STREAM)
        s.settimeout(10)
        s.connect((ip or self.ip, port or self.port))
        s.sendall(cmd + b"\n")
        return s

    def read_all(self, s: socket.socket) -> bytes:
        buf = b""
        while data := s.recv(65536):
            buf += data
        return buf

    # each check returns (ok, detail, socket-for-path or None)
    def check_blocking_connect_and_names(self):
        s = self.dial(b"echo")
        s.sendall(b"x" * 1000)
        got = b""
        while len(got) < 1000:
            got += s.recv(65536)
        me = s.getsockname()
        peer = s.getpeername()
        ok = (peer == (self.ip, self.port) and me[0] == self.own_ip() and me[1] > 0 and got == b"x" * 1000)
        return ok, {"sockname": me, "peername": peer}, s

    def own_ip(self) -> str:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as u:
            u.connect((self.ip, 9))
            return u.getsockname()[0]

    def check_server_sees_tcp_addresses(self):
        s = self.dial(b"info")
        me = s.getsockname()
        info = json.loads(self.read_all(s))
        ok = (info["peername"] == [me[0], me[1]] and info["sockname"] == [self.ip, self.port]
              and (info["domain"], info["type"], info["protocol"]) == (2, 1, 6))
        return ok, info, s

    def _accept_flags(self, port_offset: int, nonblock: bool, cloexec: bool):
        s = self.dial(b"info", self.port + port_offset)
        info = json.loads(self.read_all(s))
        return (info["nonblock"], info["cloexec"]) == (nonblock, cloexec), info, s

    def check_accept4_nonblock_cloexec(self):
        return self._accept_flags(1, True, True)

    def check_accept_without_flags(self):
        return self._accept_flags(2, False, False)

    def check_accept_from_epoll_nonblocking_listener(self):
        s = self.dial(b"echo", self.port + 4)
        s.sendall(b"ping")
        return s.recv(4) == b"ping", {}, s

    def check_nonblocking_connect(self):
        s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        s.setblocking(False)
        err = s.connect_ex((self.ip, self.port))
        if err not in (0, errno.EINPROGRESS):
            return False, {"connect": err}, s
        _, w, _ = select.select([], [s], [], 10)
        so_error = s.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR)
        nb = bool(fcntl.fcntl(s.fileno(), fcntl.F_GETFL) & os.O_NONBLOCK)
        s.setblocking(True)
        s.sendall(b"echo\nab")
        ok = bool(w) and so_error == 0 and nb and s.recv(2) == b"ab"
        return ok, {"connect": err, "so_error": so_error, "still_nonblocking": nb}, s

    def check_poll_epoll_select_readiness(self):
        s = self.dial(b"echo")
        ep = select.epoll()
        ep.register(s.fileno(), select.EPOLLIN | select.EPOLLOUT)
        writable = any(ev & select.EPOLLOUT for _, ev in ep.poll(5))
        p = select.poll()
        p.register(s.fileno(), select.POLLIN)
        before = p.poll(0)
        s.sendall(b"hi")
        after = p.poll(5000)
        r, _, _ = select.select([s], [], [], 5)
        ok = writable and before == [] and after and bool(r) and s.recv(2) == b"hi"
        return ok, {"before": before, "after": after}, s

    def check_socket_options(self):
        s = self.dial(b"echo")
        res = {}
        opts = [(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1), (socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1),
                (socket.SOL_SOCKET, socket.SO_REUSEADDR, 1), (socket.SOL_SOCKET, socket.SO_REUSEPORT, 1),
                (socket.IPPROTO_TCP, socket.TCP_KEEPIDLE, 30), (socket.IPPROTO_TCP, socket.TCP_KEEPINTVL, 5),
                (socket.IPPROTO_TCP, socket.TCP_KEEPCNT, 3), (socket.IPPROTO_IP, socket.IP_TOS, 0x10),
                # what servers set per request (nginx's tcp_nopush): QKernel's compiled fast path
                # answers these on a local-path socket, Python reads them back
                (socket.IPPROTO_TCP, socket.TCP_CORK, 1), (socket.IPPROTO_TCP, socket.TCP_CORK, 0),
                (socket.IPPROTO_TCP, socket.TCP_NODELAY, 0), (socket.IPPROTO_TCP, socket.TCP_CORK, 1)]
        ok = True
        for level, opt, val in opts:
            s.setsockopt(level, opt, val)
            got = s.getsockopt(level, opt)
            res[f"{level}/{opt}"] = got
            ok &= (got == val) if opt != socket.SO_KEEPALIVE else bool(got)
        s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 1 << 20)
        s.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 1 << 20)
        ok &= s.getsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF) > 0
        s.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 2))
        ok &= struct.unpack("ii", s.getsockopt(socket.SOL_SOCKET, socket.SO_LINGER, 8)) == (1, 2)
        info = s.getsockopt(socket.IPPROTO_TCP, socket.TCP_INFO, 104)
        ok &= len(info) == 104 and info[0] == 1   # TCP_ESTABLISHED
        try:   # TCP's own checks: a value shorter than an int is EINVAL
            s.setsockopt(socket.IPPROTO_TCP, socket.TCP_CORK, b"\x01")
            ok = False
        except OSError as e:
            ok &= e.errno == errno.EINVAL
        return ok, res, s

    def check_domain_type_protocol(self):
        s = self.dial(b"echo")
        got = (s.getsockopt(socket.SOL_SOCKET, SO_DOMAIN), s.getsockopt(socket.SOL_SOCKET, socket.SO_TYPE),
               s.getsockopt(socket.SOL_SOCKET, SO_PROTOCOL))
        py = socket.socket(fileno=os.dup(s.fileno()))   # Python asks the kernel the same three
        ok = got == (2, 1, 6) and (py.family, py.type, py.proto) == (socket.AF_INET, socket.SOCK_STREAM, 6)
        py.close()
        return ok, got, s

    def check_shutdown_half_close(self):
        s = self.dial(b"halfclose")
        s.sendall(b"y" * 5000)
        s.shutdown(socket.SHUT_WR)
        reply = self.read_all(s)
        return reply == b"got 5000 then EOF", reply.decode(), s

    def check_connection_refused(self):
        s = socket.socket()
        s.settimeout(5)
        try:
            s.connect((self.ip, self.port + 50))
            return False, "connected", None
        except ConnectionRefusedError:
            pass
        nb = socket.socket()
        nb.setblocking(False)
        err = nb.connect_ex((self.ip, self.port + 50))
        select.select([], [nb], [], 5)
        so_error = nb.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR)
        return so_error == errno.ECONNREFUSED or err == errno.ECONNREFUSED, {"err": err, "so_error": so_error}, None

    def check_ipv6(self):
        s = self.dial(b"info", self.port + 3, self.ip6, socket.AF_INET6)
        me = s.getsockname()
        info = json.loads(self.read_all(s))
        ok = (s.getpeername()[:2] == (self.ip6, self.port + 3) and info["peername"] == [me[0], me[1]]
              and info["domain"] == 10 and s.getsockopt(socket.SOL_SOCKET, SO_DOMAIN) == 10)
        return ok, info, s

    def check_ipv4_to_dual_stack_listener(self):
        s = self.dial(b"info", self.port + 3)
        info = json.loads(self.read_all(s))
        return info["peername"][0] == "::ffff:" + self.own_ip(), info, s

    def check_loopback_stays_in_the_pod(self):
        lst = socket.socket()
        lst.bind(("127.0.0.1", 0))
        lst.listen(1)
        c = socket.create_connection(lst.getsockname(), timeout=5)
        a, peer = lst.accept()
        c.sendall(b"lo")
        ok = a.recv(2) == b"lo" and real_kind(c.fileno()) == "tcp" and peer[0] == "127.0.0.1"
        a.close()
        lst.close()
        return ok, {}, c

    def check_fork_exec_dup(self):
        s = self.dial(b"echo")
        d = os.dup(s.fileno())
        pid = os.fork()
        if pid == 0:
            os.write(d, b"child;")
            os._exit(0)
        os.waitpid(pid, 0)
        subprocess.run([sys.executable, "-c", f"import os; os.write({d}, b'exec;')"], pass_fds=[d], check=True)
        os.write(d, b"dup;")
        os.close(d)
        want = b"child;exec;dup;"
        got = b""
        while len(got) < len(want):
            got += s.recv(100)
        return got == want, got.decode(), s

    def check_epoll_registered_before_connect(self):
        """nginx's order: the socket joins an epoll set before connect(). It must just work (TSoR
        leaves such a socket native)."""
        s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        s.setblocking(False)
        ep = select.epoll()
        ep.register(s.fileno(), select.EPOLLOUT | select.EPOLLIN)
        err = s.connect_ex((self.ip, self.port))
        writable = any(fd == s.fileno() and ev & select.EPOLLOUT for fd, ev in ep.poll(10))
        s.setblocking(True)
        s.settimeout(10)
        s.sendall(b"echo\nepoll")
        deadline, readable = time.monotonic() + 10, False
        while not readable and time.monotonic() < deadline:   # EPOLLOUT alone comes back at once
            readable = any(fd == s.fileno() and ev & select.EPOLLIN for fd, ev in ep.poll(1))
        got = b""
        while len(got) < 5:
            got += s.recv(100)
        ep.close()
        ok = err in (0, errno.EINPROGRESS) and writable and readable and got == b"epoll"
        return ok, {"connect": err, "writable": writable, "got": got.decode(errors="replace")}, s

    def check_dup_before_connect(self):
        """A duplicate taken before connect() is the same connection afterwards."""
        s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        s.settimeout(10)
        d = os.dup(s.fileno())
        s.connect((self.ip, self.port))
        os.write(d, b"echo\nvia-dup")
        os.close(d)
        got = b""
        while len(got) < 7:
            got += s.recv(100)
        return got == b"via-dup", got.decode(errors="replace"), s

    def check_sendfile_and_splice(self):
        path = "/tmp/sendfile.bin"
        with open(path, "wb") as f:
            f.write(os.urandom(1 << 20))
        s = self.dial(b"count")
        s.setblocking(True)
        with open(path, "rb") as f:
            sent = 0
            while sent < 1 << 20:
                sent += os.sendfile(s.fileno(), f.fileno(), sent, (1 << 20) - sent)
        r, w = os.pipe()
        os.write(w, b"z" * 4096)
        spliced = os.splice(r, s.fileno(), 4096)
        s.shutdown(socket.SHUT_WR)
        n = int(self.read_all(s).split()[0])
        return n == (1 << 20) + 4096 and spliced == 4096, {"server_counted": n}, s

    def run(self) -> dict:
        results = {}
        for name in [n for n in dir(self) if n.startswith("check_")]:
            try:
                ok, detail, s = getattr(self, name)()
                results[name[6:]] = {"ok": bool(ok), "detail": detail,
                                     "path": real_kind(s.fileno()) if s is not None else None}
                if s is not None:
                    s.close()
            except Exception:
                results[name[6:]] = {"ok": False, "detail": traceback.format_exc()}
        return results


def wait_for(path: str, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while not os.path.exists(path):
        if time.monotonic() > deadline:
            raise TimeoutError(path)
        time.sleep(0.05)


def restart(ip: str, port: int) -> None:
    """Phases driven by the test through files in /out: tsord up, down, back up."""
    c = Client(ip, "", port)
    first = c.dial(b"echo")
    report = {"first": real_kind(first.fileno())}
    open("/out/phase1", "w").close()
    wait_for("/out/go2")
    first.sendall(b"alive")
    report["established_survives"] = first.recv(5) == b"alive"
    second = c.dial(b"echo")
    second.sendall(b"ok")
    report["while_down"] = real_kind(second.fileno()) if second.recv(2) == b"ok" else "broken"
    open("/out/phase2", "w").close()
    wait_for("/out/go3")
    third = c.dial(b"echo")
    third.sendall(b"ok")
    report["after_restart"] = real_kind(third.fileno()) if third.recv(2) == b"ok" else "broken"
    first.sendall(b"still")
    report["established_survives_restart"] = first.recv(5) == b"still"
    with open("/out/restart.json", "w") as f:
        json.dump(report, f)


def many(ip: str, port: int, count: int, out: str) -> None:
    """`count` concurrent connections, 64 KiB to 16 MiB each; the server returns each one's length
    and CRC32, checked against what was sent."""
    import selectors
    import zlib
    sizes = [16 << 20 if i % 100 == 0 else 64 << 10 << (i % 5) for i in range(count)]
    blocks = [bytes([i % 251]) * 7 + os.urandom(65529) for i in range(8)]
    conns = []
    for i in range(count):
        s = socket.create_connection((ip, port), timeout=30)
        s.sendall(b"count\n")
        conns.append(s)
    kinds = {}
    for s in conns:
        kinds[real_kind(s.fileno())] = kinds.get(real_kind(s.fileno()), 0) + 1
        s.setblocking(False)
    sel = selectors.DefaultSelector()
    state = {}
    for i, s in enumerate(conns):
        state[s.fileno()] = {"i": i, "sent": 0, "crc": 0, "reply": b"", "sock": s}
        sel.register(s, selectors.EVENT_WRITE)
    bad, done = [], 0
    while done < count:
        for key, ev in sel.select(30):
            st = state[key.fd]
            s = st["sock"]
            if ev & selectors.EVENT_WRITE:
                block = blocks[st["i"] % 8]
                left = sizes[st["i"]] - st["sent"]
                chunk = block[:min(left, len(block))]
                try:
                    n = s.send(chunk)
                except BlockingIOError:
                    continue
                st["crc"] = zlib.crc32(chunk[:n], st["crc"])
                st["sent"] += n
                if st["sent"] == sizes[st["i"]]:
                    s.shutdown(socket.SHUT_WR)
                    sel.modify(s, selectors.EVENT_READ)
            else:
                data = s.recv(100)
                if data:
                    st["reply"] += data
                    continue
                sel.unregister(s)
                s.close()
                done += 1
                want = f"{sizes[st['i']]} {st['crc']}".encode()
                if st["reply"] != want:
                    bad.append([st["i"], st["reply"].decode(), want.decode()])
    with open(out, "w") as f:
        json.dump({"count": count, "bytes": sum(sizes), "bad": bad, "kinds": kinds}, f)


def main() -> None:
    if sys.argv[1] == "server":
        server(int(sys.argv[2]))
    elif sys.argv[1] == "restart":
        restart(sys.argv[2], int(sys.argv[3]))
    elif sys.argv[1] == "many":
        many(sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), sys.argv[5])
    else:
        ip, ip6, port, out = sys.argv[2], sys.argv[3], int(sys.argv[4]), sys.argv[5]
        results = Client(ip, ip6, port).run()
        with open(out, "w") as f:
            json.dump(results, f, indent=1, default=str)


if __name__ == "__main__":
    main()
