"""The /metrics probe: per-stage progress counters and load gauges from the server's page,
and the stage replicas its `stage`/`replica` labels name (vLLM-Omni 0.30 labels them)."""

from __future__ import annotations

import asyncio
import math
import re
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import aiohttp

from omni_watchdog.config import ProbesConfig
from omni_watchdog.http_body import read_at_most
from omni_watchdog.topology import MAX_STAGE_REPLICAS, observed_topology
from omni_watchdog.types import (
    STEP_COUNTERS,
    Clock,
    Observation,
    ObservationKind,
    ProbeError,
    StageRef,
    TopologyOrigin,
)

# Counted at every engine step: they move while a request is being worked on.
STEP_SERIES = frozenset(
    {
        "vllm:generation_tokens_total",
        "vllm:prompt_tokens_total",
        "vllm:iteration_tokens_total_count",
    }
)
# Counted when a request completes: they say nothing while a long one is worked on.
PROGRESS_SERIES = STEP_SERIES | {"vllm_omni:stage_gen_time_s_count", "vllm:request_success_total"}
ENGINE_LOAD_SERIES = frozenset({"vllm:num_requests_running", "vllm:num_requests_waiting"})
STAGE_WAITING_SERIES = "vllm_omni:stage_waiting_requests"
WANTED_SERIES = PROGRESS_SERIES | ENGINE_LOAD_SERIES | {STAGE_WAITING_SERIES}

_NAME = re.compile(r"[a-zA-Z_:][a-zA-Z0-9_:]*")
_LABEL = re.compile(r'[ \t]*([a-zA-Z_][a-zA-Z0-9_]*)[ \t]*=[ \t]*"((?:[^"\\\n]|\\.)*)"[ \t]*')
_UNESCAPE = re.compile(r"\\(.)")
_ESCAPES = {"n": "\n", "\\": "\\", '"': '"'}

LabelSet = tuple[tuple[str, str], ...]


@dataclass(frozen=True)
class Sample:
    """One sample line of a Prometheus text page."""

    name: str
    labels: dict[str, str]
    value: float
    timestamp_ms: int | None = None


def _unescape(text: str) -> str:
    if "\\" not in text:
        return text
    return _UNESCAPE.sub(lambda match: _ESCAPES.get(match.group(1), match.group(0)), text)


def _parse_labels(line: str, start: int, number: int) -> tuple[dict[str, str], int]:
    """The label set opening at `line[start] == "{"`, and the index after its `}`."""
    labels: dict[str, str] = {}
    position = start + 1
    while True:
        while position < len(line) and line[position] in " \t":
            position += 1
        if position < len(line) and line[position] == "}":
            return labels, position + 1
        match = _LABEL.match(line, position)
        if not match:
            raise ValueError(f"line {number}: malformed label set")
        labels[match.group(1)] = _unescape(match.group(2))
        position = match.end()
        if position < len(line) and line[position] == ",":
            position += 1
        elif position >= len(line) or line[position] != "}":
            raise ValueError(f"line {number}: expected ',' or '}}' in label set")


def parse_samples(text: str, wanted: frozenset[str] | None = None) -> Iterator[Sample]:
    """Samples of a Prometheus text-format (0.0.4) page; only `wanted` names, if given.

    Every line is checked to start like a sample or a comment, so an HTML error page or
    other garbage fails; only wanted lines are parsed further, which keeps a scrape cheap.
    Raises ValueError naming the line.
    """
    for number, raw in enumerate(text.split("\n"), start=1):
        line = raw.strip()
        if not line or line[0] == "#":
            continue
        match = _NAME.match(line)
        end = match.end() if match else 0
        if not match or (end < len(line) and line[end] not in "{ \t"):
            raise ValueError(f"line {number}: not a metric sample: {line[:80]!r}")
        name = match.group(0)
        if wanted is not None and name not in wanted:
            continue
        labels: dict[str, str] = {}
        if end < len(line) and line[end] == "{":
            labels, end = _parse_labels(line, end, number)
        fields = line[end:].split()
        if not 1 <= len(fields) <= 2:
            raise ValueError(f"line {number}: expected a value and an optional timestamp")
        try:
            value = float(fields[0])
            timestamp = int(fields[1]) if len(fields) == 2 else None
        except ValueError:
            raise ValueError(f"line {number}: bad value or timestamp: {line[:80]!r}") from None
        yield Sample(name, labels, value, timestamp)


def stage_of_labels(name: str, labels: dict[str, str]) -> StageRef | None:
    """The stage replica a series belongs to, or None for target-wide series."""
    try:
        if "stage" in labels:
            return StageRef(int(labels["stage"]), int(labels.get("replica", "0")))
        if name.startswith("vllm_omni:"):
            return None
        # Plain vLLM labels every series with its engine; data-parallel engines are replicas.
        return StageRef(0, int(labels.get("engine", "0")))
    except ValueError:
        raise ValueError(f"{name}{labels}: stage, replica and engine must be integers") from None


# The largest /metrics page read: a real vLLM-Omni server's is about 50 KB. One larger is
# refused unread, and counted as the probe's failure: a 200 MiB page, read whole, made the
# watchdog 845 MB and blind 36 s of 43.
MAX_METRICS_PAGE = 8 * 2**20


class MetricsProbe:
    """Scrapes the server's /metrics into PROGRESS and LOAD observations per stage."""

    name = "metrics"

    def __init__(
        self,
        session: aiohttp.ClientSession,
        target_url: str,
        config: ProbesConfig,
        clock: Clock,
    ) -> None:
        self._session = session
        self._url = target_url.rstrip("/") + config.metrics_path
        self._timeout = aiohttp.ClientTimeout(total=config.metrics_timeout)
        self._clock = clock
        self.last_page: str | None = None
        # Counters restart at zero when the server restarts; progress is kept cumulative
        # by adding each series' increase since the last scrape, so it never goes back.
        self._last_counter: dict[tuple[str, LabelSet], float] = {}
        self._progress: dict[StageRef, float] = {}
        # Every stage replica a label named so far: one whose series vanish (an evicted
        # replica) stays in the topology, to be judged.
        self._labelled: set[StageRef] = set()

    async def collect(self) -> Sequence[Observation]:
        page = await self._fetch()
        try:
            samples = list(parse_samples(page, WANTED_SERIES))
            progress, load = self._digest(samples)
            stepping = {
                stage
                for sample in samples
                if sample.name in STEP_SERIES
                and (stage := stage_of_labels(sample.name, sample.labels)) is not None
            }
        except ValueError as error:
            raise ProbeError(f"{self._url}: unreadable metrics page: {error}") from None
        self.last_page = page
        now = self._clock.monotonic()
        observations = [
            Observation(
                ObservationKind.PROGRESS,
                now,
                stage=stage,
                value=value,
                detail=STEP_COUNTERS if stage in stepping else "",
            )
            for stage, value in sorted(progress.items())
        ]
        observations.extend(
            Observation(ObservationKind.LOAD, now, stage=stage, value=value)
            for stage, value in sorted(load.items())
        )
        observations.extend(self._labelled_topology(samples, now))
        return observations

    def _labelled_topology(self, samples: list[Sample], now: float) -> list[Observation]:
        """A TOPOLOGY observation when the `stage` labels name a stage replica not named
        before; plain vLLM labels none and gets none."""
        named = {
            StageRef(int(sample.labels["stage"]), int(sample.labels.get("replica", "0")))
            for sample in samples
            if "stage" in sample.labels
        }
        if named <= self._labelled or len(self._labelled | named) > MAX_STAGE_REPLICAS:
            return []
        self._labelled |= named
        topology = observed_topology(self._labelled, TopologyOrigin.METRICS, "metrics")
        if topology is None:
            return []
        return [Observation(ObservationKind.TOPOLOGY, now, topology=topology)]

    async def _fetch(self) -> str:
        try:
            async with self._session.get(self._url, timeout=self._timeout) as response:
                if response.status != 200:
                    raise ProbeError(f"{self._url}: HTTP {response.status}")
                announced = response.content_length
                if announced is not None and announced > MAX_METRICS_PAGE:
                    raise ProbeError(self._too_large())
                page, more = await read_at_most(response, MAX_METRICS_PAGE)
                if more:
                    raise ProbeError(self._too_large())
                return page.decode("utf-8")
        except asyncio.TimeoutError:
            raise ProbeError(f"{self._url}: no answer in {self._timeout.total:g}s") from None
        except aiohttp.ClientError as error:
            raise ProbeError(f"{self._url}: {error}") from None
        except UnicodeDecodeError as error:
            raise ProbeError(f"{self._url}: not text: {error}") from None

    def _too_large(self) -> str:
        return f"{self._url}: a page over {MAX_METRICS_PAGE // 2**20} MiB, not read"

    def _digest(self, samples: list[Sample]) -> tuple[dict[StageRef, float], dict[StageRef, float]]:
        """Cumulative progress and current load per stage from one page's samples."""
        engine_load: dict[StageRef, float] = {}
        stage_waiting: dict[StageRef, float] = {}
        progress = dict(self._progress)
        seen_progress: set[StageRef] = set()
        moved: set[StageRef] = set()
        unrefreshed: set[StageRef] = set()
        counters: dict[tuple[str, LabelSet], float] = {}
        for sample in samples:
            stage = stage_of_labels(sample.name, sample.labels)
            if stage is None or math.isnan(sample.value):
                continue
            if sample.name in PROGRESS_SERIES:
                key = (sample.name, tuple(sorted(sample.labels.items())))
                previous = self._last_counter.get(key, 0.0)
                increase = sample.value - previous if sample.value >= previous else sample.value
                progress[stage] = progress.get(stage, 0.0) + increase
                counters[key] = sample.value
                seen_progress.add(stage)
                if increase > 0:
                    moved.add(stage)
                continue
            if "stage" in sample.labels:
                unrefreshed.add(stage)
            if sample.name in ENGINE_LOAD_SERIES:
                engine_load[stage] = engine_load.get(stage, 0.0) + sample.value
            else:
                stage_waiting[stage] = stage_waiting.get(stage, 0.0) + sample.value
        self._last_counter = counters
        self._progress = progress
        # vLLM-Omni sets a stage's gauges from the scheduler's counts in each output batch
        # of that stage, and sends no batch once its last request is done: an idle stage
        # keeps the counts of its last batch (one running request on every stage of an
        # idle 0.30 server, measured). They say something only when a batch came since the
        # last scrape, which moves the stage's counters; otherwise they are left out, and
        # the detector's load for the stage goes stale. Plain vLLM's engines report their
        # counts when they go idle too, so their gauges always count.
        stale = unrefreshed - moved
        engine_load = {s: v for s, v in engine_load.items() if s not in stale}
        stage_waiting = {s: v for s, v in stage_waiting.items() if s not in stale}
        # stage_waiting_requests sums the waiting queues of all of a stage's replicas, which
        # the engines' own per-replica gauges already count; it has no replica label, so it
        # only stands in for a stage whose engines report nothing themselves.
        reported = {stage.stage_id for stage in engine_load}
        load = dict(engine_load)
        for stage, waiting in stage_waiting.items():
            if stage.stage_id not in reported:
                load[stage] = waiting
        return {stage: progress[stage] for stage in seen_progress}, load
