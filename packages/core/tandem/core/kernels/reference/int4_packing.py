"""4-bit codes packed eight to an int32, in the order GPTQ checkpoints use.

Layout rules of a GPTQ (``checkpoint_format: gptq``) linear layer with ``K`` inputs, ``N``
outputs and ``G`` groups, as AutoGPTQ writes it and vLLM reads it (vLLM 0.32's
``auto_gptq.py``: ``qweight`` is a ``PackedvLLMParameter`` with input_dim 0, packed_dim 0,
pack factor 32 // bits; ``qzeros`` a packed column parameter with packed_dim 1; and
``quant_utils.unpack_quantized_values_into_int32``, which takes element ``i`` of each run of
eight from bits ``4 * i``):

- ``qweight`` int32 [K / 8, N]: word [k, n] holds the codes of inputs 8k .. 8k+7 of output n,
  input 8k + i in bits 4i .. 4i+3 (the first input in the lowest nibble);
- ``qzeros`` int32 [G, N / 8]: word [g, j] holds the zero points of outputs 8j .. 8j+7 in
  group g, same nibble order; AutoGPTQ stores each zero point minus one (its ``pack`` subtracts
  1, its kernels add it back), so a symmetric 4-bit layer's zero 8 is stored 7 (0x77777777);
  ``gptq_v2`` (GPTQModel) drops that offset;
- ``scales`` [G, N] in the checkpoint's float dtype (float16 as AutoGPTQ writes);
- ``g_idx`` int32 [K]: the group of each input; ``i // group_size`` unless the layer was
  quantized in activation order (``desc_act``), where it is a permutation's groups;
- a weight is ``(code - zero) * scale`` of its input's group.

AWQ (``quant_method: awq``, ``version: gemm``, as AutoAWQ writes it; vLLM 0.32's
``auto_awq.py``, ``_convert_awq_to_standard_format``) packs both ``qweight`` [K, N / 8] and
``qzeros`` [G, N / 8] along the outputs, in another order within a word: nibble p holds
output ``AWQ_ORDER[p]`` of its run of eight (AutoAWQ's ``order_map``); zero points are stored
as they are (no offset), and there is no ``g_idx`` (groups are consecutive inputs).
"""

from __future__ import annotations

import torch

BITS = 4
PACK = 32 // BITS
_MASK = (1 << BITS) - 1
# Which code of a run of eight each nibble holds, lowest nibble first.
GPTQ_ORDER = (0, 1, 2, 3, 4, 5, 6, 7)
AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)


def _shifts(device: torch.device) -> torch.Tensor:
    return torch.arange(0, 32, BITS, dtype=torch.int32, device=device)


def unpack_int4(
    packed: torch.Tensor, dim: int, order: tuple[int, ...] = GPTQ_ORDER
) -> torch.Tensor:
    """int32 words -> their 4-bit codes (uint8), eight per word along ``dim`` (0 or 1 of a 2-D
    tensor); nibble p (from the lowest) holds code ``order[p]`` of its run."""
    words = packed.movedim(dim, -1)
    # >> on int32 sign-extends the top nibble; the mask drops those bits.
    nibbles = (words.unsqueeze(-1) >> _shifts(packed.device)) & _MASK
    if order != GPTQ_ORDER:
        nibbles = nibbles[..., _inverse(order)]
    return nibbles.flatten(-2).to(torch.uint8).movedim(-1, dim)


def pack_int4(codes: torch.Tensor, dim: int, order: tuple[int, ...] = GPTQ_ORDER) -> torch.Tensor:
    """4-bit codes (any integer dtype, values 0..15) -> int32 words, eight along ``dim``
    (that size must be a multiple of eight), code ``order[p]`` of each run in nibble p."""
    values = codes.movedim(dim, -1).to(torch.int32)
    if values.shape[-1] % PACK:
        raise ValueError(f"{values.shape[-1]} codes do not pack into whole int32 words of {PACK}")
    if values.numel() and (int(values.min()) < 0 or int(values.max()) > _MASK):
        raise ValueError("4-bit codes must lie in 0..15")
    runs = values.reshape(*values.shape[:-1], -1, PACK)[..., list(order)]
    runs = runs << _shifts(codes.device)
    # Disjoint bit fields: their sum is their bitwise or (int32 wraps into the sign bit).
    words: torch.Tensor = runs.sum(-1, dtype=torch.int32)
    return words.movedim(-1, dim).contiguous()


def _inverse(order: tuple[int, ...]) -> list[int]:
    """Where each code of a run sits: the inverse permutation of ``order``."""
    where = [0] * len(order)
    for slot, code in enumerate(order):
        where[code] = slot
    return where
