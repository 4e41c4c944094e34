"""Redaction tables: what must be hidden, and what must be left for the post-mortem."""

from __future__ import annotations

from typing import Any

import pytest

from omni_watchdog.redact import redact_argv, redact_environ, redact_json, redact_text
from omni_watchdog.semconv import GEN_AI_USAGE_PROMPT_TOKENS


@pytest.mark.parametrize(
    ("text", "redacted"),
    [
        ("vllm serve m --api-key sk-123 --port 8000", "vllm serve m --api-key *** --port 8000"),
        ("vllm serve m --api-key=sk-123", "vllm serve m --api-key=***"),
        ("--x-token v", "--x-token ***"),
        ("--x-token=v", "--x-token=***"),
        ("--X-TOKEN v", "--X-TOKEN ***"),
        ("--hf-token hf_abc --model m", "--hf-token *** --model m"),
        ("--db-password hunter2", "--db-password ***"),
        ("--client-secret=s3 --other x", "--client-secret=*** --other x"),
        ('--api-key "two words" --model m', '--api-key "***" --model m'),
        # A following argument that starts with `-` is another flag, not a value.
        ("--x-token --model m", "--x-token --model m"),
        ("--api-key", "--api-key"),
        ("HF_TOKEN=hf_abc python -m vllm", "HF_TOKEN=*** python -m vllm"),
        (
            "OPENAI_API_KEY=sk-1 AWS_SECRET_ACCESS_KEY=a/b+c",
            "OPENAI_API_KEY=*** AWS_SECRET_ACCESS_KEY=***",
        ),
        ("Authorization: Bearer abc", "Authorization: ***"),
        ("authorization=Bearer abc", "authorization=***"),
        ("AUTHORIZATION: Basic dXNlcjpwYXNz", "AUTHORIZATION: ***"),
        ("curl -H 'Authorization: Bearer abc' http://h", "curl -H 'Authorization: ***' http://h"),
        ('{"Authorization": "Bearer abc", "x": 1}', '{"Authorization": "***", "x": 1}'),
        ('{"api_key": "sk-1", "model": "m"}', '{"api_key": "***", "model": "m"}'),
        ("{'api_key': 'sk-1'}", "{'api_key': '***'}"),
        ("X-Api-Key: abc", "X-Api-Key: ***"),
        ("http://h/v1?api_key=abc&model=m", "http://h/v1?api_key=***&model=m"),
        (
            "Process 4242: python -m vllm.entrypoints.openai.api_server --api-key sk-123\n"
            "Python v3.11.7 (/usr/bin/python3.11)\n\n"
            'Thread 4242 (idle): "MainThread"\n    select (selectors.py:468)\n',
            "Process 4242: python -m vllm.entrypoints.openai.api_server --api-key ***\n"
            "Python v3.11.7 (/usr/bin/python3.11)\n\n"
            'Thread 4242 (idle): "MainThread"\n    select (selectors.py:468)\n',
        ),
        ("--api-key ***", "--api-key ***"),
        # Forms an adversarial pass found left in the clear.
        ('--authorization "Bearer abc" --model m', '--authorization "***" --model m'),
        ("--authorization Bearer abc --model m", "--authorization *** --model m"),
        ("--authorization=Bearer abc", "--authorization=***"),
        ("--passwd hunter2", "--passwd ***"),
        ("--auth abc --model m", "--auth *** --model m"),
        ("--credentials c.json", "--credentials ***"),
        ("--bearer abc", "--bearer ***"),
        ("--cookie session=abc", "--cookie ***"),
        ("--pat ghp_abc", "--pat ***"),
        ("GITHUB_PAT=ghp_abc", "GITHUB_PAT=***"),
        ("git clone https://me:pw123@git.example/x", "git clone https://me:***@git.example/x"),
        ("REDIS_URL=redis://:s3@h:6379/0", "REDIS_URL=redis://:***@h:6379/0"),
        ("OTEL_EXPORTER_OTLP_HEADERS=x-api-key=abc", "OTEL_EXPORTER_OTLP_HEADERS=x-api-key=***"),
    ],
)
def test_secrets_in_text_are_replaced(text: str, redacted: str) -> None:
    assert redact_text(text) == redacted


@pytest.mark.parametrize(
    "text",
    [
        "--model x",
        "--kv-cache-dtype auto",
        "VLLM::StageEngineCoreProc_stage0_replica0_DP0",
        "python -m multiprocessing.spawn",
        "python -m vllm.entrypoints.openai.api_server --model Qwen/Qwen2.5-Omni-7B --port 8000",
        "stage 1.0 dead; no progress for 30s",
        "SIGTERM: process group 100 sent; every recorded process exited",
        "http://127.0.0.1:8000/health",
        "HTTP 200\n{}",
        "PATH=/usr/bin MODEL=m",
        "    wait (threading.py:320)",
        # Short secret names only as a whole part of a name.
        "--author alice --path /models/m",
        "authorization failed for this request",
        "https://user@git.example/x http://h:8000/v1",
    ],
)
def test_what_is_no_secret_is_left_alone(text: str) -> None:
    assert redact_text(text) == text


@pytest.mark.parametrize(
    ("argv", "redacted"),
    [
        (["vllm", "serve", "--api-key", "sk-1"], ["vllm", "serve", "--api-key", "***"]),
        (["vllm", "--api-key=sk-1", "--port", "1"], ["vllm", "--api-key=***", "--port", "1"]),
        (["vllm", "--x-token", "--model", "m"], ["vllm", "--x-token", "--model", "m"]),
        (["vllm", "--x-token"], ["vllm", "--x-token"]),
        (["vllm", "--api-key", "two words"], ["vllm", "--api-key", "***"]),
        (["env", "HF_TOKEN=abc", "vllm"], ["env", "HF_TOKEN=***", "vllm"]),
        (["curl", "-H", "Authorization: Bearer abc"], ["curl", "-H", "Authorization: ***"]),
        (["python", "-m", "multiprocessing.spawn"], ["python", "-m", "multiprocessing.spawn"]),
        (["vllm", "--kv-cache-dtype", "auto"], ["vllm", "--kv-cache-dtype", "auto"]),
    ],
)
def test_secret_flags_in_argv_are_replaced(argv: list[str], redacted: list[str]) -> None:
    assert redact_argv(argv) == redacted


def test_a_secret_flag_s_value_is_hidden_in_argv_whatever_its_form() -> None:
    argv = ["vllm", "--authorization", "Bearer abc", "--auth", "x", "--pat", "y", "--path", "p"]
    assert redact_argv(argv) == [
        "vllm",
        "--authorization",
        "***",
        "--auth",
        "***",
        "--pat",
        "***",
        "--path",
        "p",
    ]


def test_secret_variables_of_an_environment_are_replaced() -> None:
    environ = {
        "HF_TOKEN": "hf_abc",
        "OPENAI_API_KEY": "sk-1",
        "db_password": "hunter2",
        "PATH": "/usr/bin",
        "VLLM_ARGS": "--model m --api-key sk-2",
    }
    assert redact_environ(environ) == {
        "HF_TOKEN": "***",
        "OPENAI_API_KEY": "***",
        "db_password": "***",
        "PATH": "/usr/bin",
        "VLLM_ARGS": "--model m --api-key ***",
    }


@pytest.mark.parametrize(
    ("value", "redacted"),
    [
        ({"title": "vllm --api-key sk-1"}, {"title": "vllm --api-key ***"}),
        ({"x.api_key": "sk-1", "model": "m"}, {"x.api_key": "***", "model": "m"}),
        # A token count is no secret, though its key names tokens.
        ({GEN_AI_USAGE_PROMPT_TOKENS: 12}, {GEN_AI_USAGE_PROMPT_TOKENS: 12}),
        ({"secrets": {"a": "b", "n": 1}}, {"secrets": {"a": "***", "n": 1}}),
        ({"argv": ["vllm", "--api-key", "sk-1"]}, {"argv": ["vllm", "--api-key", "***"]}),
        ([{"detail": "Authorization: Bearer abc"}, 3], [{"detail": "Authorization: ***"}, 3]),
        ({"pid": 100, "stage": None}, {"pid": 100, "stage": None}),
    ],
)
def test_json_values_are_redacted_by_key_and_by_text(value: Any, redacted: Any) -> None:
    assert redact_json(value) == redacted
