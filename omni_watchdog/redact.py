"""Secrets out of what the watchdog writes: command lines, environments, JSON and free text.

A value is secret when its flag, variable or key names a token, key, secret, password,
credential, cookie or authorization (`--api-key`, `HF_TOKEN=`, `"db_password":`,
`--passwd`, `--cookie`), or is one of the short names of one (`--auth`, `GITHUB_PAT`);
when it follows `Authorization`; and when it is the password of a URL
(`https://user:pw@host`). A value that names no secret is read again for one inside it
(`OTEL_EXPORTER_OTLP_HEADERS=x-api-key=...`).
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from typing import Any

REDACTED = "***"
SECRET_WORDS = (
    "TOKEN",
    "KEY",
    "SECRET",
    "PASSWORD",
    "PASSWD",
    "CREDENTIAL",
    "AUTHORIZATION",
    "BEARER",
    "COOKIE",
)
# Short names of a secret, which name one only as a whole part of a name (`--auth`,
# `GITHUB_PAT`), never inside a longer word (`--author`, `PATH`).
SECRET_PARTS = frozenset({"AUTH", "PAT", "PW", "PWD"})
_NAME_PARTS = re.compile(r"[^A-Z0-9]+")

# A value: quoted as a whole, or up to a blank, a quote or the next URL parameter. A secret
# may hold any other character, so a bracket or a semicolon right after one goes with it.
_VALUE = r"""(?P<value>"(?:[^"\\]|\\.)*"|'[^']*'|[^\s"'&\\]+)"""
_NAME = r"[A-Za-z_][\w.-]*"
# `--flag=value`, or `--flag value` where a value that starts with `-` is the next flag.
_FLAG = re.compile(rf"(?<![\w-])(?P<name>--?{_NAME})(?:=|[ \t]+(?!-)){_VALUE}")
# `NAME=value`: an environment variable, a URL parameter, a log field.
_ASSIGNMENT = re.compile(rf"(?<![\w.-])(?P<name>{_NAME})={_VALUE}")
# `name: value`, `"name": "value"`: a header, YAML, JSON or a Python repr.
_COLON = re.compile(
    rf"(?<![\w.-])(?P<quote>[\"']?)(?P<name>{_NAME})(?P=quote)[ \t]*:[ \t]*{_VALUE}"
)
# A credential with its scheme (`Bearer abc`, `Basic abc`), or quoted as a whole.
_CREDENTIAL = r"""(?P<value>"(?:[^"\\]|\\.)*"|'[^']*'|(?:[A-Za-z]+[ \t]+)?[^\s"'&\\]+)"""
# The credential of an Authorization header or of an `--authorization` flag.
_AUTHORIZATION = re.compile(
    r"""(?<![\w-])(?:(?P<quote>["']?)authorization(?P=quote)[ \t]*[:=]|--?authorization[ \t=])"""
    rf"""[ \t]*{_CREDENTIAL}""",
    re.IGNORECASE,
)
# The password of a URL's user (`scheme://user:password@host`).
_URL_PASSWORD = re.compile(r"(?<![\w+.-])[A-Za-z][\w+.-]*://[^\s/:@]*:(?P<value>[^\s/@]+)@")


def is_secret_name(name: str) -> bool:
    """Whether a flag, variable or key names a secret."""
    upper = name.upper()
    if any(word in upper for word in SECRET_WORDS):
        return True
    return any(part in SECRET_PARTS for part in _NAME_PARTS.split(upper))


def redact_text(text: str) -> str:
    """Free text with every secret value replaced: a command line, py-spy output, JSON."""
    text = _AUTHORIZATION.sub(_conceal, text)
    if "://" in text and "@" in text:
        text = _URL_PASSWORD.sub(_conceal, text)
    text = _FLAG.sub(_conceal_named, text)
    text = _ASSIGNMENT.sub(_conceal_assigned, text)
    return _COLON.sub(_conceal_named, text)


def redact_argv(argv: Sequence[str]) -> list[str]:
    """A command line as a list, with the value of every secret flag replaced."""
    redacted: list[str] = []
    follows_secret_flag = False
    for argument in argv:
        if follows_secret_flag and not argument.startswith("-"):
            redacted.append(REDACTED)
            follows_secret_flag = False
            continue
        follows_secret_flag = (
            argument.startswith("-") and "=" not in argument and is_secret_name(argument)
        )
        redacted.append(redact_text(argument))
    return redacted


def redact_environ(environ: Mapping[str, str]) -> dict[str, str]:
    """An environment with the value of every secret variable replaced."""
    return {
        name: REDACTED if is_secret_name(name) else redact_text(value)
        for name, value in environ.items()
    }


def redact_json(value: Any) -> Any:
    """Plain JSON values with secrets replaced: strings under a secret key, lists as argv."""
    if isinstance(value, Mapping):
        return {
            key: _conceal_strings(item) if is_secret_name(str(key)) else redact_json(item)
            for key, item in value.items()
        }
    if isinstance(value, (list, tuple)):
        if all(isinstance(item, str) for item in value):
            return redact_argv(value)
        return [redact_json(item) for item in value]
    if isinstance(value, str):
        return redact_text(value)
    return value


def _conceal_strings(value: Any) -> Any:
    """Every string inside `value` replaced; numbers (a token count) are no secret."""
    if isinstance(value, Mapping):
        return {key: _conceal_strings(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [_conceal_strings(item) for item in value]
    return REDACTED if isinstance(value, str) else value


def _conceal(match: re.Match[str]) -> str:
    value = match.group("value")
    quote = value[0] if value[0] in "'\"" else ""
    start, end = match.span("value")
    text = match.string
    return text[match.start() : start] + quote + REDACTED + quote + text[end : match.end()]


def _conceal_named(match: re.Match[str]) -> str:
    return _conceal(match) if is_secret_name(match.group("name")) else match.group(0)


def _conceal_assigned(match: re.Match[str]) -> str:
    """`NAME=value`: concealed when NAME names a secret; else the value is read again for
    one of its own (`OTEL_EXPORTER_OTLP_HEADERS=x-api-key=abc`). It is shorter than the
    match, so this ends."""
    if is_secret_name(match.group("name")):
        return _conceal(match)
    value = match.group("value")
    if "=" not in value:
        return match.group(0)
    start, end = match.span("value")
    text = match.string
    return text[match.start() : start] + redact_text(value) + text[end : match.end()]
