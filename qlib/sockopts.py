"""The socket options TSoR answers itself for a redirected socket, which QKernel's filter traps for
that reason: the contract between qkernel/table.py (which get/setsockopt calls reach the
supervisor) and tsor/intercept.py (what it answers). Here, below both, so neither imports the
other."""

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
