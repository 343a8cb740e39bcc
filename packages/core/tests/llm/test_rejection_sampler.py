"""Verifying drafts: greedy keeps the plain greedy tokens; random rows keep the target
distribution at every position; seeded rows reproduce."""

from __future__ import annotations

import torch

from tandem.core.llm.forward_input import DraftRows, SamplingBatch
from tandem.core.llm.sampler import Sampler

# Upper 0.1% points of the chi-square distribution by degrees of freedom.
_CHI2_999 = {1: 10.828, 2: 13.816, 3: 16.266, 4: 18.467, 5: 20.515, 6: 22.458, 7: 24.322}


def _batch(
    num_drafts: tuple[int, ...],
    drafts: tuple[int, ...],
    temperature: float,
    top_k: int = 0,
    seed: int | None = None,
) -> SamplingBatch:
    rows = sum(num_drafts) + len(num_drafts)
    steps = tuple(j for k in num_drafts for j in range(k + 1))
    return SamplingBatch(
        temperatures=torch.full((rows,), temperature),
        top_p=torch.ones(rows),
        top_k=torch.full((rows,), top_k, dtype=torch.int64),
        seeds=(seed,) * rows,
        steps=steps,
        all_greedy=temperature == 0.0,
        needs_top_k_top_p=top_k > 0,
        max_logprobs=None,
        drafts=DraftRows(num_drafts=num_drafts, token_ids=drafts),
    )


def test_greedy_keeps_drafts_while_they_are_the_argmax() -> None:
    # Three sequences: drafts (2, 5) with argmaxes 2, 4, 1 (one kept, then the argmax 4);
    # no drafts (argmax 3); drafts (0,) with argmaxes 0, 6 (kept, then the bonus 6).
    argmax = [2, 4, 1, 3, 0, 6]
    logits = torch.zeros(6, 8)
    logits[torch.arange(6), torch.tensor(argmax)] = 5.0
    out = Sampler(seed=0)(logits, _batch((2, 0, 1), (2, 5, 0), temperature=0.0))
    assert out.token_ids == [4, 3, 6]
    assert out.num_accepted == [1, 0, 1]


def _chi2_two_sample(a: torch.Tensor, b: torch.Tensor) -> tuple[float, int]:
    """Chi-square statistic of homogeneity of two count vectors, and its degrees of freedom
    (categories empty in both do not count)."""
    used = (a + b) > 0
    a, b = a[used].double(), b[used].double()
    na, nb = a.sum(), b.sum()
    stat = ((a * (nb / na).sqrt() - b * (na / nb).sqrt()) ** 2 / (a + b)).sum()
    return float(stat), int(used.sum()) - 1


def test_random_rows_keep_the_target_distribution() -> None:
    """Drafts (d0, d1) against three positions' logits, over many rows at once: the first
    token emitted must follow position 0's distribution (whether d0 was kept or replaced),
    and, where d0 was kept, the second must follow position 1's, as the plain sampler draws
    them from the same logits (temperature and top-k applied). Each comparison is a
    two-sample chi-square test at the 0.1% level: with fresh random draws, a correct
    sampler fails this test at most 0.2% of the time (two tests); the seeds here are fixed,
    so the test itself is deterministic."""
    vocab, n = 6, 30_000
    rows = torch.tensor(
        [[1.0, 0.4, 0.2, 0.9, -1.0, 0.0], [0.1, 1.2, 0.3, 0.8, 0.5, -0.5], [0.0] * 6]
    )
    d0, d1 = 3, 1
    spec_logits = rows.repeat(n, 1)
    spec = Sampler(seed=1)(spec_logits, _batch((2,) * n, (d0, d1) * n, 0.8, top_k=5))
    assert spec.num_accepted is not None
    first = torch.tensor(
        [d0 if a > 0 else t for a, t in zip(spec.num_accepted, spec.token_ids, strict=True)]
    )
    second = torch.tensor(
        [
            d1 if a > 1 else t
            for a, t in zip(spec.num_accepted, spec.token_ids, strict=True)
            if a >= 1
        ]
    )
    plain = Sampler(seed=2)
    plain_batch = SamplingBatch(
        temperatures=torch.full((n,), 0.8),
        top_p=torch.ones(n),
        top_k=torch.full((n,), 5, dtype=torch.int64),
        seeds=(None,) * n,
        steps=(0,) * n,
        all_greedy=False,
        needs_top_k_top_p=True,
        max_logprobs=None,
    )
    for position, emitted in ((0, first), (1, second)):
        reference = torch.tensor(plain(rows[position].repeat(n, 1), plain_batch).token_ids)
        a = torch.bincount(emitted, minlength=vocab)
        b = torch.bincount(reference, minlength=vocab)
        # Top-k 5 cuts the least likely token: neither sampler may ever emit it.
        assert int(a[rows[position].argmin()]) == 0 == int(b[rows[position].argmin()])
        stat, df = _chi2_two_sample(a, b)
        assert stat < _CHI2_999[df], (position, a.tolist(), b.tolist(), stat)
    # The test is not vacuous: drafts were both kept and replaced.
    assert 0 < sum(1 for a in spec.num_accepted if a > 0) < n


def test_seeded_rows_reproduce_whatever_the_engine_seed() -> None:
    logits = torch.randn(4, 50, generator=torch.Generator().manual_seed(0))
    batch = _batch((3,), (7, 8, 9), temperature=1.0, seed=1234)
    outs = [Sampler(seed=s)(logits, batch) for s in (0, 1)]
    assert outs[0] == outs[1]
