"""Flags of how chat requests are rendered and read (vLLM's names), mapped onto ChatConfig."""

from __future__ import annotations

import argparse
from pathlib import Path

from tandem.core import ConfigError
from tandem.server.reasoning import REASONING_PARSERS
from tandem.server.state import ChatConfig
from tandem.server.tool_parsers import TOOL_CALL_PARSERS


def add_chat_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("chat")
    g.add_argument(
        "--chat-template",
        default=None,
        metavar="FILE",
        help="a Jinja chat template file (or the template itself) for models without one, "
        "or to replace the model's",
    )
    g.add_argument(
        "--tool-call-parser",
        choices=TOOL_CALL_PARSERS,
        default=None,
        help='read tool calls out of answers (tool_choice "auto"): hermes for Qwen2.5, '
        "Qwen3 and Qwen3.5",
    )
    g.add_argument(
        "--reasoning-parser",
        choices=REASONING_PARSERS,
        default=None,
        help="split <think>...</think> into reasoning_content: qwen3 for Qwen3 and Qwen3.5",
    )


def chat_config_from_args(args: argparse.Namespace) -> ChatConfig:
    return ChatConfig(
        chat_template=_template(args.chat_template),
        tool_call_parser=args.tool_call_parser,
        reasoning_parser=args.reasoning_parser,
    )


def _template(value: str | None) -> str | None:
    """A file's text, or the value itself when it is a template (vLLM takes both)."""
    if value is None:
        return None
    path = Path(value)
    if path.is_file():
        return path.read_text(encoding="utf-8")
    if "{{" in value or "{%" in value:
        return value
    raise ConfigError(f"--chat-template {value}: no such file (and not a Jinja template)")
