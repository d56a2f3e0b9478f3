"""TCP endpoints (address, port) and the sockaddr_in / sockaddr_in6 bytes applications see."""
from __future__ import annotations

import ipaddress
import socket
import struct

Endpoint = tuple[str, int]


def family_of(ip: str) -> int:
    return socket.AF_INET6 if ":" in ip else socket.AF_INET


def unmapped(ip: str) -> str:
    """An IPv4-mapped IPv6 address (::ffff:a.b.c.d, what a dual-stack socket sees) as plain IPv4."""
    a = ipaddress.ip_address(ip)
    if isinstance(a, ipaddress.IPv6Address) and a.ipv4_mapped is not None:
        return str(a.ipv4_mapped)
    return str(a)


def as_family(ip: str, family: int) -> str:
    """`ip` as a socket of `family` names it: IPv4 on an AF_INET6 socket is IPv4-mapped."""
    if family == socket.AF_INET6 and family_of(ip) == socket.AF_INET:
        return f"::ffff:{ip}"
    return ip


def is_loopback(ip: str) -> bool:
    return ipaddress.ip_address(unmapped(ip)).is_loopback


def is_unspecified(ip: str) -> bool:
    return ipaddress.ip_address(unmapped(ip)).is_unspecified


def parse_sockaddr(data: bytes) -> tuple[int, Endpoint] | None:
    """(family, endpoint) of a sockaddr_in/in6, None for any other family or a short buffer."""
    if len(data) < 2:
        return None
    family = struct.unpack_from("=H", data)[0]
    if family == socket.AF_INET and len(data) >= 16:
        port, = struct.unpack_from("!H", data, 2)
        return family, (socket.inet_ntop(socket.AF_INET, data[4:8]), port)
    if family == socket.AF_INET6 and len(data) >= 28:
        port, = struct.unpack_from("!H", data, 2)
        return family, (socket.inet_ntop(socket.AF_INET6, data[8:24]), port)
    return None


def sockaddr(family: int, ep: Endpoint) -> bytes:
    ip, port = ep
    if family == socket.AF_INET:
        return struct.pack("=H", family) + struct.pack("!H", port) + socket.inet_pton(family, ip) + b"\0" * 8
    return (struct.pack("=H", family) + struct.pack("!HI", port, 0)
            + socket.inet_pton(family, as_family(ip, family)) + struct.pack("=I", 0))


def valid_ip(ip: object) -> bool:
    if not isinstance(ip, str):
        return False
    try:
        ipaddress.ip_address(ip)
    except ValueError:
        return False
    return True
