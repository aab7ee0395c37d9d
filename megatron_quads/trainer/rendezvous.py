"""A free TCP port for a process group's rendezvous (gloo or NCCL), picked where no outgoing
connection can take it meanwhile."""

from __future__ import annotations

import random
import socket

_LOWEST_PICKED_PORT = 10000
"""The lowest port picked at random (below it sit well-known and registered services)."""


def _ephemeral_port_range() -> tuple[int, int]:
    """The kernel's range for ports it assigns on its own (Linux; the common default elsewhere)."""
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            low, high = (int(v) for v in f.read().split())
        return low, high
    except (OSError, ValueError):
        return 32768, 60999


def find_free_port(host: str = "127.0.0.1", attempts: int = 64) -> int:
    """A TCP port that was free on ``host`` a moment ago (for a gloo or NCCL rendezvous).

    Picked at random below the kernel's ephemeral range where there is room: a port from that range
    can be handed to any outgoing connection (a gloo pair, a Ray worker) between this check and the
    rendezvous binding it, which failed a CI run with ``EADDRINUSE``. Falls back to a port the
    kernel assigns."""
    low, _ = _ephemeral_port_range()
    rng = random.SystemRandom()
    for _ in range(attempts if low > _LOWEST_PICKED_PORT else 0):
        port = rng.randrange(_LOWEST_PICKED_PORT, low)
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
            try:
                sock.bind((host, port))
            except OSError:
                continue
            return port
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]
