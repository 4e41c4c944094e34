"""The operator's routes over HTTP: the token, what a body may be, and the record kept."""

from __future__ import annotations

import asyncio
import logging
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from aiohttp import web
from aiohttp.test_utils import TestClient, TestServer
from fakes import FakePsutil
from policy.test_policy import Rig, the_0_11_tree

from omni_watchdog.operator import (
    MAX_ACTION_BODY,
    MAX_ACTIONS_AN_HOUR,
    REFUSALS_TOLD_EVERY,
    OperatorActions,
)
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
    journaled = IncidentJournal(tmp_path / "journal.jsonl", StateWriteErrors()).actions()
    if status in (401, 403):
        # Anyone can send these, as fast as they like: counted, never journaled.
        assert journaled == []
        return
    assert [(a.action, a.outcome) for a in journaled] == [("pause", outcome)]
    # The token itself is never written down.
    assert TOKEN not in (tmp_path / "journal.jsonl").read_text()


def test_refusals_without_the_token_are_counted_and_summed_up_not_journaled(
    tmp_path: Path, fake_psutil: FakePsutil, caplog: pytest.LogCaptureFixture
) -> None:
    """2,100 refused pauses a second each added a journal line and a log line: a journal
    of 65 MiB pushed an accepted pause out of what a restart replays."""
    rig = Rig(tmp_path, fake_psutil, Mode.ENFORCE)
    wrong = {"Authorization": "Bearer not-the-token"}

    async def scenario() -> OperatorActions:
        async with aiohttp.ClientSession() as session:
            actions = actions_app(rig, session, TOKEN)
            app = web.Application()
            actions.add_routes(app)
            async with TestClient(TestServer(app)) as client:
                body = {"seconds": 60, "reason": "upgrade"}
                assert (await client.post("/v1/pause", headers=RIGHT, json=body)).status == 200
                for _ in range(200):
                    answer = await client.post("/v1/pause", headers=wrong, json=body)
                    assert answer.status == 401
                rig.clock.advance(REFUSALS_TOLD_EVERY)
                assert (await client.post("/v1/resume", headers=wrong)).status == 401
            return actions

    with caplog.at_level(logging.WARNING, logger="omni_watchdog.operator"):
        actions = asyncio.run(scenario())
    assert actions.counts[("pause", "unauthorized")] == 200
    assert actions.counts[("resume", "unauthorized")] == 1
    journaled = IncidentJournal(tmp_path / "journal.jsonl", StateWriteErrors()).actions()
    assert [(a.action, a.outcome) for a in journaled] == [("pause", "accepted")]
    told = [
        getattr(r, "fields", {})
        for r in caplog.records
        if r.getMessage() == "operator_actions_refused"
    ]
    # The first refusal at once, then the rest summed up once the minute is over.
    assert [fields["refused"] for fields in told] == [
        {"pause: missing or wrong operator token": 1},
        {
            "pause: missing or wrong operator token": 199,
            "resume: missing or wrong operator token": 1,
        },
    ]


def test_actions_past_the_hourly_bound_are_429_and_never_journaled(
    tmp_path: Path, fake_psutil: FakePsutil
) -> None:
    """Even with the token, the journal grows by at most `MAX_ACTIONS_AN_HOUR` actions an
    hour: a pause stays inside what a restart replays, however fast the operator posts."""
    rig = Rig(tmp_path, fake_psutil, Mode.ENFORCE)

    async def scenario() -> tuple[list[int], str, int, OperatorActions]:
        async with aiohttp.ClientSession() as session:
            actions = actions_app(rig, session, TOKEN)
            app = web.Application()
            actions.add_routes(app)
            async with TestClient(TestServer(app)) as client:
                long_id = "x" * 4000
                statuses = []
                for _ in range(MAX_ACTIONS_AN_HOUR):
                    # A bad request is journaled too, the id it named with it.
                    answer = await client.post(
                        "/v1/remediate", headers=RIGHT, json={"incident": long_id, "from": "x"}
                    )
                    statuses.append(answer.status)
                rig.clock.advance(1800)
                limited = await client.post("/v1/resume", headers=RIGHT)
                retry = limited.headers.get("Retry-After", "")
                rig.clock.advance(1801)
                again = await client.post("/v1/resume", headers=RIGHT)
                return [*statuses, limited.status], retry, again.status, actions

    statuses, retry, again, actions = asyncio.run(scenario())
    assert set(statuses[:-1]) == {400} and statuses[-1] == 429
    assert retry == "1800"
    assert again == 200
    assert actions.counts[("resume", "rate_limited")] == 1
    journal = tmp_path / "journal.jsonl"
    lines = journal.read_bytes().splitlines()
    assert len(lines) == MAX_ACTIONS_AN_HOUR + 1
    # Each line bounded, whatever the body named.
    assert max(len(line) for line in lines) < 1400


def test_header_bytes_that_are_not_text_are_a_refusal_not_an_error(
    tmp_path: Path, fake_psutil: FakePsutil
) -> None:
    """`Authorization: Bearer \\xff\\xfe` on the wire, as no client library sends it."""
    rig = Rig(tmp_path, fake_psutil, Mode.ENFORCE)

    async def scenario() -> tuple[bytes, OperatorActions]:
        async with aiohttp.ClientSession() as session:
            actions = actions_app(rig, session, TOKEN)
            app = web.Application()
            actions.add_routes(app)
            async with TestServer(app) as server:
                reader, writer = await asyncio.open_connection(server.host, server.port)
                body = b'{"seconds": 60, "reason": "upgrade"}'
                writer.write(
                    b"POST /v1/pause HTTP/1.1\r\nHost: watchdog\r\n"
                    b"Authorization: Bearer \xff\xfe\r\nContent-Type: application/json\r\n"
                    b"Content-Length: %d\r\nConnection: close\r\n\r\n%s" % (len(body), body)
                )
                await writer.drain()
                answer = await reader.read()
                writer.close()
                return answer, actions

    answer, actions = asyncio.run(scenario())
    assert answer.startswith(b"HTTP/1.1 401"), answer[:200]
    assert actions.counts[("pause", "unauthorized")] == 1
    assert actions._window.current() is None


@pytest.mark.parametrize(
    ("path", "body", "status", "reason"),
    [
        ("/v1/pause", b"{not json", 400, "not JSON"),
        ("/v1/pause", b"[1, 2]", 400, "expected a JSON object"),
        ("/v1/pause", {"seconds": "soon", "reason": "x"}, 400, "seconds: expected a number"),
        ("/v1/pause", {"seconds": 0, "reason": "x"}, 400, "more than 0 s"),
        ("/v1/pause", {"seconds": 60}, 400, "reason: expected text"),
        ("/v1/pause", b"x" * (MAX_ACTION_BODY + 1), 413, "at most"),
        ("/v1/pause", b'{"seconds": 1' + b"0" * 400 + b', "reason": "x"}', 400, "out of range"),
        ("/v1/pause", b"[" * 1500 + b"]" * 1500, 400, "nested too deep"),
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


@pytest.mark.parametrize(
    ("headers", "body", "changes"),
    [
        (RIGHT, {"seconds": 60, "reason": "upgrade"}, 1),
        ({"Authorization": "Bearer not-the-token"}, {"seconds": 60, "reason": "upgrade"}, 0),
        (RIGHT, {"seconds": "soon", "reason": "upgrade"}, 0),
    ],
    ids=["accepted", "refused", "bad request"],
)
def test_an_accepted_action_is_shown_at_once_and_no_other_is(
    tmp_path: Path,
    fake_psutil: FakePsutil,
    headers: dict[str, str],
    body: dict[str, Any],
    changes: int,
) -> None:
    """The API shows the state of the last evaluation, a second old while the server is at
    rest: an accepted action has the state made again, so `status` right after `pause`
    says paused."""
    rig = Rig(tmp_path, fake_psutil, Mode.ENFORCE)
    told: list[bool] = []

    async def scenario() -> None:
        async with aiohttp.ClientSession() as session:
            actions = actions_app(rig, session, TOKEN)
            app = web.Application()
            actions.add_routes(app, lambda: told.append(actions._window.current() is not None))
            async with TestClient(TestServer(app)) as client:
                await client.post("/v1/pause", headers=headers, json=body)

    asyncio.run(scenario())
    # Told after the change was made, never before it or for a change that was not.
    assert told == [True] * changes
