"""Qwen3's thinking: ``<think>reasoning</think>answer``.

Where the output starts decides the reading. The chat template may close the thought in the
prompt (``enable_thinking: false`` writes ``<think>\\n\\n</think>``): all content. It may open
it (Qwen3.5 writes ``<think>``): the output starts as reasoning. Otherwise (Qwen3's template)
the model opens the thought itself when thinking is enabled, Qwen3's default: an output that
starts with ``<think>`` is reasoning up to ``</think>``, one that does not (a non-thinking
model, or an answer a grammar forced) is all content. A thought that never closes (the output
was cut short) is all reasoning.

vLLM's qwen3 parser reads the same, except that it takes an output without any tag as
reasoning whenever thinking is enabled. Streaming and whole-output parsing are one code path,
so they always agree.
"""

from __future__ import annotations

from typing import Literal

from tandem.server.tag_scan import partial_tag_length

START = "<think>"
END = "</think>"

_Mode = Literal["content", "reasoning", "opening"]


class Qwen3Reasoning:
    def __init__(self, mode: _Mode) -> None:
        self._mode: _Mode = mode
        # The output's very beginning may (re)state the opening tag; it is dropped.
        self._at_start = True
        self._pending = ""

    @classmethod
    def for_prompt(cls, thinking_enabled: bool, generation_prompt: str) -> Qwen3Reasoning:
        opened, closed = generation_prompt.rfind(START), generation_prompt.rfind(END)
        if closed > opened:
            return cls("content")
        if opened >= 0:
            return cls("reasoning")
        return cls("opening" if thinking_enabled else "content")

    def feed(self, delta: str) -> tuple[str, str]:
        """(reasoning, content) that ``delta`` completes; a possible partial tag waits."""
        text = self._pending + delta
        self._pending = ""
        if self._mode == "content":
            return "", text
        if self._at_start:
            stripped = text.lstrip()
            if len(stripped) < len(START) and START.startswith(stripped):
                self._pending = text
                return "", ""
            self._at_start = False
            if stripped.startswith(START):
                text = stripped[len(START) :]
                self._mode = "reasoning"
            elif self._mode == "opening":
                self._mode = "content"
                return "", text
        at = text.find(END)
        if at >= 0:
            self._mode = "content"
            return text[:at], text[at + len(END) :]
        keep = partial_tag_length(text, END)
        self._pending = text[len(text) - keep :]
        return text[: len(text) - keep], ""

    def finish(self) -> tuple[str, str]:
        """What was held back, at the end of the output."""
        pending, self._pending = self._pending, ""
        return (pending, "") if self._mode == "reasoning" else ("", pending)
