"""The grammar a request asks for, from OpenAI's response_format or vLLM's structured_outputs
(and its older guided_* fields), compiled before the request reaches the engine."""

from __future__ import annotations

import asyncio
import json
from typing import Any

from tandem.core.errors import InvalidRequestError
from tandem.core.llm.structured_output import fresh_error
from tandem.core.llm.structured_output_spec import StructuredOutputSpec
from tandem.server.deadline import before_deadline
from tandem.server.errors import ApiError
from tandem.server.protocol import StructuredOutputsParams, _SamplingFields
from tandem.server.state import ServerState


def structured_output_spec(body: _SamplingFields) -> StructuredOutputSpec | None:
    """The one grammar ``body`` asks for, if any; asking for two is a 400."""
    found: list[StructuredOutputSpec] = []
    fmt = body.response_format
    if fmt is not None and fmt.type == "json_object":
        found.append(StructuredOutputSpec.json_object("response_format"))
    elif fmt is not None and fmt.type == "json_schema":
        if fmt.json_schema is None:
            raise ApiError(
                400,
                "response_format of type json_schema needs a json_schema object.",
                param="response_format.json_schema",
            )
        schema = fmt.json_schema.schema_
        param = "response_format.json_schema.schema"
        found.append(
            StructuredOutputSpec.json_object(param)
            if schema is None
            else StructuredOutputSpec.json_schema(schema, param)
        )
    if body.structured_outputs is not None:
        found += _from_structured_outputs(body.structured_outputs)
    if body.guided_json is not None:
        found.append(_json_spec(body.guided_json, "guided_json"))
    if body.guided_regex is not None:
        found.append(StructuredOutputSpec.regex(body.guided_regex, "guided_regex"))
    if body.guided_choice is not None:
        found.append(StructuredOutputSpec.choice(body.guided_choice, "guided_choice"))
    if body.guided_grammar is not None:
        found.append(StructuredOutputSpec.grammar(body.guided_grammar, "guided_grammar"))
    if len(found) > 1:
        names = ", ".join(spec.param for spec in found)
        raise ApiError(
            400,
            f"Ask for one kind of structured output at a time; this request asks for {names}.",
            param=found[1].param,
        )
    return found[0] if found else None


def _from_structured_outputs(params: StructuredOutputsParams) -> list[StructuredOutputSpec]:
    found = []
    if params.json_ is not None:
        found.append(_json_spec(params.json_, "structured_outputs.json"))
    if params.regex is not None:
        found.append(StructuredOutputSpec.regex(params.regex, "structured_outputs.regex"))
    if params.choice is not None:
        found.append(StructuredOutputSpec.choice(params.choice, "structured_outputs.choice"))
    if params.grammar is not None:
        found.append(StructuredOutputSpec.grammar(params.grammar, "structured_outputs.grammar"))
    if params.json_object:
        found.append(StructuredOutputSpec.json_object("structured_outputs.json_object"))
    if not found:
        raise ApiError(
            400,
            "structured_outputs needs one of json, regex, choice, grammar or json_object.",
            param="structured_outputs",
        )
    return found


def _json_spec(schema: dict[str, Any] | str, param: str) -> StructuredOutputSpec:
    if isinstance(schema, str):
        try:
            schema = json.loads(schema)
        except ValueError as exc:
            raise ApiError(400, f"{param} is not valid JSON: {exc}.", param=param) from None
        except RecursionError:
            raise ApiError(400, f"{param} nests too deeply to be read.", param=param) from None
    if not isinstance(schema, dict):
        raise ApiError(400, f"{param} must be a JSON schema object.", param=param)
    return StructuredOutputSpec.json_schema(schema, param)


async def compile_grammar(state: ServerState, spec: StructuredOutputSpec) -> None:
    """Compile ``spec`` on the engine's grammar threads (or find it compiled) without holding
    up the event loop; one that cannot compile, or not within the compile time limit, raises
    InvalidRequestError (a 400); the request's own deadline stops the wait too (a 504)."""
    compiler = state.engine.structured_outputs
    future = compiler.submit(spec)
    # The compile checks its own time; this bounds the wait where llguidance itself is slow.
    timeout = compiler.compile_timeout_s + 1.0
    # Shielded: the compiled grammar is shared, only this request stops waiting for it.
    waited = asyncio.wait_for(asyncio.shield(asyncio.wrap_future(future)), timeout)
    try:
        await before_deadline(waited)
    except InvalidRequestError as exc:
        raise fresh_error(exc) from None
    except TimeoutError:
        raise compiler.refuse_slow(spec) from None
