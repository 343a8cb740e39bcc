"""A step's attention metadata reaches an accelerator without a host sync: every decision that
depends on the step's values is made on the host, the tensors cross in one copy, and the rest
is built on the device from sizes the host already knows.

The device here is ``meta``: its tensors have shapes and no values, so anything that reads a
device value back (``.item()``, ``int(t.max())``, ``nonzero()``, a Python ``bool`` of a
tensor) raises instead of waiting. Building the metadata for ``meta`` therefore fails on the
first host sync the code would make on a real device, and the copies into it are counted.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from tandem.core.kernels.attention_metadata import AttentionGroup, AttentionMetadata
from tandem.core.kernels.device_copy import to_device_once
from tandem.core.llm.attention_metadata import build_attention_metadata, plan_attention_metadata

from ..kernels.cpu.attention_steps import make_step

META = torch.device("meta")

STEPS = {
    "decodes": ([7, 40, 16, 130], []),
    "prefills": ([], [(0, 9), (21, 5), (0, 33)]),
    "mixed": ([3, 64], [(16, 16), (0, 1), (40, 7)]),
}


class HostToDeviceCopies(TorchDispatchMode):  # type: ignore[no-untyped-call]  # torch leaves it untyped
    """Counts copies whose source is on the host and whose result is on the meta device."""

    def __init__(self) -> None:
        super().__init__()  # type: ignore[no-untyped-call]
        self.copies = 0

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        sources = [a for a in args if isinstance(a, torch.Tensor)]
        if (
            func.overloadpacket in (torch.ops.aten._to_copy, torch.ops.aten.copy_)
            and any(t.device.type == "cpu" for t in sources)
            and isinstance(out, torch.Tensor)
            and out.device.type == "meta"
        ):
            self.copies += 1
        return out


def fields(obj: object | None, prefix: str) -> list[tuple[str, torch.Tensor]]:
    """The device tensors: the ``host_`` ones stay on the host by design (torch_npu's
    attention takes its lengths there)."""
    if obj is None:
        return []
    items = vars(obj).items()
    return [
        (f"{prefix}.{k}", v)
        for k, v in items
        if isinstance(v, torch.Tensor) and not k.startswith("host_")
    ]


def tensors_of(meta: AttentionMetadata) -> list[tuple[str, torch.Tensor]]:
    linear = meta.linear
    return [
        ("slot_mapping", meta.slot_mapping),
        *fields(meta.decode, "decode"),
        *fields(meta.prefill, "prefill"),
        *fields(linear, "linear"),
        *fields(linear.prefill if linear else None, "linear.prefill"),
    ]


@pytest.mark.parametrize("conv_kernel_size", [None, 4])
@pytest.mark.parametrize("step", sorted(STEPS))
def test_metadata_is_built_for_the_device_without_reading_it_back(
    step: str, conv_kernel_size: int | None
) -> None:
    fi = make_step(*STEPS[step], block_size=16, num_blocks=64, gen=torch.Generator().manual_seed(1))
    on_host = build_attention_metadata(fi, torch.device("cpu"), conv_kernel_size)
    plan = plan_attention_metadata(fi, conv_kernel_size)
    with HostToDeviceCopies() as counted:
        on_device = plan.finish(to_device_once(plan.tensors, META), META)
    assert counted.copies == 1
    host, device = tensors_of(on_host), tensors_of(on_device)
    assert [name for name, _ in device] == [name for name, _ in host]
    for (name, want), (_, got) in zip(host, device, strict=True):
        assert got.device == META, name
        assert (got.shape, got.dtype) == (want.shape, want.dtype), name
    assert on_device.slot_mapping_int32().device == META
    for group in (on_device.decode, on_device.prefill):
        assert group is None or isinstance(group, AttentionGroup)
        if group is not None:
            assert group.block_table_int32().device == META
            assert group.host_kv_lens is not None and group.host_kv_lens.device.type == "cpu"
            assert group.host_kv_lens.dtype == torch.int32


def test_the_old_way_would_have_been_caught() -> None:
    """The check itself: reading a meta tensor's value back raises."""
    lens = torch.tensor([3, 5]).to(META)
    with pytest.raises((RuntimeError, NotImplementedError)):
        int(lens.max())


def test_one_copy_keeps_each_tensors_dtype_and_shape() -> None:
    parts = [torch.arange(6).view(2, 3), torch.tensor([True, False, True]), torch.arange(5)]
    moved = to_device_once(parts, META)
    assert [(t.dtype, t.shape) for t in moved] == [(t.dtype, t.shape) for t in parts]
    assert to_device_once(parts, torch.device("cpu"))[0] is parts[0]
