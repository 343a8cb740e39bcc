"""Chat messages checked the way OpenAI checks them, then written as the dicts chat templates
read (Hugging Face's conventions: tool calls with their arguments as objects)."""

from __future__ import annotations

import json
from typing import Any

from tandem.server.errors import ApiError
from tandem.server.protocol import ChatMessage

ROLES = ("system", "developer", "user", "assistant", "tool")


def template_messages(messages: list[ChatMessage]) -> list[dict[str, Any]]:
    return [_message(f"messages[{i}]", m) for i, m in enumerate(messages)]


def _message(where: str, m: ChatMessage) -> dict[str, Any]:
    if m.role not in ROLES:
        raise ApiError(
            400,
            f"Invalid value for '{where}.role': {m.role!r}; expected one of {', '.join(ROLES)}.",
            param=f"{where}.role",
        )
    media = m.media_types()
    if media:
        # Every model here is served for text (a *ForConditionalGeneration checkpoint's
        # vision tower is not loaded); dropping the part would answer another question.
        raise ApiError(
            400,
            f"{where}.content has {media[0]} content, but this server serves text only (no "
            "image, video or audio input); send text content parts only.",
            param=f"{where}.content",
            code="unsupported_content_type",
        )
    if m.content is None and not (m.role == "assistant" and m.tool_calls):
        needs = " (or tool_calls)" if m.role == "assistant" else ""
        raise ApiError(
            400,
            f"Missing required parameter: '{where}.content'{needs}.",
            param=f"{where}.content",
        )
    if m.role == "tool" and m.tool_call_id is None:
        raise ApiError(
            400,
            f"Missing required parameter: '{where}.tool_call_id' (a tool message answers "
            "the tool call of that id).",
            param=f"{where}.tool_call_id",
        )
    if m.tool_calls and m.role != "assistant":
        raise ApiError(
            400,
            f"Only assistant messages carry tool_calls; {where} is {m.role!r}.",
            param=f"{where}.tool_calls",
        )
    # Templates know system prompts; OpenAI's developer role is one.
    out: dict[str, Any] = {"role": "system" if m.role == "developer" else m.role}
    out["content"] = m.text()
    if m.name is not None:
        out["name"] = m.name
    if m.tool_call_id is not None:
        out["tool_call_id"] = m.tool_call_id
    if m.reasoning_content is not None:
        out["reasoning_content"] = m.reasoning_content
    if m.tool_calls:
        out["tool_calls"] = [
            {
                "id": call.id,
                "type": "function",
                "function": {
                    "name": call.function.name,
                    "arguments": _arguments(call.function.arguments),
                },
            }
            for call in m.tool_calls
        ]
    return out


def _arguments(text: str) -> Any:
    # Templates write arguments with `| tojson` and expect an object; keep text that is not.
    try:
        return json.loads(text)
    except ValueError:
        return text
