"""Every bad request gets the documented status and an OpenAI-shaped error body, and the
server keeps answering good requests after each one."""

from __future__ import annotations

import json
from typing import Any

import httpx
import pytest
from harness import MODEL_NAME, Server

GOOD = {"model": MODEL_NAME, "prompt": "hello", "max_tokens": 2}
CHAT = {"model": MODEL_NAME, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}

# (name, method, path, body (dict, or raw bytes), expected status, expected param)
CASES: list[tuple[str, str, str, Any, int, str | None]] = [
    ("malformed json", "POST", "/v1/completions", b'{"model": "x", "prompt": ', 400, None),
    ("body not an object", "POST", "/v1/completions", b"[1, 2, 3]", 400, None),
    ("missing model", "POST", "/v1/completions", {"prompt": "hi"}, 400, "model"),
    ("unknown model", "POST", "/v1/completions", {**GOOD, "model": "gpt-9"}, 404, "model"),
    ("missing prompt", "POST", "/v1/completions", {"model": MODEL_NAME}, 400, "prompt"),
    (
        "max_tokens wrong type",
        "POST",
        "/v1/completions",
        {**GOOD, "max_tokens": "many"},
        400,
        "max_tokens",
    ),
    ("max_tokens zero", "POST", "/v1/completions", {**GOOD, "max_tokens": 0}, 400, "max_tokens"),
    (
        "max_tokens negative",
        "POST",
        "/v1/completions",
        {**GOOD, "max_tokens": -5},
        400,
        "max_tokens",
    ),
    (
        "temperature negative",
        "POST",
        "/v1/completions",
        {**GOOD, "temperature": -1},
        400,
        "temperature",
    ),
    (
        "temperature too high",
        "POST",
        "/v1/completions",
        {**GOOD, "temperature": 3.5},
        400,
        "temperature",
    ),
    ("top_p zero", "POST", "/v1/completions", {**GOOD, "top_p": 0}, 400, "top_p"),
    ("top_p above one", "POST", "/v1/completions", {**GOOD, "top_p": 1.5}, 400, "top_p"),
    ("n zero", "POST", "/v1/completions", {**GOOD, "n": 0}, 400, "n"),
    ("logprobs too many", "POST", "/v1/completions", {**GOOD, "logprobs": 50}, 400, "logprobs"),
    ("seed negative", "POST", "/v1/completions", {**GOOD, "seed": -1}, 400, "seed"),
    ("stop wrong type", "POST", "/v1/completions", {**GOOD, "stop": 7}, 400, "stop"),
    (
        "prompt over context",
        "POST",
        "/v1/completions",
        {**GOOD, "prompt": [20] * 600},
        400,
        "prompt",
    ),
    (
        "token id outside vocab",
        "POST",
        "/v1/completions",
        {**GOOD, "prompt": [20, 10**6]},
        400,
        "prompt",
    ),
    ("empty prompt", "POST", "/v1/completions", {**GOOD, "prompt": ""}, 400, "prompt"),
    (
        "stream_options without stream",
        "POST",
        "/v1/completions",
        {**GOOD, "stream_options": {"include_usage": True}},
        400,
        "stream_options",
    ),
    *[
        (f"{field} out of range", "POST", "/v1/completions", {**GOOD, field: value}, 400, field)
        for field, value in [
            ("presence_penalty", 2.5),
            ("frequency_penalty", -3),
            ("repetition_penalty", 0),
            ("min_p", 1.5),
            ("min_tokens", -1),
            ("prompt_logprobs", 50),
            ("logit_bias", {"7": 500}),
            ("logit_bias", {"not-a-token": 1}),
            ("logit_bias", {"100000": 1}),
            ("stop_token_ids", [100000]),
        ]
    ],
    (
        "min_tokens over max_tokens",
        "POST",
        "/v1/completions",
        {**GOOD, "min_tokens": 5},
        400,
        "min_tokens",
    ),
    (
        "prompt_logprobs streamed",
        "POST",
        "/v1/completions",
        {**GOOD, "prompt_logprobs": 1, "stream": True},
        400,
        "prompt_logprobs",
    ),
    ("n with greedy", "POST", "/v1/completions", {**GOOD, "n": 2, "temperature": 0}, 400, "n"),
    (
        "response_format unknown type",
        "POST",
        "/v1/completions",
        {**GOOD, "response_format": {"type": "yaml"}},
        400,
        "response_format",
    ),
    (
        "json_schema that cannot compile",
        "POST",
        "/v1/completions",
        {
            **GOOD,
            "response_format": {
                "type": "json_schema",
                "json_schema": {"name": "x", "schema": {"type": "bogus"}},
            },
        },
        400,
        "response_format.json_schema.schema",
    ),
    (
        "regex that cannot compile",
        "POST",
        "/v1/completions",
        {**GOOD, "structured_outputs": {"regex": "a(b"}},
        400,
        "structured_outputs.regex",
    ),
    (
        "two structured outputs",
        "POST",
        "/v1/completions",
        {**GOOD, "guided_json": {"type": "object"}, "guided_regex": "a+"},
        400,
        "guided_regex",
    ),
    (
        "empty structured_outputs",
        "POST",
        "/v1/completions",
        {**GOOD, "structured_outputs": {}},
        400,
        "structured_outputs",
    ),
    (
        "user message without content",
        "POST",
        "/v1/chat/completions",
        {**CHAT, "messages": [{"role": "user"}]},
        400,
        "messages[0].content",
    ),
    (
        "system message without content",
        "POST",
        "/v1/chat/completions",
        {**CHAT, "messages": [{"role": "system"}, {"role": "user", "content": "hi"}]},
        400,
        "messages[0].content",
    ),
    (
        "tool message without tool_call_id",
        "POST",
        "/v1/chat/completions",
        {
            **CHAT,
            "messages": [{"role": "user", "content": "hi"}, {"role": "tool", "content": "42"}],
        },
        400,
        "messages[1].tool_call_id",
    ),
    (
        "tool_choice auto without a parser",
        "POST",
        "/v1/chat/completions",
        {**CHAT, "tools": [{"type": "function", "function": {"name": "f"}}]},
        400,
        "tool_choice",
    ),
    (
        "tool_choice names an unknown function",
        "POST",
        "/v1/chat/completions",
        {
            **CHAT,
            "tools": [{"type": "function", "function": {"name": "f"}}],
            "tool_choice": {"type": "function", "function": {"name": "g"}},
        },
        400,
        "tool_choice",
    ),
    (
        "chat_template_kwargs overriding a field",
        "POST",
        "/v1/chat/completions",
        {**CHAT, "chat_template_kwargs": {"tools": []}},
        400,
        "chat_template_kwargs",
    ),
    ("tokenize without prompt or messages", "POST", "/tokenize", {}, 400, "prompt"),
    (
        "detokenize outside the vocabulary",
        "POST",
        "/detokenize",
        {"tokens": [1, 10**6]},
        400,
        "tokens",
    ),
    (
        "chat without messages",
        "POST",
        "/v1/chat/completions",
        {**CHAT, "messages": []},
        400,
        "messages",
    ),
    (
        "chat bad role",
        "POST",
        "/v1/chat/completions",
        {**CHAT, "messages": [{"role": "wizard", "content": "hi"}]},
        400,
        "messages[0].role",
    ),
    (
        "chat top_logprobs without logprobs",
        "POST",
        "/v1/chat/completions",
        {**CHAT, "top_logprobs": 2},
        400,
        "top_logprobs",
    ),
    (
        "chat messages over context",
        "POST",
        "/v1/chat/completions",
        {**CHAT, "messages": [{"role": "user", "content": "hello world " * 400}]},
        400,
        "messages",
    ),
    (
        "chat image content",
        "POST",
        "/v1/chat/completions",
        {
            **CHAT,
            "messages": [
                {
                    "role": "user",
                    "content": [
                        {"type": "text", "text": "what is this?"},
                        {
                            "type": "image_url",
                            "image_url": {"url": "data:image/png;base64,iVBORw0KGgo="},
                        },
                    ],
                }
            ],
        },
        400,
        "messages[0].content",
    ),
    (
        "chat video content",
        "POST",
        "/v1/chat/completions",
        {
            **CHAT,
            "messages": [
                {
                    "role": "user",
                    "content": [
                        {"type": "video_url", "video_url": {"url": "https://example.com/clip.mp4"}},
                    ],
                }
            ],
        },
        400,
        "messages[0].content",
    ),
    ("unknown route", "GET", "/v1/engines", None, 404, None),
    ("wrong method", "GET", "/v1/completions", None, 405, None),
    ("oversize body", "POST", "/v1/completions", {**GOOD, "prompt": "x" * (9 << 20)}, 413, None),
]


@pytest.mark.parametrize(
    ("method", "path", "body", "status", "param"),
    [case[1:] for case in CASES],
    ids=[case[0] for case in CASES],
)
def test_bad_request(
    server: Server, method: str, path: str, body: Any, status: int, param: str | None
) -> None:
    url = server.base_url + path
    with httpx.Client(timeout=60) as client:
        if body is None:
            response = client.request(method, url)
        else:
            raw = body if isinstance(body, bytes) else json.dumps(body).encode()
            response = client.request(
                method, url, content=raw, headers={"content-type": "application/json"}
            )
        assert response.status_code == status, response.text
        error = response.json()["error"]
        assert set(error) == {"message", "type", "param", "code"}
        assert isinstance(error["message"], str) and error["message"]
        assert isinstance(error["type"], str)
        if param is not None:
            assert error["param"] == param
        if status == 404 and path.endswith("completions"):
            assert error["code"] == "model_not_found"
        if isinstance(body, dict) and "_url" in json.dumps(body.get("messages", "")):
            assert error["code"] == "unsupported_content_type"
            assert "text only" in error["message"], error["message"]
        # The server is still fine.
        good = client.post(f"{server.base_url}/v1/completions", json=GOOD)
        assert good.status_code == 200, good.text
        assert good.json()["usage"]["completion_tokens"] == 2


def test_at_least_fifteen_cases() -> None:
    assert len(CASES) >= 15
