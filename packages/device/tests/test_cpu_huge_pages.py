"""Huge pages for long-lived CPU tensors (the KV cache): asked for the aligned 2 MiB part
only, before first touch, and harmless to the data."""

from __future__ import annotations

import sys

import pytest
import torch

from tandem.device.cpu import advise_huge_pages

linux = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="madvise is Linux's")


def _anon_huge_kib(tensor: torch.Tensor) -> int:
    """AnonHugePages of the mapping that holds ``tensor``'s first 2 MiB-aligned byte
    (/proc/self/smaps; the advice splits the unaligned head off into a mapping of its
    own)."""
    huge = 2 << 20
    address = -(-tensor.data_ptr() // huge) * huge
    inside = False
    with open("/proc/self/smaps", encoding="ascii") as smaps:
        for line in smaps:
            head = line.split()[0]
            if "-" in head and not head.endswith(":"):
                low, high = (int(part, 16) for part in head.split("-"))
                inside = low <= address < high
            elif inside and head == "AnonHugePages:":
                return int(line.split()[1])
    return 0


@linux
def test_a_big_tensor_is_advised_and_keeps_its_data() -> None:
    # Over glibc's largest mmap threshold (32 MiB), so the tensor is a fresh mapping: a
    # smaller one may reuse heap memory earlier tests touched (their pages are small
    # already, and the advice only shapes pages faulted in after it).
    tensor = torch.empty(64 << 20, dtype=torch.uint8)
    assert advise_huge_pages(tensor)
    tensor.fill_(7)
    assert int(tensor.min()) == 7 and int(tensor.max()) == 7
    with open("/sys/kernel/mm/transparent_hugepage/enabled", encoding="ascii") as mode:
        enabled = "[never]" not in mode.read()
    if enabled:
        # The kernel may still fall back to small pages when memory is fragmented; on a
        # fresh mapping it has not been seen to.
        assert _anon_huge_kib(tensor) >= 2048


def test_what_holds_no_whole_huge_page_is_left_alone() -> None:
    assert not advise_huge_pages(torch.empty(1 << 20, dtype=torch.uint8))
    assert not advise_huge_pages(torch.empty(0))
