"""Backing a CPU tensor's pages with memory up front (populate_pages): every page resident
afterwards, by Linux's own account (mincore(2)), and every byte as it was, on both paths
(MADV_POPULATE_WRITE, and one write per page where the kernel lacks it)."""

from __future__ import annotations

import ctypes
import ctypes.util
import errno
import mmap
import sys
from collections.abc import Callable

import pytest
import torch

from tandem.device import cpu
from tandem.device.cpu import populate_pages

linux = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="Linux's madvise/mincore")
PAGE = mmap.PAGESIZE


def _resident_pages(start: int, length: int) -> list[bool]:
    """Per page from the one holding ``start``: whether it is backed by memory (mincore)."""
    libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
    first = start // PAGE * PAGE
    pages = -(-(start + length - first) // PAGE)
    vec = (ctypes.c_ubyte * pages)()
    libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
    assert libc.mincore(first, pages * PAGE, vec) == 0, ctypes.get_errno()
    return [bool(v & 1) for v in vec]


def _fresh(nbytes: int) -> tuple[mmap.mmap, torch.Tensor]:
    """A private anonymous mapping, none of it touched yet, as a uint8 tensor."""
    mapping = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    return mapping, torch.frombuffer(mapping, dtype=torch.uint8, count=nbytes)


def _failing_madvise(code: int) -> Callable[[], Callable[[int, int, int], int]]:
    def madvise(address: int, length: int, advice: int) -> int:
        ctypes.set_errno(code)
        return -1

    return lambda: madvise


@linux
@pytest.mark.parametrize("path", ["madvise", "writes"])
def test_every_page_is_backed_and_keeps_its_bytes(
    path: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    if path == "writes":
        # A kernel before 5.14 answers MADV_POPULATE_WRITE with EINVAL.
        monkeypatch.setattr(cpu, "_madvise", _failing_madvise(errno.EINVAL))
    # Small steps, so that the walk crosses several of them.
    monkeypatch.setattr(cpu, "_POPULATE_STEP", 5 * PAGE + 123)
    _mapping, whole = _fresh(64 * PAGE)
    # A tensor that starts and ends inside a page, with bytes already written in some.
    tensor = whole[PAGE + 100 : 40 * PAGE + 77].view(torch.uint8)
    tensor[:10] = 3
    tensor[7 * PAGE : 7 * PAGE + 5] = 9
    # In the page before the last, which (partial, 177 bytes) nothing touches before.
    tensor[-200] = 5
    before = _resident_pages(tensor.data_ptr(), tensor.numel())
    assert not all(before)
    reported: list[tuple[int, int]] = []
    populate_pages(tensor, lambda done, total: reported.append((done, total)))
    assert all(_resident_pages(tensor.data_ptr(), tensor.numel()))
    expected = torch.zeros_like(tensor)
    expected[:10] = 3
    expected[7 * PAGE : 7 * PAGE + 5] = 9
    expected[-200] = 5
    assert torch.equal(tensor, expected)
    # Nothing outside the tensor was written or backed on the writes path's account.
    assert int(whole[: PAGE + 100].count_nonzero()) == 0
    assert int(whole[40 * PAGE + 77 :].count_nonzero()) == 0
    assert [total for _, total in reported] == [tensor.numel()] * len(reported)
    assert [done for done, _ in reported] == sorted({done for done, _ in reported})
    assert len(reported) > 1 and reported[-1][0] == tensor.numel()


@linux
def test_memory_that_is_not_there_fails_at_once(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(cpu, "_madvise", _failing_madvise(errno.ENOMEM))
    _mapping, tensor = _fresh(4 * PAGE)
    with pytest.raises(MemoryError, match="could not back"):
        populate_pages(tensor)


def test_a_strided_tensor_is_refused() -> None:
    with pytest.raises(ValueError, match="contiguous"):
        populate_pages(torch.zeros(8, 8)[:, 1])
