"""Per-request sampling parameters, validated when the request arrives."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from tandem.core.errors import InvalidRequestError
from tandem.core.llm.structured_output_spec import StructuredOutputSpec

# How many top logprobs a request may ask for; the sampler computes the largest asked.
MAX_LOGPROBS = 20
# OpenAI's bound on logit_bias values.
MAX_LOGIT_BIAS = 100.0
# Beyond this a penalty only erases every seen token; bounded so a typo is caught.
MAX_REPETITION_PENALTY = 100.0


@dataclass
class SamplingParams:
    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    # 0 or -1: no top-k cut.
    top_k: int = 0
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    # Number of top logprobs to return per generated token (None: no logprobs).
    logprobs: int | None = None
    # Number of top logprobs to return per prompt token (None: none; the first token has none).
    prompt_logprobs: int | None = None
    # OpenAI's penalties over the generated tokens, as vLLM applies them: the logit of a token
    # generated c times drops by frequency_penalty * c + presence_penalty * (c > 0).
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    # transformers' / vLLM's: logits of tokens seen in the prompt or the output are divided by
    # it when positive and multiplied when negative. 1 = off.
    repetition_penalty: float = 1.0
    # Drop tokens whose probability is below min_p times the most likely one's (0 = off).
    min_p: float = 0.0
    # EOS and stop_token_ids cannot end the output before this many tokens (nor stop strings).
    min_tokens: int = 0
    # Token id -> value added to its logit before sampling.
    logit_bias: dict[int, float] = field(default_factory=dict)
    include_stop_str_in_output: bool = False
    # A grammar the output must follow (JSON schema, regex, choice, ...).
    structured_output: StructuredOutputSpec | None = None

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.validate()

    @classmethod
    def greedy(cls, max_tokens: int = 16, **kwargs: object) -> SamplingParams:
        return cls(max_tokens=max_tokens, temperature=0.0, **kwargs)  # type: ignore[arg-type]

    @property
    def is_greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def has_penalties(self) -> bool:
        return (
            self.presence_penalty != 0.0
            or self.frequency_penalty != 0.0
            or self.repetition_penalty != 1.0
        )

    def validate(self) -> None:
        if not isinstance(self.max_tokens, int) or isinstance(self.max_tokens, bool):
            raise InvalidRequestError("max_tokens must be an integer", param="max_tokens")
        if self.max_tokens < 1:
            raise InvalidRequestError(
                f"max_tokens must be at least 1, got {self.max_tokens}", param="max_tokens"
            )
        if not 0.0 <= self.temperature <= 100.0 or self.temperature != self.temperature:
            raise InvalidRequestError(
                f"temperature must be in [0, 100], got {self.temperature}", param="temperature"
            )
        if not 0.0 < self.top_p <= 1.0:
            raise InvalidRequestError(f"top_p must be in (0, 1], got {self.top_p}", param="top_p")
        if self.top_k < -1:
            raise InvalidRequestError(
                f"top_k must be -1, 0 (disabled) or positive, got {self.top_k}", param="top_k"
            )
        if self.seed is not None and not 0 <= self.seed < 2**63:
            raise InvalidRequestError(f"seed must be in [0, 2**63), got {self.seed}", param="seed")
        if any(not isinstance(s, str) or not s for s in self.stop):
            raise InvalidRequestError("stop must hold non-empty strings", param="stop")
        if any(not isinstance(t, int) or t < 0 for t in self.stop_token_ids):
            raise InvalidRequestError(
                "stop_token_ids must hold non-negative integers", param="stop_token_ids"
            )
        if self.logprobs is not None and not 0 <= self.logprobs <= MAX_LOGPROBS:
            raise InvalidRequestError(
                f"logprobs must be in [0, {MAX_LOGPROBS}], got {self.logprobs}", param="logprobs"
            )
        if self.prompt_logprobs is not None and not 0 <= self.prompt_logprobs <= MAX_LOGPROBS:
            raise InvalidRequestError(
                f"prompt_logprobs must be in [0, {MAX_LOGPROBS}], got {self.prompt_logprobs}",
                param="prompt_logprobs",
            )
        self._validate_logit_processing()

    def _validate_logit_processing(self) -> None:
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if not (math.isfinite(value) and -2.0 <= value <= 2.0):
                raise InvalidRequestError(f"{name} must be in [-2, 2], got {value}", param=name)
        rp = self.repetition_penalty
        if not (math.isfinite(rp) and 0.0 < rp <= MAX_REPETITION_PENALTY):
            raise InvalidRequestError(
                f"repetition_penalty must be in (0, {MAX_REPETITION_PENALTY:g}], got {rp}",
                param="repetition_penalty",
            )
        if not 0.0 <= self.min_p <= 1.0:
            raise InvalidRequestError(f"min_p must be in [0, 1], got {self.min_p}", param="min_p")
        if not 0 <= self.min_tokens <= self.max_tokens:
            raise InvalidRequestError(
                f"min_tokens must be in [0, max_tokens={self.max_tokens}], got {self.min_tokens}",
                param="min_tokens",
            )
        for token, bias in self.logit_bias.items():
            if not isinstance(token, int) or token < 0:
                raise InvalidRequestError(
                    f"logit_bias keys must be token ids (non-negative integers), got {token!r}",
                    param="logit_bias",
                )
            if not (math.isfinite(bias) and -MAX_LOGIT_BIAS <= bias <= MAX_LOGIT_BIAS):
                raise InvalidRequestError(
                    f"logit_bias values must be in [-{MAX_LOGIT_BIAS:g}, {MAX_LOGIT_BIAS:g}], "
                    f"got {bias} for token {token}",
                    param="logit_bias",
                )
