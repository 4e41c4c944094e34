"""The first process of a lab host's pid namespace: starts the host's containers in order,
starts each again when it exits (Kubernetes' restartPolicy: Always, the kubelet's part),
reaps every orphan, and on SIGTERM ends them all.

Run as `python host_init.py SPEC`, SPEC a JSON file: {"events": path, "containers":
[{"name", "argv", "env", "log", "restart_delay"}]}. Each start and exit is a line in
the events file, with the pid as this namespace numbers it. Only the standard library:
it runs with the interpreter of the project's environment, before anything is imported.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

REAP_EVERY = 0.05
STOP_GRACE = 5.0


@dataclass
class Container:
    name: str
    argv: list[str]
    env: dict[str, str]
    log: Path
    restart_delay: float
    process: subprocess.Popen[bytes] | None = None
    due: float = 0.0
    starts: int = 0


class Init:
    def __init__(self, spec: dict[str, Any]) -> None:
        self.events = Path(spec["events"])
        self.containers = [
            Container(
                c["name"],
                list(c["argv"]),
                dict(c["env"]),
                Path(c["log"]),
                float(c.get("restart_delay", 1.0)),
            )
            for c in spec["containers"]
        ]
        self.stopping = False

    def record(self, event: str, container: Container, **fields: Any) -> None:
        line = {"time": time.time(), "event": event, "container": container.name, **fields}
        with self.events.open("a") as events:
            events.write(json.dumps(line) + "\n")

    def start(self, container: Container) -> None:
        with container.log.open("ab") as log:
            container.process = subprocess.Popen(
                container.argv,
                env={**os.environ, **container.env},
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        container.starts += 1
        self.record("started", container, pid=container.process.pid, starts=container.starts)

    def reap(self) -> None:
        while True:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                return
            if pid == 0:
                return
            for container in self.containers:
                if container.process is not None and container.process.pid == pid:
                    container.process.returncode = os.waitstatus_to_exitcode(status)
                    self.record("exited", container, pid=pid, code=container.process.returncode)
                    container.process = None
                    container.due = time.monotonic() + container.restart_delay

    def run(self) -> None:
        signal.signal(signal.SIGTERM, self.stop)
        for container in self.containers:
            self.start(container)
        while not self.stopping:
            self.reap()
            for container in self.containers:
                if container.process is None and time.monotonic() >= container.due:
                    self.start(container)
            time.sleep(REAP_EVERY)
        self.end_all()

    def stop(self, signum: int, frame: object) -> None:
        self.stopping = True

    def end_all(self) -> None:
        """SIGTERM to each container's group, SIGKILL to whatever is left after the grace;
        the namespace dies with this process anyway."""
        for sig in (signal.SIGTERM, signal.SIGKILL):
            for container in self.containers:
                if container.process is not None:
                    with contextlib.suppress(ProcessLookupError):
                        os.killpg(container.process.pid, sig)
            deadline = time.monotonic() + STOP_GRACE
            while time.monotonic() < deadline and any(c.process for c in self.containers):
                self.reap()
                time.sleep(REAP_EVERY)


if __name__ == "__main__":
    Init(json.loads(Path(sys.argv[1]).read_text())).run()
