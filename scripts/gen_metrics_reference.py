"""Writes the reference of the watchdog's own metrics, `docs/metrics.md`.

The reference is generated from the exposition itself: `MetricsExposition` renders the
representative states the exposition tests use (tests/exporters/watchdog_state.py: the
scripted story, the headless stage's watchdog, a stage whose work advances past its
budget), and each family's name, type, help and label names are read from what it wrote.
The values of a label are those every scrape carries from the start, read from a state in
which nothing has happened yet. What each label means is written here (`LABELS`); a label
the exposition writes without a meaning here is an error, as is a family none of the
states shows a series of.

Edit this script, run `python scripts/gen_metrics_reference.py`, and commit both.
`--check` exits 1 when the committed file differs from what this script writes
(tests/test_metrics_reference.py runs it).
"""

from __future__ import annotations

import argparse
import dataclasses
import re
import sys
from collections.abc import Iterable
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parent.parent
OUTPUT = ROOT / "docs" / "metrics.md"
RULES = ROOT / "alerts" / "omni-watchdog.rules.yml"
# The representative states are the exposition tests' own.
sys.path.insert(0, str(ROOT / "tests"))

from exporters.watchdog_state import (  # noqa: E402
    Scripted,
    headless_state,
    scripted_state,
    working_state,
)

from omni_watchdog.config import WatchdogConfig  # noqa: E402
from omni_watchdog.exporters.prometheus import PREFIX  # noqa: E402
from omni_watchdog.self_health import ProbeBoard  # noqa: E402
from omni_watchdog.stats import WatchdogStats  # noqa: E402

# What each label means. Labels whose values are a closed set have them listed per family.
LABELS = {
    "action": "the operator action",
    "address": "the master's address, from the headless stage's command line",
    "cause": "why a silent stage is silent ([design](design.md#why-a-stage-is-silent))",
    "evidence": "a kind of evidence the verdict carried ([design](design.md#evidence))",
    "gpu": "the GPU's index on this host",
    "host": "the host the stage runs on (`unknown` until a span places it)",
    "le": "the histogram bucket's upper bound",
    "listener": "`api` (`--listen`) or `otlp` (`--otlp-listen`)",
    "loop": "the watchdog's own loop that caught the exception",
    "outcome": "the outcome: of the `/health` call, the incident, the step or the action",
    "pid": "the process holding the memory (its pid as this watchdog sees it)",
    "port": "the master's port, from the headless stage's command line",
    "probe": "the probe",
    "python_version": "the Python running the watchdog",
    "reason": "why the span, request body or connection was refused or closed",
    "replica": "the stage's replica",
    "role": "the process's role in the server's tree; for `host_info`, the watchdog's:"
    " `server` (beside a server) or `headless_stage` (beside a headless stage)",
    "stage": "the stage id (`pipeline` for a verdict no single stage could be proved the one for)",
    "stage_name": "the stage's name from the topology",
    "state": "the detector's state of the stage",
    "status": "the process's status",
    "step": "the remediation ladder's step",
    "version": "the watchdog's version",
}
_HELP = re.compile(r"^# HELP (\S+) (.*)$")
_TYPE = re.compile(r"^# TYPE (\S+) (\S+)$")
_SAMPLE = re.compile(r"^([a-zA-Z_:][\w:]*)(?:\{(.*)\})? ")
_LABEL = re.compile(r'(\w+)="((?:[^"\\]|\\.)*)"')
_METRIC = re.compile(PREFIX + r"\w+")
_HISTOGRAM_SERIES = ("_bucket", "_sum", "_count")


@dataclasses.dataclass
class Family:
    name: str
    kind: str = ""
    help: str = ""
    labels: set[str] = dataclasses.field(default_factory=set)
    seen: bool = False
    # Label values every scrape carries from the start.
    values: dict[str, list[str]] = dataclasses.field(default_factory=dict)


def resting_state() -> Scripted:
    """The scripted watchdog before anything happened: no reading, no judgement, no count."""
    scripted = scripted_state()
    state = scripted.state
    probes = ProbeBoard(WatchdogConfig().probes.enabled)
    resting = dataclasses.replace(
        state,
        target=dataclasses.replace(state.target, health=None),
        report=None,
        gpu=None,
        probes=probes.snapshot(),
        counters=WatchdogStats().counters(),
    )
    return Scripted(resting, scripted.clock)


def _family_of(sample: str, families: dict[str, Family]) -> Family:
    if sample in families:
        return families[sample]
    for suffix in _HISTOGRAM_SERIES:
        base = sample.removesuffix(suffix)
        if base != sample and families.get(base, Family(base)).kind == "histogram":
            return families[base]
    raise ValueError(f"{sample}: a series of no family the exposition declared")


def read_families(texts: Iterable[str]) -> dict[str, Family]:
    """Every family the texts declare, with the labels of their series."""
    families: dict[str, Family] = {}
    for text in texts:
        for line in text.splitlines():
            if match := _HELP.match(line):
                family = families.setdefault(match.group(1), Family(match.group(1)))
                family.help = match.group(2).replace("\\n", "\n").replace("\\\\", "\\")
            elif match := _TYPE.match(line):
                families.setdefault(match.group(1), Family(match.group(1))).kind = match.group(2)
            elif match := _SAMPLE.match(line):
                family = _family_of(match.group(1), families)
                family.seen = True
                family.labels.update(name for name, _ in _LABEL.findall(match.group(2) or ""))
    return families


def add_resting_values(families: dict[str, Family], text: str) -> None:
    """The values of each closed-set label that the resting state's scrape carries."""
    for line in text.splitlines():
        match = _SAMPLE.match(line)
        if line.startswith("#") or match is None:
            continue
        family = _family_of(match.group(1), families)
        for name, value in _LABEL.findall(match.group(2) or ""):
            if name in CLOSED_LABELS and (family.name, name) not in OPEN_LABELS:
                values = family.values.setdefault(name, [])
                if value not in values:
                    values.append(value)


# Labels whose values are a closed set the exposition writes in full from the start.
CLOSED_LABELS = frozenset(
    {"action", "cause", "evidence", "listener", "outcome", "probe", "reason", "role"}
    | {"state", "status", "step"}
)
# ... but for these families, whose label takes one of its values at a time.
OPEN_LABELS = frozenset({(PREFIX + "host_info", "role")})


def alerts_by_family(families: dict[str, Family]) -> dict[str, list[str]]:
    """The alerting rules that read each family."""
    document = yaml.safe_load(RULES.read_text())
    found: dict[str, list[str]] = {}
    for group in document["groups"]:
        for rule in group["rules"]:
            if "alert" not in rule:
                continue
            for name in sorted(set(_METRIC.findall(rule["expr"]))):
                family = _family_of(name, families).name
                if rule["alert"] not in found.setdefault(family, []):
                    found[family].append(rule["alert"])
    return found


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def render() -> str:
    states = (scripted_state(), headless_state(), working_state())
    families = read_families(state.rendered() for state in states)
    add_resting_values(families, resting_state().rendered())
    unseen = sorted(name for name, family in families.items() if not family.seen)
    if unseen:
        raise SystemExit(f"no series of {', '.join(unseen)}: extend the representative states")
    unexplained = sorted({label for f in families.values() for label in f.labels} - set(LABELS))
    if unexplained:
        raise SystemExit(f"labels without a meaning in LABELS: {', '.join(unexplained)}")
    alerts = alerts_by_family(families)
    lines = [
        "# Metrics reference",
        "",
        "<!-- Generated by scripts/gen_metrics_reference.py from the exposition; do not edit. -->",
        "",
        "Every family the watchdog's `GET /metrics` writes (on `--listen`, default",
        "`127.0.0.1:9464`), in the order of the exposition. Every series exists from the start,",
        "zeroed, for every known stage replica, state, step, outcome, probe, rejection reason",
        "and evidence kind, except where a family says otherwise; the values listed beside a",
        "label are those. Every series of a stage carries its `host`. The alerts named are in",
        "`alerts/omni-watchdog.rules.yml`; what to do for each is in [the runbook](runbook.md).",
        "",
        "| metric | type | labels | meaning |",
        "| --- | --- | --- | --- |",
    ]
    for family in families.values():
        labels = []
        for label in sorted(family.labels - {"le"}):
            values = family.values.get(label)
            shown = f" ({', '.join(f'`{value}`' for value in values)})" if values else ""
            labels.append(f"`{label}`{shown}")
        if family.kind == "histogram":
            labels.append("`le` on `_bucket`; also `_sum`, `_count`")
        meaning = family.help
        if family.name in alerts:
            meaning += " Alerts: " + ", ".join(f"`{alert}`" for alert in alerts[family.name]) + "."
        row = (f"`{family.name}`", family.kind, ", ".join(labels), meaning)
        lines.append("| " + " | ".join(_cell(cell) for cell in row) + " |")
    lines.append("")
    lines += [
        "## Labels",
        "",
        "| label | meaning |",
        "| --- | --- |",
        *(f"| `{label}` | {_cell(meaning)} |" for label, meaning in sorted(LABELS.items())),
    ]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--check", action="store_true", help="exit 1 if the committed file is not up to date"
    )
    parser.add_argument("--output", type=Path, default=OUTPUT, help="the reference file")
    args = parser.parse_args(argv)
    output: Path = args.output
    text = render()
    if args.check:
        if not output.exists() or output.read_text() != text:
            print(
                f"{output} is stale: run python scripts/gen_metrics_reference.py", file=sys.stderr
            )
            return 1
        return 0
    output.write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
