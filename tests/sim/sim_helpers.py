"""Helpers of the simulator tests: start the sim as a real process tree, look at it, kill it."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import psutil
from deadline import wait_until

from omni_watchdog.demo import REPORT_REQUEST
from omni_watchdog.process_start import start_time
from omni_watchdog.sim.nvml import STATE_ENV, SimulatedNvml

START_TIMEOUT_S = 30.0
EXAMPLES = Path(__file__).resolve().parents[2] / "omni_watchdog" / "examples"
V030_CONFIG = EXAMPLES / "qwen2_5_omni_0.30.yaml"
CONFIGS = {"0.11": EXAMPLES / "qwen2_5_omni_0.11.yaml", "0.30": V030_CONFIG}


def main_thread_status(pid: int) -> dict[str, str]:
    """`/proc/<pid>/status`: what the kernel says of the process's main thread."""
    lines = Path(f"/proc/{pid}/status").read_text().splitlines()
    return {key: value.strip() for key, _, value in (line.partition(":") for line in lines)}


def wait_delivered(pid: int, *signals: signal.Signals, timeout: float = 10.0) -> None:
    """Wait until none of `signals` is pending to the process or its main thread any more:
    each was delivered, or dropped as ignored."""

    def pending() -> list[str]:
        status = main_thread_status(pid)
        mask = int(status["ShdPnd"], 16) | int(status["SigPnd"], 16)
        return [each.name for each in signals if mask >> (each - 1) & 1]

    wait_until(
        lambda: not pending(),
        timeout,
        seen=lambda: f"{pending()} pending, state {main_thread_status(pid)['State']}",
    )


def voluntary_switches(pid: int) -> int:
    """How many times the process's main thread has blocked and been scheduled again."""
    return int(main_thread_status(pid)["voluntary_ctxt_switches"])


class Answer:
    """An HTTP answer: status (0 when none came in time), body and its JSON."""

    def __init__(self, status: int, body: bytes) -> None:
        self.status = status
        self.body = body

    def json(self) -> Any:
        return json.loads(self.body)


class Sim:
    """One simulated server started by a test, with helpers to look at it."""

    def __init__(self, state_dir: Path, log: Path) -> None:
        self.state_dir = state_dir
        self.log = log
        self.process: subprocess.Popen[bytes] | None = None
        self.known: dict[int, float] = {}
        self.url = ""

    def start(self, *args: str, env: dict[str, str] | None = None, wait: bool = True) -> Sim:
        self.launch("--port", "0", *args, env=env)
        api = wait_until(lambda: self.state_file("api.json"), START_TIMEOUT_S)
        self.url = f"http://127.0.0.1:{api['port']}"
        if wait:
            wait_until(lambda: self.get("/health", timeout=0.5).status == 200, START_TIMEOUT_S)
            self.state()
        return self

    def launch(self, *args: str, env: dict[str, str] | None = None) -> None:
        """Start `python -m omni_watchdog.sim` with `args`, not waiting for anything."""
        command = [sys.executable, "-m", "omni_watchdog.sim"]
        command += ["--state-dir", str(self.state_dir), "--token-delay", "0.01", *args]
        environment = {**os.environ, **(env or {})}
        environment.pop(STATE_ENV, None)
        with self.log.open("ab") as log:
            # A session of its own, as a shell gives a job: the test can kill the whole group.
            self.process = subprocess.Popen(
                command,
                stdout=log,
                stderr=subprocess.STDOUT,
                env=environment,
                start_new_session=True,
            )

    def state_file(self, name: str) -> dict[str, Any] | None:
        """A JSON file the sim writes in its state dir, or None while there is none; fails
        once the sim has exited."""
        assert self.process is not None
        if self.process.poll() is not None:
            raise AssertionError(f"sim exited with {self.process.returncode}:\n{self.output()}")
        try:
            return dict(json.loads((self.state_dir / name).read_text()))
        except (FileNotFoundError, ValueError):
            return None

    @property
    def pid(self) -> int:
        assert self.process is not None
        return self.process.pid

    def output(self) -> str:
        return self.log.read_text(errors="replace")

    def request(
        self,
        method: str,
        path: str,
        body: Any = None,
        timeout: float = 5.0,
        headers: dict[str, str] | None = None,
    ) -> Answer:
        data = None if body is None else json.dumps(body).encode()
        request = urllib.request.Request(self.url + path, data=data, method=method)
        request.add_header("Content-Type", "application/json")
        for name, value in (headers or {}).items():
            request.add_header(name, value)
        try:
            with urllib.request.urlopen(request, timeout=timeout) as response:
                return Answer(response.status, response.read())
        except urllib.error.HTTPError as error:
            return Answer(error.code, error.read())
        except (TimeoutError, urllib.error.URLError, ConnectionError):
            return Answer(0, b"")

    def get(self, path: str, timeout: float = 5.0) -> Answer:
        return self.request("GET", path, timeout=timeout)

    def post(self, path: str, body: Any, timeout: float = 5.0) -> Answer:
        return self.request("POST", path, body, timeout=timeout)

    def chat(self, timeout: float = 10.0) -> Answer:
        return self.post("/v1/chat/completions", REPORT_REQUEST, timeout=timeout)

    def inject(self, kind: str, stage: int = 0, replica: int = 0) -> None:
        answer = self.post("/sim/faults", {"kind": kind, "stage": stage, "replica": replica})
        assert answer.status == 200, answer.body

    def state(self) -> dict[str, Any]:
        state: dict[str, Any] = self.get("/sim/state").json()
        for stage in state["stages"]:
            pids = [stage["pid"], stage["engine_pid"], *(c["pid"] for c in stage["children"])]
            for pid in filter(None, pids):
                self._remember(pid)
        return state

    def _remember(self, pid: int) -> None:
        with contextlib.suppress(psutil.NoSuchProcess):
            self.known.setdefault(pid, start_time(pid))

    def stage(self, stage: int, replica: int = 0) -> dict[str, Any]:
        return next(
            s for s in self.state()["stages"] if (s["stage"], s["replica"]) == (stage, replica)
        )

    def metric(self, name: str, **labels: str) -> float:
        """The value of one series of `/metrics`, matched on the labels given."""
        for line in self.get("/metrics").body.decode().splitlines():
            if not line.startswith(name + "{"):
                continue
            series, _, value = line.rpartition(" ")
            if all(f'{key}="{wanted}"' in series for key, wanted in labels.items()):
                return float(value)
        raise AssertionError(f"no series {name}{labels}")

    def nvml(self) -> SimulatedNvml:
        return SimulatedNvml(self.state_dir)

    def used_bytes(self) -> int:
        nvml = self.nvml()
        return nvml.memory(nvml.handle(0)).used

    def gpu_pids(self) -> set[int]:
        nvml = self.nvml()
        return {p.pid for p in nvml.processes(nvml.handle(0))}

    def group(self) -> list[psutil.Process]:
        """The live, non-zombie processes of the sim's process group."""
        found = []
        for process in psutil.process_iter(["pid"]):
            try:
                if os.getpgid(process.pid) == self.pid and process.status() != "zombie":
                    found.append(process)
            except (ProcessLookupError, psutil.NoSuchProcess):
                continue
        return found

    def events(self) -> list[dict[str, Any]]:
        path = self.state_dir / "events.jsonl"
        if not path.exists():
            return []
        return [json.loads(line) for line in path.read_text().splitlines()]

    def wait_exit(self, timeout: float) -> int:
        assert self.process is not None
        return self.process.wait(timeout)

    def kill_everything(self) -> None:
        """SIGKILL the group, then whatever left it: recorded pids and GPU holders."""
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.pid, signal.SIGKILL)
        try:
            for pid in self.gpu_pids():  # the stand-in checks each pid's start time
                self._remember(pid)
        except Exception:
            pass  # no device file: the sim never got that far
        for pid, started in self.known.items():
            try:
                process = psutil.Process(pid)
                # Only a process this test started: the pid and its start time both match.
                if start_time(pid) == started:
                    process.kill()
            except psutil.NoSuchProcess:
                pass
        if self.process is not None:
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.process.wait(5)
