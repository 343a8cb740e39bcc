"""Logprobs in the shapes the APIs return them: the completions API's parallel lists, the
chat API's per-token objects, and vLLM's prompt_logprobs (token id -> logprob, rank, text)."""

from __future__ import annotations

from typing import Any

from tandem.core.llm.sequence import TokenLogprobs
from tandem.core.llm.tokenizer import Tokenizer


class TokenNames:
    """How tokens are named in logprobs: their text, or ``token_id:N`` when a client asks
    (vLLM's return_tokens_as_token_ids: tokens whose text is not valid UTF-8 stay apart)."""

    def __init__(self, tokenizer: Tokenizer, as_ids: bool) -> None:
        self.tokenizer = tokenizer
        self.as_ids = as_ids

    def __call__(self, token_id: int) -> str:
        return f"token_id:{token_id}" if self.as_ids else self.tokenizer.token_text(token_id)


def legacy_logprobs(
    names: TokenNames, entries: list[tuple[int, TokenLogprobs | None]], text_offset: int
) -> dict[str, Any]:
    """The completions API's logprobs object for (token id, its logprobs) pairs (None for a
    token with nothing before it, the prompt's first), offsets counted from ``text_offset``."""
    tokens: list[str] = []
    token_logprobs: list[float | None] = []
    tops: list[dict[str, float] | None] = []
    offsets: list[int] = []
    offset = text_offset
    for token_id, entry in entries:
        text = names(token_id)
        tokens.append(text)
        offsets.append(offset)
        offset += len(text)
        if entry is None:
            token_logprobs.append(None)
            tops.append(None)
            continue
        token_logprobs.append(entry.logprob)
        top = {names(t): lp for t, lp in entry.top}
        top.setdefault(text, entry.logprob)
        tops.append(top)
    return {
        "tokens": tokens,
        "token_logprobs": token_logprobs,
        "top_logprobs": tops,
        "text_offset": offsets,
    }


def generated(entries: list[TokenLogprobs]) -> list[tuple[int, TokenLogprobs | None]]:
    return [(e.token_id, e) for e in entries]


def chat_logprobs(names: TokenNames, entries: list[TokenLogprobs]) -> dict[str, Any]:
    def entry(token_id: int, logprob: float) -> dict[str, Any]:
        # The token's own bytes: a token holding part of a character has no text of its own.
        raw = list(names.tokenizer.token_bytes(token_id))
        return {"token": names(token_id), "logprob": logprob, "bytes": raw}

    return {
        "content": [
            {**entry(e.token_id, e.logprob), "top_logprobs": [entry(t, lp) for t, lp in e.top]}
            for e in entries
        ]
    }


def prompt_logprobs_json(
    tokenizer: Tokenizer, entries: list[TokenLogprobs | None]
) -> list[dict[str, dict[str, Any]] | None]:
    """vLLM's prompt_logprobs: per prompt token, None for the first, else the token itself
    and the top candidates, each ``{"logprob", "rank", "decoded_token"}`` by token id."""
    out: list[dict[str, dict[str, Any]] | None] = []
    for entry in entries:
        if entry is None:
            out.append(None)
            continue
        scored: dict[str, dict[str, Any]] = {}
        for rank, (token, logprob) in enumerate(entry.top, start=1):
            scored[str(token)] = _scored(tokenizer, token, logprob, rank)
        scored.setdefault(
            str(entry.token_id), _scored(tokenizer, entry.token_id, entry.logprob, entry.rank)
        )
        out.append(scored)
    return out


def _scored(tokenizer: Tokenizer, token: int, logprob: float, rank: int | None) -> dict[str, Any]:
    return {"logprob": logprob, "rank": rank, "decoded_token": tokenizer.token_text(token)}
