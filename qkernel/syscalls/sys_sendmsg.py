"""sendmsg/sendmmsg on a TSoR local-path end: the bytes, never the control buffer.

A local-path end is an AF_UNIX socket underneath, which would carry file descriptors (SCM_RIGHTS)
and credentials (SCM_CREDENTIALS) to the peer pod; TCP carries neither: its sendmsg sends the bytes
and drops the control messages. The compiled fast path (qkernel/fastpath.c) lets through every call
on any other fd, and every sendmsg on an end without a control buffer (where the kernel lets the ends
refuse fds; elsewhere every sendmsg on an end is sent here); what reaches this handler is
sent here, from the supervisor's duplicate of the end, without its control buffer, and answered as
TCP answers: the bytes sent (sendmsg), the messages sent with each one's msg_len (sendmmsg). On a
blocking socket the call waits, on the loop, until all of it is sent, as a blocking stream send does.
"""
from __future__ import annotations

import errno
import fcntl
import os
import socket
import struct

from qkernel.request import Continue, Errno, Request, Return
from qkernel.sockets import SocketHooks, TrappedCall

MSGHDR = 56                # struct msghdr on 64-bit: name, namelen, iov @16, iovlen @24, control @32, controllen @40
MMSGHDR = 64               # struct mmsghdr: a msghdr and its msg_len (@56)
MAX_IOV = 1024             # UIO_MAXIOV
MAX_BYTES = 4 << 20        # read from the task per call at most (more: a partial send, as TCP may make)
_PASSED = socket.MSG_DONTWAIT | socket.MSG_NOSIGNAL | getattr(socket, "MSG_MORE", 0x8000) | socket.MSG_OOB


def handle(req: Request, hooks: SocketHooks, call: TrappedCall):
    fd = req.args[0] & 0xFFFFFFFF
    sock = hooks.local_end(call, fd if fd < 1 << 31 else -1)
    if sock is None:
        return Continue()
    try:
        if req.name == "sendmsg":
            headers = [req.read(req.args[1], MSGHDR)]
            flags = req.args[2] & 0xFFFFFFFF
        else:
            vlen = min(req.args[2] & 0xFFFFFFFF, MAX_IOV)
            if vlen == 0:
                sock.close()
                return Continue()
            raw = req.read(req.args[1], MMSGHDR * vlen)
            headers = [raw[i * MMSGHDR:i * MMSGHDR + MSGHDR] for i in range(vlen)]
            flags = req.args[3] & 0xFFFFFFFF
        if hooks.ends_refuse_rights and all(struct.unpack_from("Q", h, 40)[0] == 0 for h in headers):
            sock.close()
            # nothing TCP would drop: the kernel's own call (a thread that adds a control buffer
            # meanwhile meets the ends' SO_PASSRIGHTS: EPERM, never an fd across)
            return Continue()
        datas = [_gather(req, h) for h in headers]
    except _Fail as e:
        sock.close()
        return Errno(e.errno)
    except BaseException:
        sock.close()
        raise
    blocking = not (flags & socket.MSG_DONTWAIT) and not (fcntl.fcntl(sock.fileno(), fcntl.F_GETFL) & os.O_NONBLOCK)
    send = _Send(req, sock, datas, flags & _PASSED | socket.MSG_DONTWAIT, blocking)
    return send.step()


def _gather(req: Request, header: bytes) -> bytes:
    iov, iovlen = struct.unpack_from("QQ", header, 16)
    if iovlen > MAX_IOV:
        raise _Fail(errno.EMSGSIZE)
    out = bytearray()
    if iovlen:
        for i in range(iovlen):
            base, length = struct.unpack("QQ", req.read(iov + 16 * i, 16))
            take = min(length, MAX_BYTES - len(out))
            if take:
                out += req.read(base, take)
            if len(out) >= MAX_BYTES:
                break
    return bytes(out)


class _Fail(Exception):
    def __init__(self, err: int) -> None:
        self.errno = err


class _Send:
    """Sends `datas` (one per message) without control; answers when TCP's call would return."""

    def __init__(self, req: Request, sock: socket.socket, datas: list[bytes], flags: int, blocking: bool) -> None:
        self.req, self.sock, self.datas, self.flags, self.blocking = req, sock, datas, flags, blocking
        self.message, self.offset, self.sent = 0, 0, 0
        self.deferred = None

    def step(self):
        """Send what the socket takes now: an answer, or a Deferred completed once it took the rest."""
        try:
            while self.message < len(self.datas):
                data = self.datas[self.message]
                if self.offset < len(data):
                    n = self.sock.send(memoryview(data)[self.offset:], self.flags)
                    self.offset += n
                    self.sent += n
                    if self.offset < len(data):
                        continue
                self._done_message()
        except BlockingIOError:
            if self.blocking and not (self.req.name == "sendmmsg" and self.message > 0):
                return self._wait()
            if self.sent == 0 and self.message == 0:
                return self._answer(Errno(errno.EAGAIN))
        except OSError as e:
            if self.sent == 0 and self.message == 0:
                return self._answer(Errno(e.errno))
        return self._answer(self._result())

    def _done_message(self) -> None:
        if self.req.name == "sendmmsg":   # each message's msg_len, as the kernel writes it
            self.req.write(self.req.args[1] + self.message * MMSGHDR + MSGHDR, struct.pack("I", self.offset))
        self.message += 1
        self.offset = 0

    def _result(self):
        if self.req.name == "sendmmsg":
            return Return(self.message) if self.message else Errno(errno.EAGAIN)
        return Return(self.sent)

    def _wait(self):
        loop = self.req.kernel.loop
        if self.deferred is None:
            self.deferred = self.req.defer()
            self.deferred.on_cancel(self._cancel)
        loop.add_writer(self.sock.fileno(), self._writable)
        return self.deferred

    def _writable(self) -> None:
        self.req.kernel.loop.remove_writer(self.sock.fileno())
        if self.deferred.done:
            return
        answer = self.step()
        if answer is not self.deferred:
            self.deferred.complete(answer)

    def _answer(self, answer):
        self.sock.close()
        return answer

    def _cancel(self) -> None:
        try:
            self.req.kernel.loop.remove_writer(self.sock.fileno())
        except (KeyError, ValueError, OSError):
            pass
        self.sock.close()
