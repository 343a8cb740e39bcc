"""Paged KV cache writes: ``_npu_reshape_and_cache``."""

from __future__ import annotations

import torch

from ._rules import (
    NpuValueError,
    require,
    require_dtype,
    require_rank,
    require_same_dtype,
    same_device,
)

_OP = "_npu_reshape_and_cache"
_DOC = (
    "ATB ReshapeAndCacheOperation, hiascend CANN 8.0.RC3 ascendtbapi ascendtb_01_0089 and "
    "CANN 8.2.RC1 ascendtb_01_0242; schema op-plugin op_plugin/ops/atb/ReshapeAndCachAtb.cpp"
)


def _npu_reshape_and_cache(
    key: torch.Tensor,
    value: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slot_indices: torch.Tensor,
) -> None:
    """Write each token's key/value into the paged caches, in place (returns nothing).

    Schema (op-plugin ``ReshapeAndCachAtb.cpp``)::

        _npu_reshape_and_cache(Tensor key, Tensor value, Tensor(a!) key_cache,
                               Tensor(b!) value_cache, Tensor slot_indices) -> ()

    Rules (ATB ``ReshapeAndCacheOperation``, ND caches, no head compression):

    - ``key`` [num_tokens, num_head, k_head_size], ``value`` [num_tokens, num_head,
      v_head_size]; ``key_cache`` [num_blocks, block_size, num_head, k_head_size],
      ``value_cache`` [num_blocks, block_size, num_head, v_head_size] (k and v head sizes may
      differ; the head counts of a tensor and its cache must match).
    - key, value, key_cache, value_cache: one dtype, float16 / bfloat16 / int8.
    - ``slot_indices`` (slotMapping): int32, [num_tokens], each
      ``block_id * block_size + offset_in_block``, in ``(-num_blocks * block_size,
      num_blocks * block_size)``, no value repeated. A negative slot moves nothing (stated by
      the 8.2.RC1 page; the 8.0.RC3 page allows negatives without saying what they do, so the
      stand-in follows 8.2.RC1).
    - The NZ cache format (Atlas inference cards) is not modelled: CPU tensors are ND.
    """
    same_device(
        _OP,
        {
            "key": key,
            "value": value,
            "key_cache": key_cache,
            "value_cache": value_cache,
            "slot_indices": slot_indices,
        },
    )
    for name, t in (("key", key), ("value", value)):
        require_rank(_OP, name, t, (3,), _DOC)
    for name, t in (("key_cache", key_cache), ("value_cache", value_cache)):
        require_rank(_OP, name, t, (4,), _DOC)
    allowed = (torch.float16, torch.bfloat16, torch.int8)
    require_dtype(_OP, "key", key, allowed, _DOC)
    require_same_dtype(
        _OP,
        {"key": key, "value": value, "key_cache": key_cache, "value_cache": value_cache},
        _DOC,
    )
    require_dtype(_OP, "slot_indices", slot_indices, (torch.int32,), _DOC)
    require_rank(_OP, "slot_indices", slot_indices, (1,), _DOC)
    num_tokens = key.shape[0]
    require(
        value.shape[0] == num_tokens and slot_indices.shape[0] == num_tokens,
        _OP,
        f"key, value and slot_indices must share num_tokens, got {key.shape[0]}, "
        f"{value.shape[0]}, {slot_indices.shape[0]}",
        _DOC,
    )
    num_blocks, block_size = key_cache.shape[0], key_cache.shape[1]
    require(
        tuple(value_cache.shape[:2]) == (num_blocks, block_size),
        _OP,
        "key_cache and value_cache must share [num_blocks, block_size]",
        _DOC,
    )
    require(
        tuple(key.shape[1:]) == tuple(key_cache.shape[2:]),
        _OP,
        f"key [num_tokens, num_head, k_head_size] must match key_cache's last two dims, got "
        f"{tuple(key.shape)} vs {tuple(key_cache.shape)}",
        _DOC,
    )
    require(
        tuple(value.shape[1:]) == tuple(value_cache.shape[2:]),
        _OP,
        f"value [num_tokens, num_head, v_head_size] must match value_cache's last two dims, "
        f"got {tuple(value.shape)} vs {tuple(value_cache.shape)}",
        _DOC,
    )
    slots = slot_indices.to(torch.int64)
    capacity = num_blocks * block_size
    if slots.numel():
        lo, hi = int(slots.min()), int(slots.max())
        if hi >= capacity or lo <= -capacity:
            raise NpuValueError(
                f"{_OP}: slot_indices must lie in (-num_blocks*block_size, "
                f"num_blocks*block_size) = ({-capacity}, {capacity}), got [{lo}, {hi}] ({_DOC})"
            )
    keep = slots >= 0
    kept = slots[keep]
    if kept.numel() != torch.unique(kept).numel():
        raise NpuValueError(f"{_OP}: slot_indices must not repeat a slot ({_DOC})")
    k_flat = key_cache.view(capacity, *key_cache.shape[2:])
    v_flat = value_cache.view(capacity, *value_cache.shape[2:])
    k_flat[kept] = key[keep]
    v_flat[kept] = value[keep]
