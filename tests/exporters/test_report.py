"""The HTML incident report: sections, timeline marks, degraded bundles, escaping, no assets."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from dataclasses import dataclass, field
from html.parser import HTMLParser
from typing import Any

import pytest
from exporters.report_bundle import (
    API_PID,
    ENGINE_PID,
    LADDER,
    OPENED,
    STAGE_PID,
    processes,
    py_spy_dump,
    sample_files,
    sample_incident,
)

from omni_watchdog.exporters.report.page import STACK_FRAMES_SHOWN, render_incident_report
from omni_watchdog.semconv import (
    DENOISE_STEP_COUNT,
    DENOISE_STEP_INDEX,
    DENOISE_STEP_SECONDS,
    DENOISE_STEP_SPAN,
    DIFFUSION_REQUEST_SPAN,
)

SECTIONS = (
    "summary",
    "timeline",
    "evidence",
    "steps",
    "gpu",
    "denoising",
    "stacks",
    "processes",
    "actions",
)
SCRIPT = "<script>alert(1)</script>"
ESCAPED_SCRIPT = "&lt;script&gt;alert(1)&lt;/script&gt;"
VOID_ELEMENTS = frozenset(
    {"area", "base", "br", "col", "embed", "hr", "img", "input", "link", "meta", "source", "wbr"}
)


@dataclass
class Node:
    tag: str
    attrs: dict[str, str]
    parent: Node | None = None
    children: list[Node] = field(default_factory=list)
    text: list[str] = field(default_factory=list)

    def walk(self) -> Iterator[Node]:
        yield self
        for child in self.children:
            yield from child.walk()

    def all_text(self) -> str:
        return "".join(node_text for node in self.walk() for node_text in node.text)

    def classes(self) -> set[str]:
        return set(self.attrs.get("class", "").split())

    def find(self, tag: str, css: str = "") -> list[Node]:
        return [n for n in self.walk() if n.tag == tag and (not css or css in n.classes())]


class StrictTree(HTMLParser):
    """Builds an element tree and records every end tag that does not close the open one."""

    def __init__(self) -> None:
        super().__init__(convert_charrefs=True)
        self.root = Node("#document", {})
        self.open: list[Node] = [self.root]
        self.errors: list[str] = []
        self.doctype = ""

    def handle_decl(self, decl: str) -> None:
        self.doctype = decl

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        node = self._add(tag, attrs)
        if tag not in VOID_ELEMENTS:
            self.open.append(node)

    def handle_startendtag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        self._add(tag, attrs)

    def handle_endtag(self, tag: str) -> None:
        if len(self.open) > 1 and self.open[-1].tag == tag:
            self.open.pop()
        else:
            self.errors.append(f"</{tag}> while <{self.open[-1].tag}> is open")

    def handle_data(self, data: str) -> None:
        self.open[-1].text.append(data)

    def _add(self, tag: str, attrs: list[tuple[str, str | None]]) -> Node:
        node = Node(tag, {k: v or "" for k, v in attrs}, self.open[-1])
        self.open[-1].children.append(node)
        return node


def parse(document: str) -> StrictTree:
    tree = StrictTree()
    tree.feed(document)
    tree.close()
    assert tree.errors == []
    assert [n.tag for n in tree.open] == ["#document"], "elements left open"
    return tree


def render(
    incident: dict[str, Any] | None = None,
    files: dict[str, str] | None = None,
    actions: list[dict[str, Any]] | None = None,
) -> str:
    incident = incident if incident is not None else sample_incident()
    bundle = files if files is not None else sample_files(incident)
    return render_incident_report(incident, bundle, actions or [])


def section(tree: StrictTree, section_id: str) -> Node:
    (found,) = [n for n in tree.root.find("section") if n.attrs.get("id") == section_id]
    return found


def test_every_section_is_there_once_with_a_heading() -> None:
    tree = parse(render())
    assert tree.doctype.lower() == "doctype html"
    ids = [n.attrs.get("id") for n in tree.root.find("section")]
    assert ids == list(SECTIONS)
    for section_id in SECTIONS:
        assert section(tree, section_id).find("h2"), section_id


def test_summary_gives_the_incident_and_its_release_times() -> None:
    text = section(parse(render()), "summary").all_text()
    for expected in (
        "20261204T001709Z-637b24",
        "http://127.0.0.1:8000",
        "enforce",
        "recovered_by_kill",
        "stage 1.0 dead",
        "2026-12-04T00:17:09.750Z",
        # released 6.384 s after the opening, first evidence 2.8 s before it
        "9.18 s",
        "6.38 s",
    ):
        assert expected in text, expected


def test_one_step_group_per_ladder_step_with_a_visible_bar() -> None:
    timeline = section(parse(render()), "timeline")
    groups = timeline.find("g", "step")
    assert [(g.attrs["data-step"], g.attrs["data-outcome"]) for g in groups] == [
        (step.value, outcome.value) for step, outcome, _, _ in LADDER
    ]
    for group in groups:
        (bar,) = group.find("rect")
        assert float(bar.attrs["width"]) > 0, group.attrs
        assert float(bar.attrs["height"]) > 0, group.attrs
        assert group.find("title"), "each bar explains itself on hover"
        # Colour is never the only carrier of the outcome.
        assert group.attrs["data-outcome"] in group.all_text()


def test_instantaneous_step_gets_a_minimum_width() -> None:
    groups = section(parse(render()), "timeline").find("g", "step")
    kill = next(g for g in groups if g.attrs["data-step"] == "kill")
    assert float(kill.find("rect")[0].attrs["width"]) >= 2


def test_timeline_marks_every_key_moment() -> None:
    timeline = section(parse(render()), "timeline")
    marks = [g.attrs["data-mark"] for g in timeline.find("g", "mark")]
    assert sorted(marks) == sorted(sample_incident()["timeline"])
    svg = timeline.find("svg", "timeline")[0]
    assert float(svg.attrs["width"]) > 0 and float(svg.attrs["height"]) > 0


def test_states_json_gives_one_lane_per_stage() -> None:
    timeline = section(parse(render()), "timeline")
    segments = [
        (rect.attrs["data-stage"], rect.attrs["data-state"])
        for rect in timeline.find("rect", "state")
    ]
    assert segments == [
        ("0.0", "healthy"),
        ("1.0", "healthy"),
        ("1.0", "degraded"),
        ("1.0", "dead"),
        ("1.0", "unknown"),
    ]
    assert all(float(r.attrs["width"]) > 0 for r in timeline.find("rect", "state"))
    lanes = [g.attrs["data-stage"] for g in timeline.find("g", "lane")]
    assert lanes == ["0.0", "1.0"]
    assert "stage 1.0 talker" in timeline.all_text()


def test_without_states_json_the_verdicts_mark_their_stages() -> None:
    files = sample_files()
    del files["states.json"]
    timeline = section(parse(render(files=files)), "timeline")
    assert timeline.find("rect", "state") == []
    (mark,) = timeline.find("rect", "verdict")
    assert (mark.attrs["data-stage"], mark.attrs["data-state"]) == ("1.0", "dead")
    assert "states.json is not in the bundle" in timeline.all_text()
    # The stage's name still comes from the stage spans the capture step saved.
    assert "stage 1.0 talker" in timeline.all_text()


def test_times_are_utc_iso_with_offsets_from_the_opening() -> None:
    steps = section(parse(render()), "steps")
    text = steps.all_text()
    assert "2026-12-04T00:17:12.060Z" in text  # the shutdown step, 2.31 s in
    assert "(+2.31 s)" in text
    assert all(t.attrs["datetime"].endswith("Z") for t in steps.find("time"))


def test_evidence_times_on_the_monotonic_clock_are_shown_as_wall_times() -> None:
    evidence = section(parse(render()), "evidence")
    (verdict,) = evidence.find("article", "verdict")
    assert (verdict.attrs["data-stage"], verdict.attrs["data-state"]) == ("1.0", "dead")
    text = evidence.all_text()
    assert "process_exit" in text and "engine exited" in text
    assert "2026-12-04T00:17:06.950Z" in text  # 2.8 s before the verdict
    assert "(2.80 s before the verdict)" in text


def test_steps_table_lists_every_step() -> None:
    rows = section(parse(render()), "steps").find("tr")[1:]
    assert [row.find("td")[0].all_text() for row in rows] == [s.value for s, _, _, _ in LADDER]
    assert "not_recovered" in rows[2].all_text()
    assert "3.06 s" in rows[2].all_text()
    assert "4100, 4101" in rows[0].all_text()


def test_gpu_timeline_charts_and_tabulates_each_pid() -> None:
    gpu = section(parse(render()), "gpu")
    charts = gpu.find("svg", "gpu-chart")
    assert sorted(c.attrs["data-pid"] for c in charts) == sorted([str(STAGE_PID), str(ENGINE_PID)])
    per_pid = gpu.find("table")[0]
    rows = {row.find("td")[0].all_text(): row for row in per_pid.find("tr")[1:]}
    engine = [td.all_text() for td in rows[str(ENGINE_PID)].find("td")]
    assert engine[2:] == ["1,024 MiB", "1,024 MiB", "0 MiB"]
    assert "VLLM::EngineCore" in engine[1]


def test_without_a_gpu_timeline_the_capture_snapshot_is_shown() -> None:
    files = sample_files()
    del files["gpu-timeline.json"]
    gpu = section(parse(render(files=files)), "gpu")
    text = gpu.all_text()
    assert gpu.find("svg") == []
    assert "24,576 MiB" in text and "512 MiB" in text
    assert "gpu.json" in text


def test_without_any_gpu_reading_the_section_says_so() -> None:
    files = sample_files()
    del files["gpu-timeline.json"], files["gpu.json"]
    assert "no GPU readings" in section(parse(render(files=files)), "gpu").all_text()
    nvml_absent = sample_files(replace={"gpu.json": "null"})
    del nvml_absent["gpu-timeline.json"]
    text = section(parse(render(files=nvml_absent)), "gpu").all_text()
    assert "NVML was not available" in text


def test_stacks_show_each_threads_top_frames_under_the_process() -> None:
    stacks = section(parse(render()), "stacks")
    articles = {a.attrs["data-pid"]: a for a in stacks.find("article", "stack")}
    assert sorted(articles) == sorted([str(API_PID), str(STAGE_PID)])
    stage = articles[str(STAGE_PID)]
    heading = stage.find("h3")[0].all_text()
    assert "stage" in heading and "1.0" in heading and "SpawnProcess-2" in heading
    main, feeder = stage.find("pre")
    frames = main.all_text().splitlines()
    assert frames[:STACK_FRAMES_SHOWN] == [
        f"frame_{i} (module.py:{i + 1})" for i in range(STACK_FRAMES_SHOWN)
    ]
    assert f"frame_{STACK_FRAMES_SHOWN}" not in main.all_text()
    assert "8 more frames" in main.all_text()
    assert "Queue._feed" in feeder.all_text()
    first_thread = stage.find("h4")[0].all_text()
    assert first_thread == f'Thread {STAGE_PID} (idle): "MainThread"'


def test_processes_table_and_unkillable_survivors() -> None:
    unkillable = [{"pid": STAGE_PID, "title": "t", "state": "disk-sleep", "wait_channel": "nv"}]
    files = sample_files(replace={"unkillable.json": json.dumps(unkillable)})
    part = section(parse(render(files=files)), "processes")
    text = part.all_text()
    assert "VLLM::EngineCore" in text and "exited" in text
    assert "Unkillable" in text and "disk-sleep" in text and "nv" in text


def test_actions_listed_or_none() -> None:
    assert section(parse(render()), "actions").find("p")[0].all_text() == "none"
    action = {"time": OPENED + 1, "action": "pause", "outcome": "accepted", "detail": "window"}
    part = section(parse(render(actions=[action])), "actions")
    assert [td.all_text() for td in part.find("td")][1:] == ["pause", "accepted", "window"]


@pytest.mark.parametrize(
    "name", ["processes.json", "gpu.json", "gpu-timeline.json", "states.json", "spans.json"]
)
def test_a_missing_file_costs_only_its_own_section(name: str) -> None:
    files = sample_files()
    del files[name]
    tree = parse(render(files=files))
    assert [n.attrs.get("id") for n in tree.root.find("section")] == list(SECTIONS)
    assert "could not be rendered" not in tree.root.all_text()


def test_a_bundle_with_nothing_in_it_still_renders_every_section() -> None:
    tree = parse(render(files={}))
    assert [n.attrs.get("id") for n in tree.root.find("section")] == list(SECTIONS)
    text = tree.root.all_text()
    assert "processes.json is not in the bundle" in text
    assert "no stacks in the bundle" in text
    assert "no GPU readings" in text
    assert "states.json is not in the bundle" in text
    assert len(section(tree, "timeline").find("g", "step")) == len(LADDER)


GARBAGE = [
    "{not json",
    "",
    "null",
    "42",
    '"text"',
    "[1, null, {}]",
    '{"unexpected": {"shape": [1, 2]}}',
    '[{"time": "yesterday", "stage": null, "pids": [1], "devices": "0", "pid": "x"}]',
    '[{"time": 1e400, "pids": {"1": "lots"}, "stage": {}, "state": 5}]',
    "[" * 100_000,
    "\x00\udcff",
]


@pytest.mark.parametrize("garbage", GARBAGE, ids=[str(i) for i in range(len(GARBAGE))])
def test_malformed_files_degrade_with_a_message_and_never_raise(garbage: str) -> None:
    names = [
        "incident.json",
        "processes.json",
        "gpu.json",
        "spans.json",
        "states.json",
        "gpu-timeline.json",
        "unkillable.json",
        f"stacks/{API_PID}.txt",
        "stacks/not-a-pid.txt",
        "health.txt",
        "metrics.txt",
    ]
    files = sample_files(replace=dict.fromkeys(names, garbage))
    tree = parse(render(files=files))
    assert [n.attrs.get("id") for n in tree.root.find("section")] == list(SECTIONS)
    text = tree.root.all_text()
    assert "could not be rendered" not in text, "a section needed its safety net"
    for name in ("processes.json", "gpu-timeline.json", "states.json"):
        assert name in text, f"no word about the malformed {name}"


def test_malformed_entries_inside_lists_are_skipped_and_counted() -> None:
    bad_states = [*sample_files_states(), {"stage": "1.0"}, "nonsense"]
    files = sample_files(replace={"states.json": json.dumps(bad_states)})
    timeline = section(parse(render(files=files)), "timeline")
    assert "2 malformed entries skipped" in timeline.all_text()
    assert len(timeline.find("rect", "state")) == 5


def sample_files_states() -> list[Any]:
    loaded = json.loads(sample_files()["states.json"])
    assert isinstance(loaded, list)
    return loaded


@pytest.mark.parametrize(
    "incident",
    [
        {},
        {"steps": "x", "verdicts": [1, {"stage": 5, "evidence": "z"}], "timeline": []},
        {"opened": "yesterday", "closed": True, "outcome": None, "cause": {"a": [1]}},
        {
            "steps": [{"step": None, "started": 1e300, "duration": -5, "targets": "1,2"}],
            "timeline": {"opened": float("nan"), "verdict": "x"},
        },
        {"verdicts": [{"stage": {"stage_id": 1}, "time": 5.0, "evidence": [{"since": "x"}]}]},
    ],
)
def test_malformed_incidents_render_without_raising(incident: dict[str, Any]) -> None:
    tree = parse(render_incident_report(incident, {}, [{"time": "x"}, {}]))
    assert [n.attrs.get("id") for n in tree.root.find("section")] == list(SECTIONS)
    assert "could not be rendered" not in tree.root.all_text()


def test_untrusted_strings_are_escaped_everywhere() -> None:
    hostile_step = 'kill" onmouseover="x'
    incident = sample_incident(cause=f"stage 1.0 dead {SCRIPT}")
    incident["steps"][0]["step"] = hostile_step
    incident["steps"][1]["detail"] = SCRIPT
    hostile_states = [{"time": OPENED, "stage": f'1.0"{SCRIPT}', "name": SCRIPT, "state": SCRIPT}]
    files = sample_files(
        incident,
        replace={
            "processes.json": json.dumps(processes(api_title=f"python {SCRIPT}")),
            f"stacks/{API_PID}.txt": py_spy_dump(API_PID, SCRIPT),
            "states.json": json.dumps(hostile_states),
            "stacks/<img src=x onerror=alert(1)>.txt": SCRIPT,
        },
    )
    action = {"time": OPENED, "action": SCRIPT, "outcome": SCRIPT, "detail": SCRIPT}
    document = render(incident, files, [action])
    assert "<script" not in document.lower()
    assert "<img" not in document.lower()
    assert document.count(ESCAPED_SCRIPT) >= 8
    tree = parse(document)
    for section_id in ("summary", "stacks", "processes", "timeline", "steps", "actions"):
        # Parsed back, the text is the hostile string itself: shown, never interpreted.
        assert SCRIPT in section(tree, section_id).all_text(), section_id
    steps = [g.attrs["data-step"] for g in tree.root.find("g", "step")]
    assert steps[0] == hostile_step, "the quote stayed inside its attribute"
    assert all("onmouseover" not in node.attrs for node in tree.root.walk())
    assert all("onerror" not in node.attrs for node in tree.root.walk())


def test_characters_that_do_not_print_never_reach_the_page() -> None:
    """The target's command line is saved as the kernel gave it: an escape sequence or a
    bidi override in it is shown as a replacement character, the rest as it was."""
    title = "python \x1b[2J\x1b]0;owned\x07serve \u202egnp.exe --model m"
    files = sample_files(replace={"processes.json": json.dumps(processes(api_title=title))})
    document = render(files=files)
    assert "\x1b" not in document and "\x07" not in document and "\u202e" not in document
    text = section(parse(document), "processes").all_text()
    assert "python \ufffd[2J\ufffd]0;owned\ufffdserve \ufffdgnp.exe --model m" in text


def test_text_that_utf8_cannot_encode_still_gives_a_saveable_page() -> None:
    files = sample_files(replace={f"stacks/{API_PID}.txt": "Thread 1 (idle)\n    f (\udcff.py:1)"})
    render(files=files).encode("utf-8")


# What a src, an href or a CSS url() points to, quoted or not.
REFERENCE = re.compile(
    r"""\b(?:src|href)\s*=\s*(?:"([^"]*)"|'([^']*)'|([^\s>"']+))|url\(\s*["']?([^"')]*)""",
    re.IGNORECASE,
)
# Anything but a fragment of this same page: a scheme (http, file, data...), //, or a path.
EXTERNAL = re.compile(r"^(?!#)")


def external_references(document: str) -> list[str]:
    targets = ["".join(groups) for groups in REFERENCE.findall(document)]
    return [target for target in targets if EXTERNAL.match(target.strip())]


def test_nothing_external_is_referenced() -> None:
    document = render(actions=[{"time": OPENED, "action": "pause"}])
    assert REFERENCE.findall(document), "the page's own links were not seen"
    assert external_references(document) == []
    lowered = document.lower()
    for forbidden in ("<script", "<link", "<img", "<iframe", "<object", "@import", "@font-face"):
        assert forbidden not in lowered, forbidden


@pytest.mark.parametrize(
    "reference",
    [
        '<img src="http://x/y.png">',
        '<a href="//cdn/x">',
        "<a href='file:///etc/passwd'>",
        "<a href=https://x/>",
        'style="background:url(https://x/y)"',
        "<style>p{background:url( '//x/y' )}</style>",
        '<a href="stacks/4100.txt">',
        '<image href="data:image/png;base64,AAAA">',
    ],
)
def test_the_external_reference_check_catches(reference: str) -> None:
    assert external_references(reference), reference


def test_the_report_is_the_same_each_time() -> None:
    assert render() == render()


def test_a_stalled_verdict_names_what_the_stage_was_doing() -> None:
    incident = sample_incident()
    incident["verdicts"][0].update(
        state="stalled",
        cause={
            "cause": "spinning",
            "since": 100.0,
            "working": False,
            "detail": "pid 4101: thread 4101 at 100% CPU in the same frames: <forward>",
        },
    )
    evidence = section(parse(render(incident)), "evidence")
    (cause,) = evidence.find("p", "cause")
    (name,) = cause.find("strong")
    assert name.all_text() == "spinning"
    # The detail is shown as text, escaped: a frame's name is the stage's to choose.
    assert "(nothing advancing): pid 4101: thread 4101 at 100% CPU" in cause.all_text()
    assert "in the same frames: <forward>" in cause.all_text()


def step_span(
    request: str, step: int, steps: int, at: float, previous: float | None
) -> dict[str, Any]:
    attributes: dict[str, Any] = {
        DENOISE_STEP_INDEX: step,
        DENOISE_STEP_COUNT: steps,
    }
    if previous is not None:
        attributes[DENOISE_STEP_SECONDS] = previous
    return {
        "name": DENOISE_STEP_SPAN,
        "request_id": request,
        "start_unix_nano": int(at * 1e9),
        "attributes": attributes,
    }


def test_denoising_shows_each_request_at_its_latest_step_and_the_stage_s_pace() -> None:
    spans = {
        "ring_size": 256,
        "stages": {
            "1.0": [
                step_span("img-7", 36, 50, OPENED - 1.0, 0.4),
                step_span("img-7", 37, 50, OPENED - 0.6, 0.35),
                # A request that ended (its diffusion request span) is not in flight.
                step_span("img-6", 50, 50, OPENED - 9.0, 0.3),
                {"name": DIFFUSION_REQUEST_SPAN, "request_id": "img-6", "attributes": {}},
                {"name": "omni.stage.loop", "attributes": {DENOISE_STEP_INDEX: "junk"}},
            ]
        },
        "pids": {},
    }
    part = section(
        parse(render(files=sample_files(replace={"spans.json": json.dumps(spans)}))), "denoising"
    )
    cells = [td.all_text() for td in part.find("td")]
    assert cells[:4] == ["1.0", "img-7", "37/50", "0.35 s"]
    assert "img-6" not in cells
    assert section(parse(render()), "denoising").find("p")[0].all_text() == "none"


HUGE = 10**400  # an integer beyond any float: float() of it raises OverflowError


def test_an_integer_beyond_any_float_in_a_bare_incident_still_gives_the_page() -> None:
    tree = parse(render_incident_report({"opened": HUGE}, {}))
    text = tree.root.all_text()
    assert "could not be read" not in text and "could not be rendered" not in text
    opened = section(tree, "summary").find("dd")[5]
    assert opened.all_text() == "unknown"


def with_value_at(path: tuple[str | int, ...], value: Any) -> Any:
    """A valid incident, or one of its bundle files, with `value` at `path`."""
    incident = sample_incident()
    files: dict[str, Any] = {
        name: json.loads(content)
        for name, content in sample_files(incident).items()
        if name.endswith(".json")
    }
    document: dict[str, Any] = {"incident": incident, **files}
    *parents, last = path
    holder: Any = document
    for key in parents:
        holder = holder[key]
    holder[last] = value
    return document


@pytest.mark.parametrize("value", [HUGE, -HUGE, float("nan"), float("inf"), "12", True, [1]])
@pytest.mark.parametrize(
    "path",
    [
        ("incident", "opened"),
        ("incident", "opened_monotonic"),
        ("incident", "closed"),
        ("incident", "timeline", "verdict"),
        ("incident", "steps", 1, "started"),
        ("incident", "steps", 1, "duration"),
        ("incident", "verdicts", 0, "time"),
        ("incident", "verdicts", 0, "evidence", 0, "since"),
        ("incident", "verdicts", 0, "stage", "stage_id"),
        ("processes.json", 1, "pid"),
        ("processes.json", 1, "create_time"),
        ("processes.json", 1, "cpu_seconds"),
        ("states.json", 2, "time"),
        ("gpu-timeline.json", 3, "time"),
        ("gpu-timeline.json", 3, "devices", "0"),
        ("gpu.json", "processes", 0, "pid"),
        ("gpu.json", "devices", 0, "used_bytes"),
    ],
    ids=lambda path: ".".join(str(key) for key in path) if isinstance(path, tuple) else None,
)
def test_an_odd_number_costs_only_its_own_field(path: tuple[str | int, ...], value: Any) -> None:
    """Through the incident the API passes and through the bundle's files alike."""
    document = with_value_at(path, value)
    incident = document.pop("incident")
    files = sample_files(incident, replace={name: json.dumps(v) for name, v in document.items()})
    if path[0] == "gpu.json":
        del files["gpu-timeline.json"]  # the capture's one reading is shown only without it
    tree = parse(render_incident_report(incident, files, []))
    text = tree.root.all_text()
    assert "could not be read" not in text and "could not be rendered" not in text
    steps = section(tree, "timeline").find("g", "step")
    assert [g.attrs["data-step"] for g in steps] == [step.value for step, _, _, _ in LADDER]


def test_an_incident_that_recorded_no_clock_pair_shows_its_verdict_times_as_monotonic() -> None:
    """Bundles written before incidents recorded `opened_monotonic`: their verdict and
    evidence times are not guessed onto the wall clock; the timeline's own wall-clock
    moment of the verdict still places it on the drawing."""
    incident = sample_incident()
    del incident["opened_monotonic"]
    files = sample_files(incident)
    del files["states.json"]
    tree = parse(render(incident, files))
    evidence = section(tree, "evidence").all_text()
    assert "Verdict at monotonic 33730.500 s (no wall-clock anchor)" in evidence
    assert "monotonic 33727.700 s (no wall-clock anchor) (2.80 s before the verdict)" in evidence
    assert "2026-12-04T00:17:06.950Z" not in evidence
    (mark,) = section(tree, "timeline").find("rect", "verdict")
    assert "2026-12-04T00:17:09.750Z" in mark.all_text()


def test_a_time_is_read_on_the_clock_it_was_recorded_on_whatever_its_size() -> None:
    """A wall-clock time of the 1970s is a wall-clock time, and a verdict time as large
    as a wall-clock one is still a monotonic one."""
    incident = sample_incident(opened=5.0, opened_monotonic=1_700_000_000.0)
    incident["verdicts"][0]["time"] = 1_700_000_000.0
    tree = parse(render(incident, {}))
    assert "1970-01-01T00:00:05.000Z" in section(tree, "summary").all_text()
    (verdict,) = section(tree, "evidence").find("article", "verdict")
    assert verdict.find("time")[0].attrs["datetime"] == "1970-01-01T00:00:05.000Z"
