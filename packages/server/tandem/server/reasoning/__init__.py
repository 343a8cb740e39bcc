"""Reasoning parsers: split a reasoning model's output into its thinking and its answer
(--reasoning-parser NAME)."""

from __future__ import annotations

from tandem.server.reasoning.qwen3 import Qwen3Reasoning

REASONING_PARSERS = ("qwen3",)


def reasoning_parser(name: str, thinking_enabled: bool, generation_prompt: str) -> Qwen3Reasoning:
    """A parser for one choice of a request whose prompt ends with ``generation_prompt``."""
    if name == "qwen3":
        return Qwen3Reasoning.for_prompt(thinking_enabled, generation_prompt)
    raise ValueError(f"unknown reasoning parser {name!r}; known: {', '.join(REASONING_PARSERS)}")
