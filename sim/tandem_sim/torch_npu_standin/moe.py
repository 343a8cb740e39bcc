"""Mixture-of-experts routing and grouped matmul: ``npu_moe_gating_top_k_softmax``,
``npu_moe_init_routing``, ``npu_moe_compute_expert_tokens``, ``npu_grouped_matmul`` and
``npu_moe_finalize_routing``.

Index conventions, as the pages define them (N rows, top-k K):

- ``row_idx`` from gating is ``arange(N*K).reshape(K, N).T``: slot (i, k) holds
  ``k * N + i`` (column-major numbering of the (row, choice) slots).
- init_routing sorts the flattened ``expert_idx`` (row-major, stable) and gathers
  ``row_idx`` in that order: ``expanded_dst_to_src_row[j]`` is the slot number of the j-th
  expanded row, and ``expanded_x[j] = x[expanded_dst_to_src_row[j] % N]``. It returns the
  INVERSE permutation, ``expanded_row_idx[slot] = j`` (source slot -> expanded position).
- finalize_routing reads ``expanded_src_to_dst_row`` (that same ``expanded_row_idx``) at
  ``k * N + i`` for drop_pad_mode 0/1 ("column arrangement") and at ``i * K + k`` for 2/3.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence

import torch

from ._rules import (
    FLOATS,
    NpuDtypeError,
    NpuValueError,
    not_implemented,
    require,
    require_dtype,
    require_rank,
    same_device,
)

_DOCS = "op-plugin docs/zh/custom_APIs/torch_npu/"
_SCHEMA = "schema op_plugin/config/op_plugin_functions.yaml"

_GATE = "npu_moe_gating_top_k_softmax"
_GATE_DOC = f"torch_npu.{_GATE}, {_DOCS}torch_npu-{_GATE}.md; {_SCHEMA}"


def npu_moe_gating_top_k_softmax(
    x: torch.Tensor, finished: torch.Tensor | None = None, k: int = 1
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Softmax over the last dim, then top-k; returns ``(y, expert_idx, row_idx)``.

    Schema: ``npu_moe_gating_top_k_softmax(Tensor x, Tensor? finished=None, int k=1) ->
    (Tensor, Tensor, Tensor)``. Rules (op-plugin page):

    - x: 2-D or 3-D, float16 / bfloat16 / float32. 0 < k <= x.shape[-1], k <= 1024.
    - y: the top-k softmax values, x's dtype; expert_idx: their expert numbers, int32;
      row_idx int32 = ``arange(R*k).reshape(k, R).transpose(1, 0)`` with R the rows (for
      3-D x, the leading dims flattened), all of y's shape.
    - finished: bool, shape x.shape[:-1]; True marks a row that takes no part. The page does
      not say what such a row's outputs are, so a True entry raises NotImplementedError
      (all-False is accepted).
    - Softmax in float32; top-k in descending order (ties: the page is silent; torch.topk's
      order).
    """
    same_device(_GATE, {"x": x, "finished": finished})
    require_rank(_GATE, "x", x, (2, 3), _GATE_DOC)
    require_dtype(_GATE, "x", x, FLOATS, _GATE_DOC)
    experts = x.shape[-1]
    require(
        0 < k <= experts and k <= 1024,
        _GATE,
        f"k must satisfy 0 < k <= x.shape[-1]={experts} and k <= 1024, got {k}",
        _GATE_DOC,
    )
    if finished is not None:
        require_dtype(_GATE, "finished", finished, (torch.bool,), _GATE_DOC)
        require(
            tuple(finished.shape) == tuple(x.shape[:-1]),
            _GATE,
            f"finished must have shape x.shape[:-1]={tuple(x.shape[:-1])}, got "
            f"{tuple(finished.shape)}",
            _GATE_DOC,
        )
        if bool(finished.any()):
            raise not_implemented(_GATE, "finished rows (their outputs are undocumented)")
    probs = torch.softmax(x.float(), dim=-1)
    y, idx = torch.topk(probs, k, dim=-1)
    rows = y.numel() // k
    row_idx = torch.arange(rows * k, dtype=torch.int32).reshape(k, rows).transpose(0, 1)
    return (
        y.to(x.dtype),
        idx.to(torch.int32),
        row_idx.reshape(y.shape).contiguous().to(x.device),
    )


_INIT = "npu_moe_init_routing"
_INIT_DOC = f"torch_npu.{_INIT}, {_DOCS}torch_npu-{_INIT}.md; {_SCHEMA}"


def npu_moe_init_routing(
    x: torch.Tensor, row_idx: torch.Tensor, expert_idx: torch.Tensor, active_num: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Group the (row, choice) slots by expert; returns ``(expanded_x, expanded_row_idx,
    expanded_expert_idx)``.

    Schema: ``npu_moe_init_routing(Tensor x, Tensor row_idx, Tensor expert_idx, int
    active_num) -> (Tensor, Tensor, Tensor)``. Transcribed from the page's formula and its
    reference code:

    - ``expanded_expert_idx, sorted_row_idx = keyValueSort(expert_idx, row_idx)`` (stable
      sort of the row-major flattened expert_idx, row_idx carried along);
      ``expanded_row_idx[sorted_row_idx[j]] = j``;
      ``expanded_x[j] = x[sorted_row_idx[j] % NUM_ROWS]`` for
      ``j < min(NUM_ROWS, active_num) * K``.
    - x: 2-D (NUM_ROWS, H), float16 / bfloat16 / float32, fewer than 2^24 elements.
    - expert_idx: 2-D (NUM_ROWS, K), int32; row_idx: int32, expert_idx's shape. The page does
      not require row_idx to be a permutation; the inverse is only defined when it is one
      of 0..N*K-1, which the stand-in requires.
    - Outputs: expanded_x (min(NUM_ROWS, active_num) * K, H) in x's dtype; expanded_row_idx
      (NUM_ROWS * K,) int32; expanded_expert_idx (NUM_ROWS * K,) int32.
    """
    same_device(_INIT, {"x": x, "row_idx": row_idx, "expert_idx": expert_idx})
    require_rank(_INIT, "x", x, (2,), _INIT_DOC)
    require_dtype(_INIT, "x", x, FLOATS, _INIT_DOC)
    require(x.numel() < 2**24, _INIT, "x must have fewer than 2^24 elements", _INIT_DOC)
    require_rank(_INIT, "expert_idx", expert_idx, (2,), _INIT_DOC)
    require_dtype(_INIT, "expert_idx", expert_idx, (torch.int32,), _INIT_DOC)
    require_dtype(_INIT, "row_idx", row_idx, (torch.int32,), _INIT_DOC)
    num_rows = x.shape[0]
    require(
        expert_idx.shape[0] == num_rows,
        _INIT,
        f"expert_idx must be (NUM_ROWS={num_rows}, K), got {tuple(expert_idx.shape)}",
        _INIT_DOC,
    )
    require(
        tuple(row_idx.shape) == tuple(expert_idx.shape),
        _INIT,
        f"row_idx must have expert_idx's shape {tuple(expert_idx.shape)}, got "
        f"{tuple(row_idx.shape)}",
        _INIT_DOC,
    )
    require(active_num >= 0, _INIT, f"active_num must be >= 0, got {active_num}", _INIT_DOC)
    k = expert_idx.shape[1]
    total = num_rows * k
    flat_rows = row_idx.reshape(-1).to(torch.int64)
    require(
        bool(torch.equal(torch.sort(flat_rows).values, torch.arange(total, device=x.device))),
        _INIT,
        "row_idx must hold each of 0..NUM_ROWS*K-1 once (expanded_row_idx is its inverse)",
        _INIT_DOC,
    )
    order = torch.sort(expert_idx.reshape(-1).to(torch.int64), stable=True).indices
    expanded_expert_idx = expert_idx.reshape(-1)[order]
    dst_to_src = flat_rows[order]
    expanded_row_idx = torch.empty(total, dtype=torch.int32, device=x.device)
    expanded_row_idx[dst_to_src] = torch.arange(total, dtype=torch.int32, device=x.device)
    active = min(active_num, num_rows) * k
    expanded_x = x[dst_to_src[:active] % num_rows]
    return expanded_x, expanded_row_idx, expanded_expert_idx.contiguous()


_TOK = "npu_moe_compute_expert_tokens"
_TOK_DOC = f"torch_npu.{_TOK}, {_DOCS}torch_npu-{_TOK}.md; {_SCHEMA}"


def npu_moe_compute_expert_tokens(
    sorted_expert_for_source_row: torch.Tensor, num_expert: int
) -> torch.Tensor:
    """For each expert ``i`` in [0, num_expert), the end of its rows in the sorted list.

    Schema: ``npu_moe_compute_expert_tokens(Tensor sorted_expert_for_source_row, int
    num_expert) -> Tensor``. Rules (op-plugin page):

    - sorted_expert_for_source_row: 1-D int32, values in [0, num_expert - 1], non-decreasing,
      fewer than 2^24 elements. num_expert in (0, 2048].
    - Output: 1-D [num_expert], the input's dtype (int32).
    - The page says "binary search for the position of the last row each expert handles".
      The stand-in returns the position one past it (the number of rows with expert <= i,
      so an expert with no rows repeats the previous value): the cumulative counts that
      ``npu_grouped_matmul``'s group_list_type 0 takes. The page does not say whether its
      "position" is that end or the last index.
    """
    s = sorted_expert_for_source_row
    require_rank(_TOK, "sorted_expert_for_source_row", s, (1,), _TOK_DOC)
    require_dtype(_TOK, "sorted_expert_for_source_row", s, (torch.int32,), _TOK_DOC)
    require(s.numel() < 2**24, _TOK, "fewer than 2^24 elements", _TOK_DOC)
    require(
        0 < num_expert <= 2048,
        _TOK,
        f"num_expert must be in (0, 2048], got {num_expert}",
        _TOK_DOC,
    )
    if s.numel():
        require(
            int(s.min()) >= 0 and int(s.max()) < num_expert,
            _TOK,
            f"values must lie in [0, num_expert-1={num_expert - 1}]",
            _TOK_DOC,
        )
        require(
            bool((s[1:] >= s[:-1]).all()),
            _TOK,
            "values must be in non-decreasing order",
            _TOK_DOC,
        )
    experts = torch.arange(num_expert, dtype=s.dtype, device=s.device)
    return torch.searchsorted(s, experts, right=True).to(s.dtype)


_GMM = "npu_grouped_matmul"
_GMM_DOC = f"torch_npu.{_GMM}, {_DOCS}torch_npu-{_GMM}.md; {_SCHEMA}"
_GMM_BIAS = {
    torch.float16: torch.float16,
    torch.bfloat16: torch.float32,
    torch.float32: torch.float32,
}


def npu_grouped_matmul(
    x: Sequence[torch.Tensor],
    weight: Sequence[torch.Tensor],
    *,
    bias: Sequence[torch.Tensor] | None = None,
    scale: Sequence[torch.Tensor] | None = None,
    offset: Sequence[torch.Tensor] | None = None,
    antiquant_scale: Sequence[torch.Tensor] | None = None,
    antiquant_offset: Sequence[torch.Tensor] | None = None,
    per_token_scale: Sequence[torch.Tensor] | None = None,
    group_list: torch.Tensor | Sequence[int] | None = None,
    activation_input: Sequence[torch.Tensor] | None = None,
    activation_quant_scale: Sequence[torch.Tensor] | None = None,
    activation_quant_offset: Sequence[torch.Tensor] | None = None,
    split_item: int | None = 0,
    group_type: int | None = None,
    group_list_type: int | None = 0,
    act_type: int | None = 0,
    tuning_config: Sequence[int] | None = None,
    output_dtype: torch.dtype | int | None = None,
    x_dtype: int | None = None,
    weight_dtype: int | None = None,
    scale_dtype: int | None = None,
    per_token_scale_dtype: int | None = None,
) -> list[torch.Tensor]:
    """``y_i = x_i @ weight_i + bias_i`` over groups; returns a list of tensors.

    Schema (op_plugin_functions.yaml)::

        npu_grouped_matmul(Tensor[] x, Tensor[] weight, *, Tensor[]? bias=None,
            Tensor[]? scale=None, Tensor[]? offset=None, Tensor[]? antiquant_scale=None,
            Tensor[]? antiquant_offset=None, Tensor[]? per_token_scale=None,
            Tensor? group_list=None, Tensor[]? activation_input=None,
            Tensor[]? activation_quant_scale=None, Tensor[]? activation_quant_offset=None,
            int? split_item=0, int? group_type=None, int? group_list_type=0, int? act_type=0,
            int[]? tuning_config=None, int? output_dtype=None, int? x_dtype=None,
            int? weight_dtype=None, int? scale_dtype=None,
            int? per_token_scale_dtype=None) -> Tensor[]

    Implemented (non-quantised, Atlas A2/A3, group_list a Tensor):

    - group_type 0 (m-axis grouping), x ONE 2-D tensor [M, K], split_item 2 or 3 (one output
      [M, N]): weight ONE 3-D tensor [E, K, N] ("single-single-single", group_list length
      <= 1024) or E 2-D tensors [K, N] with equal N ("single-multi-single", <= 128).
      group_list: 1-D int64 of length E; group_list_type 0 = cumulative sizes
      (non-negative, non-decreasing, last == M), 1 = sizes (non-negative, sum == M, length
      not 1). Rows of group i: [end_{i-1}, end_i).
    - group_type -1 (no grouping), split_item 0 or 1, group_list None: x and weight lists of
      equal length, x_i 2-6 dims, weight_i 2-D, one output per pair ("multi-multi-multi").
    - dtypes: x/weight float16/float16 (bias float16), bfloat16/bfloat16 (bias float32),
      float32/float32 (bias float32); output x's dtype; output_dtype None or x's dtype.
      bias: one 1-D [N] tensor per weight tensor; with a single 3-D weight the stand-in
      takes one [E, N] tensor (the page only says "1-D", written for weight lists).
    - K and N below the inner-axis limit 65536.
    - Refused with NotImplementedError: scale / offset / antiquant / per_token_scale /
      activation_* / tuning_config / the *_dtype ints (quantised paths), act_type != 0,
      group_type 2 (k-axis), group_list_type 2, group_list as List[int], x as a list of
      several tensors with group_type 0 ("multi-multi-single").
    """
    for name, arg in (
        ("scale", scale),
        ("offset", offset),
        ("antiquant_scale", antiquant_scale),
        ("antiquant_offset", antiquant_offset),
        ("per_token_scale", per_token_scale),
        ("activation_input", activation_input),
        ("activation_quant_scale", activation_quant_scale),
        ("activation_quant_offset", activation_quant_offset),
        ("tuning_config", tuning_config),
        ("x_dtype", x_dtype),
        ("weight_dtype", weight_dtype),
        ("scale_dtype", scale_dtype),
        ("per_token_scale_dtype", per_token_scale_dtype),
    ):
        if arg is not None:
            raise not_implemented(_GMM, name)
    if act_type not in (0, None):
        raise not_implemented(_GMM, f"act_type={act_type}")
    if isinstance(x, torch.Tensor) or isinstance(weight, torch.Tensor):
        raise NpuDtypeError(f"{_GMM}: x and weight are lists of tensors (Tensor[]) ({_GMM_DOC})")
    xs, ws = list(x), list(weight)
    require(
        0 < len(xs) <= 128 and 0 < len(ws) <= 128,
        _GMM,
        "x and weight lists hold 1..128 tensors",
        _GMM_DOC,
    )
    same_device(
        _GMM,
        {
            **{f"x[{i}]": t for i, t in enumerate(xs)},
            **{f"weight[{i}]": t for i, t in enumerate(ws)},
            "group_list": group_list if isinstance(group_list, torch.Tensor) else None,
        },
    )
    dtype = xs[0].dtype
    for name, ts in (("x", xs), ("weight", ws)):
        for i, t in enumerate(ts):
            require_dtype(_GMM, f"{name}[{i}]", t, FLOATS, _GMM_DOC)
            if t.dtype != dtype:
                raise NpuDtypeError(
                    f"{_GMM}: x and weight must share one dtype (non-quantised), got "
                    f"{dtype} and {t.dtype} ({_GMM_DOC})"
                )
    if output_dtype is not None and output_dtype != dtype:
        raise NpuDtypeError(
            f"{_GMM}: output_dtype must be None or x's dtype {dtype} when not quantised, got "
            f"{output_dtype} ({_GMM_DOC})"
        )
    if group_list is not None and not isinstance(group_list, torch.Tensor):
        raise not_implemented(_GMM, "group_list as List[int]")
    bias_list = None if bias is None else list(bias)
    if bias_list is not None:
        require(
            len(bias_list) == len(ws),
            _GMM,
            f"bias must have as many tensors as weight ({len(ws)}), got {len(bias_list)}",
            _GMM_DOC,
        )
        for i, b in enumerate(bias_list):
            require_dtype(_GMM, f"bias[{i}]", b, (_GMM_BIAS[dtype],), _GMM_DOC)

    if group_type == -1:
        require(
            split_item in (0, 1),
            _GMM,
            f"group_type -1 takes split_item 0 or 1, got {split_item}",
            _GMM_DOC,
        )
        require(group_list is None, _GMM, "group_type -1 takes no group_list", _GMM_DOC)
        require(len(xs) == len(ws), _GMM, "x and weight lists must match in length", _GMM_DOC)
        outs = []
        for i, (xi, wi) in enumerate(zip(xs, ws, strict=True)):
            require_rank(_GMM, f"x[{i}]", xi, range(2, 7), _GMM_DOC)
            require_rank(_GMM, f"weight[{i}]", wi, (2,), _GMM_DOC)
            require(
                xi.shape[-1] == wi.shape[0],
                _GMM,
                f"x[{i}]'s K {xi.shape[-1]} must equal weight[{i}]'s K {wi.shape[0]}",
                _GMM_DOC,
            )
            _inner_limit(xi.shape[-1], wi.shape[1])
            yi = xi.float() @ wi.float()
            if bias_list is not None:
                require_rank(_GMM, f"bias[{i}]", bias_list[i], (1,), _GMM_DOC)
                yi = yi + bias_list[i].float()
            outs.append(yi.to(dtype))
        return outs
    if group_type == 2:
        raise not_implemented(_GMM, "group_type=2 (k-axis grouping)")
    require(
        group_type == 0,
        _GMM,
        f"group_type must be -1, 0 or 2 with a Tensor group_list, got {group_type}",
        _GMM_DOC,
    )
    if len(xs) != 1:
        raise not_implemented(_GMM, "several x tensors with group_type 0 (multi-multi-single)")
    require(
        split_item in (2, 3),
        _GMM,
        f"group_type 0 with one x tensor takes split_item 2 or 3, got {split_item}",
        _GMM_DOC,
    )
    xi = xs[0]
    require_rank(_GMM, "x[0]", xi, (2,), _GMM_DOC)
    if len(ws) == 1:
        require_rank(_GMM, "weight[0]", ws[0], (3,), _GMM_DOC)
        w3 = ws[0]
        max_groups = 1024
    else:
        for i, wi in enumerate(ws):
            require_rank(_GMM, f"weight[{i}]", wi, (2,), _GMM_DOC)
        require(
            len({wi.shape[1] for wi in ws}) == 1,
            _GMM,
            "every weight tensor's N must be equal",
            _GMM_DOC,
        )
        require(
            len({wi.shape[0] for wi in ws}) == 1,
            _GMM,
            "every weight tensor's K must equal x's K",
            _GMM_DOC,
        )
        w3 = torch.stack(list(ws))
        max_groups = 128
    experts, k_dim, n_dim = w3.shape
    require(
        xi.shape[1] == k_dim,
        _GMM,
        f"x's K {xi.shape[1]} must equal weight's K {k_dim}",
        _GMM_DOC,
    )
    _inner_limit(k_dim, n_dim)
    require(group_list is not None, _GMM, "group_type 0 needs a group_list", _GMM_DOC)
    assert isinstance(group_list, torch.Tensor)
    require_dtype(_GMM, "group_list", group_list, (torch.int64,), _GMM_DOC)
    require_rank(_GMM, "group_list", group_list, (1,), _GMM_DOC)
    require(
        group_list.shape[0] == experts,
        _GMM,
        f"group_list's length must equal the number of weight groups {experts}, got "
        f"{group_list.shape[0]}",
        _GMM_DOC,
    )
    require(
        experts <= max_groups,
        _GMM,
        f"at most {max_groups} groups here, got {experts}",
        _GMM_DOC,
    )
    values = [int(v) for v in group_list.tolist()]
    m = xi.shape[0]
    if group_list_type == 2:
        raise not_implemented(_GMM, "group_list_type=2 ([E, 2] index/size pairs)")
    if group_list_type in (0, None):
        require(
            all(v >= 0 for v in values) and all(b >= a for a, b in itertools.pairwise(values)),
            _GMM,
            "group_list_type 0: group_list must be non-negative and non-decreasing",
            _GMM_DOC,
        )
        require(
            values[-1] == m,
            _GMM,
            f"group_list_type 0: group_list's last value must equal x's rows {m}, got {values[-1]}",
            _GMM_DOC,
        )
        ends = values
    elif group_list_type == 1:
        require(
            all(v >= 0 for v in values) and len(values) != 1,
            _GMM,
            "group_list_type 1: group_list must be non-negative and not of length 1",
            _GMM_DOC,
        )
        require(
            sum(values) == m,
            _GMM,
            f"group_list_type 1: group_list must sum to x's rows {m}, got {sum(values)}",
            _GMM_DOC,
        )
        ends = [sum(values[: i + 1]) for i in range(len(values))]
    else:
        raise NpuValueError(
            f"{_GMM}: group_list_type must be 0, 1 or 2, got {group_list_type} ({_GMM_DOC})"
        )
    bias_rows: torch.Tensor | None = None
    if bias_list is not None:
        if len(ws) == 1:
            bias_rows = bias_list[0]
            require(
                tuple(bias_rows.shape) == (experts, n_dim),
                _GMM,
                f"bias for a 3-D weight must be [E, N] = {(experts, n_dim)}",
                _GMM_DOC,
            )
        else:
            for i, b in enumerate(bias_list):
                require_shape_1d(b, n_dim, i)
            bias_rows = torch.stack(bias_list)
    out = torch.empty(m, n_dim, dtype=torch.float32, device=xi.device)
    start = 0
    xf = xi.float()
    for e, end in enumerate(ends):
        part = xf[start:end] @ w3[e].float()
        if bias_rows is not None:
            part = part + bias_rows[e].float()
        out[start:end] = part
        start = end
    return [out.to(dtype)]


def _inner_limit(k_dim: int, n_dim: int) -> None:
    require(
        k_dim < 65536 and n_dim < 65536,
        _GMM,
        f"the last dims of x and weight must be below the inner limit 65536, got K={k_dim}, "
        f"N={n_dim}",
        _GMM_DOC,
    )


def require_shape_1d(b: torch.Tensor, n_dim: int, i: int) -> None:
    require(
        b.dim() == 1 and b.shape[0] == n_dim,
        _GMM,
        f"bias[{i}] must be 1-D [N={n_dim}], got {tuple(b.shape)}",
        _GMM_DOC,
    )


_FIN = "npu_moe_finalize_routing"
_FIN_DOC = f"torch_npu.{_FIN}, {_DOCS}torch_npu-{_FIN}.md; {_SCHEMA}"


def npu_moe_finalize_routing(
    expanded_permuted_rows: torch.Tensor,
    skip1: torch.Tensor | None,
    skip2: torch.Tensor | None,
    bias: torch.Tensor | None,
    scales: torch.Tensor | None,
    expanded_src_to_dst_row: torch.Tensor,
    export_for_source_row: torch.Tensor | None,
    drop_pad_mode: int | None = 0,
    k: int | None = 1,
) -> torch.Tensor:
    """Combine the experts' rows back into token rows:
    ``out[i] = skip1[i] + skip2[i] + sum_k scales[i,k] * (rows[src_to_dst(i,k)] +
    bias[expert(i,k)])``.

    Schema (op_plugin_functions.yaml)::

        npu_moe_finalize_routing(Tensor expanded_permuted_rows, Tensor? skip1,
            Tensor? skip2, Tensor? bias, Tensor? scales, Tensor expanded_src_to_dst_row,
            Tensor? export_for_source_row, int? drop_pad_mode=0, int? k=1) -> Tensor

    The page names the seventh argument ``expert_for_source_row`` and has no ``k``; the
    binding's names are used (a keyword call must match the binding).

    Rules (op-plugin page and its reference code):

    - expanded_permuted_rows float16 / bfloat16 / float32: (NUM_ROWS*K, H) for drop_pad_mode
      0/2, (E, C, H) for 1/3. skip1, skip2 (NUM_ROWS, H), bias (E, H), scales (NUM_ROWS, K):
      its dtype. skip2 given needs skip1 given.
    - expanded_src_to_dst_row: 1-D int32 (NUM_ROWS*K,); values in [0, NUM_ROWS*K-1] (mode
      0/2) or [-1, E*C-1] (mode 1/3, -1 = dropped, contributes nothing). Mode 0/1 read it at
      ``k*NUM_ROWS + i`` (column arrangement), 2/3 at ``i*K + k`` (row arrangement).
    - export_for_source_row: (NUM_ROWS, K) int32 in [0, E-1]; needed only when bias is given.
    - K: scales.shape[1]; without scales the binding's ``k`` (the page's reference code
      takes K = 1 there; the page does not describe ``k``).
    - Output (NUM_ROWS, H), the rows' dtype; computed in float32.
    """
    op, doc = _FIN, _FIN_DOC
    rows = expanded_permuted_rows
    same_device(
        op,
        {
            "expanded_permuted_rows": rows,
            "skip1": skip1,
            "skip2": skip2,
            "bias": bias,
            "scales": scales,
            "expanded_src_to_dst_row": expanded_src_to_dst_row,
            "export_for_source_row": export_for_source_row,
        },
    )
    mode = 0 if drop_pad_mode is None else drop_pad_mode
    require(mode in (0, 1, 2, 3), op, f"drop_pad_mode must be in [0, 3], got {mode}", doc)
    require_dtype(op, "expanded_permuted_rows", rows, FLOATS, doc)
    require_rank(op, "expanded_permuted_rows", rows, (2,) if mode in (0, 2) else (3,), doc)
    for name, t in (("skip1", skip1), ("skip2", skip2), ("bias", bias), ("scales", scales)):
        if t is not None:
            require_rank(op, name, t, (2,), doc)
            if t.dtype != rows.dtype:
                raise NpuDtypeError(
                    f"{op}: {name} must have expanded_permuted_rows' dtype {rows.dtype}, got "
                    f"{t.dtype} ({doc})"
                )
    require(
        not (skip1 is None and skip2 is not None),
        op,
        "skip2 must be None when skip1 is None",
        doc,
    )
    src = expanded_src_to_dst_row
    require_rank(op, "expanded_src_to_dst_row", src, (1,), doc)
    require_dtype(op, "expanded_src_to_dst_row", src, (torch.int32,), doc)
    top_k = scales.shape[1] if scales is not None else (1 if k is None else k)
    require(top_k > 0, op, f"K must be > 0, got {top_k}", doc)
    nk = src.shape[0]
    require(nk % top_k == 0, op, f"expanded_src_to_dst_row length {nk} must be NUM_ROWS*K", doc)
    num_rows = nk // top_k
    hidden = rows.shape[-1]
    flat = rows.reshape(-1, hidden).float()
    if mode in (0, 2):
        require(
            rows.shape[0] == nk,
            op,
            f"expanded_permuted_rows must be (NUM_ROWS*K={nk}, H), got {tuple(rows.shape)}",
            doc,
        )
        lo = 0
    else:
        lo = -1
    idx = src.to(torch.int64)
    if nk:
        require(
            int(idx.min()) >= lo and int(idx.max()) < flat.shape[0],
            op,
            f"expanded_src_to_dst_row values must lie in [{lo}, {flat.shape[0] - 1}]",
            doc,
        )
    for name, t in (("skip1", skip1), ("skip2", skip2)):
        if t is not None:
            require(
                tuple(t.shape) == (num_rows, hidden),
                op,
                f"{name} must be (NUM_ROWS, H) = {(num_rows, hidden)}, got {tuple(t.shape)}",
                doc,
            )
    if scales is not None:
        require(
            scales.shape[0] == num_rows,
            op,
            f"scales must be (NUM_ROWS={num_rows}, K)",
            doc,
        )
    experts_of: torch.Tensor | None = None
    if bias is not None:
        require(bias.shape[1] == hidden, op, f"bias must be (E, H={hidden})", doc)
        require(
            export_for_source_row is not None,
            op,
            "export_for_source_row (the experts of each row) is needed with a bias",
            doc,
        )
        assert export_for_source_row is not None
        require_dtype(op, "export_for_source_row", export_for_source_row, (torch.int32,), doc)
        require(
            tuple(export_for_source_row.shape) == (num_rows, top_k),
            op,
            f"export_for_source_row must be (NUM_ROWS, K) = {(num_rows, top_k)}",
            doc,
        )
        experts_of = export_for_source_row.to(torch.int64)
        if experts_of.numel():
            require(
                int(experts_of.min()) >= 0 and int(experts_of.max()) < bias.shape[0],
                op,
                f"export_for_source_row values must lie in [0, E-1={bias.shape[0] - 1}]",
                doc,
            )
    out = torch.zeros(num_rows, hidden, dtype=torch.float32, device=rows.device)
    if skip1 is not None:
        out += skip1.float()
    if skip2 is not None:
        out += skip2.float()
    i = torch.arange(num_rows, device=rows.device)
    for kk in range(top_k):
        pos = kk * num_rows + i if mode in (0, 1) else i * top_k + kk
        dst = idx[pos]
        valid = (dst >= 0).unsqueeze(1)
        picked = flat[dst.clamp(min=0)] * valid
        if experts_of is not None:
            assert bias is not None
            picked = picked + bias.float()[experts_of[:, kk]]
        weight = scales[:, kk].float().unsqueeze(1) if scales is not None else 1.0
        out += weight * picked
    return out.to(rows.dtype)
