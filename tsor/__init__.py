"""TSoR: TCP between quark sandboxes without the host's TCP/IP path in between.

The node daemon, `tsord`: daemon.py, with config.py (tsor.yaml), gate.py (connections not yet
vouched for), identity.py and pods.py (who a sandbox or a CNI-registered pod is, as the kernel
says), routes.py (pod address -> node; a static file, or routes_k8s.py and k8s_fields.py from the
API server), netpol.py and policy_kinds.py (NetworkPolicy), metrics.py and bytecount.py (its
counters), check.py (`quark tsor check`). Supervisors and quark-cni talk to it over a unix socket
(protocol.py).

The sandbox's side, in its supervisor: sandbox.py (SandboxNet: the connection to tsord and the
state of redirected sockets), intercept.py (SocketIntercept: what QKernel's trapped socket calls
do, qkernel/sockets.py's SocketHooks), peers.py (direct channels between the supervisors of one
node), sockopt_offload.py (TCP_NODELAY/TCP_CORK answered by cgroup BPF programs, not a trap). Its
BPF programs and sockmap.py's are C in bpf/ (*.bpf.c), built by `make install`.

The paths a connection takes (tsord picks one per connect; the sockmap path replaces the socketpair
for a whole node):
- local, socketpair (transport/local.py): both pods on this node get the two ends of one AF_UNIX
  socketpair;
- local, sockmap (sockmap.py, `local_path: sockmap`): the kernel's own TCP through the pods' veths,
  its bytes moved socket to socket by SK_MSG; no trapped call but shutdown (half-close);
- tcp (transport/tcp.py): node to node over one authenticated TCP connection per connection;
- rdma (transport/rdma_link.py sets links up, transport/rdma.py's engine or the compiled
  transport/rdma_pump.c with rdma_pump.py move the bytes; tsor/verbs/ is the verbs interface, with
  pyverbs_provider.py over a real device);
- fallback: no path; the application's own socket connects natively.
kernel_sockets.py holds TSoR's kernel-facing helpers; addr.py, errors.py the shared types.
"""
DEFAULT_SOCKET = "/run/quark/tsord.sock"
DEFAULT_CONFIG = "/etc/quark/tsor.yaml"


def local_path_marker(tsord_socket: str) -> str:
    """The file beside tsord's socket that says `sockmap` when tsord runs the sockmap local path
    (tsor/sockmap.py): a sandbox reads it before its filter is made, to trap no socket call."""
    return f"{tsord_socket}.local-path"


# Annotation naming another tsord socket for one sandbox (several tsords on one machine: tests).
SOCKET_ANNOTATION = "io.quark.tsor.socket"
