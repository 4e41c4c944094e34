"""The only code that touches the target: admin requests, signals, and capture tools.

Every signal goes through `SignalGuard`: the process must be one the watchdog recorded as
the target's (pid and create time both match, so a reused pid is never hit), and never
the watchdog itself, its own process group, or pid 1.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
from collections.abc import Callable
from dataclasses import dataclass

import aiohttp

from omni_watchdog import process_start
from omni_watchdog.http_body import read_at_most
from omni_watchdog.types import ProcessIdentity, ProcessTable, StepOutcome


@dataclass(frozen=True)
class SignalRecord:
    """One signal sent (or refused), for the incident's step detail."""

    target: str
    signal_name: str
    sent: bool
    reason: str = ""


@dataclass(frozen=True)
class AdminAnswer:
    """How the server's shutdown endpoint answered."""

    outcome: StepOutcome
    detail: str


class SignalGuard:
    """Decides whether a pid or process group may be signalled at all."""

    def __init__(
        self,
        process_table: ProcessTable,
        is_recorded: Callable[[ProcessIdentity], bool],
        own_pid: int | None = None,
        own_pgid: int | None = None,
        getpgid: Callable[[int], int] = os.getpgid,
        start_time: Callable[[int], float] = process_start.start_time,
    ) -> None:
        self._psutil = process_table
        self._start_time = start_time
        self._is_recorded = is_recorded
        self._own_pid = os.getpid() if own_pid is None else own_pid
        self._own_pgid = os.getpgid(0) if own_pgid is None else own_pgid
        self._getpgid = getpgid

    def check_process(self, identity: ProcessIdentity) -> str:
        """Empty when `identity` may be signalled, else the reason it may not."""
        if identity.pid in (0, 1):
            return "pid 1 and the kernel are never signalled"
        if identity.pid == self._own_pid:
            return "the watchdog never signals itself"
        if not self._is_recorded(identity):
            return "not a recorded process of the target"
        try:
            current = ProcessIdentity(identity.pid, self._start_time(identity.pid))
        except self._psutil.NoSuchProcess:
            return "already gone"
        except self._psutil.Error as error:
            return f"cannot inspect: {error}"
        if not identity.matches(current):
            return "pid now belongs to another process (create time differs)"
        return ""

    def check_group(self, pgid: int) -> str:
        """Empty when group `pgid` may be signalled: every live member must be recorded.

        A server started from a script shares the script's group; signalling that group
        would reach processes that are not the target's, so then only pids are signalled.
        """
        if pgid in (0, 1):
            return "process group 0 and 1 are never signalled"
        if pgid == self._own_pgid:
            return "the watchdog's own process group is never signalled"
        members = 0
        for process in self._psutil.process_iter(["pid"]):
            try:
                if self._getpgid(process.pid) != pgid:
                    continue
                identity = ProcessIdentity(process.pid, self._start_time(process.pid))
                if process.status() == self._psutil.STATUS_ZOMBIE:
                    continue
            except (ProcessLookupError, self._psutil.Error):
                continue
            if not self._is_recorded(identity) or identity.pid in (1, self._own_pid):
                return f"the group holds pid {identity.pid}, which is not the target's"
            members += 1
        return "" if members else "already gone"


class Actuators:
    """Sends the admin request and signals, through the guard; runs bounded capture tools."""

    def __init__(
        self,
        guard: SignalGuard,
        session: aiohttp.ClientSession,
        kill: Callable[[int, int], None] = os.kill,
        killpg: Callable[[int, int], None] = os.killpg,
    ) -> None:
        self._guard = guard
        self._session = session
        self._kill = kill
        self._killpg = killpg

    async def request_shutdown(
        self, url: str, method: str, token: str, timeout: float
    ) -> AdminAnswer:
        headers = {"Authorization": f"Bearer {token}"} if token else {}
        try:
            async with self._session.request(
                method, url, headers=headers, timeout=aiohttp.ClientTimeout(total=timeout)
            ) as response:
                # The first 200 bytes say what the endpoint answered; no more is read.
                head, _ = await read_at_most(response, 200)
                body = head.decode("utf-8", "replace")
                if 200 <= response.status < 300:
                    return AdminAnswer(StepOutcome.OK, f"{response.status} {body}".strip())
                return AdminAnswer(StepOutcome.REFUSED, f"{response.status} {body}".strip())
        except asyncio.TimeoutError:
            return AdminAnswer(StepOutcome.TIMEOUT, f"no answer from {url} in {timeout:g}s")
        except aiohttp.ClientError as error:
            return AdminAnswer(StepOutcome.UNREACHABLE, f"{url}: {error}")

    def signal_group(self, pgid: int, sig: signal.Signals) -> SignalRecord:
        return self._send(
            f"process group {pgid}", self._guard.check_group(pgid), self._killpg, pgid, sig
        )

    def signal_process(self, identity: ProcessIdentity, sig: signal.Signals) -> SignalRecord:
        reason = self._guard.check_process(identity)
        return self._send(f"pid {identity.pid}", reason, self._kill, identity.pid, sig)

    @staticmethod
    def _send(
        target: str,
        refusal: str,
        send: Callable[[int, int], None],
        number: int,
        sig: signal.Signals,
    ) -> SignalRecord:
        if refusal:
            return SignalRecord(target, sig.name, False, refusal)
        try:
            send(number, sig)
        except ProcessLookupError:
            return SignalRecord(target, sig.name, False, "already gone")
        except PermissionError as error:
            return SignalRecord(target, sig.name, False, f"not permitted: {error}")
        return SignalRecord(target, sig.name, True)

    async def run_bounded(self, argv: list[str], timeout: float) -> tuple[int | None, str]:
        """Run a capture tool; past `timeout` it is killed and its partial output kept."""
        try:
            process = await asyncio.create_subprocess_exec(
                *argv, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT
            )
        except OSError as error:
            return None, f"cannot run {argv[0]}: {error}"
        try:
            output, _ = await asyncio.wait_for(process.communicate(), timeout)
        except asyncio.TimeoutError:
            # The tool is our own child, so stopping it is ours to do; it may have exited
            # at that very moment (asyncio then raises ProcessLookupError).
            with contextlib.suppress(ProcessLookupError):
                process.kill()
            output, _ = await process.communicate()
            text = output.decode(errors="replace")
            return None, f"{text}\n[stopped after {timeout:g}s]"
        except asyncio.CancelledError:
            # The step's bound or the watchdog's stop: the tool must not outlive it.
            with contextlib.suppress(ProcessLookupError):
                process.kill()
            # Reaped here: an unreaped child's transport would outlive the event loop.
            await process.wait()
            raise
        return process.returncode, output.decode(errors="replace")


def is_alive(
    process_table: ProcessTable,
    identity: ProcessIdentity,
    start_time: Callable[[int], float] = process_start.start_time,
) -> bool:
    """The recorded process still exists: same pid, same start time, not a zombie."""
    try:
        process = process_table.Process(identity.pid)
        if not identity.matches(ProcessIdentity(identity.pid, start_time(identity.pid))):
            return False
        return process.status() != process_table.STATUS_ZOMBIE
    except process_table.NoSuchProcess:
        return False
    except process_table.Error:
        return True
