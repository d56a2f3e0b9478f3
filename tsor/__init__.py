"""TSoR: TCP between quark sandboxes without the host's TCP/IP path in between.

`tsord` (daemon.py) is the node daemon; sandboxes talk to it over a unix socket (protocol.py);
routes.py maps pod addresses to nodes; transport/ holds the ways a connection is carried (local:
one AF_UNIX socketpair, tcp: node to node). sandbox.py is the sandbox's side, used by QKernel's
socket handlers (qkernel/syscalls/sys_socket.py).
"""
DEFAULT_SOCKET = "/run/quark/tsord.sock"
DEFAULT_CONFIG = "/etc/quark/tsor.yaml"
# Annotation naming another tsord socket for one sandbox (several tsords on one machine: tests).
SOCKET_ANNOTATION = "io.quark.tsor.socket"
