"""The operator's routes over HTTP: the token, what a body may be, and the record kept."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from aiohttp import web
from aiohttp.test_utils import TestClient, TestServer
from fakes import FakePsutil
from policy.test_policy import Rig, the_0_11_tree

from omni_watchdog.operator import MAX_ACTION_BODY, OperatorActions
from omni_watchdog.policy.incidents import IncidentJournal, StateWriteErrors
from omni_watchdog.types import Mode

TOKEN = "s3cret-operator-token"
RIGHT = {"Authorization": f"Bearer {TOKEN}"}


def actions_app(rig: Rig, session: aiohttp.ClientSession, token: str) -> OperatorActions:
    policy = rig.policy(session)
    return OperatorActions(
        token=token,
        policy=policy,
        window=policy.window,
        journal=IncidentJournal(rig.tmp_path / "journal.jsonl", StateWriteErrors()),
        clock=rig.clock,
        snapshot=rig.snapshot,
    )


def call(
    rig: Rig, token: str, path: str, headers: dict[str, str], body: Any
) -> tuple[int, dict[str, Any], dict[str, str], OperatorActions]:
    async def scenario() -> tuple[int, dict[str, Any], dict[str, str], OperatorActions]:
        async with aiohttp.ClientSession() as session:
            actions = actions_app(rig, session, token)
            app = web.Application()
            actions.add_routes(app)
            async with TestClient(TestServer(app)) as client:
                data = body if isinstance(body, bytes) else None
                json_body = None if isinstance(body, bytes) else body
                response = await client.post(path, headers=headers, data=data, json=json_body)
                answer = await response.json()
                return response.status, answer, dict(response.headers), actions

    return asyncio.run(scenario())


@pytest.mark.parametrize(
    ("configured", "headers", "status", "outcome"),
    [
        ("", RIGHT, 403, "forbidden"),
        (TOKEN, {}, 401, "unauthorized"),
        (TOKEN, {"Authorization": "Bearer s3cret-operator-tokem"}, 401, "unauthorized"),
        (TOKEN, {"Authorization": f"Basic {TOKEN}"}, 401, "unauthorized"),
        (TOKEN, RIGHT, 200, "accepted"),
    ],
    ids=["none configured", "none given", "wrong", "wrong scheme", "right"],
)
def test_an_action_needs_the_configured_token(
    tmp_path: Path,
    fake_psutil: FakePsutil,
    configured: str,
    headers: dict[str, str],
    status: int,
    outcome: str,
) -> None:
    rig = Rig(tmp_path, fake_psutil, Mode.ENFORCE)
    body = {"seconds": 60, "reason": "upgrade"}
    code, answer, response_headers, actions = call(rig, configured, "/v1/pause", headers, body)
    assert code == status, answer
    if status == 401:
        assert response_headers["WWW-Authenticate"].startswith("Bearer")
    assert actions.counts[("pause", outcome)] == 1
    assert (actions._window.current() is not None) is (status == 200)
    (journaled,) = IncidentJournal(tmp_path / "journal.jsonl", StateWriteErrors()).actions()
    assert (journaled.action, journaled.outcome) == ("pause", outcome)
    # The token itself is never written down.
    assert TOKEN not in (tmp_path / "journal.jsonl").read_text()


@pytest.mark.parametrize(
    ("path", "body", "status", "reason"),
    [
        ("/v1/pause", b"{not json", 400, "not JSON"),
        ("/v1/pause", b"[1, 2]", 400, "expected a JSON object"),
        ("/v1/pause", {"seconds": "soon", "reason": "x"}, 400, "seconds: expected a number"),
        ("/v1/pause", {"seconds": 0, "reason": "x"}, 400, "more than 0 s"),
        ("/v1/pause", {"seconds": 60}, 400, "reason: expected text"),
        ("/v1/pause", b"x" * (MAX_ACTION_BODY + 1), 413, "at most"),
        ("/v1/remediate", {"from": "reboot"}, 400, "from: expected one of"),
        ("/v1/remediate", {"incident": 7}, 400, "incident: expected"),
        ("/v1/remediate", {"incident": "nope"}, 404, "no incident nope"),
    ],
)
def test_a_bad_action_is_refused_with_its_reason_and_counted(
    tmp_path: Path, fake_psutil: FakePsutil, path: str, body: Any, status: int, reason: str
) -> None:
    rig = Rig(tmp_path, fake_psutil, Mode.ENFORCE)
    the_0_11_tree(rig)
    code, answer, _, actions = call(rig, TOKEN, path, RIGHT, body)
    assert code == status and reason in answer["error"], answer
    action = path.rpartition("/")[2]
    outcome = "refused" if status == 404 else "bad_request"
    assert actions.counts[(action, outcome)] == 1
    assert fake_psutil.signals == []


def test_remediate_answers_with_the_incident_and_its_planned_steps(
    tmp_path: Path, fake_psutil: FakePsutil
) -> None:
    rig = Rig(tmp_path, fake_psutil, Mode.DRY_RUN)
    the_0_11_tree(rig)
    code, answer, _, actions = call(rig, TOKEN, "/v1/remediate", RIGHT, {"from": "terminate"})
    assert code == 202, answer
    assert answer["mode"] == "enforce"
    assert answer["steps"] == ["capture", "terminate", "kill", "verify"]
    assert actions.counts[("remediate", "accepted")] == 1
