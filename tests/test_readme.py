"""The README's examples paste and run, and docs/design.md names every module.

Every fenced shell block of README.md is valid bash (`bash -n`), every `omni-watchdog`
command in one is accepted by the command line's own parser (a renamed flag fails here),
and every YAML block loads through the config loader (a renamed field fails here). The
module table of docs/design.md ("Where each lives") names every module of the package.
"""

from __future__ import annotations

import re
import shlex
import shutil
import subprocess
from pathlib import Path

import pytest

from omni_watchdog.cli import build_parser, overrides_of
from omni_watchdog.config import load_config

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
DESIGN = ROOT / "docs" / "design.md"
PACKAGE = ROOT / "omni_watchdog"
SHELL_LANGUAGES = {"sh", "bash", "shell", "console"}
_FENCE = re.compile(r"^```(\w*)\n(.*?)^```$", re.MULTILINE | re.DOTALL)
_ASSIGNMENT = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*=")
_SEPARATORS = {"&&", "||", ";", "&", "|", ";;", "(", ")"}
# The set-up commands the README starts with (the project's contract).
SETUP_COMMANDS = ("make demo", "make test")


def blocks(language: set[str]) -> list[str]:
    return [m.group(2) for m in _FENCE.finditer(README.read_text()) if m.group(1) in language]


def shell_blocks() -> list[str]:
    return blocks(SHELL_LANGUAGES)


def commands(block: str) -> list[list[str]]:
    """The simple commands of a shell block, as words (leading variable assignments
    included): comments and line continuations gone, split at `&&`, `|`, `;` and `&`."""
    lexer = shlex.shlex(block.replace("\\\n", " "), posix=True, punctuation_chars=True)
    lexer.whitespace_split = True
    lexer.commenters = "#"
    found: list[list[str]] = []
    current: list[str] = []
    for word in lexer:
        if word in _SEPARATORS:
            found.append(current)
            current = []
        else:
            current.append(word)
    found.append(current)
    return [command for command in found if command]


def without_assignments(command: list[str]) -> tuple[dict[str, str], list[str]]:
    """A command's leading `NAME=value` words as an environment, and the rest."""
    environ = {}
    while command and _ASSIGNMENT.match(command[0]):
        name, _, value = command[0].partition("=")
        environ[name] = value
        command = command[1:]
    return environ, command


def exported() -> dict[str, str]:
    """The watchdog's variables the README's blocks export: an example that follows the
    quick start runs in the shell that exported them. A value stands in for each."""
    names = set()
    for block in shell_blocks():
        for line in block.replace("\\\n", " ").splitlines():
            for command in commands(line):
                if command[0] == "export":
                    names |= {word.partition("=")[0] for word in command[1:]}
    return {name: "readme-example" for name in names if name.startswith("OMNI_WATCHDOG_")}


def watchdog_commands() -> list[tuple[dict[str, str], list[str]]]:
    # Each line of a block is split on its own (after joining its continuations).
    found = []
    for block in shell_blocks():
        for line in block.replace("\\\n", " ").splitlines():
            for command in commands(line):
                environ, words = without_assignments(command)
                if words and words[0] == "omni-watchdog":
                    found.append((environ, words))
    return found


def test_the_readme_starts_with_the_set_up_commands() -> None:
    first = shell_blocks()[0]
    lines = [line.split("#")[0].strip() for line in first.splitlines()]
    assert lines[: len(SETUP_COMMANDS)] == list(SETUP_COMMANDS)
    assert README.read_text().index(first) < README.read_text().index("\n## ")


@pytest.mark.parametrize("block", shell_blocks(), ids=lambda b: b.split("\n")[0][:40])
def test_every_shell_block_is_valid_bash(block: str) -> None:
    bash = shutil.which("bash")
    assert bash is not None
    result = subprocess.run(
        [bash, "-n"], input=block, capture_output=True, text=True, timeout=30, check=False
    )
    assert result.returncode == 0, result.stderr
    # A comment after a line continuation ends the command there: the rest is lost.
    for line in block.splitlines():
        assert not re.search(r"\\\s+#", line), f"a comment after a continuation: {line}"
        assert not line.rstrip().endswith("\\ "), f"a space after a continuation: {line}"


def test_the_readme_has_the_commands_this_test_checks() -> None:
    verbs = {words[1] for _, words in watchdog_commands() if len(words) > 1}
    assert {"run", "status", "incidents", "remediate", "pause", "resume", "report"} <= verbs
    assert {"demo", "sim"} <= verbs


@pytest.mark.parametrize(
    "command", watchdog_commands(), ids=lambda c: " ".join(c[1][1:])[:60].replace(" ", "_")
)
def test_every_omni_watchdog_command_parses(command: tuple[dict[str, str], list[str]]) -> None:
    environ, words = command
    parser = build_parser()
    try:
        args = parser.parse_args(words[1:])
    except SystemExit as error:  # argparse's way of refusing a command line
        pytest.fail(f"`{shlex.join(words)}` is refused by the parser (exit {error.code})")
    if args.command == "run":
        # The flags as a config layer over the quick start's environment, checked as the
        # watchdog checks them at start; a config file named is the README's own example.
        overrides = overrides_of(args)
        overrides.pop("stage_config", None)
        load_config(None, environ={**exported(), **environ}, overrides=overrides)


@pytest.mark.parametrize("block", blocks({"yaml", "yml"}))
def test_every_yaml_example_is_a_valid_config(block: str, tmp_path: Path) -> None:
    path = tmp_path / "watchdog.yaml"
    path.write_text(block)
    load_config(path, environ={})


def test_the_readme_copies_no_benchmark_figure() -> None:
    text = README.read_text()
    assert "(benchmarks/RESULTS.md)" in text
    assert "| measured |" not in text and "| verdict |" not in text


def module_table() -> str:
    text = DESIGN.read_text()
    start = text.index("## Where each lives")
    end = text.find("\n## ", start + 1)
    return text[start : end if end != -1 else len(text)]


def test_the_design_module_table_names_every_module() -> None:
    """Every module under omni_watchdog/ (but the packages' `__init__.py`) is named in the
    first column of docs/design.md's table, by its path under the package."""
    named = set()
    for line in module_table().splitlines():
        if line.startswith("| `"):
            named |= set(re.findall(r"`([^`]+\.py)`", line.split(" | ")[0]))
    modules = {
        path.relative_to(PACKAGE).as_posix()
        for path in PACKAGE.rglob("*.py")
        if path.name != "__init__.py"
    }
    assert sorted(modules - named) == [], "add these to docs/design.md, Where each lives"
    assert sorted(named - modules) == [], "docs/design.md names modules that do not exist"


def anchors(markdown: str) -> set[str]:
    """The anchors GitHub gives a document's headings."""
    found = set()
    for heading in re.findall(r"^#+ (.+)$", markdown, re.MULTILINE):
        slug = re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")
        found.add(slug)
    return found


def test_every_link_of_the_readme_and_the_docs_leads_somewhere() -> None:
    for document in (README, DESIGN, ROOT / "docs" / "metrics.md", ROOT / "docs" / "runbook.md"):
        text = _FENCE.sub("", document.read_text())
        for target in re.findall(r"\]\(([^)\s]+)\)", text):
            if re.match(r"[a-z]+://", target):
                continue
            path, _, anchor = target.partition("#")
            linked = (document.parent / path).resolve() if path else document
            assert linked.exists(), f"{document.name}: {target}: no such file"
            if anchor:
                assert anchor in anchors(linked.read_text()), f"{document.name}: {target}"
