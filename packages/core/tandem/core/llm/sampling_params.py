"""Per-request sampling parameters, validated when the request arrives."""

from __future__ import annotations

from dataclasses import dataclass, field

from tandem.core.errors import InvalidRequestError

# How many top logprobs a request may ask for; the sampler computes the largest asked.
MAX_LOGPROBS = 20


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
