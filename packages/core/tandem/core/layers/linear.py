"""Column- and row-parallel linear layers; each rank holds and loads only its shard."""

from __future__ import annotations

import torch
from torch import nn

from tandem.collectives import ProcessGroup
from tandem.core.layers.quant_scheme import QuantScheme, projection_scheme
from tandem.core.layers.quantized_linear import QuantizableLinear
from tandem.core.layers.weights import LazyTensor, copy_checked, read_shard


def _divide(total: int, parts: int, what: str) -> int:
    if total % parts:
        raise ValueError(f"{what} ({total}) is not divisible by the tensor-parallel size {parts}")
    return total // parts


class ColumnParallelLinear(QuantizableLinear):
    """y = x W^T + b with W split by output rows; the output stays sharded. Quantized
    (``quant``), the per-channel weight scales split with the rows."""

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool,
        group: ProcessGroup,
        quant: QuantScheme | None = None,
        input_sources: int = 1,
    ):
        super().__init__()
        self.group = group
        self.out_per_rank = _divide(out_features, group.size, "output size")
        self.make_weight(self.out_per_rank, in_features, quant, input_sources)
        self.bias = (
            nn.Parameter(torch.empty(self.out_per_rank), requires_grad=False) if bias else None
        )

    def load_weight(self, param: nn.Parameter, loaded: LazyTensor, name: str) -> None:
        if param is self.input_scale:
            self.load_input_scale(loaded, 0, name)
            return
        start = self.group.rank * self.out_per_rank
        self.load_output_rows(param, loaded, name, start, self.out_per_rank)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.matmul(x, self.bias)


class MergedColumnParallelLinear(ColumnParallelLinear):
    """Several column-parallel projections of one input fused into one matmul (gate/up)."""

    def __init__(
        self,
        in_features: int,
        out_sizes: list[int],
        bias: bool,
        group: ProcessGroup,
        quant: QuantScheme | None = None,
    ):
        super().__init__(in_features, sum(out_sizes), bias, group, quant, len(out_sizes))
        self.shard_sizes = [_divide(s, group.size, "output size") for s in out_sizes]

    def load_shard(self, param: nn.Parameter, loaded: LazyTensor, shard: int, name: str) -> None:
        if param is self.input_scale:
            self.load_input_scale(loaded, shard, name)
            return
        size = self.shard_sizes[shard]
        offset = sum(self.shard_sizes[:shard])
        self.load_output_rows(param, loaded, name, self.group.rank * size, size, offset)


class QKVParallelLinear(ColumnParallelLinear):
    """Fused q/k/v projection; query heads split across ranks, KV heads split or replicated
    (when there are fewer KV heads than ranks, each rank keeps the one its query heads use).
    With ``gated_query`` each query head is followed by its output gate (Qwen3.5's q_proj)."""

    def __init__(
        self,
        hidden_size: int,
        head_dim: int,
        num_heads: int,
        num_kv_heads: int,
        bias: bool,
        group: ProcessGroup,
        gated_query: bool = False,
        quant: QuantScheme | None = None,
    ):
        tp = group.size
        self.num_heads = _divide(num_heads, tp, "number of attention heads")
        if num_kv_heads >= tp:
            self.num_kv_heads = _divide(num_kv_heads, tp, "number of KV heads")
            kv_start = group.rank * self.num_kv_heads
        else:
            _divide(tp, num_kv_heads, "tensor-parallel size over KV heads")
            self.num_kv_heads = 1
            kv_start = group.rank * num_kv_heads // tp
        self.head_dim = head_dim
        q_size = self.num_heads * head_dim * (2 if gated_query else 1)
        kv_size = self.num_kv_heads * head_dim
        super().__init__(hidden_size, (q_size + 2 * kv_size) * tp, bias, group, quant, 3)
        # (offset in this rank's fused output, size, start row in the checkpoint tensor)
        self._layout = {
            "q": (0, q_size, group.rank * q_size),
            "k": (q_size, kv_size, kv_start * head_dim),
            "v": (q_size + kv_size, kv_size, kv_start * head_dim),
        }

    def load_shard(self, param: nn.Parameter, loaded: LazyTensor, shard: str, name: str) -> None:
        if param is self.input_scale:
            self.load_input_scale(loaded, "qkv".index(shard), name)
            return
        offset, size, start = self._layout[shard]
        self.load_output_rows(param, loaded, name, start, size, offset)


class RowParallelLinear(QuantizableLinear):
    """y = x W^T + b with W split by input columns; partial sums are all-reduced. Quantized
    (``quant``), every rank holds all the per-channel weight scales and the ranks reduce
    exact int32 sums (``reduced_int8_matmul``)."""

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool,
        group: ProcessGroup,
        *,
        quant: QuantScheme | None = None,
    ):
        super().__init__()
        self.group = group
        self.in_per_rank = _divide(in_features, group.size, "input size")
        self.make_weight(out_features, self.in_per_rank, quant, full_columns=in_features)
        self.bias = nn.Parameter(torch.empty(out_features), requires_grad=False) if bias else None

    def load_weight(self, param: nn.Parameter, loaded: LazyTensor, name: str) -> None:
        if param is self.input_scale:
            self.load_input_scale(loaded, 0, name)
            return
        split = self.input_split(param)
        if split is None:  # bias, per-channel weight scales: whole on every rank
            copy_checked(param.data, read_shard(loaded, 0, 0, loaded.get_shape()[0]), name)
            return
        n = split.per_entry
        start = self.group.rank * self.in_per_rank
        copy_checked(
            param.data, read_shard(loaded, split.dim, start // n, self.in_per_rank // n), name
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.group.size == 1:
            return self.matmul(x, self.bias)
        if self.weight_scale is not None:
            return self.reduced_int8_matmul(x, self.bias, self.group)
        y = self.group.all_reduce(self.matmul(x))
        return y + self.bias if self.bias is not None else y

    def partial(self, x: torch.Tensor) -> torch.Tensor:
        """This rank's partial sum, without the bias, for a caller that reduces it together
        with others."""
        return self.matmul(x)


def row_parallel_projection(
    in_features: int,
    out_features: int,
    group: ProcessGroup,
    quant: QuantScheme | None,
    projection: str,
) -> RowParallelLinear:
    """A bias-free row-parallel layer computing the checkpoint's ``projection``, quantized
    as ``quant`` says of it."""
    return RowParallelLinear(
        in_features,
        out_features,
        bias=False,
        group=group,
        quant=projection_scheme(quant, projection),
    )
