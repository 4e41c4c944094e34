"""The operator's actions on a running watchdog: remediate now, pause, resume.

Each is a POST on the API address with `Authorization: Bearer <token>`, the token being
`OMNI_WATCHDOG_OPERATOR_TOKEN` (config `operator_token`). With none configured every
action is refused (403); a missing or wrong token is 401, compared in constant time. The
read endpoints stay open. Every action is counted for `/metrics`; one with the token,
done or refused, is journaled with its time, incident and outcome; one without it is
summed up in a log line a minute at most, never journaled.
"""

from __future__ import annotations

import json
import logging
import math
from collections import deque
from collections.abc import Callable
from typing import Any

from aiohttp import web

from omni_watchdog.bearer import bearer_matches
from omni_watchdog.log import log_event
from omni_watchdog.policy.core import ActionRefused, Policy
from omni_watchdog.policy.incidents import IncidentJournal
from omni_watchdog.policy.maintenance import MaintenanceWindow
from omni_watchdog.types import (
    ACTION_OUTCOMES,
    OPERATOR_ACTIONS,
    Clock,
    MaintenancePause,
    OperatorAction,
    StepName,
    TargetSnapshot,
)

logger = logging.getLogger("omni_watchdog.operator")

# An action's body is a few fields; anything larger is not one.
MAX_ACTION_BODY = 4096
# Outcomes of a caller without the right token: counted, not journaled.
UNAUTHENTICATED_OUTCOMES = frozenset({"unauthorized", "forbidden"})
# Journaled actions in any hour, at most; the next is a 429, counted, not journaled. An
# action's line is at most about 1.3 KB (a 500-character reason; an id and a detail cut
# to MAX_JOURNALED_ID and MAX_JOURNALED_DETAIL), so a day of them is under 19 MB: an
# accepted pause (24 h at most), the open incident and the hour's budget stay inside the
# journal's 64 MiB replay, whoever holds the token. On call never needs ten a minute.
MAX_ACTIONS_AN_HOUR = 600
MAX_JOURNALED_ID = 256
MAX_JOURNALED_DETAIL = 640
NOT_JOURNALED_OUTCOMES = UNAUTHENTICATED_OUTCOMES | {"rate_limited"}
# Seconds between two log lines that sum up the refusals of such callers.
REFUSALS_TOLD_EVERY = 60.0


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
        # Refusals of callers without the token since the last line that told them.
        self._unheard: dict[str, int] = {}
        self._told_at: float | None = None
        # When each action journaled in the last hour came (monotonic).
        self._journaled: deque[float] = deque()
        self._after_change: Callable[[], None] = lambda: None

    def add_routes(
        self, app: web.Application, after_change: Callable[[], None] = lambda: None
    ) -> None:
        """Serve the actions on `app`; `after_change` runs after each accepted one, so that
        what the API shows next already holds it."""
        self._after_change = after_change
        app.router.add_post("/v1/remediate", self._remediate)
        app.router.add_post("/v1/pause", self._pause)
        app.router.add_post("/v1/resume", self._resume)

    async def _remediate(self, request: web.Request) -> web.Response:
        refused = self._authorize(request, "remediate") or self._rate_limited("remediate")
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
        refused = self._authorize(request, "pause") or self._rate_limited("pause")
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
        except OverflowError:
            return self._bad("pause", None, "seconds: out of range")
        except ValueError as error:
            return self._bad("pause", None, str(error))
        self._done("pause", "accepted", None, f"until {pause.until:.0f}: {pause.reason}", pause)
        return web.json_response({"pause": _pause_json(pause)})

    async def _resume(self, request: web.Request) -> web.Response:
        refused = self._authorize(request, "resume") or self._rate_limited("resume")
        if refused is not None:
            return refused
        ended = self._window.resume()
        self._done("resume", "accepted", None, "no pause was in force" if ended is None else "")
        return web.json_response({"pause": None})

    def _rate_limited(self, action: str) -> web.Response | None:
        """A 429 once `MAX_ACTIONS_AN_HOUR` actions were journaled in the last hour."""
        now = self._clock.monotonic()
        journaled = self._journaled
        while journaled and now - journaled[0] >= 3600.0:
            journaled.popleft()
        if len(journaled) < MAX_ACTIONS_AN_HOUR:
            journaled.append(now)
            return None
        wait = max(1, math.ceil(3600.0 - (now - journaled[0])))
        self._done(action, "rate_limited", None, f"over {MAX_ACTIONS_AN_HOUR} actions an hour")
        return _error(
            429,
            f"at most {MAX_ACTIONS_AN_HOUR} operator actions an hour are taken: retry in {wait}s",
            {"Retry-After": str(wait)},
        )

    def _authorize(self, request: web.Request, action: str) -> web.Response | None:
        if not self._token:
            self._done(action, "forbidden", None, "no operator token configured")
            return _error(
                403,
                "operator actions are off: start the watchdog with OMNI_WATCHDOG_OPERATOR_TOKEN",
            )
        if not bearer_matches(request.headers.get("Authorization"), self._token):
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
        except RecursionError:
            return self._bad(action, None, "body: nested too deep for an action")
        except ValueError as error:  # UnicodeDecodeError is one
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
        if outcome in NOT_JOURNALED_OUTCOMES:
            self._refused(action, detail)
            return
        if incident_id is not None:
            incident_id = incident_id[:MAX_JOURNALED_ID]
        detail = detail[:MAX_JOURNALED_DETAIL]
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
        if outcome == "accepted":
            self._after_change()

    def _refused(self, action: str, detail: str) -> None:
        """A caller without the token, or over the hourly bound: counted (`/metrics`),
        never journaled, and told in one log line a `REFUSALS_TOLD_EVERY` at most. Anyone
        who can reach the port can send them, as fast as they like; the journal holds what
        must survive a restart (a pause, open incidents, the budget), and they must not
        push it out."""
        key = f"{action}: {detail}"
        self._unheard[key] = self._unheard.get(key, 0) + 1
        now = self._clock.monotonic()
        if self._told_at is not None and now - self._told_at < REFUSALS_TOLD_EVERY:
            return
        self._told_at = now
        refused, self._unheard = self._unheard, {}
        log_event(
            logger,
            "operator_actions_refused",
            logging.WARNING,
            refused=refused,
            every=REFUSALS_TOLD_EVERY,
        )


def _pause_json(pause: MaintenancePause) -> dict[str, Any]:
    return {"since": pause.since, "until": pause.until, "reason": pause.reason}


def _error(status: int, reason: str, headers: dict[str, str] | None = None) -> web.Response:
    return web.json_response({"error": reason}, status=status, headers=headers)
