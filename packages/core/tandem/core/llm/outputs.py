"""What the engine reports per request after each step."""

from __future__ import annotations

from dataclasses import dataclass, field

from tandem.core.llm.sequence import RequestMetrics, TokenLogprobs


@dataclass
class RequestOutput:
    request_id: str
    prompt_token_ids: list[int]
    # Everything generated so far (the text stops before a matched stop string).
    token_ids: list[int]
    text: str
    # What this step added; a streaming client sends exactly these.
    new_token_ids: list[int]
    delta_text: str
    finished: bool
    finish_reason: str | None = None  # "stop", "length", "abort" or "error"
    # The stop string or stop token id that ended the request, if any.
    stop_reason: str | int | None = None
    error: str | None = None
    # Set when the error is the client's input (a request field the engine could not serve):
    # the field's name, for a 400 instead of a 500.
    error_param: str | None = None
    logprobs: list[TokenLogprobs] | None = None
    new_logprobs: list[TokenLogprobs] = field(default_factory=list)
    # One per prompt token (the first None), once the prompt is computed, when asked for.
    prompt_logprobs: list[TokenLogprobs | None] | None = None
    num_cached_tokens: int = 0
    metrics: RequestMetrics | None = None
