"""Tool calls and reasoning through the official openai client, against a server started as a
vLLM user starts one for Qwen3: --chat-template (a Qwen3-shaped template that takes tools),
--tool-call-parser hermes, --reasoning-parser qwen3.

The random-weight model writes what a real Qwen3 would only when a grammar makes it: a regex
forces the exact text of a tool call (or of a thought), and the parsers must read it back."""

from __future__ import annotations

import json
import shutil
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import jsonschema
import openai
import pytest
from harness import MODEL_NAME, Server, ServerFactory, openai_client
from openai import OpenAI

TEMPLATE = Path(__file__).resolve().parents[1] / "docs" / "chat_templates" / "qwen3_tools.jinja"

WEATHER: dict[str, Any] = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city.",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "enum": ["Paris", "Oslo"]},
                "days": {"type": "integer", "minimum": 1, "maximum": 7},
            },
            "required": ["city", "days"],
        },
    },
}
TIME: dict[str, Any] = {
    "type": "function",
    "function": {
        "name": "get_time",
        "parameters": {
            "type": "object",
            "properties": {"tz": {"enum": ["UTC", "CET"]}},
            "required": ["tz"],
        },
    },
}
TOOLS = [WEATHER, TIME]
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]
NO_THINKING = {"enable_thinking": False}
# What Qwen3 writes to call a tool, as a regex the grammar forces.
CALL_REGEX = (
    r'Let me look\.\n<tool_call>\n\{"name": "get_weather", "arguments": '
    r'\{"city": "(Paris|Oslo)", "days": [1-7]\}\}\n</tool_call>'
)


@pytest.fixture(scope="module")
def qwen3_server(
    start_server: ServerFactory, model_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Server:
    # The demo tokenizer spends about a token per character; tool definitions need a longer
    # context than the demo model's 512 (RoPE has no hard limit: only the config's number).
    folder = tmp_path_factory.mktemp("long") / "model"
    shutil.copytree(model_dir, folder)
    config = json.loads((folder / "config.json").read_text())
    config["max_position_embeddings"] = 2048
    (folder / "config.json").write_text(json.dumps(config))
    return start_server(
        "--model", str(folder), "--served-model-name", MODEL_NAME,
        "--chat-template", str(TEMPLATE), "--enable-auto-tool-choice",
        "--tool-call-parser", "hermes", "--reasoning-parser", "qwen3",
        demo_model=False,
    )  # fmt: skip


@pytest.fixture(scope="module")
def client(qwen3_server: Server) -> OpenAI:
    return openai_client(qwen3_server.base_url)


def _chat(client: OpenAI, **kwargs: Any) -> Any:
    extra = kwargs.pop("extra_body", {})
    return client.chat.completions.create(
        model=MODEL_NAME,
        messages=kwargs.pop("messages", ASK),
        max_tokens=kwargs.pop("max_tokens", 120),
        temperature=0,
        extra_body=extra,
        **kwargs,
    )


def _streamed(client: OpenAI, **kwargs: Any) -> dict[str, Any]:
    """A streamed chat's deltas put together the way clients do."""
    out: dict[str, Any] = {"content": "", "reasoning": "", "calls": {}, "finish": None}
    for chunk in _chat(client, stream=True, **kwargs):
        if not chunk.choices:
            continue
        choice = chunk.choices[0]
        delta = choice.delta
        out["content"] += delta.content or ""
        out["reasoning"] += (delta.model_extra or {}).get("reasoning_content") or ""
        for call in delta.tool_calls or []:
            entry = out["calls"].setdefault(call.index, {"id": None, "name": None, "args": ""})
            entry["id"] = entry["id"] or call.id
            if call.function is not None:
                entry["name"] = entry["name"] or call.function.name
                entry["args"] += call.function.arguments or ""
        out["finish"] = choice.finish_reason or out["finish"]
    return out


def test_a_forced_tool_call_is_parsed(client: OpenAI) -> None:
    extra = {"structured_outputs": {"regex": CALL_REGEX}, "chat_template_kwargs": NO_THINKING}
    response = _chat(client, tools=TOOLS, extra_body=extra)
    choice = response.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.content == "Let me look."
    [call] = choice.message.tool_calls
    assert call.type == "function" and call.id.startswith("chatcmpl-tool-")
    assert call.function.name == "get_weather"
    jsonschema.validate(json.loads(call.function.arguments), WEATHER["function"]["parameters"])
    streamed = _streamed(client, tools=TOOLS, extra_body=extra)
    assert streamed["content"] == "Let me look." and streamed["finish"] == "tool_calls"
    assert [(c["name"], c["args"]) for c in streamed["calls"].values()] == [
        ("get_weather", call.function.arguments)
    ]


def test_malformed_tool_call_text_stays_content(client: OpenAI) -> None:
    broken = r'<tool_call>\n\{"name": get_weather, "arguments": \{\}\}\n</tool_call>'
    extra = {"structured_outputs": {"regex": broken}, "chat_template_kwargs": NO_THINKING}
    choice = _chat(client, tools=TOOLS, extra_body=extra).choices[0]
    assert not choice.message.tool_calls and choice.finish_reason == "stop"
    assert choice.message.content.startswith('<tool_call>\n{"name": get_weather')
    streamed = _streamed(client, tools=TOOLS, extra_body=extra)
    assert streamed["calls"] == {} and streamed["content"] == choice.message.content


def test_required_and_named_tool_choice(client: OpenAI) -> None:
    thinking_off = {"chat_template_kwargs": NO_THINKING}
    # One call: a random model never chooses to end a list by itself.
    required = _chat(
        client, tools=TOOLS, tool_choice="required", parallel_tool_calls=False
    ).choices[0]
    assert required.finish_reason == "tool_calls" and required.message.tool_calls
    schemas = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
    for call in required.message.tool_calls:
        jsonschema.validate(json.loads(call.function.arguments), schemas[call.function.name])
    named_choice = {"type": "function", "function": {"name": "get_time"}}
    named = _chat(client, tools=TOOLS, tool_choice=named_choice, extra_body=thinking_off)
    [call] = named.choices[0].message.tool_calls
    assert call.function.name == "get_time" and named.choices[0].finish_reason == "stop"
    jsonschema.validate(json.loads(call.function.arguments), schemas["get_time"])
    streamed = _streamed(client, tools=TOOLS, tool_choice=named_choice, extra_body=thinking_off)
    assert [(c["name"], c["args"]) for c in streamed["calls"].values()] == [
        ("get_time", call.function.arguments)
    ]
    streamed_required = _streamed(
        client, tools=TOOLS, tool_choice="required", parallel_tool_calls=False
    )
    assert [c["name"] for c in streamed_required["calls"].values()] == [
        c.function.name for c in required.message.tool_calls
    ]


def test_tool_results_go_back_to_the_model(client: OpenAI, qwen3_server: Server) -> None:
    call_id = "chatcmpl-tool-1"
    arguments = json.dumps({"city": "Paris", "days": 2})
    conversation = [
        *ASK,
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": call_id,
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": arguments},
                }
            ],
        },
        {"role": "tool", "tool_call_id": call_id, "content": "sunny, 24 C"},
    ]
    answer = _chat(client, messages=conversation, tools=TOOLS, max_tokens=8).choices[0]
    assert answer.finish_reason in ("stop", "length")
    rendered = httpx.post(
        f"{qwen3_server.base_url}/tokenize",
        json={"messages": conversation, "tools": TOOLS, "return_token_strs": True},
        timeout=30,
    ).json()
    text = httpx.post(
        f"{qwen3_server.base_url}/detokenize", json={"tokens": rendered["tokens"]}, timeout=30
    ).json()["prompt"]
    assert "<tool_response>\nsunny, 24 C\n</tool_response>" in text
    assert '"arguments": {"city": "Paris", "days": 2}' in text


def test_reasoning_is_split_out(client: OpenAI) -> None:
    thought = {
        "structured_outputs": {
            "regex": r"<think>\nthe user asks [a-z]{3,8}\n</think>\n\nIt is [a-z]{3,8}\."
        }
    }
    message = _chat(client, extra_body=thought).choices[0].message
    extra = message.model_extra or {}
    assert extra["reasoning_content"].startswith("\nthe user asks ")
    assert extra["reasoning"] == extra["reasoning_content"]
    assert message.content.startswith("\n\nIt is ") and "</think>" not in message.content
    streamed = _streamed(client, extra_body=thought)
    assert streamed["reasoning"] == extra["reasoning_content"]
    assert streamed["content"] == message.content
    # Cut short inside the thought: all of it is reasoning.
    cut = _chat(client, max_tokens=12, extra_body=thought).choices[0]
    assert cut.finish_reason == "length" and cut.message.content is None
    assert (cut.message.model_extra or {})["reasoning_content"]


def test_enable_thinking_false_is_honoured(client: OpenAI, qwen3_server: Server) -> None:
    forced = {"structured_outputs": {"regex": r"[a-z]{3,8} [a-z]{3,8}"}}
    off = _chat(client, extra_body={**forced, "chat_template_kwargs": NO_THINKING})
    message = off.choices[0].message
    assert message.content and (message.model_extra or {})["reasoning_content"] is None
    rendered = httpx.post(
        f"{qwen3_server.base_url}/tokenize",
        json={"messages": ASK, "chat_template_kwargs": NO_THINKING, "return_token_strs": True},
        timeout=30,
    ).json()
    assert "think" in "".join(rendered["token_strs"])


def test_a_batch_mixing_tools_grammars_and_penalties(client: OpenAI) -> None:
    no_thinking = {"chat_template_kwargs": NO_THINKING}
    # Short answers where the length proves nothing: the module's time is decode steps.
    requests: list[dict[str, Any]] = [
        {"extra_body": no_thinking, "max_tokens": 16},
        {
            "extra_body": {**no_thinking, "repetition_penalty": 1.3},
            "presence_penalty": 1.0,
            "max_tokens": 16,
        },
        {"response_format": {"type": "json_object"}, "max_tokens": 60},
        {
            "tools": TOOLS,
            "extra_body": {**no_thinking, "structured_outputs": {"regex": CALL_REGEX}},
        },
        {"tools": TOOLS, "tool_choice": "required", "parallel_tool_calls": False},
        {"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "get_time"}}},
    ]

    def summary(kwargs: dict[str, Any]) -> Any:
        choice = _chat(client, **kwargs).choices[0]
        calls = [(c.function.name, c.function.arguments) for c in choice.message.tool_calls or []]
        return choice.message.content, calls, choice.finish_reason

    alone = [summary(r) for r in requests]
    assert alone[3][1] and alone[4][1] and alone[5][1]
    with ThreadPoolExecutor(len(requests) * 2) as pool:
        together = list(pool.map(summary, requests * 2))
    assert together == alone * 2


def test_auto_without_a_parser_and_named_unknown_are_400s(client: OpenAI) -> None:
    with pytest.raises(openai.BadRequestError) as info:
        _chat(client, tools=TOOLS, tool_choice={"type": "function", "function": {"name": "nope"}})
    assert isinstance(info.value.body, dict) and info.value.body["param"] == "tool_choice"
