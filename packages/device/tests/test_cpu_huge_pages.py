"""Huge pages for long-lived CPU tensors (the KV cache): asked for the aligned 2 MiB part
only, before first touch, and harmless to the data."""

from __future__ import annotations

import sys
from dataclasses import dataclass

import pytest
import torch

from tandem.device.cpu import advise_huge_pages

linux = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="madvise is Linux's")

_HUGE = 2 << 20


@dataclass(frozen=True)
class _Mapping:
    low: int
    high: int
    flags: frozenset[str]


def _mapping_at(address: int) -> _Mapping:
    """The mapping of this process that holds ``address`` (/proc/self/smaps)."""
    span: tuple[int, int] | None = None
    flags: frozenset[str] = frozenset()
    with open("/proc/self/smaps", encoding="ascii") as smaps:
        for line in smaps:
            head = line.split()[0]
            if "-" in head and not head.endswith(":"):
                if span is not None:
                    break
                low, high = (int(part, 16) for part in head.split("-"))
                if low <= address < high:
                    span = (low, high)
            elif span is not None and head == "VmFlags:":
                flags = frozenset(line.split()[1:])
    assert span is not None, f"no mapping holds {address:#x}"
    return _Mapping(low=span[0], high=span[1], flags=flags)


@linux
def test_a_big_tensor_is_advised_and_keeps_its_data() -> None:
    # Over glibc's largest mmap threshold (32 MiB), so the tensor is a fresh mapping of its
    # own, untouched until filled.
    tensor = torch.empty(64 << 20, dtype=torch.uint8)
    start = tensor.data_ptr()
    first = -(-start // _HUGE) * _HUGE
    last = (start + tensor.numel()) // _HUGE * _HUGE
    assert advise_huge_pages(tensor)
    # The advice is on the whole aligned part ("hg" in VmFlags) and on nothing before it:
    # the unaligned head is split off into a mapping of its own without it.
    advised = _mapping_at(first)
    assert "hg" in advised.flags
    assert advised.low <= first and advised.high >= last
    if first > start:
        assert "hg" not in _mapping_at(start).flags
    tensor.fill_(7)
    assert int(tensor.min()) == 7 and int(tensor.max()) == 7
    # Whether the kernel then backs it with huge pages is its call (it falls back to small
    # pages when it has none to hand, and "never" ignores the advice), so it is not asserted:
    # CI has seen 0 kB on a fresh mapping while the same test alone got 63,488 kB.


def test_what_holds_no_whole_huge_page_is_left_alone() -> None:
    assert not advise_huge_pages(torch.empty(1 << 20, dtype=torch.uint8))
    assert not advise_huge_pages(torch.empty(0))
