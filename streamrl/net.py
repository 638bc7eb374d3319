"""Small network facts shared by the Ray connection, the megatron rendezvous and the weight groups
(no Ray or torch import here)."""

from __future__ import annotations

import ipaddress
import socket

LOOPBACK = "127.0.0.1"


def is_loopback(host: str) -> bool:
    """127.0.0.0/8, ::1, ::ffff:127.x.y.z (an IPv6 socket bound to IPv4 loopback), or `localhost`."""
    if host == "localhost":
        return True
    try:
        address = ipaddress.ip_address(host.strip("[]"))
    except ValueError:  # a host name
        return False
    mapped = getattr(address, "ipv4_mapped", None)
    return address.is_loopback or (mapped is not None and mapped.is_loopback)


def free_port(host: str = LOOPBACK) -> int:
    """A TCP port free on `host` at the time of asking (for a rendezvous another process opens)."""
    with socket.socket() as probe:
        probe.bind((host, 0))
        return probe.getsockname()[1]
