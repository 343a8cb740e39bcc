"""Batched sampling: a grammar's mask and the logits processors (min_tokens, logit_bias,
penalties, min_p, plugins: ``logits_processors.py``), greedy, temperature, top-k, top-p and
per-request seeds.

Random rows are drawn by inverting their cumulative distribution with one uniform number a
row: the first token whose cumulative probability exceeds u * total. That draws from p as
exactly as float32 sums of it can say (no token's share moves by more than ~1e-7 of its
block's) in one pass over the vocabulary, where the exponential race (argmax of p / E,
E ~ Exp(1)) needs a random number per token: drawn by one CPU generator on one thread, 17 ms
a step at 48 rows of a 16K vocabulary. The sums are taken in two levels (blocks of the
vocabulary, then the tokens of the one block the number falls in), since a running sum over
the whole vocabulary is a chain of dependent adds: 0.3 ms against 4.3 ms for torch.cumsum
(measured, 2 threads). A seeded row draws its number from a generator keyed by (seed, step),
so its tokens do not depend on which other requests share the batch, nor on preemption.
"""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import torch
import torch.nn.functional as F

from tandem.core.llm.forward_input import DraftRows, SamplerOutput, SamplingBatch
from tandem.core.llm.logits_processor import LogitsProcessor, StepRows
from tandem.core.llm.logits_processors import (
    LogitsProcessors,
    apply_grammar_masks,
    needs_after_temperature,
    needs_pre_temperature,
)
from tandem.core.llm.processor_failures import ProcessorFailed
from tandem.core.llm.rejection_sampler import Verified, draft_per_position, verify

_SEED_MIX = 0x9E3779B97F4A7C15
_CDF_BLOCK = 128
# Candidate widths tried before a full sort (see apply_top_k_top_p).
_CUT_CANDIDATES = (1024, 8192)


def _row_generator(seed: int, step: int) -> torch.Generator:
    g = torch.Generator()
    g.manual_seed((seed * 1_000_003 + step * _SEED_MIX) % (2**63))
    return g


def apply_top_k_top_p(
    logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor
) -> torch.Tensor:
    """Set logits outside each row's top-k / nucleus to -inf.

    A full sort of the vocabulary is what the cut needs in general, and on CPU it is slow
    (48 rows: 26 ms at 16K tokens, 290 ms at 152K). The cut is first looked for among each
    row's largest logits (topk of 1024: 4 / 14 ms; of 8192: 40 ms at 152K): a row whose
    top-k is within them, or without top-k whose nucleus is (their probability reaches
    top_p), is decided there; only rows that no candidate width decides are sorted. Rows
    with neither filter are left as they are."""
    vocab = logits.shape[-1]
    out = torch.empty_like(logits)
    untouched = ((top_k <= 0) | (top_k >= vocab)) & (top_p >= 1.0)
    if bool(untouched.any()):
        out[untouched] = logits[untouched]
    rest = ~untouched
    for width in _CUT_CANDIDATES:
        if not bool(rest.any()) or width >= vocab:
            break
        cut, decided = _cut_among_largest(logits[rest], top_k[rest], top_p[rest], width)
        rows = rest.nonzero().squeeze(1)
        out[rows[decided]] = cut[decided]
        rest[rows[decided]] = False
    if bool(rest.any()):
        out[rest] = top_k_top_p_by_sort(logits[rest], top_k[rest], top_p[rest])
    return out


def _cut_among_largest(
    logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor, width: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """The cut as decided among each row's ``width`` largest logits, and which rows it
    decides (their top-k, or their nucleus, lies within those)."""
    vocab = logits.shape[-1]
    k = torch.where(top_k > 0, top_k.clamp(max=vocab), torch.full_like(top_k, vocab))
    values, order = logits.topk(width, dim=-1)
    drop = torch.arange(width, device=logits.device).unsqueeze(0) >= k.unsqueeze(1)
    within = k <= width
    # Probabilities after the top-k cut: normalized over the kept candidates when top-k
    # falls among them, over the whole row when there is no top-k; a top-k past the
    # candidates normalizes over tokens they do not hold, so such a row is not decided here.
    kept_norm = values.masked_fill(drop, float("-inf")).logsumexp(dim=-1)
    norm = torch.where(within, kept_norm, logits.logsumexp(dim=-1))
    probs = (values - norm.unsqueeze(1)).exp().masked_fill(drop, 0.0)
    mass = probs.cumsum(dim=-1)
    # Keep a token while the mass before it is below top_p; the first token always stays
    # (a top_p below float32's smallest normal rounds to 0, which would drop every token).
    drop |= (mass - probs) >= top_p.unsqueeze(1)
    drop[:, 0] = False
    out = torch.full_like(logits, float("-inf"))
    out.scatter_(-1, order, values.masked_fill(drop, float("-inf")))
    return out, within | ((k >= vocab) & (mass[:, -1] >= top_p))


def top_k_top_p_by_sort(
    logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor
) -> torch.Tensor:
    """``apply_top_k_top_p`` over a full sort of each row: the rows the candidates cannot
    decide, and the reference the faster path is tested against."""
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    vocab = logits.shape[-1]
    k = torch.where(top_k > 0, top_k.clamp(max=vocab), torch.full_like(top_k, vocab))
    ranks = torch.arange(vocab, device=logits.device).unsqueeze(0)
    drop = ranks >= k.unsqueeze(1)
    probs = sorted_logits.masked_fill(drop, float("-inf")).softmax(dim=-1)
    mass_before = probs.cumsum(dim=-1) - probs
    drop |= mass_before >= top_p.unsqueeze(1)
    drop[:, 0] = False
    sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
    return torch.empty_like(logits).scatter_(-1, order, sorted_logits)


def inverse_cdf_sample(probs: torch.Tensor, uniform: torch.Tensor) -> torch.Tensor:
    """Per row of ``probs`` [rows, vocab] (not necessarily normalized), the first token whose
    cumulative probability exceeds ``uniform`` [rows, 1] (in [0, 1), float64) times the
    row's total. The number is kept under the total, so some token's sum exceeds it, and a
    token of probability 0 (whose sum equals its predecessor's) is never the first to. The
    block's own sums may round a hair below the block total the number was placed by, so its
    offset is kept under the last of them (reached first by the block's last token of
    nonzero probability); the clamps only guard rows without a finite distribution."""
    rows, vocab = probs.shape
    pad = -vocab % _CDF_BLOCK
    blocks = (F.pad(probs, (0, pad)) if pad else probs).view(rows, -1, _CDF_BLOCK)
    # Block sums in float32 (torch sums pairwise: off by ~1e-7 of the block at most), which
    # places the blocks; everything after is float64. Widening first would copy every row.
    block_cdf = blocks.sum(dim=-1).double().cumsum(dim=-1)
    total = block_cdf[:, -1:]
    # u * total rounds to total for u a hair under 1; one step below it is still past
    # every sum short of the total, and a sum reaching it ends a block with mass.
    below_total = torch.nextafter(total, torch.zeros_like(total))
    target = torch.minimum(uniform.to(probs.device) * total, below_total)
    block = torch.searchsorted(block_cdf, target, right=True).clamp_(max=block_cdf.shape[1] - 1)
    before = block_cdf.gather(1, (block - 1).clamp(min=0)).masked_fill_(block == 0, 0.0)
    inner = blocks.gather(1, block.unsqueeze(-1).expand(rows, 1, _CDF_BLOCK)).squeeze(1)
    inner_cdf = inner.cumsum(dim=-1, dtype=torch.float64)
    last = inner_cdf[:, -1:]
    within = torch.minimum(target - before, torch.nextafter(last, torch.zeros_like(last)))
    offset = torch.searchsorted(inner_cdf, within, right=True)
    tokens = block * _CDF_BLOCK + offset.clamp_(max=_CDF_BLOCK - 1)
    return tokens.squeeze(1).clamp_(max=vocab - 1)


class Sampler:
    def __init__(self, seed: int, processors: LogitsProcessors | None = None) -> None:
        """``processors``: the worker's logits processors (None: the batches' processor
        rows are ignored, as benchmarks and probes run)."""
        self.generator = torch.Generator()
        self.generator.manual_seed(seed)
        self.processors = processors

    def update(self, batch: SamplingBatch) -> None:
        """Apply the batch update of a step that samples no row."""
        if self.processors is not None and batch.update is not None:
            self.processors.prepare(batch)

    def __call__(self, logits: torch.Tensor, batch: SamplingBatch) -> SamplerOutput:
        logits = logits.float()
        processors = self.processors
        if processors is None:
            return self._sample_step(logits, batch, [])
        active = processors.prepare(batch)
        while True:
            try:
                out = self._sample_step(logits, batch, active)
                break
            except ProcessorFailed as failure:
                # Its rows fail; the step is sampled again from the model's logits (untouched:
                # edits go to a copy) without it, so no other row keeps a trace of its edit.
                # Each pass drops one processor, so this ends. Nothing is drawn from the
                # generators before the processors ran, so the retry draws what one pass would.
                processors.fail(failure)
                active = [(p, rows) for p, rows in active if p is not failure.processor]
        failed = processors.failed_rows(batch.slots)
        if failed is None:
            return out
        if batch.drafts is not None:
            failed = _by_sequence(failed, batch.drafts)
        return replace(out, failed=failed)

    def _sample_step(
        self,
        logits: torch.Tensor,
        batch: SamplingBatch,
        active: list[tuple[LogitsProcessor, StepRows]],
    ) -> SamplerOutput:
        processors = self.processors
        # Logprobs are the model's own, before any edit (vLLM's default "raw_logprobs").
        processed = logits
        if batch.grammar is not None or needs_pre_temperature(active):
            processed = logits.clone()
            if batch.grammar is not None:
                apply_grammar_masks(processed, batch.grammar)
            if processors is not None:
                processed = processors.apply(processed, active, after_temperature=False)
        if batch.drafts is not None:
            return self._verify(logits, processed, batch, active)
        # max(dim) gives argmax's first-maximum index 3x faster on CPU (one pass, parallel).
        greedy = processed.max(dim=-1).indices if batch.all_greedy else None
        tokens = greedy if greedy is not None else self._sample(processed, batch, active)
        if processors is not None and active:
            processors.on_sampled(active, tokens)
        if batch.max_logprobs is None:
            return SamplerOutput(token_ids=tokens.tolist())
        return _with_logprobs(SamplerOutput(token_ids=tokens.tolist()), logits, tokens, batch)

    def _verify(
        self,
        logits: torch.Tensor,
        processed: torch.Tensor,
        batch: SamplingBatch,
        active: list[tuple[LogitsProcessor, StepRows]],
    ) -> SamplerOutput:
        """A batch with draft rows (``rejection_sampler.py``): one row of ``logits`` per
        sampled position, one token (and accepted count) per sequence out."""
        assert batch.drafts is not None
        greedy = batch.temperatures.to(logits.device) == 0
        argmax = processed.max(dim=-1).indices
        probs = uniform = accept_uniform = None
        if not batch.all_greedy:
            probs = self._probs(processed, batch, active)
            uniform, accept_uniform = self._uniforms(batch, pairs=True)
        verified = verify(
            argmax, probs, greedy, batch.drafts, uniform, accept_uniform, inverse_cdf_sample
        )
        if self.processors is not None and active:
            self.processors.on_sampled(active, verified.position_tokens)
        out = SamplerOutput(token_ids=verified.tokens, num_accepted=verified.num_accepted)
        if batch.max_logprobs is None:
            return out
        # Every position's chosen token: the draft where one was accepted, else the emitted
        # one (positions after a sequence's first rejection are never read).
        draft = draft_per_position(batch.drafts).to(logits.device)
        chosen = torch.where(draft >= 0, draft, verified.position_tokens.to(logits.device))
        final = torch.tensor(verified.positions, dtype=torch.int64, device=logits.device)
        chosen[final] = torch.tensor(verified.tokens, dtype=torch.int64, device=logits.device)
        scored = _with_logprobs(SamplerOutput(token_ids=[]), logits, chosen, batch)
        return _split_by_sequence(out, scored, verified)

    def _uniforms(
        self, batch: SamplingBatch, pairs: bool = False
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """A uniform number per row to draw its token with (and with ``pairs`` a second,
        [rows], to accept a draft with); a seeded row's from its (seed, step) generator.
        Drawn on the CPU, where the generators live, so a seed means the same tokens on
        every device kind."""
        rows = len(batch.seeds)
        uniform = torch.rand(rows, 1, dtype=torch.float64, generator=self.generator)
        second = torch.rand(rows, dtype=torch.float64, generator=self.generator) if pairs else None
        for row, seed in enumerate(batch.seeds):
            if seed is not None:
                g = _row_generator(seed, batch.steps[row])
                uniform[row] = torch.rand(1, dtype=torch.float64, generator=g)
                if second is not None:
                    second[row] = torch.rand(1, dtype=torch.float64, generator=g)
        return uniform, second

    def _sample(
        self,
        logits: torch.Tensor,
        batch: SamplingBatch,
        active: list[tuple[LogitsProcessor, StepRows]],
    ) -> torch.Tensor:
        greedy = batch.temperatures.to(logits.device) == 0
        probs = self._probs(logits, batch, active)
        uniform, _ = self._uniforms(batch)
        sampled = inverse_cdf_sample(probs, uniform)
        if not bool(greedy.any()):
            return sampled
        return torch.where(greedy, logits.max(dim=-1).indices, sampled)

    def _probs(
        self,
        logits: torch.Tensor,
        batch: SamplingBatch,
        active: list[tuple[LogitsProcessor, StepRows]],
    ) -> torch.Tensor:
        """Each row's unnormalized distribution: temperature (1 for greedy rows), the
        processors after it, top-k and top-p."""
        temps = batch.temperatures.to(logits.device)
        greedy = temps == 0
        scaled = logits / torch.where(greedy, 1.0, temps).unsqueeze(1)
        if self.processors is not None and needs_after_temperature(active):
            scaled = self.processors.apply(scaled, active, after_temperature=True)
        if batch.needs_top_k_top_p:
            scaled = apply_top_k_top_p(
                scaled, batch.top_k.to(logits.device), batch.top_p.to(logits.device)
            )
        # Unnormalized probabilities are all the inversion needs (it scales by the row's
        # total), computed in place: `scaled` is this call's own tensor, and a fresh
        # [rows, vocab] one costs its page faults (at 48 x 152K: 29 MB, ~4 ms).
        return scaled.sub_(scaled.amax(dim=-1, keepdim=True)).exp_()


def _by_sequence(failed: dict[int, str], drafts: DraftRows) -> dict[int, str]:
    """Failed sampled positions of a step with drafts as the rows of their sequences."""
    ends = np.cumsum(np.array(drafts.num_drafts, dtype=np.int64) + 1)
    rows = np.searchsorted(ends, np.array(list(failed), dtype=np.int64), side="right")
    return {int(row): message for row, message in zip(rows, failed.values(), strict=True)}


def _split_by_sequence(
    out: SamplerOutput, scored: SamplerOutput, verified: Verified
) -> SamplerOutput:
    """``out`` with the logprobs of each sequence's token and of its accepted drafts, taken
    from ``scored`` (one entry per position)."""
    assert scored.logprobs is not None
    assert scored.top_token_ids is not None and scored.top_logprobs is not None
    ends = verified.positions
    starts = [end - accepted for end, accepted in zip(ends, verified.num_accepted, strict=True)]
    return replace(
        out,
        logprobs=[scored.logprobs[e] for e in ends],
        top_token_ids=[scored.top_token_ids[e] for e in ends],
        top_logprobs=[scored.top_logprobs[e] for e in ends],
        accepted_logprobs=[scored.logprobs[a:e] for a, e in zip(starts, ends, strict=True)],
        accepted_top_token_ids=[
            scored.top_token_ids[a:e] for a, e in zip(starts, ends, strict=True)
        ],
        accepted_top_logprobs=[scored.top_logprobs[a:e] for a, e in zip(starts, ends, strict=True)],
    )


def _with_logprobs(
    out: SamplerOutput, logits: torch.Tensor, tokens: torch.Tensor, batch: SamplingBatch
) -> SamplerOutput:
    """``out`` with the logprobs of ``tokens`` under ``logits`` (one row each) and the top
    ones. Logprobs are the model's own, before any edit (vLLM's default "raw_logprobs")."""
    assert batch.max_logprobs is not None
    logprobs = logits.log_softmax(dim=-1)
    chosen = logprobs.gather(1, tokens.unsqueeze(1)).squeeze(1)
    top_values, top_ids = logprobs.topk(max(batch.max_logprobs, 1), dim=-1)
    return replace(
        out,
        logprobs=chosen.tolist(),
        top_token_ids=top_ids.tolist(),
        top_logprobs=top_values.tolist(),
    )
