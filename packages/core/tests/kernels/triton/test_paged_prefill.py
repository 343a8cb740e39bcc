"""The Triton prefill kernel against the torch reference, under Triton's interpreter: fresh
prompts, chunks after cached tokens (starting inside a cache block and at a block boundary,
one token long, long enough for several unmasked key tiles), ragged sequences together in one
group behind a step's decodes, on scattered blocks, with the GQA ratios (1, 2, 4, 8), head
sizes (64, 128, 256) and block sizes (16, 32, 128) the served models use.

Error analysis. The kernel computes in float32 whatever the input dtype and rounds the output
once; it is compared with the reference run in float32 on the same values. The queries and
keys are multiples of 1/8 in [-1, 1] and the scale a power of two, so every product q_d k_d is
a multiple of 1/64 of magnitude at most 1 and every partial sum of a score (at most 256 terms)
a multiple of 1/64 below 2^8: exact in float32 (and in a float16 ``tl.dot`` accumulating in
float32) in any order. Both sides hold the same scores s_j, exactly. What remains is the
softmax out = sum_j e_j v_j / sum_j e_j, e_j = exp(s_j - m), over at most L keys, in each:
- each e_j: the exponential's own error E, and u |s_j - m| <= R u from the rounded
  subtraction (R bounds the spread of the scores; u = 2^-24);
- the numerator's and the denominator's sums of at most L terms (gamma_L, first order L u),
  one rounding of each product e_j v_j, and up to T rescalings of the running sums when the
  running max grows (a rounding each; the rescaling factor itself multiplies numerator and
  denominator alike, so its own error cancels); then the division, u.
Relative errors th in the numerator's terms and ph in the denominator's move the quotient by
at most (th + ph) A, A = sum_j w_j |v_j| (w the exact softmax weights), so each side is within
(2 (E + R u) + (2 L + 2 T + 3) u) A of the exact value, and the two are within
    B = (2 (E_k + E_r) + 4 R + 8 L + 6) u A      (T <= L on both sides).
E_k = 8 u (four ulps: the interpreter takes numpy's float32 exp) and E_r = 40 u (twenty
ulps: torch's CPU flash attention takes its exponentials with ``exp_u20``). With the values
in [-1, 1), A <= 1, and for the data here (L <= 153, R <= 22) B stays under 1e-4 (which the
test asserts too). float16 and bfloat16 add the output's one rounding: half an ulp to nearest
in float16, a whole one in bfloat16 (the interpreter converts float32 to bfloat16 by
truncation); on a device it rounds to nearest, and the device check compares there. In those
two dtypes the weights reach the weighted sum of V split into parts of the input dtype (the
kernel's docstring): 24 bits in bfloat16, even truncated, and in float16 22 bits down to its
subnormal step, an absolute 2^-25 per weight, at most L u / 2 on the numerator (|v| <= 1)
over a denominator of at least 1: inside B's 8 L u A for these data (A about 1/2).
"""

from __future__ import annotations

import pytest
import torch

from tandem.core.kernels.attention_metadata import AttentionGroup
from tandem.core.kernels.reference.paged_attention import reference_prefill
from tandem.core.kernels.triton.paged_prefill import paged_prefill
from tandem.core.llm.attention_metadata import build_attention_metadata

from ..cpu.attention_steps import make_step

U = 2.0**-24
# Exponential errors (in u) of the kernel under the interpreter and of the reference.
EXP_KERNEL, EXP_REFERENCE = 8, 40

SHAPES = [
    # heads, kv heads, head_dim, block_size
    (4, 2, 64, 16),
    (8, 1, 128, 32),
    (2, 2, 256, 128),
    (16, 4, 128, 16),
]

Shape = tuple[int, int, int, int]


def ulp(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    mag = x.abs().clamp_min(torch.finfo(dtype).tiny)
    return torch.finfo(dtype).eps * torch.exp2(torch.floor(torch.log2(mag)))


def eighths(gen: torch.Generator, *shape: int) -> torch.Tensor:
    """Multiples of 1/8 in [-1, 1]: exact in every dtype, and so are their dot products."""
    return torch.randint(-8, 9, shape, generator=gen).float() / 8


class Case:
    """A step's prefill group on scattered blocks, with caches and queries for it."""

    def __init__(
        self,
        shape: Shape,
        dtype: torch.dtype,
        prefills: list[tuple[int, int]],
        decode_lens: tuple[int, ...] = (),
        seed: int = 0,
    ) -> None:
        heads, kv_heads, head_dim, block_size = shape
        gen = torch.Generator().manual_seed(seed)
        num_blocks = 2048 // block_size
        step = make_step(list(decode_lens), prefills, block_size, num_blocks, gen)
        meta = build_attention_metadata(step, torch.device("cpu"))
        assert meta.prefill is not None
        self.group: AttentionGroup = meta.prefill
        self.kv_len = max(cached + new for cached, new in prefills)
        cache_shape = (num_blocks, block_size, kv_heads, head_dim)
        self.k_cache = eighths(gen, *cache_shape).to(dtype)
        self.v_cache = (torch.rand(cache_shape, generator=gen) * 2 - 1).to(dtype)
        self.q = eighths(gen, self.group.num_tokens, heads, head_dim).to(dtype)
        self.scale = 0.5 if head_dim <= 128 else 0.25

    def reference(self, v_cache: torch.Tensor) -> torch.Tensor:
        q, k_cache = self.q.float(), self.k_cache.float()
        out = torch.empty(q.shape)
        return reference_prefill(q, q, q, k_cache, v_cache, self.group, self.scale, out)

    def bound(self, want: torch.Tensor) -> torch.Tensor:
        """B of the module docstring, per output element, and the output's rounding."""
        q, k = self.q.double(), self.k_cache.double().flatten(0, 1)  # [N, H, D], [P, Hkv, D]
        group = q.shape[1] // k.shape[1]
        scores = torch.einsum("nhd,phd->nhp", q, k.repeat_interleave(group, dim=1))
        spread = 2 * self.scale * scores.abs().max().item()
        weighted = self.reference(self.v_cache.float().abs())  # A = sum_j w_j |v_j|
        terms = 2 * (EXP_KERNEL + EXP_REFERENCE) + 4 * spread + 8 * self.kv_len + 6
        bound = terms * U * weighted
        assert bound.max().item() <= 1e-4
        dtype = self.q.dtype
        if dtype is not torch.float32:
            rounding = 1.0 if dtype is torch.bfloat16 else 0.5
            bound = bound + rounding * ulp(want.abs() + bound, dtype)
        return bound

    def check(self, q: torch.Tensor | None = None, out: torch.Tensor | None = None) -> float:
        """The kernel's worst error as a fraction of its bound (asserted at most 1)."""
        q = self.q if q is None else q
        out = torch.empty_like(self.q) if out is None else out
        got = paged_prefill(q, q, q, self.k_cache, self.v_cache, self.group, self.scale, out)
        assert got.data_ptr() == out.data_ptr()
        want = self.reference(self.v_cache.float())
        worst = ((got.float() - want).abs() / self.bound(want)).max().item()
        assert worst <= 1.0, f"worst {worst:.2f} of the bound"
        return worst


# Every shape in float32; float16 and bfloat16 (the output's rounding on top) on two each.
CASES = [(shape, torch.float32) for shape in SHAPES] + [
    (SHAPES[0], torch.float16),
    (SHAPES[2], torch.float16),
    (SHAPES[1], torch.bfloat16),
    (SHAPES[3], torch.bfloat16),
]


@pytest.mark.parametrize(("shape", "dtype"), CASES)
def test_ragged_chunks_after_decodes_match_the_reference(shape: Shape, dtype: torch.dtype) -> None:
    """One group: a fresh prompt, a chunk starting inside a cache block, one starting at a
    block boundary, one after enough cached tokens for several unmasked key tiles, and a
    one-token chunk; the step's decodes come first (the group's block tables follow theirs)."""
    bs = shape[3]
    prefills = [(0, 37), (bs + 5, 20), (bs, 9), (100, 40), (3, 1)]
    Case(shape, dtype, prefills, decode_lens=(9, 30), seed=shape[2] + bs).check()


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_fresh_prompts_match_the_reference(dtype: torch.dtype) -> None:
    Case((4, 2, 64, 16), dtype, [(0, 70), (0, 1), (0, 16)], seed=1).check()


def test_a_chunk_after_a_long_cache_matches_the_reference() -> None:
    """Many key tiles before the chunk, the chunk starting mid-block and spanning two."""
    Case((8, 2, 128, 32), torch.float32, [(120, 17)], seed=2).check()


def test_every_offset_of_a_chunk_against_the_key_tiles() -> None:
    """Chunks of four query tiles (8 tokens to a tile at GQA 8) after 0 .. 7 cached tokens:
    the tiles' first and last queries fall at every offset within a 32-key tile, so the edges
    of the unmasked and the diagonal key ranges are all crossed."""
    Case((8, 1, 64, 16), torch.float32, [(c, 32) for c in range(8)], seed=4).check()


def test_a_query_view_of_a_wider_projection_is_read_in_place() -> None:
    """q and out as views of wider tensors (q split from a fused projection)."""
    case = Case((4, 1, 64, 16), torch.float32, [(21, 19), (0, 6)], seed=3)
    n = case.group.num_tokens
    wide_q = torch.zeros(n, 4, 128)
    wide_q[:, :, 32:96] = case.q
    wide_out = torch.zeros(n, 6, 64)
    case.check(q=wide_q[:, :, 32:96], out=wide_out[:, 1:5])
    assert not wide_out[:, 0].any() and not wide_out[:, 5].any()
