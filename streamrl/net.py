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


def cluster_address_problem(address: str) -> str | None:
    """What is wrong with a Ray cluster address (`auto`, HOST:PORT or ray://HOST:PORT), or None."""
    if address == "auto":
        return None
    host_port = address.removeprefix("ray://")
    host, sep, port = host_port.rpartition(":")
    if not sep or not host or "/" in host_port or "://" in host_port:
        return f"not a Ray cluster address: {address!r} (expected HOST:PORT, ray://HOST:PORT or auto)"
    if ":" in host and not (host.startswith("[") and host.endswith("]")):  # Ray's parser needs the brackets
        return f"not a Ray cluster address: {address!r} (an IPv6 host goes in brackets: [{host}]:{port})"
    if not (port.isdigit() and 1 <= int(port) <= 65535):
        return f"not a Ray cluster address: {address!r} (its port {port!r} is not a number from 1 to 65535)"
    return None


def free_port(host: str = LOOPBACK) -> int:
    """A TCP port free on `host` at the time of asking (for a rendezvous another process opens)."""
    with socket.socket() as probe:
        probe.bind((host, 0))
        return probe.getsockname()[1]
