"""TSoR: TCP between quark sandboxes without the host's TCP/IP path in between.

`tsord` (daemon.py) is the node daemon; sandboxes talk to it over a unix socket (protocol.py);
routes.py maps pod addresses to nodes; transport/ holds the ways a connection is carried (local:
one AF_UNIX socketpair, tcp: node to node). sandbox.py is the sandbox's side, used by QKernel's
socket handlers (qkernel/syscalls/sys_socket.py).
"""
DEFAULT_SOCKET = "/run/quark/tsord.sock"
DEFAULT_CONFIG = "/etc/quark/tsor.yaml"


def local_path_marker(tsord_socket: str) -> str:
    """The file beside tsord's socket that says `sockmap` when tsord runs the sockmap local path
    (tsor/sockmap.py): a sandbox reads it before its filter is made, to trap no socket call."""
    return f"{tsord_socket}.local-path"


# Annotation naming another tsord socket for one sandbox (several tsords on one machine: tests).
SOCKET_ANNOTATION = "io.quark.tsor.socket"
# The socket options TSoR answers for a redirected socket instead of the socket underneath (an
# AF_UNIX end on the local path): every option at these levels (IPPROTO_IP, IPPROTO_TCP,
# IPPROTO_IPV6: AF_UNIX has none), SO_TYPE/SO_PROTOCOL/SO_DOMAIN (those of the TCP socket the
# application made), and the SOL_SOCKET options AF_UNIX refuses but TCP accepts (SO_REUSEPORT,
# SO_ZEROCOPY, SO_TXTIME). tsor/intercept.py answers them; QKernel's filter traps get/setsockopt
# for these only (qkernel/table.py), so every other option runs natively.
# The credential options (SO_PASSCRED, SO_PEERCRED, SO_PEERSEC, SO_PASSSEC, SO_PASSPIDFD,
# SO_PEERPIDFD, SO_PASSRIGHTS) are TCP's too, never the AF_UNIX end's: on it they would hand the peer
# pod this pod's credentials, or read tsord's as the peer's.
EMULATED_LEVELS = (0, 6, 41)
RECORDED_SOCKET_OPTS = (3, 38, 39)
UNIX_REFUSED_SOCKET_OPTS = (15, 60, 61) + (16, 17, 31, 34, 76, 77, 83)
