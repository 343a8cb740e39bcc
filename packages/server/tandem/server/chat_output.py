"""One chat choice's output read as reasoning, content and tool calls, piece by piece as it
streams. A whole output is read the same way, in one piece, so the two always agree."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Literal

from tandem.server.reasoning.qwen3 import Qwen3Reasoning
from tandem.server.tool_parsers.hermes import HermesToolParser
from tandem.server.tool_parsers.tool_call import ParsedToolCall, tool_call_from_json

# How the answer holds tool calls: written by the model in its own format and read by a
# tool-call parser ("parsed"), or forced by a grammar to be the arguments of one named
# function ("named") or a JSON list of calls ("required").
ToolMode = Literal["none", "parsed", "named", "required"]


@dataclass
class ToolCallDelta:
    index: int
    # Set on a call's first piece only (with its id, which the endpoint assigns).
    name: str | None
    arguments: str


@dataclass
class ChoiceDelta:
    reasoning: str = ""
    content: str = ""
    tool_calls: list[ToolCallDelta] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.reasoning or self.content or self.tool_calls)


class ChoiceReader:
    def __init__(
        self,
        reasoning: Qwen3Reasoning | None,
        tool_mode: ToolMode,
        tool_parser: HermesToolParser | None = None,
        function_name: str | None = None,
    ) -> None:
        self._reasoning = reasoning
        self._mode = tool_mode
        self._parser = tool_parser
        self._function = function_name
        self._num_calls = 0
        self._forced_text = ""

    @property
    def called_tools(self) -> bool:
        return self._num_calls > 0

    def feed(self, text: str) -> ChoiceDelta:
        if self._reasoning is None:
            return self._answer(ChoiceDelta(), text, final=False)
        reasoning, answer = self._reasoning.feed(text)
        return self._answer(ChoiceDelta(reasoning=reasoning), answer, final=False)

    def finish(self) -> ChoiceDelta:
        if self._reasoning is None:
            return self._answer(ChoiceDelta(), "", final=True)
        reasoning, answer = self._reasoning.finish()
        return self._answer(ChoiceDelta(reasoning=reasoning), answer, final=True)

    def _answer(self, delta: ChoiceDelta, text: str, final: bool) -> ChoiceDelta:
        if self._mode == "parsed":
            assert self._parser is not None
            content, calls = self._parser.feed(text)
            if final:
                rest, more = self._parser.finish()
                content, calls = content + rest, calls + more
            delta.content = content
            delta.tool_calls = [self._whole_call(call) for call in calls]
        elif self._mode == "named":
            assert self._function is not None
            if text and self._num_calls == 0:
                self._num_calls = 1
                delta.tool_calls.append(ToolCallDelta(0, self._function, text))
            elif text:
                delta.tool_calls.append(ToolCallDelta(0, None, text))
        elif self._mode == "required":
            # A list of calls is only known once whole: read at the end.
            self._forced_text += text
            if final:
                listed = _calls_from_list(self._forced_text)
                if listed is None:
                    delta.content = self._forced_text
                else:
                    delta.tool_calls = [self._whole_call(call) for call in listed]
        else:
            delta.content = text
        return delta

    def _whole_call(self, call: ParsedToolCall) -> ToolCallDelta:
        self._num_calls += 1
        return ToolCallDelta(self._num_calls - 1, call.name, call.arguments)


def _calls_from_list(text: str) -> list[ParsedToolCall] | None:
    """``[{"name": ..., "parameters": {...}}, ...]``, the shape the "required" grammar forces
    (vLLM's); None if the output is not that (cut short by max_tokens)."""
    try:
        items = json.loads(text)
    except ValueError:
        return None
    if not isinstance(items, list):
        return None
    calls = [tool_call_from_json(item) for item in items]
    return None if any(c is None for c in calls) else [c for c in calls if c is not None]
