"""A TCP port for a test's process-group rendezvous."""

from __future__ import annotations

import random
import socket


def rendezvous_port() -> int:
    """A free port below the kernel's ephemeral range. An ephemeral port (``bind(0)``) is released
    before rank 0 listens on it, and in that gap another test's gloo ranks, connecting to each other
    from ephemeral ports of their own, can take it: rank 0 then fails with EADDRINUSE. Ports below
    the range are never handed out for outgoing connections, so only another listener can hold one,
    which the bind below rules out at the time of the call."""
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            low = int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        low = 32768  # Linux's default range starts here
    rng = random.SystemRandom()
    for _ in range(200):
        port = rng.randrange(max(1024, low - 12000), low)
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
        return port
    with socket.socket() as s:  # every tried port taken: fall back to an ephemeral one
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
