"""The hermes tool-call parser and the qwen3 reasoning parser: whole outputs, and the same
outputs streamed in every split, read alike."""

from __future__ import annotations

import json

import pytest

from tandem.server.chat_output import ChoiceDelta, ChoiceReader, ToolCallDelta, ToolMode
from tandem.server.reasoning import reasoning_parser
from tandem.server.tool_parsers import tool_call_parser

CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'


def _read(reader: ChoiceReader, pieces: list[str]) -> ChoiceDelta:
    whole = ChoiceDelta()
    calls: dict[int, list[str | None]] = {}
    for delta in [*(reader.feed(p) for p in pieces), reader.finish()]:
        whole.reasoning += delta.reasoning
        whole.content += delta.content
        for call in delta.tool_calls:
            entry = calls.setdefault(call.index, [call.name, ""])
            entry[1] = (entry[1] or "") + call.arguments
    whole.tool_calls = []
    for index, (name, arguments) in sorted(calls.items()):
        whole.tool_calls.append(ToolCallDelta(index, name, arguments or ""))
    return whole


def _splits(text: str) -> list[list[str]]:
    """The text whole, char by char, and in chunks of 3 and 7."""
    chunks = [[text], list(text)]
    for size in (3, 7):
        chunks.append([text[i : i + size] for i in range(0, len(text), size)])
    return chunks


def _reader(mode: ToolMode = "parsed", reasoning: str | None = None) -> ChoiceReader:
    parser = reasoning_parser("qwen3", True, reasoning) if reasoning is not None else None
    return ChoiceReader(parser, mode, tool_call_parser("hermes"), function_name="get_time")


def _same_in_every_split(
    text: str, mode: ToolMode = "parsed", reasoning: str | None = None
) -> ChoiceDelta:
    results = [_read(_reader(mode, reasoning), pieces) for pieces in _splits(text)]
    for other in results[1:]:
        assert other == results[0]
    return results[0]


def test_calls_and_content() -> None:
    second = '<tool_call>\n{"name": "get_time", "arguments": "{\\"tz\\": \\"UTC\\"}"}\n</tool_call>'
    out = _same_in_every_split("Let me check.\n" + CALL + "\n" + second + "\n")
    assert out.content == "Let me check."
    assert [(c.index, c.name) for c in out.tool_calls] == [(0, "get_weather"), (1, "get_time")]
    assert json.loads(out.tool_calls[0].arguments) == {"city": "Paris"}
    assert json.loads(out.tool_calls[1].arguments) == {"tz": "UTC"}


@pytest.mark.parametrize(
    "text",
    [
        '<tool_call>\n{"name": get_weather}\n</tool_call>',
        '<tool_call>\n{"arguments": {}}\n</tool_call> and more',
        "a < b, and <tool_call without its bracket",
        "no calls at all\n\n",
    ],
)
def test_malformed_calls_stay_content(text: str) -> None:
    out = _same_in_every_split(text)
    assert out.tool_calls == [] and out.content == text


def test_a_call_cut_off_at_the_end_is_read_if_whole() -> None:
    out = _same_in_every_split(CALL.removesuffix("</tool_call>"))
    assert [c.name for c in out.tool_calls] == ["get_weather"] and out.content == ""


@pytest.mark.parametrize(
    ("generation_prompt", "text", "reasoning", "content"),
    [
        ("<|im_start|>assistant\n", "<think>\nhmm\n</think>\n\nHi", "\nhmm\n", "\n\nHi"),
        ("<|im_start|>assistant\n", "Hi there", "", "Hi there"),
        ("<|im_start|>assistant\n", "<think>\ncut short", "\ncut short", ""),
        ("<|im_start|>assistant\n<think>\n", "plan</think>answer", "plan", "answer"),
        (
            "<|im_start|>assistant\n<think>\n\n</think>\n\n",
            "<think>x</think>y",
            "",
            "<think>x</think>y",
        ),
    ],
)
def test_qwen3_reasoning(generation_prompt: str, text: str, reasoning: str, content: str) -> None:
    out = _same_in_every_split(text, reasoning=generation_prompt)
    assert (out.reasoning, out.content) == (reasoning, content)


def test_thinking_disabled_is_all_content() -> None:
    parser = reasoning_parser("qwen3", False, "<|im_start|>assistant\n")
    reader = ChoiceReader(parser, "none")
    out = _read(reader, ["<think>a</think>b"])
    assert (out.reasoning, out.content) == ("", "<think>a</think>b")


def test_reasoning_then_a_call() -> None:
    out = _same_in_every_split("<think>weather?</think>\n\n" + CALL, reasoning="assistant\n")
    assert out.reasoning == "weather?" and out.content == ""
    assert [c.name for c in out.tool_calls] == ["get_weather"]


def test_forced_calls() -> None:
    named = _same_in_every_split('{"tz": "UTC"}', mode="named")
    assert [(c.name, c.arguments) for c in named.tool_calls] == [("get_time", '{"tz": "UTC"}')]
    listed = '[{"name": "get_time", "parameters": {"tz": "UTC"}}, {"name": "f", "parameters": {}}]'
    required = _same_in_every_split(listed, mode="required")
    assert [c.name for c in required.tool_calls] == ["get_time", "f"]
    # Cut short by max_tokens: not a list of calls, so it stays content.
    assert _same_in_every_split('[{"name": "get_t', mode="required").content == '[{"name": "get_t'
