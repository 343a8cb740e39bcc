"""Per-request sampling parameters, validated when the request arrives."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from tandem.core.errors import InvalidRequestError
from tandem.core.llm.structured_output_spec import StructuredOutputSpec

# How many top logprobs a request may ask for; the sampler computes the largest asked.
MAX_LOGPROBS = 20
# OpenAI's bound on logit_bias values.
MAX_LOGIT_BIAS = 100.0
# Beyond this a penalty only erases every seen token; bounded so a typo is caught.
MAX_REPETITION_PENALTY = 100.0
# Bound of integer fields (token counts, top_k, token ids): well inside int64 tensors.
MAX_INT = 2**31 - 1
# Temperatures below this sample greedily: dividing logits by less overflows float32 (vLLM's
# threshold too).
GREEDY_BELOW = 1e-5


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
    # Parameters of logits-processor plugins, by the request field each declares
    # (``LogitsProcessor.extra_params``); each processor checks its own.
    extra: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.validate()

    @classmethod
    def greedy(cls, max_tokens: int = 16, **kwargs: object) -> SamplingParams:
        return cls(max_tokens=max_tokens, temperature=0.0, **kwargs)  # type: ignore[arg-type]

    @property
    def is_greedy(self) -> bool:
        return self.temperature < GREEDY_BELOW

    @property
    def has_penalties(self) -> bool:
        return (
            self.presence_penalty != 0.0
            or self.frequency_penalty != 0.0
            or self.repetition_penalty != 1.0
        )

    def validate(self) -> None:
        """InvalidRequestError, naming the field, for any value out of range: every value
        must also fit the tensors the step is built from (int64, float32)."""
        check_int("max_tokens", self.max_tokens, low=1, high=MAX_INT)
        check_float("temperature", self.temperature, low=0.0, high=100.0)
        check_float("top_p", self.top_p, low=0.0, high=1.0)
        if self.top_p == 0.0:
            raise InvalidRequestError(f"top_p must be in (0, 1], got {self.top_p}", param="top_p")
        # -1 and 0 both disable the cut.
        check_int("top_k", self.top_k, low=-1, high=MAX_INT)
        if self.seed is not None:
            check_int("seed", self.seed, low=0, high=2**63 - 1)
        if any(not isinstance(s, str) or not s for s in self.stop):
            raise InvalidRequestError("stop must hold non-empty strings", param="stop")
        for token in self.stop_token_ids:
            check_int("stop_token_ids", token, low=0, high=MAX_INT)
        if self.logprobs is not None:
            check_int("logprobs", self.logprobs, low=0, high=MAX_LOGPROBS)
        if self.prompt_logprobs is not None:
            check_int("prompt_logprobs", self.prompt_logprobs, low=0, high=MAX_LOGPROBS)
        check_int("min_tokens", self.min_tokens, low=0, high=MAX_INT)
        self._validate_logit_processing()
        # Here, not at the top: the processors' module reads SamplingParams.
        from tandem.core.llm.logits_processors import validate_params

        validate_params(self)

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
            if not isinstance(token, int) or not 0 <= token <= MAX_INT:
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


def check_int(name: str, value: object, low: int, high: int) -> None:
    """InvalidRequestError naming ``name`` unless ``value`` is an int in [low, high]."""
    if not isinstance(value, int) or isinstance(value, bool):
        raise InvalidRequestError(f"{name} must be an integer, got {value!r}", param=name)
    if low == 1 and value < 1:
        raise InvalidRequestError(f"{name} must be at least 1, got {value}", param=name)
    if not low <= value <= high:
        raise InvalidRequestError(f"{name} must be in [{low}, {high}], got {value}", param=name)


def check_float(name: str, value: object, low: float, high: float) -> None:
    """InvalidRequestError naming ``name`` unless ``value`` is a number in [low, high]."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise InvalidRequestError(f"{name} must be a number, got {value!r}", param=name)
    if not low <= value <= high:  # NaN fails this too
        raise InvalidRequestError(f"{name} must be in [{low:g}, {high:g}], got {value}", param=name)
