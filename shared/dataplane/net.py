"""Addresses: which interface peers dial (advertised, never a wildcard by accident), and parsing them."""

from __future__ import annotations

import socket

WILDCARDS = ("0.0.0.0", "::", "*", "")


def resolve_advertise(advertise: str, host: str) -> str:
    """The host peers dial. ``auto``: this host's outward interface (containers, one IP per replica).
    A wildcard bind without an advertised address would hand peers 0.0.0.0: refuse that."""
    if advertise == "auto":
        return outward_ip()
    if advertise:
        if advertise in WILDCARDS:
            raise ValueError(f"--data-advertise {advertise!r} is a wildcard: give an address peers can reach")
        return advertise
    if host in WILDCARDS:
        raise ValueError("the data plane listens on all interfaces: set --data-advertise (an address peers "
                         "can reach, or 'auto')")
    return host


def outward_ip() -> str:
    """The address of the interface that the default route leaves by."""
    probe = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    try:
        probe.connect(("10.255.255.255", 1))  # no packet is sent; the kernel only picks a route
        return probe.getsockname()[0]
    except OSError:
        return socket.gethostbyname(socket.gethostname())
    finally:
        probe.close()


def url_host(host: str) -> str:
    """``host`` as it goes into a URL: IPv6 literals in brackets."""
    return f"[{host}]" if ":" in host and not host.startswith("[") else host


def split_address(address: str, scheme: str) -> tuple[str, int]:
    """``scheme://host:port`` → (host, port); ValueError for anything else."""
    prefix = f"{scheme}://"
    if not address.startswith(prefix):
        raise ValueError(f"not a {scheme} address")
    host, sep, port = address[len(prefix):].rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"malformed {scheme} address")
    return host.strip("[]"), int(port)
