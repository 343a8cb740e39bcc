"""Requests in: validated, tokenized and checked against the model's limits, made into the
``TokenSequence`` the engine schedules, without touching engine state (any thread).

``PromptEncoder`` is the part that needs the tokenizer alone, so that a preparation process
with its own tokenizer encodes and refuses prompts as the engine does.
"""

from __future__ import annotations

import itertools
import re
import unicodedata
from collections.abc import Callable
from dataclasses import dataclass

from tandem.core.config import SchedulerConfig
from tandem.core.errors import InvalidRequestError
from tandem.core.kv.block_manager import BlockManager
from tandem.core.llm.sampling_params import SamplingParams
from tandem.core.llm.sequence import TokenSequence
from tandem.core.llm.structured_output import StructuredOutputs
from tandem.core.llm.tokenizer import Tokenizer
from tandem.core.models.model_config import ModelConfig

Prompt = str | list[int]

# Where a prefix may be cut: a space after a non-space character (found in the reversed text).
_CUT = re.compile(r" \S")


@dataclass(frozen=True)
class TokenBudget:
    """At most ``limit`` tokens; ``refuse(what)`` is the error for a text of ``what`` tokens
    (``"at least N tokens"`` when only a prefix was counted)."""

    limit: int
    refuse: Callable[[str], Exception]


def eos_token_ids(model_config: ModelConfig, tokenizer: Tokenizer) -> frozenset[int]:
    """The model's end-of-sequence tokens and the tokenizer's."""
    eos = set(model_config.eos_token_ids)
    if tokenizer.eos_token_id is not None:
        eos.add(tokenizer.eos_token_id)
    return frozenset(eos)


class PromptEncoder:
    def __init__(self, tokenizer: Tokenizer, max_model_len: int) -> None:
        self.tokenizer = tokenizer
        self.max_model_len = max_model_len

    # A text longer than this many UTF-8 bytes per token of its limit is counted by a prefix
    # first. Prose and code average 3-5 bytes per token, and so does CJK (a character of 3
    # bytes, 1-2 characters a token), so a text that fits the limit almost never pays for the
    # prefix, while a text many times too long is refused after tokenizing about twice what
    # the largest admitted text costs. Characters would give CJK a prefix 3x as costly.
    prefix_bytes_per_token = 8

    def encode_prompt(
        self,
        text: str,
        param: str = "prompt",
        add_special_tokens: bool = True,
        check_length: bool = True,
        budget: TokenBudget | None = None,
    ) -> list[int]:
        """``text``'s token ids, after a length check: a text too long for the context by
        its size alone is refused before it is tokenized (which would take seconds and
        hundreds of MB for megabytes of text); so are its tokens, with ``check_length``, or
        more tokens than ``budget`` (a large text is refused by a prefix's tokens then)."""
        # Normalization may shrink text (NFC composes characters, at most ~3x): the slack
        # keeps the bound from refusing a text that would fit.
        limit = 4 * self.tokenizer.max_token_bytes * self.max_model_len
        try:
            data = text.encode("utf-8")
        except UnicodeEncodeError:
            raise InvalidRequestError(
                f"the {param} is not valid Unicode (it holds a lone surrogate)", param=param
            ) from None
        if len(data) > limit:
            raise InvalidRequestError(
                f"the {param} is {len(data)} bytes long, too long for this model's maximum context "
                f"length of {self.max_model_len} tokens; shorten the {param}",
                param=param,
            )
        if check_length:
            budget = TokenBudget(self.max_model_len - 1, lambda what: self._too_long(what, param))
        ids = self._encode_within(text, data, add_special_tokens, budget)
        if check_length:
            self.check_prompt_length(len(ids), param)
        return ids

    def _encode_within(
        self, text: str, data: bytes, add_special_tokens: bool, budget: TokenBudget | None
    ) -> list[int]:
        """The whole text's ids (``data``: its UTF-8), unless a prefix of it already has more
        than ``budget``'s tokens (a prefix 4x larger each time, so at most ~1.3x the work of
        the last one).

        Why a prefix's count proves the text too long: the prefix ends just before a space
        that follows a non-space character. Every pre-tokenizer that splits on spaces (the
        byte-level regexes of GPT-2, Llama 3 and Qwen; SentencePiece's Metaspace; BERT's and
        the Whitespace ones) splits there, the normalizers in use act on single characters
        or the text's ends, special tokens are added alike to both, and each pre-token is
        encoded on its own: the prefix has exactly as many tokens as that part of the whole.

        Otherwise the cut falls inside a pre-token: always for a tokenizer without that split
        (Llama 2's SentencePiece BPE, whose pieces may span a space), and for a text with no
        such space in the prefix's second half (digits, CJK, a run of punctuation: one
        pre-token to GPT-2's regex), cut then before a character that starts a combining
        sequence, so that normalization (NFC reorders and composes within one) treats both
        sides alike. A regex looks at most a character past its match, so only the
        pre-token at the cut is encoded differently, and within it BPE merges in rank
        order: the cut takes away the merges reaching past it, and the whole text's token
        across the cut covers at most max_token_bytes bytes, which the prefix encodes as at
        most one token per byte. A taken-away merge frees its left part for another merge,
        and the change spreads further left only through a chain of merges, each freed by the
        one before and ranked after it; trained vocabularies hold such chains of a few
        tokens (at most 4 extra tokens over any cut of digits, CJK, punctuation or unspaced
        words with the test tokenizers). The margin of twice max_token_bytes covers both and
        is small next to any real limit: a refusal is wrong only for a vocabulary built to
        hold a longer chain."""
        if budget is None:
            return self.tokenizer.encode(text, add_special_tokens=add_special_tokens)
        margin = 2 * self.tokenizer.max_token_bytes
        most = budget.limit + margin
        size = self.prefix_bytes_per_token * most
        while size < len(data):
            # The characters whole within ``size`` bytes: fewer than the text's.
            chars = len(data[:size].decode("utf-8", "ignore"))
            count = len(
                self.tokenizer.encode(
                    text[: _cut(text, chars)], add_special_tokens=add_special_tokens
                )
            )
            if count > most:
                raise budget.refuse(f"at least {count - margin} tokens")
            size *= 4
        return self.tokenizer.encode(text, add_special_tokens=add_special_tokens)

    def check_prompt_length(self, num_tokens: int, param: str = "prompt") -> None:
        """InvalidRequestError unless a prompt of ``num_tokens`` leaves room for at least one
        generated token; ``param`` names the request field the prompt came from."""
        if num_tokens >= self.max_model_len:
            raise self._too_long(f"{num_tokens} tokens", param)

    def _too_long(self, what: str, param: str) -> InvalidRequestError:
        return InvalidRequestError(
            f"{what} of {param}, but this model's maximum context length is "
            f"{self.max_model_len} tokens (prompt plus at least one generated token); "
            f"shorten the {param}",
            param=param,
        )


def _cut(text: str, size: int) -> int:
    """Where a prefix of about ``size`` characters of ``text`` (which is longer) ends: before
    the last space after a non-space in its second half, else before the last character in
    it that starts a combining sequence, else at ``size`` (see ``_encode_within``)."""
    found = _CUT.search(text[size // 2 : size][::-1])
    if found is not None:
        return size - 1 - found.start()
    # Marks attach to the character before them; a text of nothing but marks is cut anyway.
    for end in range(size, size // 2, -1):
        if unicodedata.combining(text[end]) == 0:
            return end
    return size


class InputProcessor(PromptEncoder):
    def __init__(
        self,
        tokenizer: Tokenizer,
        max_model_len: int,
        vocab_size: int,
        eos_token_ids: frozenset[int],
        block_manager: BlockManager,
        scheduler_config: SchedulerConfig,
        structured_outputs: StructuredOutputs,
    ) -> None:
        super().__init__(tokenizer, max_model_len)
        self.vocab_size = vocab_size
        self.eos_token_ids = eos_token_ids
        self._blocks = block_manager
        self._scheduler_config = scheduler_config
        self._structured_outputs = structured_outputs
        self._ids = itertools.count()

    def prepare(
        self, request_id: str | None, prompt: Prompt, params: SamplingParams
    ) -> TokenSequence:
        """Validate and tokenize a request (any thread)."""
        params.validate()
        request_id = request_id if request_id is not None else f"req-{next(self._ids)}"
        if isinstance(prompt, str):
            prompt_ids = self.encode_prompt(prompt)
        else:
            prompt_ids = list(prompt)
            # Length first: it is cheap, the token check below is not for huge lists.
            self.check_prompt_length(len(prompt_ids))
            vocab = self.vocab_size
            bad = [t for t in prompt_ids if not isinstance(t, int) or not 0 <= t < vocab]
            if bad:
                raise InvalidRequestError(
                    f"prompt token ids must be integers in [0, {vocab}); got {bad[:5]}",
                    param="prompt",
                )
        if not prompt_ids:
            raise InvalidRequestError("the prompt is empty", param="prompt")
        self._check_token_ids(params)
        self.check_prompt_length(len(prompt_ids))
        self._check_fits(len(prompt_ids), params.max_tokens)
        spec = params.structured_output
        return TokenSequence(
            request_id=request_id,
            prompt_token_ids=prompt_ids,
            params=params,
            eos_token_ids=self.eos_token_ids,
            max_total_tokens=self.max_model_len,
            # Compiled already when the caller awaited structured_outputs.submit(spec).
            grammar=None if spec is None else self._structured_outputs.new_grammar(spec),
        )

    def _check_token_ids(self, params: SamplingParams) -> None:
        vocab = self.vocab_size
        for name, ids in (
            ("logit_bias", params.logit_bias),
            ("stop_token_ids", params.stop_token_ids),
        ):
            bad = [t for t in ids if t >= vocab]
            if bad:
                raise InvalidRequestError(
                    f"{name} names token ids outside the vocabulary [0, {vocab}): {bad[:5]}",
                    param=name,
                )

    def _check_fits(self, prompt_len: int, max_tokens: int) -> None:
        """Refuse a request that could never run: more KV than the whole cache, or a prompt
        no batch can hold without chunked prefill."""
        total = min(prompt_len + max_tokens, self.max_model_len)
        blocks = self._blocks
        # The last sampled token is never fed back, so its KV is never stored.
        if blocks.blocks_for(total - 1) > blocks.num_blocks:
            capacity = blocks.num_blocks * blocks.block_size
            raise InvalidRequestError(
                f"the request needs {total} tokens of KV cache (prompt {prompt_len} + "
                f"max_tokens {max_tokens}), more than the whole cache holds "
                f"({capacity} tokens); lower max_tokens or give the cache more memory",
                param="max_tokens",
            )
        sched = self._scheduler_config
        if not sched.enable_chunked_prefill and prompt_len > sched.max_tokens_per_batch:
            raise InvalidRequestError(
                f"the prompt has {prompt_len} tokens, more than max_tokens_per_batch "
                f"({sched.max_tokens_per_batch}) without chunked prefill; enable chunked "
                "prefill or raise --max-tokens-per-batch",
                param="prompt",
            )
