"""Running a request's choices on the engine: sampling parameters from the request, and the
merged stream of outputs of several choices, with metrics and aborts handled in one place."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncGenerator, Iterable
from dataclasses import dataclass, fields
from typing import Any

from tandem.core import RequestOutput, SamplingParams
from tandem.core.llm.engine_loop import RequestStream
from tandem.core.llm.input_processor import Prompt
from tandem.core.llm.logits_processors import processor_classes
from tandem.core.llm.sequence import TokenSequence
from tandem.core.llm.structured_output_spec import StructuredOutputSpec
from tandem.server.deadline import RequestTimedOut
from tandem.server.errors import ApiError
from tandem.server.protocol import _SamplingFields
from tandem.server.state import ServerState


def sampling_params(
    body: _SamplingFields,
    max_tokens: int,
    logprobs: int | None,
    choice: int,
    prompt_logprobs: int | None = None,
    structured_output: StructuredOutputSpec | None = None,
) -> SamplingParams:
    stop = [body.stop] if isinstance(body.stop, str) else list(body.stop or [])
    mapped: dict[str, Any] = dict(
        max_tokens=max_tokens,
        temperature=1.0 if body.temperature is None else float(body.temperature),
        top_p=1.0 if body.top_p is None else float(body.top_p),
        top_k=body.top_k or 0,
        # Each of n choices needs its own stream of randomness, still reproducible.
        seed=None if body.seed is None else (body.seed + choice) % (2**63),
        stop=stop,
        stop_token_ids=list(body.stop_token_ids or []),
        logprobs=logprobs,
        prompt_logprobs=prompt_logprobs,
        presence_penalty=float(body.presence_penalty or 0.0),
        frequency_penalty=float(body.frequency_penalty or 0.0),
        repetition_penalty=float(body.repetition_penalty or 1.0),
        min_p=float(body.min_p or 0.0),
        logit_bias=logit_bias(body),
        structured_output=structured_output,
        extra=plugin_params(body),
    )
    return SamplingParams(**mapped, **passed_through(body, exclude=mapped.keys()))


# SamplingParams' fields, for the request fields that pass through under the same name.
_PARAMS_FIELDS = frozenset(f.name for f in fields(SamplingParams))


def passed_through(body: _SamplingFields, exclude: Iterable[str]) -> dict[str, Any]:
    """The request fields named like a SamplingParams field that need no conversion (``ignore_eos``,
    ``min_tokens``, ...), as the client set them: a new sampling parameter is its protocol
    field, its SamplingParams field and its logits processor, with no line here."""
    names = (type(body).model_fields.keys() & _PARAMS_FIELDS) - set(exclude)
    values = {name: getattr(body, name) for name in names}
    return {name: value for name, value in values.items() if value is not None}


def plugin_params(body: _SamplingFields) -> dict[str, Any]:
    """The request fields that installed logits-processor plugins declare (each checks its
    own value when SamplingParams is made: an InvalidRequestError, a 400)."""
    extra = body.model_extra
    if not extra:
        return {}
    declared = {name for cls in processor_classes() for name in cls.extra_params}
    return {name: value for name, value in extra.items() if name in declared}


def logit_bias(body: _SamplingFields) -> dict[int, float]:
    """OpenAI's logit_bias (token ids as JSON object keys, so strings) as ids -> bias."""
    out: dict[int, float] = {}
    for key, value in (body.logit_bias or {}).items():
        try:
            token = int(key)
        except ValueError:
            raise ApiError(
                400, f"logit_bias keys must be token ids, got {key!r}.", param="logit_bias"
            ) from None
        out[token] = float(value)
    return out


@dataclass
class Job:
    index: int
    prompt: Prompt
    params: SamplingParams


async def submit_jobs(state: ServerState, jobs: list[Job], request_id: str) -> list[RequestStream]:
    """Queue every job now, so a bad one fails the whole request before any response starts.
    Tokenizing and checking them runs off the event loop."""
    engine = state.async_engine

    def prepare() -> list[TokenSequence]:
        return [
            engine.engine.inputs.prepare(f"{request_id}-{job.index}", job.prompt, job.params)
            for job in jobs
        ]

    prepared = await state.preparer.run(prepare)
    # All choices or none: a request is admitted (or refused as overloaded) whole.
    return engine.enqueue_together(prepared)


async def final_outputs(
    state: ServerState, jobs: list[Job], streams: list[RequestStream], deadline: float | None
) -> list[RequestOutput]:
    """Each job's last output, in job order."""
    finals: dict[int, RequestOutput] = {}
    async for index, out in merge_outputs(state, jobs, streams, deadline):
        if out.finished:
            finals[index] = out
    return [finals[job.index] for job in jobs]


async def merge_outputs(
    state: ServerState, jobs: list[Job], streams: list[RequestStream], deadline: float | None
) -> AsyncGenerator[tuple[int, RequestOutput], None]:
    """Outputs of all jobs as they come, tagged with the job's index, with metrics recorded.
    Leaving early (the client went away) aborts every unfinished job; so does passing
    ``deadline`` (event-loop time), which raises RequestTimedOut."""
    queue: asyncio.Queue[tuple[int, RequestOutput | None]] = asyncio.Queue()

    async def pump(index: int, stream: RequestStream) -> None:
        async for out in stream:
            await queue.put((index, out))
        await queue.put((index, None))

    async def next_of_one() -> tuple[int, RequestOutput | None]:
        # One job (n = 1, the usual case): read its stream directly, without a pump task
        # and a second queue between the engine's output and the response (each a task
        # switch per token on the event loop, which shares the GIL with the engine).
        try:
            return jobs[0].index, await streams[0].__anext__()
        except StopAsyncIteration:
            return jobs[0].index, None

    async def next_of_many() -> tuple[int, RequestOutput | None]:
        return await queue.get()

    single = len(jobs) == 1
    tasks = (
        []
        if single
        else [
            asyncio.create_task(pump(job.index, stream))
            for job, stream in zip(jobs, streams, strict=True)
        ]
    )
    get_next = next_of_one if single else next_of_many
    last_token_time: dict[int, float] = {}
    try:
        remaining = len(jobs)
        aio = asyncio.get_running_loop()
        while remaining:
            if deadline is None:
                index, out = await get_next()
            else:
                try:
                    index, out = await asyncio.wait_for(get_next(), deadline - aio.time())
                except asyncio.TimeoutError:
                    limit = state.limits.request_timeout_s
                    raise RequestTimedOut(limit or 0.0) from None
            if out is None:
                remaining -= 1
                continue
            now = time.monotonic()
            if out.new_token_ids:
                if index in last_token_time:
                    state.metrics.observe_inter_token(now - last_token_time[index])
                last_token_time[index] = now
            yield index, out
    finally:
        for task in tasks:
            task.cancel()
        for stream in streams:
            stream.close()
