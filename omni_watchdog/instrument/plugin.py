"""The vLLM plugin entry points: `vllm.general_plugins` and `vllm.endpoint_plugins`.

vLLM calls every general plugin from `load_general_plugins()`, once per process, in the
API server (from `EngineArgs.create_engine_config`), in every EngineCore (from
`EngineCore.__init__`) and in every worker (from `WorkerWrapperBase`); a forked child
inherits the parent's "already loaded" flag and its patched classes instead. Endpoint
plugins (vLLM 0.32) are zero-argument factories of an object with `name`,
`required_tasks`, `attach_router(app)` and `async init_state(engine_client, state, args)`,
and load only when named in `VLLM_PLUGINS`; an older vLLM has no such group, and there the
general plugin adds the route to the app `build_app` returns.
"""

from __future__ import annotations

import atexit
import logging
import multiprocessing
import os
import re
from collections.abc import Callable, Mapping, MutableMapping
from typing import Any

from omni_watchdog.instrument import diffusion, hooks
from omni_watchdog.instrument.admin import (
    ADMIN_SHUTDOWN_PATH,
    ShutdownAuthority,
    add_fastapi_admin_route,
)
from omni_watchdog.instrument.hooks import HookContext, ProcessIdentity
from omni_watchdog.instrument.telemetry import StageTelemetry
from omni_watchdog.types import DIFFUSION_WORKER_TITLE

logger = logging.getLogger(__name__)

PLUGIN_NAME = "omni_watchdog"
REPLICA_ENV = "VLLM_OMNI_REPLICA_ID"
# vLLM-Omni 0.30 titles its stage replicas `VLLM::StageEngineCoreProc_stage{S}_replica{R}_DP{n}`.
STAGE_TITLE = re.compile(r"StageEngineCoreProc_stage(\d+)(?:_replica(\d+))?")


def _process_title() -> str:
    try:
        import setproctitle

        return str(setproctitle.getproctitle())
    except Exception:
        return ""


def identify_process(title: str, process: Any, environ: Mapping[str, str]) -> ProcessIdentity:
    """What this process is, from its title, its multiprocessing target and environment."""
    stage = STAGE_TITLE.search(title)
    if stage is not None:
        replica = stage.group(2) or environ.get(REPLICA_ENV) or "0"
        return ProcessIdentity("stage", int(stage.group(1)), int(replica))
    target = getattr(getattr(process, "_target", None), "__name__", "")
    arguments: tuple[Any, ...] = tuple(getattr(process, "_args", ()))
    if target == "run_diffusion_proc":
        # vLLM-Omni 0.30's diffusion stage subprocess, started with its stage and replica.
        keywords: Mapping[str, Any] = getattr(process, "_kwargs", {})
        stage_id = keywords.get("omni_stage_id")
        if stage_id is None:
            stage_id = getattr(keywords.get("od_config"), "stage_id", 0)
        return ProcessIdentity(
            "stage", int(stage_id or 0), int(keywords.get("omni_replica_id") or 0)
        )
    if target == "worker_main" and len(arguments) >= 2:
        # The mp diffusion executor's `DiffusionWorker-N`, given (rank, od_config, ...).
        return ProcessIdentity("worker", int(getattr(arguments[1], "stage_id", 0) or 0), 0)
    if "EngineCore" in title:
        # Plain vLLM is stage 0; under a 0.11 stage worker the worker names the stage.
        return ProcessIdentity("engine", int(environ.get(hooks.STAGE_ID_ENV, "0")), 0)
    if "Worker" in title and DIFFUSION_WORKER_TITLE not in title:
        return ProcessIdentity("worker", int(environ.get(hooks.STAGE_ID_ENV, "0")), 0)
    if target == "_stage_worker_async_entry" and len(arguments) >= 3:
        return ProcessIdentity("stage", int(arguments[2]["stage_id"]), 0)
    # Also a one-stage diffusion server's API process, which titles itself a DiffusionWorker
    # once its inline engine starts.
    return ProcessIdentity("api")


class Plugin:
    """Installs the hooks that fit this process, once, and hands them their telemetry."""

    def __init__(
        self,
        *,
        environ: MutableMapping[str, str] = os.environ,
        process_title: Callable[[], str] = _process_title,
        current_process: Callable[[], Any] = multiprocessing.current_process,
        getpid: Callable[[], int] = os.getpid,
        make_telemetry: Callable[..., StageTelemetry] = StageTelemetry.from_environment,
        at_exit: Callable[[Callable[[], None]], Any] = atexit.register,
    ) -> None:
        self._environ = environ
        self._process_title = process_title
        self._current_process = current_process
        self._getpid = getpid
        self._make_telemetry = make_telemetry
        self._at_exit = at_exit
        self._registered_pid: int | None = None
        self.installed: list[str] = []
        self.context = HookContext(
            self._telemetry_for, self.identify, environ=environ, getpid=getpid
        )

    def identify(self) -> ProcessIdentity:
        return identify_process(self._process_title(), self._current_process(), self._environ)

    def _telemetry_for(self, identity: ProcessIdentity) -> StageTelemetry:
        telemetry = self._make_telemetry(
            process_kind=identity.kind,
            stage_id=identity.stage_id,
            replica=identity.replica,
            environ=self._environ,
        )
        self._at_exit(telemetry.shutdown)
        return telemetry

    def register_general(self) -> list[str]:
        """Install this process's hooks (once per process); the names of those installed."""
        if self._registered_pid == self._getpid():
            return self.installed
        self._registered_pid = self._getpid()
        identity = self.identify()
        title = self._process_title()
        candidates: dict[str, Callable[[], bool]] = {}
        # Not in a model worker: it has no loop of its own to watch; its EngineCore beats.
        # In the API server too, because EngineCore children forked from it inherit the patch.
        if identity.kind in ("api", "engine", "stage"):
            candidates["engine_core_loop"] = lambda: hooks.install_engine_core_loop(self.context)
        if _may_run_diffusion(identity, title) and _importable("vllm_omni.diffusion"):
            # The API server runs the engine of a one-stage pipeline itself; each hook acts
            # only where its code runs.
            candidates["diffusion_engine_loop"] = lambda: diffusion.install_diffusion_engine_loop(
                self.context
            )
            candidates["diffusion_runner"] = lambda: diffusion.install_diffusion_runner(
                self.context
            )
            candidates["diffusion_worker_loop"] = lambda: diffusion.install_diffusion_worker_loop(
                self.context
            )
        if (
            identity.kind == "stage"
            and STAGE_TITLE.search(title) is None
            and getattr(getattr(self._current_process(), "_target", None), "__name__", "")
            != "run_diffusion_proc"
        ):
            candidates["omni011_stage_worker"] = lambda: hooks.install_omni011_stage_worker(
                self.context, self._current_process()
            )
        if identity.kind == "api" and _importable("vllm_omni"):
            candidates["omni030_orchestrator"] = lambda: hooks.install_omni030_orchestrator(
                self.context
            )
            # Under 0.30 the orchestrator admits every request: the API hook only beats.
            candidates["omni011_api"] = lambda: hooks.install_omni011_api(
                self.context, admits="omni030_orchestrator" not in self.installed
            )
        if identity.kind == "api" and (
            not _has_endpoint_plugins() or ShutdownAuthority.from_environment(self._environ).enabled
        ):
            # A configured admin token is the operator's request for the route: it needs no
            # `VLLM_PLUGINS` list, which would also drop every plugin it does not name
            # (vLLM-Omni's models, an out-of-tree platform). vLLM-Omni 0.30 never calls an
            # endpoint plugin's `init_state` anyway.
            candidates["build_app_route"] = lambda: hooks.install_build_app_route(
                attach_admin_route
            )
        self.installed = []
        for name, install in candidates.items():
            if _safely(install):
                self.installed.append(name)
        logger.info(
            "omni-watchdog: %s process (stage %s, replica %s), hooks: %s",
            identity.kind,
            identity.stage_id,
            identity.replica,
            ", ".join(self.installed) or "none",
        )
        return self.installed


def _may_run_diffusion(identity: ProcessIdentity, title: str) -> bool:
    """Not an autoregressive stage's EngineCore or worker: those never denoise, and need
    not import the diffusion modules."""
    if identity.kind == "engine" or STAGE_TITLE.search(title) is not None:
        return False
    return identity.kind != "worker" or DIFFUSION_WORKER_TITLE in title or "Worker" not in title


def _importable(module_name: str) -> bool:
    import importlib.util

    try:
        return importlib.util.find_spec(module_name) is not None
    except Exception:
        return False


def _has_endpoint_plugins() -> bool:
    """Whether this vLLM loads `vllm.endpoint_plugins` itself (vLLM 0.32 does)."""
    try:
        import vllm.plugins as vllm_plugins  # type: ignore[import-not-found,unused-ignore]
    except Exception:
        return False
    return hasattr(vllm_plugins, "load_endpoint_plugins")


def _safely(install: Callable[[], bool]) -> bool:
    try:
        return install()
    except Exception:
        logger.warning("omni-watchdog: a hook failed to install", exc_info=True)
        return False


def attach_admin_route(app: Any) -> None:
    """Add `POST /admin/shutdown` to vLLM's FastAPI app unless it is there already."""
    if any(getattr(route, "path", None) == ADMIN_SHUTDOWN_PATH for route in app.routes):
        return
    add_fastapi_admin_route(app)


class AdminEndpointPlugin:
    """The `vllm.endpoint_plugins` object: the admin route and the API loop's heartbeat."""

    name = PLUGIN_NAME
    required_tasks: tuple[str, ...] | None = None

    def __init__(self, plugin: Plugin) -> None:
        self._plugin = plugin

    def attach_router(self, app: Any) -> None:
        try:
            attach_admin_route(app)
        except Exception:
            logger.warning("omni-watchdog: admin route not added", exc_info=True)

    async def init_state(self, engine_client: Any, state: Any, args: Any) -> None:
        # Runs on the API server's event loop, the loop whose starvation we want to see.
        try:
            context = self._plugin.context
            context.ensure_loop_heartbeat(context.telemetry(ProcessIdentity("api")))
        except Exception:
            logger.warning("omni-watchdog: API heartbeat not started", exc_info=True)


_PLUGIN = Plugin()


def register_general() -> None:
    """Entry point of `vllm.general_plugins`; never raises."""
    try:
        _PLUGIN.register_general()
    except Exception:
        logger.warning("omni-watchdog: plugin registration failed", exc_info=True)


def register_endpoints() -> AdminEndpointPlugin:
    """Entry point of `vllm.endpoint_plugins` (a zero-argument factory, as vLLM 0.32 wants)."""
    return AdminEndpointPlugin(_PLUGIN)
