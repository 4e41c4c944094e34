"""The ports tests hand to servers, from a range of this test worker's own.

`make test` runs two pytest-xdist workers at once, and a server binds its port seconds or
minutes after a test chose it. A port merely found free can meanwhile be chosen by the
other worker, or, in the kernel's ephemeral range, taken by any outgoing connection on the
machine: CI lost a real vLLM-Omni start that way (its orchestrator's ZMQ port, drawn from
the ephemeral range, was taken before it bound it). So each worker hands out ports, in
turn, from its own slice of the ports below the ephemeral range, each checked free as it
is drawn: two workers never hand out the same port, and the kernel never hands out one of
them by itself. vLLM draws its internal ports upward from `VLLM_PORT`, so every vLLM server
gets a block of this worker's ports as well (`port_block`).
"""

from __future__ import annotations

import os
import random
import socket
import threading
from pathlib import Path

# Below this, ports belong to well-known services.
LOWEST = 10000
# Where the kernel's own ports start when /proc does not say.
EPHEMERAL_LOW = 32768
# Ports of one vLLM server's `VLLM_PORT` block. A three-stage vLLM-Omni server draws about
# twenty (ZMQ routes, the coordinator, each stage's distributed init); the rest is slack
# for ports found busy, which vLLM skips upward.
VLLM_PORT_BLOCK = 200


def _ephemeral_low() -> int:
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return EPHEMERAL_LOW


def worker_range(environ: dict[str, str] | None = None) -> range:
    """This worker's slice of the ports between `LOWEST` and the ephemeral range: one of
    `PYTEST_XDIST_WORKER_COUNT` equal slices, by the worker's number (gw0, gw1, ...); the
    whole span outside xdist."""
    environ = dict(os.environ) if environ is None else environ
    count = int(environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    index = int(environ.get("PYTEST_XDIST_WORKER", "gw0").removeprefix("gw"))
    high = max(_ephemeral_low(), LOWEST + count * 2 * VLLM_PORT_BLOCK)
    width = (high - LOWEST) // count
    return range(LOWEST + index * width, LOWEST + (index + 1) * width)


def _free(port: int) -> bool:
    with socket.socket() as probe:
        try:
            probe.bind(("127.0.0.1", port))
        except OSError:
            return False
        return True


class _Cursor:
    """The next port of the worker's slice; it starts at random, so that two test sessions
    on one machine (a unit run beside `make test`) are unlikely to meet, and goes round."""

    def __init__(self, ports: range) -> None:
        self._ports = ports
        self._next = random.Random().randrange(len(ports))
        self._lock = threading.Lock()

    def take(self, count: int) -> int:
        """The first of `count` consecutive ports of the slice, each free now."""
        with self._lock:
            for _ in range(len(self._ports)):
                if self._next + count > len(self._ports):
                    self._next = 0
                first = self._ports[self._next]
                self._next += count
                if all(_free(port) for port in range(first, first + count)):
                    return first
        raise RuntimeError(f"no {count} free consecutive ports in {self._ports}")


_CURSOR = _Cursor(worker_range())


def free_port() -> int:
    """A port of this worker's, free now, that no other worker hands out."""
    return _CURSOR.take(1)


def port_block(size: int = VLLM_PORT_BLOCK) -> int:
    """The first of `size` consecutive ports of this worker's, all free now: a vLLM
    server's `VLLM_PORT`."""
    return _CURSOR.take(size)
