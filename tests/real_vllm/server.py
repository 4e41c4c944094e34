"""The real vLLM server (the CPU build, in `.venv-vllm`) and a watchdog attached to it.

Each server runs in a session of its own and is killed, with everything it ever started,
by the fixture that started it.
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import os
import re
import shutil
import signal
import subprocess
import tempfile
import warnings
from collections.abc import AsyncIterator, Callable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Generic, NoReturn, Protocol, TypeVar

import aiohttp
import explain
import psutil
import pytest
from deadline import wait_for
from e2e.harness import FAST, watchdog_account
from ports import free_port, port_block

from omni_watchdog.app import Watchdog
from omni_watchdog.clock import SystemClock
from omni_watchdog.config import PROBES, load_config, merge_layers
from omni_watchdog.factory import build_watchdog
from omni_watchdog.log import configure_logging
from omni_watchdog.process_start import start_time

REPO = Path(__file__).resolve().parents[2]
VLLM_VENV = REPO / ".venv-vllm"
VLLM_PYTHON = VLLM_VENV / "bin" / "python"
# Written by make/vllm.mk once the whole environment is installed.
VLLM_STAMP = VLLM_VENV / ".installed-stamp"
MAKE_TINY_MODEL = REPO / "scripts" / "make_tiny_model.py"
MODEL_NAME = "tiny"
ADMIN_TOKEN = "real-vllm-test-token"
# About 30 s to ready on two cores; a loaded CI machine gets three times that and more.
READY_TIMEOUT = 150.0
# A log line at level ERROR or CRITICAL whose message is not a line of a traceback (those
# are indented), nor its heading.
ERROR_LINE = re.compile(r"\b(?:ERROR|CRITICAL)\b[^\]]*\]\s(?!Traceback)\S")
# An access-log line of a probe's poll: `"GET /metrics HTTP/1.1" 200 OK`.
POLLING_LINE = re.compile(r'"GET /(?:metrics|health) HTTP/[\d.]+" 200\b')

# The short timeouts of the simulated-server tests; no GPU here, so the GPU probe is left
# out rather than reported failing all along. The canary matters: the real /health stays
# 200 while the engine is stopped.
REAL_FAST = merge_layers(
    FAST,
    {
        "probes": {
            "gpu_backend": "none",
            "enabled": [probe for probe in PROBES if probe != "gpu"],
        }
    },
)


def worker_cpu() -> str:
    """The CPU this test worker's vLLM workers run on (`VLLM_CPU_OMP_THREADS_BIND`).

    vLLM binds every CPU worker to the same core by default (core 0 of two here), so the
    servers of two test workers fought over one core while the other idled: CI saw a
    SIGKILLed worker still being torn down there 40 s later. Each test worker's servers
    get a core of their own, as two servers sharing a host would be given."""
    index = int(os.environ.get("PYTEST_XDIST_WORKER", "gw0").removeprefix("gw"))
    cpus = sorted(os.sched_getaffinity(0))
    return str(cpus[index % len(cpus)])


def launch(
    argv: list[str], workdir: Path, env: Mapping[str, str]
) -> tuple[subprocess.Popen[bytes], Path, Path]:
    """Start a vLLM command in a session of its own, logging to `workdir`, with caches of
    its own and the plugin's settings (the admin token, a fast heartbeat) under `env`:
    the process, its log and its scratch dir."""
    workdir.mkdir(parents=True, exist_ok=True)
    scratch = Path(tempfile.mkdtemp(prefix="vllm-"))
    child_env = {
        **os.environ,
        "HF_HUB_OFFLINE": "1",
        "VLLM_CACHE_ROOT": str(workdir / "vllm-cache"),
        "TORCHINDUCTOR_CACHE_DIR": str(workdir / "inductor-cache"),
        "TMPDIR": str(scratch),
        # vLLM draws its internal ports (ZMQ routes, its coordinator, distributed init)
        # upward from here: ports of this test worker's own, never the kernel's ephemeral
        # ones, which any outgoing connection can take before vLLM binds them.
        "VLLM_PORT": str(port_block()),
        "VLLM_CPU_OMP_THREADS_BIND": worker_cpu(),
        "OMNI_WATCHDOG_ADMIN_TOKEN": ADMIN_TOKEN,
        "OMNI_WATCHDOG_HEARTBEAT_INTERVAL": "0.5",
        **env,
    }
    log_path = workdir / "vllm.log"
    with log_path.open("ab") as log:
        process = subprocess.Popen(
            argv,
            stdout=log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            env=child_env,
            cwd=workdir,
            start_new_session=True,
        )
    return process, log_path, scratch


@dataclass(kw_only=True)
class StartedTree:
    """A process this test process started, in its own session and process group, and
    every process of its tree: only these are ever signalled."""

    process: subprocess.Popen[bytes]
    log_path: Path
    # vLLM puts ZMQ sockets under TMPDIR, and a socket path must stay under 108 bytes: a
    # pytest temp dir is too deep, so the scratch dir sits right in the system's temp dir.
    scratch: Path
    # Every process of its tree ever seen, by pid and start time, for the clean-up.
    seen: dict[int, float] = field(default_factory=dict)

    def log_tail(self, chars: int = 3000) -> str:
        """The log's last `chars`, the polling of its `/metrics` and `/health` left out: a
        watchdog's probes fill a quiet server's log, and CI shows only so much of a failure."""
        lines = self.log_path.read_text(errors="replace").splitlines()
        told = "\n".join(line for line in lines if not POLLING_LINE.search(line))
        return told[-chars:]

    def first_errors(self, lines: int = 12) -> str:
        """The log's first distinct error messages: a traceback fills the tail, and what
        began the failure is at its top."""
        found: dict[str, str] = {}
        for line in self.log_path.read_text(errors="replace").splitlines():
            error = ERROR_LINE.search(line)
            if error is not None:
                found.setdefault(line[error.end() - 1 :], line[-300:])
            if len(found) == lines:
                break
        return "\n".join(found.values()) or "(none)"

    def account(self) -> str:
        """What a failed test prints of this tree: how its root ended, every process
        recorded, the log's first errors and its tail."""
        code = self.process.poll()
        root = "running" if code is None else f"exited with {code}"
        table = explain.process_table(self.seen, start_time)
        return (
            f"root pid {self.process.pid} {root}; processes:\n{table}\n"
            f"first errors:\n{self.first_errors()}\nlog tail:\n{self.log_tail()}"
        )

    def exited(self, what: str) -> NoReturn:
        """Fail a start whose `what` exited, with its log; a port taken meanwhile is
        `PortTaken`, which a start retries once."""
        tail = self.log_tail()
        message = f"{what} exited with {self.process.returncode}:\n{tail}"
        if PORT_TAKEN in tail:
            raise PortTaken(message)
        pytest.fail(message)

    def tree(self) -> list[psutil.Process]:
        """The root and its live descendants, each remembered for the clean-up."""
        try:
            root = psutil.Process(self.process.pid)
            processes = [root, *root.children(recursive=True)]
        except psutil.NoSuchProcess:
            return []
        for process in processes:
            with contextlib.suppress(psutil.Error):
                self.seen.setdefault(process.pid, start_time(process.pid))
        return processes

    def titled(self, title: str) -> psutil.Process:
        """The one process of the tree whose title (setproctitle) starts with `title`."""
        found = [p for p in self.tree() if _title(p).startswith(title)]
        assert len(found) == 1, f"{title}: {[(p.pid, _title(p)) for p in self.tree()]}"
        return found[0]

    def leftovers(self) -> list[int]:
        """Processes of this tree that still run, however far they escaped."""
        alive = []
        for pid, started in self.seen.items():
            with contextlib.suppress(psutil.Error):
                process = psutil.Process(pid)
                if start_time(pid) == started and process.status() != psutil.STATUS_ZOMBIE:
                    alive.append(pid)
        return alive

    def signal(self, process: psutil.Process, signum: signal.Signals) -> None:
        """Send `signum` to a process of this tree, and to nothing else."""
        assert process.pid in self.seen and start_time(process.pid) == self.seen[process.pid]
        process.send_signal(signum)

    def stop(self) -> None:
        """Kill the tree's group, then any recorded process that left it."""
        self.tree()
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.process.pid, signal.SIGKILL)
        for pid in self.leftovers():
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(pid, signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.process.wait(timeout=10)
        shutil.rmtree(self.scratch, ignore_errors=True)


@dataclass(kw_only=True)
class VllmServer(StartedTree):
    """A `vllm serve` this test process started, in its own session and process group."""

    port: int
    otlp_port: int

    @classmethod
    def start(cls, model: Path, workdir: Path, env: Mapping[str, str] | None = None) -> VllmServer:
        port, otlp_port = free_port(), free_port()
        otlp_endpoint = f"http://127.0.0.1:{otlp_port}/v1/traces"
        argv = [
            str(VLLM_PYTHON),
            "-m",
            "vllm.entrypoints.openai.api_server",
            "--model",
            str(model),
            "--served-model-name",
            MODEL_NAME,
            "--enforce-eager",
            "--max-model-len",
            "512",
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
            "--otlp-traces-endpoint",
            otlp_endpoint,
        ]
        plugin_env = {
            # A GiB of KV cache, not vLLM's CPU default of most of the free memory.
            "VLLM_CPU_KVCACHE_SPACE": "1",
            # vLLM's exporter speaks gRPC unless told otherwise; the receiver is OTLP/HTTP.
            "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL": "http/protobuf",
            # The omni-watchdog plugin installed in the vLLM environment: the endpoint
            # plugin (the admin route) loads only when named, and naming it filters the
            # general plugins down to the names listed.
            "VLLM_PLUGINS": "omni_watchdog",
        }
        return cls.spawn(argv, workdir, port, otlp_port, {**plugin_env, **(env or {})})

    @classmethod
    def spawn(
        cls,
        argv: list[str],
        workdir: Path,
        port: int,
        otlp_port: int,
        env: Mapping[str, str],
    ) -> VllmServer:
        """Start `argv` (a server on `port`, exporting spans to `otlp_port`) in its own
        session, with the plugin's settings and caches of its own under `workdir`."""
        process, log_path, scratch = launch(
            argv,
            workdir,
            {"OMNI_WATCHDOG_OTLP_ENDPOINT": f"http://127.0.0.1:{otlp_port}/v1/traces", **env},
        )
        return cls(
            port=port, otlp_port=otlp_port, process=process, log_path=log_path, scratch=scratch
        )

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    async def wait_ready(self, timeout: float = READY_TIMEOUT) -> None:
        """Until /health answers 200; fails at once, with the log, if the server exits."""
        async with aiohttp.ClientSession() as session:

            async def healthy() -> bool:
                if self.process.poll() is not None:
                    self.exited("vllm")
                with contextlib.suppress(aiohttp.ClientError, asyncio.TimeoutError):
                    async with session.get(
                        self.url + "/health", timeout=aiohttp.ClientTimeout(total=2)
                    ) as response:
                        if response.status == 200:
                            self.tree()
                            return True
                return False

            await wait_for(
                healthy, timeout, "vllm's /health answering 200", 0.5, seen=self.log_tail
            )


# What vLLM logs when a port it was given or chose was bound by someone else first.
PORT_TAKEN = "Address already in use"


class PortTaken(Exception):
    """A server that exited at start because a port was taken before it bound it."""


class Startable(Protocol):
    def stop(self) -> None: ...

    async def wait_ready(self, timeout: float) -> None: ...


Started = TypeVar("Started", bound=Startable)


def start_ready(start: Callable[[], Started], timeout: float, *, alone: bool) -> Started:
    """`start()`, ready, or the test fails with the log. A start `alone` (a vLLM-Omni
    server: three stages, six processes, two minutes on two cores) holds the run's lock:
    no two of them start at once across the test workers, where they starved each other
    and whatever ran beside them. A start that met a port taken meanwhile is tried once
    more, with fresh ports, and says so in the test log."""
    with _one_start_at_a_time() if alone else contextlib.nullcontext():
        try:
            return _ready(start(), timeout)
        except PortTaken as taken:
            warnings.warn(f"starting once more with fresh ports: {taken}", stacklevel=2)
        try:
            return _ready(start(), timeout)
        except PortTaken as taken:
            pytest.fail(f"a port was taken again at the second start: {taken}")


def _ready(server: Started, timeout: float) -> Started:
    """`server` once ready; stopped, whatever is left of it, if it never is."""
    try:
        asyncio.run(server.wait_ready(timeout))
    except BaseException:
        server.stop()
        raise
    return server


@contextlib.contextmanager
def _one_start_at_a_time() -> Iterator[None]:
    """Hold the lock of this test run that real servers start under."""
    run = os.environ.get("PYTEST_XDIST_TESTRUNUID", str(os.getpid()))
    path = Path(tempfile.gettempdir()) / f"omni-watchdog-tests-{run}.start-lock"
    with path.open("a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


Value = TypeVar("Value")


@dataclass
class Shared(Generic[Value]):
    """A server that the tests of a module share (`value`, what they are given of it), and
    the test during which it ended, if one did."""

    value: Value
    server: VllmServer
    ended_during: str | None = None

    @contextlib.contextmanager
    def used_by(self, test: str) -> Iterator[None]:
        """`test` uses the server: it fails at once if an earlier test ended it (its failure
        would only be a consequence), and is named if the server ends while it runs."""
        if self.ended_during is not None or self.server.process.poll() is not None:
            pytest.fail(
                f"the shared server ended during {self.ended_during or 'no test'}: this"
                f" test's failure is a consequence of that one\n{self.server.account()}"
            )
        try:
            yield
        finally:
            if self.server.process.poll() is not None:
                self.ended_during = test


def installed_python(stamp: Path, python: Path, what: str) -> Path:
    """An environment's Python once `make tools` has installed it (`stamp`); without it the
    test fails in CI and is skipped elsewhere."""
    if not stamp.exists():
        if os.environ.get("CI"):
            pytest.fail(f"{stamp.parent.name} is missing: `make tools` must install {what} first")
        pytest.skip("run make tools")
    return python


def make_tiny_model(python: Path, output: Path, env: Mapping[str, str], *options: str) -> Path:
    """The tiny random-weight model of `scripts/make_tiny_model.py`, written by `python`."""
    subprocess.run(
        [str(python), str(MAKE_TINY_MODEL), str(output), *options],
        check=True,
        capture_output=True,
        env={**os.environ, "HF_HUB_OFFLINE": "1", **env},
        timeout=180,
    )
    return output


def _title(process: psutil.Process) -> str:
    try:
        return " ".join(process.cmdline()) or process.name()
    except psutil.Error:
        return ""


@contextlib.asynccontextmanager
async def watching(
    server: VllmServer,
    workdir: Path,
    mode: str = "enforce",
    overrides: Mapping[str, Any] | None = None,
) -> AsyncIterator[Watchdog]:
    """A watchdog in this process attached to `server` by its port, receiving its spans."""
    configure_logging("debug", (workdir / "watchdog.log").open("a"))
    config = load_config(
        environ={},
        overrides=merge_layers(
            merge_layers(
                {
                    "target": server.url,
                    "mode": mode,
                    "listen": "127.0.0.1:0",
                    "state_dir": str(workdir / "watchdog"),
                    "admin_token": ADMIN_TOKEN,
                    "spans": {"otlp_listen": f"127.0.0.1:{server.otlp_port}"},
                },
                REAL_FAST,
            ),
            overrides or {},
        ),
    )
    watchdog = await build_watchdog(config, clock=SystemClock())
    explain.witness_this_test(f"the watchdog of {server.url}", lambda: watchdog_account(watchdog))
    await watchdog.start()
    try:
        # Warm, and its processes recorded: a test that kills one right after means the
        # watchdog to have seen it alive.
        await wait_for(
            lambda: (
                watchdog.state.report
                and watchdog.state.report.warmed_up
                and watchdog.state.target.generation > 0
            ),
            30,
        )
        yield watchdog
    finally:
        await watchdog.stop()
