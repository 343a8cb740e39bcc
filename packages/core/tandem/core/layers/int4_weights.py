"""A 4-bit linear layer's parameters (GPTQ or AWQ): what each rank holds, how its shard is cut
from the checkpoint tensors, and the kernel layout they are packed into once, after loading.

Checkpoint layout (``kernels/reference/int4_packing.py`` has the rules and their sources):
GPTQ ``qweight`` int32 [K / 8, N], ``qzeros`` int32 [G, N / 8], ``scales`` [G, N], ``g_idx``
[K]; AWQ ``qweight`` int32 [K, N / 8] (packed along the outputs), the same ``qzeros`` and
``scales`` in its own nibble order, no ``g_idx``.

Tensor parallelism, as vLLM shards them (``auto_gptq.py``, ``marlin_repeat_scales_on_all_ranks``;
its older ``gptq.py`` for activation order):

- split by outputs (column-parallel): every tensor's N columns; ``qzeros`` by whole words, so
  each rank's outputs (and each fused part's) must be a multiple of 8; ``g_idx`` whole;
- split by inputs (row-parallel): ``qweight`` by whole words, ``g_idx`` by inputs, and the
  groups with them, so the group size must divide a rank's inputs (a group never straddles two
  ranks); one group per channel (``group_size`` -1) or activation order (a rank's inputs then
  belong to any group) keep every group's scales and zeros on every rank, so a rank's inputs
  need not be whole groups there (vLLM refuses such sizes even in activation order; here
  they serve, through ``g_idx`` where the rank's groups are uneven).

The kernel layout (``finish_loading``): ``qweight`` repacked output-major, int32 [N, K / 8] (a
row of codes per output, so the dequantized weight is the [N, K] ``F.linear`` takes),
``scales`` [N, G], ``qzeros`` the true zero points uint8 [N, G] (8 for a symmetric checkpoint,
whatever it stores, as vLLM's ``uint4b8`` type reads it; else the stored value plus one), and
``g_idx`` int64 only for activation order (else empty: groups are consecutive inputs). An
activation-order layer whose groups allow it has its inputs sorted by group instead, and its
activations gathered into that order on each call (``input_order``).

Routed experts stack one such set per expert (``experts``): every parameter gains a leading
expert axis, each expert's entry laid out, sharded and packed as above.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from tandem.core.kernels.npu.layouts import NpuInt4Weight
from tandem.core.kernels.reference.int4_packing import (
    AWQ_ORDER,
    PACK,
    pack_int4,
    unpack_int4,
)
from tandem.core.layers.quant_scheme import AWQ_LAYOUT, W4A16Scheme

# Symmetric 4-bit codes are centred on 8 (vLLM's uint4b8).
_SYMMETRIC_ZERO = 8
# AutoGPTQ stores each zero point minus one (checkpoint_format "gptq").
_STORED_ZERO_OFFSET = 1
_NAMES = ("qweight", "qzeros", "scales", "g_idx")


@dataclass(frozen=True)
class Split:
    """How a parameter is cut from its checkpoint tensor along one axis: the dimension, and
    how many channels one entry of that dimension covers (8 inputs a ``qweight`` word, a
    group's inputs a ``scales`` row)."""

    dim: int
    per_entry: int


def check_packable(size: int, what: str) -> None:
    if size % PACK:
        raise ValueError(
            f"{what} ({size}) is not a multiple of {PACK}: GPTQ packs {PACK} 4-bit codes per "
            "int32 word, so 4-bit checkpoints need it (per tensor-parallel rank)"
        )


class Int4Parameters:
    """Registers and describes one layer's 4-bit parameters (``rows`` outputs, ``columns``
    inputs of this rank, out of ``full_columns``), in the checkpoint's layout until
    ``finish_loading`` repacks them for the kernel; with ``experts``, one such layer per
    routed expert, stacked along a leading axis (the splits then describe each expert's
    entry)."""

    def __init__(
        self,
        module: nn.Module,
        rows: int,
        columns: int,
        full_columns: int,
        scheme: W4A16Scheme,
        experts: int | None = None,
    ) -> None:
        check_packable(rows, "a layer's output size")
        check_packable(columns, "a layer's input size")
        size = scheme.group_size
        # Whether each rank keeps every group (else the groups of its own inputs).
        self.whole_groups = size == -1 or scheme.desc_act
        # Only then may a rank hold part of a group (``int4_shard_check`` agrees).
        if not self.whole_groups and columns % size:
            raise ValueError(
                f"a layer's input size per rank ({columns}) is not a multiple of the group "
                f"size {size}: a quantization group would straddle two tensor-parallel "
                "ranks; use fewer ranks, or a checkpoint with a smaller group size"
            )
        groups = 1 if size == -1 else (full_columns if scheme.desc_act else columns) // size
        self.scheme = scheme
        self.group_inputs = size

        lead = () if experts is None else (experts,)
        self.experts = experts

        def param(*shape: int, dtype: torch.dtype | None = None) -> nn.Parameter:
            return nn.Parameter(torch.empty(*lead, *shape, dtype=dtype), requires_grad=False)

        self.awq = scheme.layout == AWQ_LAYOUT
        packed = (columns, rows // PACK) if self.awq else (columns // PACK, rows)
        module.register_parameter("qweight", param(*packed, dtype=torch.int32))
        module.register_parameter("qzeros", param(groups, rows // PACK, dtype=torch.int32))
        module.register_parameter("scales", param(groups, rows))
        if not self.awq:
            module.register_parameter("g_idx", param(columns, dtype=torch.int32))
        # Looked up by name on each use: moving the module (``_apply``) may replace them.
        self._module = module
        # The checkpoint tensor whose g_idx a fused layer took first (its parts must agree),
        # by expert (None for a plain layer).
        self.g_idx_from: dict[int | None, str] = {}
        # Whether the parameters hold the kernel layout yet (``finish_loading``).
        self.packed = False
        # The layout torch_npu's op reads, where the NPU packing step made it
        # (``layers/npu_packing.py``); the parameters are then emptied.
        self.npu: NpuInt4Weight | None = None

    def _param(self, name: str) -> nn.Parameter:
        param = self._module._parameters[name]
        assert param is not None
        return param

    @property
    def qweight(self) -> nn.Parameter:
        return self._param("qweight")

    @property
    def qzeros(self) -> nn.Parameter:
        return self._param("qzeros")

    @property
    def scales(self) -> nn.Parameter:
        return self._param("scales")

    @property
    def g_idx(self) -> nn.Parameter:
        return self._param("g_idx")

    def owns(self, param: nn.Parameter) -> bool:
        return any(param is self._module._parameters.get(n) for n in _NAMES)

    def kernel_g_idx(self) -> torch.Tensor | None:
        """Each input's group, for the kernel; None: consecutive groups (also activation
        order once its inputs are sorted by group, ``_order_inputs_by_group``)."""
        if self.awq or not self.scheme.desc_act or self.g_idx.numel() == 0:
            return None
        return self.g_idx

    def output_split(self, param: nn.Parameter) -> Split | None:
        """Where ``param`` holds output channels (None: ``g_idx``, which has none)."""
        if not self.awq and param is self.g_idx:
            return None
        packed = param is self.qzeros or (self.awq and param is self.qweight)
        return Split(dim=1, per_entry=PACK if packed else 1)

    def input_split(self, param: nn.Parameter) -> Split | None:
        """Where ``param`` holds input channels (None: the same whole tensor on every rank)."""
        if param is self.qweight:
            return Split(dim=0, per_entry=1 if self.awq else PACK)
        if not self.awq and param is self.g_idx:
            return Split(dim=0, per_entry=1)
        if self.whole_groups:
            return None
        return Split(dim=0, per_entry=self.group_inputs)

    def check_shared_g_idx(
        self, loaded: torch.Tensor, name: str, expert: int | None = None
    ) -> bool:
        """For a fused layer's parts (of routed ``expert``): False when ``loaded`` is the first
        g_idx (copy it), True when an earlier part's is there (it must be the same)."""
        first = self.g_idx_from.get(expert)
        if first is None:
            self.g_idx_from[expert] = name
            return False
        held = self.g_idx.data if expert is None else self.g_idx.data[expert]
        if not torch.equal(held, loaded.to(torch.int32)):
            raise ValueError(
                f"checkpoint tensors {first} and {name} give the inputs different "
                "groups; projections this engine fuses must share g_idx"
            )
        return True

    def finish_loading(self, name: str) -> None:
        """Repack the loaded checkpoint tensors into the kernel layout (once: a second call
        changes nothing); each expert's apart, where they are stacked."""
        if self.packed:
            return
        self.packed = True
        names = ("qweight", "qzeros", "scales") if self.awq else _NAMES
        held = [self._param(n).data for n in names]
        if self.experts is None:
            repacked = self._repack(held, name)
        else:
            each = [self._repack([t[e] for t in held], f"{name}.{e}") for e in range(self.experts)]
            repacked = [torch.stack(parts) for parts in zip(*each, strict=True)]
        for n, tensor in zip(names, repacked, strict=True):
            self._param(n).data = tensor
        if self.experts is None and not self.awq and self.scheme.desc_act:
            self._order_inputs_by_group()

    def _order_inputs_by_group(self) -> None:
        """Activation order, made consecutive groups: the inputs (weight columns) sorted by
        group, and each call's activations gathered into that order (``input_order``), so the
        kernels that read consecutive groups serve the layer (vLLM's Marlin does the same).
        Done where every group this rank uses has the same number of its inputs, each a
        whole number of packed words (always for a whole layer: GPTQ gives each group
        ``group_size`` inputs); else the layer keeps ``g_idx`` and the reference."""
        g_idx = self.g_idx.data
        if g_idx.numel() == 0:
            return
        order = torch.argsort(g_idx, stable=True)
        used, counts = torch.unique_consecutive(g_idx[order], return_counts=True)
        if not bool((counts == counts[0]).all()) or int(counts[0]) % PACK:
            return
        if not torch.equal(order, torch.arange(order.numel())):
            codes = unpack_int4(self.qweight.data, dim=1)
            self.qweight.data = pack_int4(codes[:, order], dim=1)
            self._module.register_buffer("input_order", order, persistent=False)
        self.scales.data = self.scales.data[:, used].contiguous()
        self.qzeros.data = self.qzeros.data[:, used].contiguous()
        self.g_idx.data = g_idx.new_empty(0)

    def input_order(self) -> torch.Tensor | None:
        """The activations' columns in the order the packed inputs are (None: as they come)."""
        order: torch.Tensor | None = self._module._buffers.get("input_order")
        return order

    def _repack(self, held: list[torch.Tensor], name: str) -> list[torch.Tensor]:
        """One layer's checkpoint tensors (``qweight``, ``qzeros``, ``scales`` and, GPTQ,
        ``g_idx``) in the kernel layout, in that order."""
        if self.awq:
            qweight, qzeros, scales = held
            codes = unpack_int4(qweight, dim=1, order=AWQ_ORDER)
            # AWQ stores zero points as they are.
            zeros = unpack_int4(qzeros, dim=1, order=AWQ_ORDER)
            return [pack_int4(codes.t(), dim=1), zeros.t().contiguous(), scales.t().contiguous()]
        qweight, qzeros, scales, stored_g_idx = held
        g_idx = stored_g_idx.long()
        groups = scales.shape[0]
        if self.scheme.desc_act:
            # Every rank holds every group: g_idx indexes them directly.
            if g_idx.numel() and (int(g_idx.min()) < 0 or int(g_idx.max()) >= groups):
                raise ValueError(f"{name}.g_idx names groups outside 0..{groups - 1}")
        else:
            # Without activation order the groups must be consecutive runs of inputs.
            runs = g_idx - g_idx[:1]
            expected = (
                torch.zeros_like(g_idx)
                if self.group_inputs == -1
                else torch.arange(g_idx.numel()) // self.group_inputs
            )
            if not torch.equal(runs, expected):
                raise ValueError(
                    f"{name}.g_idx is not consecutive groups of {self.group_inputs} inputs, "
                    "but quantization_config.desc_act is false"
                )
        codes = unpack_int4(qweight, dim=0)
        if self.scheme.sym:
            zeros = torch.full(scales.shape, _SYMMETRIC_ZERO, dtype=torch.uint8)
        else:
            # No wrap: a stored 15 reads 16, as AutoGPTQ's own kernels read it (a zero point
            # of 0 cannot be stored in this format; our writer never needs one).
            zeros = unpack_int4(qzeros, dim=1) + _STORED_ZERO_OFFSET
        return [
            pack_int4(codes.t(), dim=1),
            zeros.t().contiguous(),
            scales.t().contiguous(),
            g_idx if self.scheme.desc_act else g_idx.new_empty(0),
        ]
