"""POST /v1/chat/completions: messages rendered by the chat template, the answer read back as
reasoning, content and tool calls."""

from __future__ import annotations

import uuid
from dataclasses import dataclass
from typing import Any

from fastapi import Request

from tandem.core import RequestOutput
from tandem.server.chat_messages import template_messages
from tandem.server.chat_output import ChoiceDelta, ChoiceReader, ToolCallDelta
from tandem.server.common import check_request, new_id, usage
from tandem.server.endpoint import StreamShape, respond
from tandem.server.errors import ApiError
from tandem.server.generation import Job, sampling_params
from tandem.server.logprobs import TokenNames, chat_logprobs, prompt_logprobs_json
from tandem.server.preparer import PREPARED_SCOPE_KEY
from tandem.server.protocol import ChatCompletionRequest
from tandem.server.reasoning import reasoning_parser
from tandem.server.state import ServerState
from tandem.server.structured_outputs import compile_grammar, structured_output_spec
from tandem.server.tool_parsers import tool_call_parser
from tandem.server.tools import ToolPlan, plan_tools

# Arguments of the template call that come from the request's own fields, or that the
# server sets (apply_chat_template's own, which would change what it returns).
_RESERVED_TEMPLATE_ARGS = frozenset(
    {
        "messages", "conversation", "add_generation_prompt", "chat_template", "tools",
        "tokenize", "continue_final_message", "max_length", "padding", "return_dict",
        "return_assistant_tokens_mask", "return_tensors", "time_limit_s", "tokenizer_kwargs",
        "truncation",
    }
)  # fmt: skip


@dataclass(frozen=True)
class RenderedPrompt:
    text: str
    # What add_generation_prompt appended: where the answer starts (inside a thought?).
    generation_prompt: str


def request_template(state: ServerState, template: str | None) -> str | None:
    """The template a request brought, if the operator trusts request templates (a template
    is code run on the server); ApiError (400) otherwise."""
    if template is not None and not state.limits.trust_request_chat_template:
        raise ApiError(
            400,
            "This server does not run chat templates sent with requests (a template is code "
            "run on the server); leave chat_template out to use the server's. The operator "
            "can allow them with --trust-request-chat-template.",
            param="chat_template",
        )
    return template


def render_chat(
    state: ServerState,
    messages: list[dict[str, Any]],
    add_generation_prompt: bool,
    template_kwargs: dict[str, Any],
    tools: list[dict[str, Any]] | None,
    own_template: str | None = None,
) -> RenderedPrompt:
    """The prompt ``messages`` become (run it off the event loop: a template is bounded only
    by its time limit). ``own_template``: a trusted request's template."""
    tokenizer = state.engine.tokenizer
    taken = sorted(_RESERVED_TEMPLATE_ARGS.intersection(template_kwargs))
    if taken:
        raise ApiError(
            400,
            f"chat_template_kwargs may not set {', '.join(taken)}: the request's own fields do.",
            param="chat_template_kwargs",
        )
    kwargs = dict(template_kwargs)
    if tools is not None:
        kwargs["tools"] = tools
    template = own_template if own_template is not None else state.chat.chat_template
    limit = state.limits.template_time_limit_s
    text = tokenizer.apply_chat_template(
        messages, add_generation_prompt, template, time_limit_s=limit, **kwargs
    )
    generation_prompt = ""
    if add_generation_prompt and state.chat.reasoning_parser is not None:
        bare = tokenizer.apply_chat_template(
            messages, False, template, time_limit_s=limit, **kwargs
        )
        generation_prompt = text[len(bare) :] if text.startswith(bare) else text
    return RenderedPrompt(text, generation_prompt)


def prepare_chat_prompt(
    state: ServerState, body: ChatCompletionRequest
) -> tuple[RenderedPrompt, list[int]]:
    """The prompt of ``body``'s messages and its token ids (slow for long inputs: never on
    the event loop)."""
    plan = plan_tools(state.chat, body)
    prompt = render_chat(
        state,
        template_messages(body.messages),
        body.add_generation_prompt,
        body.chat_template_kwargs or {},
        plan.template_tools,
        request_template(state, body.chat_template),
    )
    # The template writes the special tokens itself.
    ids = state.engine.inputs.encode_prompt(prompt.text, param="messages", add_special_tokens=False)
    return prompt, ids


async def create_chat_completion(
    state: ServerState, body: ChatCompletionRequest, request: Request | None = None
) -> Any:
    check_request(state, body)
    if body.top_logprobs is not None and not body.logprobs:
        raise ApiError(400, "top_logprobs requires logprobs=true.", param="top_logprobs")
    if body.prompt_logprobs is not None and body.stream:
        raise ApiError(
            400, "prompt_logprobs are not available with stream=true.", param="prompt_logprobs"
        )
    # Checked before anything runs (prepare_chat_prompt renders them).
    template_messages(body.messages)
    plan = plan_tools(state.chat, body)
    spec = structured_output_spec(body)
    if spec is not None and plan.grammar is not None:
        raise ApiError(
            400,
            "tool_choice required or a named function already fixes the output's format; "
            f"drop {spec.param}.",
            param=spec.param,
        )
    spec = spec or plan.grammar
    template_kwargs = body.chat_template_kwargs or {}
    request_template(state, body.chat_template)

    # A large body was prepared in a preparation process (preparer.py) before it got here,
    # and arrives without its messages.
    prepared = None if request is None else request.scope.get(PREPARED_SCOPE_KEY)
    if prepared is not None:
        prompt, prompt_ids = prepared
    else:
        prompt, prompt_ids = await state.preparer.run(lambda: prepare_chat_prompt(state, body))
    tokenizer = state.engine.tokenizer
    if spec is not None:
        await compile_grammar(state, spec)
    max_model_len = state.engine.max_model_len
    max_tokens = body.max_completion_tokens or body.max_tokens or max_model_len - len(prompt_ids)
    logprobs = (body.top_logprobs or 0) if body.logprobs else None
    jobs = [
        Job(
            index=c,
            prompt=prompt_ids,
            params=sampling_params(
                body, max_tokens, logprobs, c, body.prompt_logprobs, structured_output=spec
            ),
        )
        for c in range(body.n)
    ]
    thinking = bool(template_kwargs.get("enable_thinking", True))
    shape = _Shape(state, body, plan, prompt, thinking)
    request_id = new_id("chatcmpl")

    def complete(outputs: list[RequestOutput], created: int) -> dict[str, Any]:
        response: dict[str, Any] = {
            "id": request_id,
            "object": "chat.completion",
            "created": created,
            "model": state.served_model_name,
            "choices": [shape.choice(j.index, o) for j, o in zip(jobs, outputs, strict=True)],
            "usage": usage(len(prompt_ids), sum(len(o.token_ids) for o in outputs)),
        }
        if body.prompt_logprobs is not None:
            response["prompt_logprobs"] = prompt_logprobs_json(
                tokenizer, outputs[0].prompt_logprobs or []
            )
        return response

    stream = shape.stream(jobs) if body.stream else None
    return await respond(state, jobs, request_id, stream, complete, request)


class _Shape:
    """How one request's outputs become choices and chunks."""

    def __init__(
        self,
        state: ServerState,
        body: ChatCompletionRequest,
        plan: ToolPlan,
        prompt: RenderedPrompt,
        thinking: bool,
    ) -> None:
        self.state = state
        self.body = body
        self.plan = plan
        self.prompt = prompt
        self.thinking = thinking
        self.names = TokenNames(state.engine.tokenizer, body.return_tokens_as_token_ids)

    def reader(self) -> ChoiceReader:
        chat = self.state.chat
        reasoning = None
        if chat.reasoning_parser is not None:
            reasoning = reasoning_parser(
                chat.reasoning_parser, self.thinking, self.prompt.generation_prompt
            )
        parser = None
        if self.plan.mode == "parsed" and chat.tool_call_parser is not None:
            parser = tool_call_parser(chat.tool_call_parser)
        return ChoiceReader(reasoning, self.plan.mode, parser, self.plan.function_name)

    def _finish_reason(self, out: RequestOutput, reader: ChoiceReader) -> str | None:
        # As vLLM: calls the model chose to make finish with "tool_calls"; a named function
        # forced on it keeps the engine's reason.
        if reader.called_tools and (
            self.plan.mode == "parsed"
            or (self.plan.mode == "required" and out.finish_reason == "stop")
        ):
            return "tool_calls"
        return out.finish_reason

    def choice(self, index: int, out: RequestOutput) -> dict[str, Any]:
        reader = self.reader()
        whole = _merge(reader.feed(out.text), reader.finish())
        ids = _ToolCallIds()
        message: dict[str, Any] = {"role": "assistant"}
        has_more = bool(whole.tool_calls or whole.reasoning)
        message["content"] = whole.content if whole.content or not has_more else None
        if self.state.chat.reasoning_parser is not None:
            message.update(_reasoning_fields(whole.reasoning or None))
        if whole.tool_calls:
            message["tool_calls"] = [ids.full(index, call) for call in whole.tool_calls]
        logprobs = chat_logprobs(self.names, out.logprobs or []) if self.body.logprobs else None
        return {
            "index": index,
            "message": message,
            "logprobs": logprobs,
            "finish_reason": self._finish_reason(out, reader),
            "stop_reason": out.stop_reason,
        }

    def stream(self, jobs: list[Job]) -> StreamShape:
        readers = {job.index: self.reader() for job in jobs}
        ids = _ToolCallIds()

        def chunks(index: int, out: RequestOutput) -> list[dict[str, Any]]:
            reader = readers[index]
            delta = reader.feed(out.delta_text)
            if out.finished:
                delta = _merge(delta, reader.finish())
            logprobs = None
            if self.body.logprobs and out.new_logprobs:
                logprobs = chat_logprobs(self.names, out.new_logprobs)
            choices: list[dict[str, Any]] = []
            if delta or logprobs is not None:
                choices.append(
                    {
                        "index": index,
                        "delta": self._delta(index, delta, ids),
                        "logprobs": logprobs,
                        "finish_reason": None,
                    }
                )
            if out.finished:
                choices.append(
                    {
                        "index": index,
                        "delta": {},
                        "logprobs": None,
                        "finish_reason": self._finish_reason(out, reader),
                        "stop_reason": out.stop_reason,
                    }
                )
            return choices

        opening = [
            {
                "index": job.index,
                "delta": {"role": "assistant", "content": ""},
                "logprobs": None,
                "finish_reason": None,
            }
            for job in jobs
        ]
        body = self.body
        return StreamShape(
            obj="chat.completion.chunk",
            opening=opening,
            chunks=chunks,
            prompt_of=lambda index: 0,
            include_usage=body.stream_options is not None and body.stream_options.include_usage,
        )

    def _delta(self, index: int, delta: ChoiceDelta, ids: _ToolCallIds) -> dict[str, Any]:
        out: dict[str, Any] = {}
        if delta.reasoning:
            out.update(_reasoning_fields(delta.reasoning))
        if delta.content or not (delta.reasoning or delta.tool_calls):
            out["content"] = delta.content
        if delta.tool_calls:
            out["tool_calls"] = [ids.piece(index, call) for call in delta.tool_calls]
        return out


def _reasoning_fields(text: str | None) -> dict[str, Any]:
    # reasoning_content is what most clients read (DeepSeek's name, vLLM's until 0.11);
    # reasoning is newer vLLM's.
    return {"reasoning_content": text, "reasoning": text}


def _merge(first: ChoiceDelta, second: ChoiceDelta) -> ChoiceDelta:
    calls: dict[int, ToolCallDelta] = {}
    for call in first.tool_calls + second.tool_calls:
        if call.index in calls:
            calls[call.index].arguments += call.arguments
        else:
            calls[call.index] = ToolCallDelta(call.index, call.name, call.arguments)
    return ChoiceDelta(
        reasoning=first.reasoning + second.reasoning,
        content=first.content + second.content,
        tool_calls=list(calls.values()),
    )


class _ToolCallIds:
    """An id per call, made when the call's first piece goes out."""

    def __init__(self) -> None:
        self._ids: dict[tuple[int, int], str] = {}

    def _id(self, choice: int, call: int) -> str:
        return self._ids.setdefault((choice, call), f"chatcmpl-tool-{uuid.uuid4().hex}")

    def full(self, choice: int, call: ToolCallDelta) -> dict[str, Any]:
        return {
            "id": self._id(choice, call.index),
            "type": "function",
            "function": {"name": call.name, "arguments": call.arguments},
        }

    def piece(self, choice: int, call: ToolCallDelta) -> dict[str, Any]:
        if call.name is None:
            return {"index": call.index, "function": {"arguments": call.arguments}}
        return {"index": call.index, **self.full(choice, call)}
