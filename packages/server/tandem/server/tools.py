"""What a chat request's tools and tool_choice mean for its prompt and its output (vLLM's
rules): "auto" lets the model call tools in its own format, read by --tool-call-parser;
"required" and a named function force the output with a grammar; "none" leaves the tools
out of the prompt."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from tandem.core.llm.structured_output_spec import StructuredOutputSpec
from tandem.server.chat_output import ToolMode
from tandem.server.errors import ApiError
from tandem.server.protocol import ChatCompletionRequest
from tandem.server.state import ChatConfig


@dataclass(frozen=True)
class ToolPlan:
    # What the chat template gets as ``tools`` (None: no tools in the prompt).
    template_tools: list[dict[str, Any]] | None
    mode: ToolMode
    function_name: str | None = None
    grammar: StructuredOutputSpec | None = None


def plan_tools(config: ChatConfig, body: ChatCompletionRequest) -> ToolPlan:
    tools = body.tools or []
    choice = body.tool_choice if body.tool_choice is not None else ("auto" if tools else "none")
    if not tools:
        if choice != "none":
            raise ApiError(400, "tool_choice needs tools to choose from.", param="tool_choice")
        return ToolPlan(None, "none")
    names = [t.function.name for t in tools]
    if len(set(names)) != len(names):
        raise ApiError(400, "Each tool needs a name of its own.", param="tools")
    if choice == "none":
        return ToolPlan(None, "none")
    definitions = [t.model_dump(exclude_none=True) for t in tools]
    if choice == "auto":
        if config.tool_call_parser is None:
            raise ApiError(
                400,
                'tool_choice "auto" needs a tool-call parser: start the server with '
                "--tool-call-parser (e.g. hermes for Qwen models), or name a function.",
                param="tool_choice",
            )
        return ToolPlan(definitions, "parsed")
    if choice == "required":
        shapes = [_call_schema(t.function.name, t.function.parameters) for t in tools]
        calls: dict[str, Any] = {"type": "array", "minItems": 1, "items": {"anyOf": shapes}}
        if not body.parallel_tool_calls:
            calls["maxItems"] = 1
        return ToolPlan(
            definitions, "required", grammar=StructuredOutputSpec.json_schema(calls, "tool_choice")
        )
    wanted = choice.function.name
    chosen = next((t for t in tools if t.function.name == wanted), None)
    if chosen is None:
        raise ApiError(
            400, f"tool_choice names {wanted!r}, which is not among the tools.", "tool_choice"
        )
    schema = chosen.function.parameters or _no_parameters()
    return ToolPlan(definitions, "named", wanted, StructuredOutputSpec.json_schema(schema, "tools"))


def _no_parameters() -> dict[str, Any]:
    return {"type": "object", "properties": {}}


def _call_schema(name: str, parameters: dict[str, Any] | None) -> dict[str, Any]:
    return {
        "type": "object",
        "properties": {
            "name": {"type": "string", "enum": [name]},
            "parameters": parameters or _no_parameters(),
        },
        "required": ["name", "parameters"],
    }
