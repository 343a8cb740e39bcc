"""Hermes-style tool calls, as Qwen2.5, Qwen3 and Qwen3.5 write them:
``<tool_call>\n{"name": "f", "arguments": {...}}\n</tool_call>``, any number of them.

A block whose JSON does not parse stays in the content verbatim, so nothing the model wrote is
lost; one cut off at the end of the output is read if its JSON is complete. Text around the
calls is content; whitespace left at the end of the content once the model called a tool is
dropped. Streaming and whole-output parsing are one code path, so they always agree.
"""

from __future__ import annotations

import json

from tandem.server.tag_scan import partial_tag_length
from tandem.server.tool_parsers.tool_call import ParsedToolCall, tool_call_from_json

START = "<tool_call>"
END = "</tool_call>"


class HermesToolParser:
    def __init__(self) -> None:
        self._buffer = ""
        self._in_block = False
        self._called = False
        # Trailing whitespace of the content, sent only if more content follows it.
        self._held = ""

    def feed(self, delta: str) -> tuple[str, list[ParsedToolCall]]:
        """(content, calls) that ``delta`` completes."""
        self._buffer += delta
        content = ""
        calls: list[ParsedToolCall] = []
        while True:
            if not self._in_block:
                at = self._buffer.find(START)
                if at < 0:
                    keep = partial_tag_length(self._buffer, START)
                    content += self._buffer[: len(self._buffer) - keep]
                    self._buffer = self._buffer[len(self._buffer) - keep :]
                    break
                content += self._buffer[:at]
                self._buffer = self._buffer[at + len(START) :]
                self._in_block = True
            at = self._buffer.find(END)
            if at < 0:
                break
            body, self._buffer = self._buffer[:at], self._buffer[at + len(END) :]
            self._in_block = False
            content += self._close_block(body, END, calls)
        return self._hold_whitespace(content), calls

    def finish(self) -> tuple[str, list[ParsedToolCall]]:
        """The rest, at the end of the output."""
        calls: list[ParsedToolCall] = []
        rest, self._buffer = self._buffer, ""
        content = self._close_block(rest, "", calls) if self._in_block else rest
        content = self._hold_whitespace(content)
        if not self._called:
            content += self._held
        self._held = ""
        return content, calls

    def _close_block(self, body: str, end: str, calls: list[ParsedToolCall]) -> str:
        try:
            call = tool_call_from_json(json.loads(body))
        except ValueError:
            call = None
        if call is None:
            return START + body + end
        calls.append(call)
        self._called = True
        return ""

    def _hold_whitespace(self, content: str) -> str:
        text = self._held + content
        sent = text.rstrip()
        self._held = text[len(sent) :]
        return sent
