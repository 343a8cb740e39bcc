"""Tool-call parsers: turn the tool calls a model writes into ``message.tool_calls``
(--tool-call-parser NAME)."""

from __future__ import annotations

from tandem.server.tool_parsers.hermes import HermesToolParser

TOOL_CALL_PARSERS = ("hermes",)


def tool_call_parser(name: str) -> HermesToolParser:
    """A parser for one choice's output."""
    if name == "hermes":
        return HermesToolParser()
    raise ValueError(f"unknown tool-call parser {name!r}; known: {', '.join(TOOL_CALL_PARSERS)}")
