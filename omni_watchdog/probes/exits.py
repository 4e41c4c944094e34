"""Exit notices: the kernel's word that a recorded process exited, as it happens.

A pidfd (Linux 5.3 and later) becomes readable when its process exits. The tracker holds
one for each running process it records and rests on them between scans, so an exit
starts a scan at once instead of waiting out the scan's period. A pidfd names one
process for its life, so the identity is checked once, right after opening: a pid reused
between the scan and the open is not watched. Where pidfds are missing (an older kernel,
a seccomp filter that refuses the call), the scan alone finds exits, as before.
"""

from __future__ import annotations

import asyncio
import errno
import logging
import os
from collections.abc import Callable, Iterable

from omni_watchdog.log import log_event
from omni_watchdog.types import ProcessIdentity

logger = logging.getLogger("omni_watchdog.probes.exits")

# A pidfd is a descriptor: beyond this many, the rest are left to the scan, so that a
# server of thousands of processes cannot take the descriptors the listeners need.
MAX_WATCHED = 128
# Identities already announced, kept so that one is never watched twice.
MAX_REMEMBERED = 4096


def _os_pidfd_open() -> Callable[[int], int] | None:
    opener: Callable[[int], int] | None = getattr(os, "pidfd_open", None)
    return opener


class ExitNotices:
    """pidfds of the processes to watch, and a rest that ends when one of them exits."""

    def __init__(
        self,
        start_time: Callable[[int], float],
        open_pidfd: Callable[[int], int] | None = None,
        close: Callable[[int], None] = os.close,
    ) -> None:
        self._start_time = start_time
        self._open = open_pidfd if open_pidfd is not None else _os_pidfd_open()
        self._close = close
        self._fds: dict[ProcessIdentity, int] = {}
        self._announced: dict[ProcessIdentity, None] = {}
        self._news = False
        self._waiter: asyncio.Future[None] | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self.unavailable: str | None = None if self._open else "os.pidfd_open is missing"
        self.noticed = 0
        self.over_cap = 0

    @property
    def watched(self) -> frozenset[ProcessIdentity]:
        return frozenset(self._fds)

    def watch(self, identities: Iterable[ProcessIdentity]) -> None:
        """Hold a pidfd for each of `identities` (running processes), and none other."""
        wanted = dict.fromkeys(identities)
        loop = asyncio.get_running_loop()
        # A reader belongs to one event loop: on another, every pidfd is opened again.
        moved = loop is not self._loop
        for identity in [i for i in self._fds if moved or i not in wanted]:
            self._drop(identity)
        self._loop = loop
        if self._open is None or self.unavailable is not None:
            return
        self.over_cap = 0
        for identity in wanted:
            if identity in self._fds or identity in self._announced:
                continue
            if len(self._fds) >= MAX_WATCHED:
                self.over_cap += 1
                continue
            try:
                fd = self._open_checked(identity)
            except OSError as error:
                self.unavailable = f"pidfd_open: {error.strerror or error}"
                log_event(
                    logger, "exit_notices_unavailable", logging.WARNING, reason=self.unavailable
                )
                return
            if fd is None:
                continue
            self._fds[identity] = fd
            loop.add_reader(fd, self._exited, identity)

    async def rest(self, seconds: float) -> None:
        """Return after `seconds`, or as soon as a watched process exits (at once if one
        exited since the last rest)."""
        if not self._news:
            loop = asyncio.get_running_loop()
            waiter: asyncio.Future[None] = loop.create_future()
            self._waiter = waiter
            timer = loop.call_later(seconds, _settle, waiter)
            try:
                await waiter
            finally:
                timer.cancel()
                self._waiter = None
        self._news = False

    def scanning(self) -> None:
        """A scan of the process table starts now: it sees every exit noticed so far, so
        the next rest waits for a newer one."""
        self._news = False

    def close(self) -> None:
        for identity in list(self._fds):
            self._drop(identity)

    def _open_checked(self, identity: ProcessIdentity) -> int | None:
        """A pidfd of `identity`, or None: gone already (the scan will see it), out of
        descriptors for now, or another process now under its pid. Raises OSError where
        this kernel gives no pidfds."""
        assert self._open is not None
        try:
            fd = self._open(identity.pid)
        except ProcessLookupError:
            return None
        except OSError as error:
            if error.errno in (errno.EMFILE, errno.ENFILE):
                return None
            raise
        try:
            now_there = ProcessIdentity(identity.pid, self._start_time(identity.pid))
        except OSError:
            now_there = None
        if now_there is None or not identity.matches(now_there):
            self._close(fd)
            return None
        return fd

    def _exited(self, identity: ProcessIdentity) -> None:
        self._drop(identity)
        self._announced[identity] = None
        while len(self._announced) > MAX_REMEMBERED:
            del self._announced[next(iter(self._announced))]
        self.noticed += 1
        self._news = True
        if self._waiter is not None:
            _settle(self._waiter)

    def _drop(self, identity: ProcessIdentity) -> None:
        fd = self._fds.pop(identity)
        if self._loop is not None:
            self._loop.remove_reader(fd)
        self._close(fd)


def _settle(waiter: asyncio.Future[None]) -> None:
    if not waiter.done():
        waiter.set_result(None)
