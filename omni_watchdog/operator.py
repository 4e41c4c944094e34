"""The operator's actions on a running watchdog: remediate now, pause, resume.

Each is a POST on the API address with `Authorization: Bearer <token>`, the token being
`OMNI_WATCHDOG_OPERATOR_TOKEN` (config `operator_token`). With none configured every
action is refused (403); a missing or wrong token is 401, compared in constant time. The
read endpoints stay open. Every action, done or refused, is journaled with its time,
incident and outcome, and counted for `/metrics`.
"""

from __future__ import annotations

import hmac
import json
import logging
from collections.abc import Callable
from typing import Any

from aiohttp import web

from omni_watchdog.log import log_event
from omni_watchdog.policy.core import ActionRefused, Policy
from omni_watchdog.policy.incidents import IncidentJournal
from omni_watchdog.policy.ladder import TargetSnapshot
from omni_watchdog.policy.maintenance import MaintenanceWindow
from omni_watchdog.types import (
    ACTION_OUTCOMES,
    OPERATOR_ACTIONS,
    Clock,
    MaintenancePause,
    OperatorAction,
    StepName,
)

logger = logging.getLogger("omni_watchdog.operator")

# An action's body is a few fields; anything larger is not one.
MAX_ACTION_BODY = 4096


class OperatorActions:
    """The mutating routes of the API address, behind the operator token."""

    def __init__(
        self,
        *,
        token: str,
        policy: Policy,
        window: MaintenanceWindow,
        journal: IncidentJournal,
        clock: Clock,
        snapshot: Callable[[], TargetSnapshot],
    ) -> None:
        self._token = token.encode()
        self._policy = policy
        self._window = window
        self._journal = journal
        self._clock = clock
        self._snapshot = snapshot
        self.counts = {
            (action, outcome): 0 for action in OPERATOR_ACTIONS for outcome in ACTION_OUTCOMES
        }

    def add_routes(self, app: web.Application) -> None:
        app.router.add_post("/v1/remediate", self._remediate)
        app.router.add_post("/v1/pause", self._pause)
        app.router.add_post("/v1/resume", self._resume)

    async def _remediate(self, request: web.Request) -> web.Response:
        refused = self._authorize(request, "remediate")
        if refused is not None:
            return refused
        body = await self._body(request, "remediate")
        if isinstance(body, web.Response):
            return body
        incident_id = body.get("incident")
        first = body.get("from")
        if incident_id is not None and not isinstance(incident_id, str):
            return self._bad("remediate", None, "incident: expected an incident id or null")
        steps = [step.value for step in StepName]
        if first is not None and first not in steps:
            return self._bad("remediate", incident_id, f"from: expected one of {steps} or null")
        try:
            incident = await self._policy.remediate_now(
                incident_id, None if first is None else StepName(first), self._snapshot()
            )
        except ActionRefused as refusal:
            self._done("remediate", "refused", incident_id, refusal.reason)
            return _error(refusal.status, refusal.reason)
        detail = f"from {first}" if first else "the whole ladder"
        if incident_id:
            detail += f", approving {incident_id}"
        self._done("remediate", "accepted", incident.incident_id, detail)
        return web.json_response(
            {
                "incident_id": incident.incident_id,
                "mode": incident.mode.value,
                "steps": [step.value for step in self._policy.planned_steps(first)],
            },
            status=202,
        )

    async def _pause(self, request: web.Request) -> web.Response:
        refused = self._authorize(request, "pause")
        if refused is not None:
            return refused
        body = await self._body(request, "pause")
        if isinstance(body, web.Response):
            return body
        seconds, reason = body.get("seconds"), body.get("reason")
        if isinstance(seconds, bool) or not isinstance(seconds, (int, float)):
            return self._bad("pause", None, "seconds: expected a number")
        if not isinstance(reason, str):
            return self._bad("pause", None, "reason: expected text")
        try:
            pause = self._window.pause(float(seconds), reason)
        except ValueError as error:
            return self._bad("pause", None, str(error))
        self._done("pause", "accepted", None, f"until {pause.until:.0f}: {pause.reason}", pause)
        return web.json_response({"pause": _pause_json(pause)})

    async def _resume(self, request: web.Request) -> web.Response:
        refused = self._authorize(request, "resume")
        if refused is not None:
            return refused
        ended = self._window.resume()
        self._done("resume", "accepted", None, "no pause was in force" if ended is None else "")
        return web.json_response({"pause": None})

    def _authorize(self, request: web.Request, action: str) -> web.Response | None:
        if not self._token:
            self._done(action, "forbidden", None, "no operator token configured")
            return _error(
                403,
                "operator actions are off: start the watchdog with OMNI_WATCHDOG_OPERATOR_TOKEN",
            )
        scheme, _, given = request.headers.get("Authorization", "").partition(" ")
        # Constant time: how much of a guess matched must not show in the answer's timing.
        if scheme.lower() != "bearer" or not hmac.compare_digest(given.encode(), self._token):
            self._done(action, "unauthorized", None, "missing or wrong operator token")
            return _error(
                401,
                "missing or wrong operator token",
                headers={"WWW-Authenticate": 'Bearer realm="omni-watchdog"'},
            )
        return None

    async def _body(self, request: web.Request, action: str) -> dict[str, Any] | web.Response:
        if request.content_length is not None and request.content_length > MAX_ACTION_BODY:
            self._done(action, "bad_request", None, "body too large")
            return _error(413, f"an action's body is at most {MAX_ACTION_BODY} bytes")
        raw = await request.content.read(MAX_ACTION_BODY + 1)
        if len(raw) > MAX_ACTION_BODY:
            self._done(action, "bad_request", None, "body too large")
            return _error(413, f"an action's body is at most {MAX_ACTION_BODY} bytes")
        if not raw.strip():
            return {}
        try:
            body = json.loads(raw)
        except (ValueError, UnicodeDecodeError) as error:
            return self._bad(action, None, f"body: not JSON ({error})")
        if not isinstance(body, dict):
            return self._bad(action, None, "body: expected a JSON object")
        return body

    def _bad(self, action: str, incident_id: str | None, reason: str) -> web.Response:
        self._done(action, "bad_request", incident_id, reason)
        return _error(400, reason)

    def _done(
        self,
        action: str,
        outcome: str,
        incident_id: str | None,
        detail: str,
        pause: MaintenancePause | None = None,
    ) -> None:
        self.counts[(action, outcome)] += 1
        record = OperatorAction(self._clock.wall(), action, outcome, incident_id, detail, pause)
        log_event(
            logger,
            "operator_action",
            logging.INFO if outcome == "accepted" else logging.WARNING,
            action=action,
            outcome=outcome,
            incident=incident_id,
            detail=detail,
        )
        self._journal.record_action(record)


def _pause_json(pause: MaintenancePause) -> dict[str, Any]:
    return {"since": pause.since, "until": pause.until, "reason": pause.reason}


def _error(status: int, reason: str, headers: dict[str, str] | None = None) -> web.Response:
    return web.json_response({"error": reason}, status=status, headers=headers)
