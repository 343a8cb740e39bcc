"""The CPU device runtime: each CPU "device" is a worker identity with its own thread."""

from __future__ import annotations

import ctypes
import ctypes.util
import errno
import logging
import mmap
import os
import threading
from collections.abc import Callable, Iterable
from typing import Any

import torch

from tandem.device.device import Device
from tandem.device.memory_info import MemoryInfo
from tandem.device.task_thread import TaskThread

logger = logging.getLogger(__name__)


def _meminfo_bytes(field: str) -> int | None:
    try:
        with open("/proc/meminfo", encoding="ascii") as handle:
            for line in handle:
                if line.startswith(field + ":"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def cpuinfo_field(name: str) -> str | None:
    """The value of the first ``name`` line of /proc/cpuinfo, None where there is none."""
    try:
        with open("/proc/cpuinfo", encoding="ascii", errors="replace") as handle:
            for line in handle:
                key, sep, value = line.partition(":")
                if sep and key.strip() == name:
                    return value.strip()
    except OSError:
        pass
    return None


def cpu_flags() -> frozenset[str]:
    """The instruction-set flags the kernel reports for this CPU (empty where there is no
    /proc/cpuinfo): what decides, for instance, whether bfloat16 matmuls are fast here."""
    return frozenset((cpuinfo_field("flags") or "").split())


def cpu_vendor() -> str:
    """The CPU's vendor as /proc/cpuinfo names it (``GenuineIntel``, ``AuthenticAMD``), or
    an empty string where it does not say (no /proc/cpuinfo, or an Arm CPU)."""
    return cpuinfo_field("vendor_id") or ""


# glibc mallopt parameters.
_M_TRIM_THRESHOLD = -1
_M_MMAP_MAX = -4
_M_ARENA_MAX = -8
# Enough arenas that worker and lane threads rarely wait on one another's malloc; few
# enough that freed activations (kept in each arena, see below) are not held once per thread.
_ARENAS = 4


def keep_freed_memory_in_heap() -> bool:
    """Make glibc serve big blocks from the heap and keep them after free.

    torch's CPU allocator has no cache: every step allocates the same multi-MB activations
    again, and glibc hands blocks that large out as fresh mmap()s, each paying a page fault
    and kernel zeroing per 4 KiB page. Measured on the demo model (48 sequences, ~330
    tokens of context), that was half of every decode step. Process-wide, once; a no-op
    where the C library is not glibc.
    """
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    mallopt.restype = ctypes.c_int
    no_mmap: int = mallopt(_M_MMAP_MAX, 0)
    no_trim: int = mallopt(_M_TRIM_THRESHOLD, 2**31 - 1)
    arenas: int = mallopt(_M_ARENA_MAX, _ARENAS)
    return no_mmap == 1 and no_trim == 1 and arenas == 1


def release_freed_memory() -> bool:
    """Hand the heap's free pages back to the system (glibc's malloc_trim), which
    keep_freed_memory_in_heap otherwise keeps for good: for after a rare, large, one-off
    allocation (a grammar whose lexer blew its budget) rather than after every step. False
    where the C library is not glibc."""
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        malloc_trim = libc.malloc_trim
    except (OSError, AttributeError):
        return False
    malloc_trim.argtypes = [ctypes.c_size_t]
    malloc_trim.restype = ctypes.c_int
    malloc_trim(0)
    return True


_MADV_HUGEPAGE = 14
_HUGE_PAGE = 2 << 20


def _madvise() -> Callable[[int, int, int], int] | None:
    """libc's madvise, with errno kept for ``ctypes.get_errno``; None where there is none."""
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
        madvise = libc.madvise
    except (OSError, AttributeError):
        return None
    madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    madvise.restype = ctypes.c_int
    return madvise


def advise_huge_pages(tensor: torch.Tensor) -> bool:
    """Ask Linux to back the 2 MiB-aligned part of a CPU tensor's memory with huge pages
    when it is first touched (call before filling it); False where that cannot be asked.

    For big tensors that live as long as the process, like the KV cache: attention reads it
    block by block from scattered places, and with 4 KiB pages every block costs TLB misses
    and restarts the hardware prefetchers at each page (measured: decode steps ~2-3%
    faster on the bench model). Not for activations: 2 MiB pages for every large
    allocation (torch's THP_MEM_ALLOC_ENABLE) made the resident size jump between steps.
    Where transparent huge pages are off ("never"), the advice is accepted and ignored.
    Memory already touched keeps its small pages (khugepaged may merge them later): a
    tensor under glibc's mmap threshold (up to 32 MiB) can reuse such heap memory.
    """
    if tensor.device.type != "cpu" or tensor.numel() == 0:
        return False
    start = tensor.data_ptr()
    end = start + tensor.numel() * tensor.element_size()
    first = -(-start // _HUGE_PAGE) * _HUGE_PAGE
    last = end // _HUGE_PAGE * _HUGE_PAGE
    if last <= first:
        return False
    madvise = _madvise()
    if madvise is None:
        return False
    return int(madvise(first, last - first, _MADV_HUGEPAGE)) == 0


_MADV_COLLAPSE = 25


def huge_page_runs(ranges: Iterable[tuple[int, int]]) -> list[tuple[int, int]]:
    """The 2 MiB-aligned spans, merged, that cover the byte ranges ``(start, end)``."""
    pages = sorted(
        {
            page
            for start, end in ranges
            if end > start
            for page in range(start // _HUGE_PAGE, -(-end // _HUGE_PAGE))
        }
    )
    runs: list[tuple[int, int]] = []
    for page in pages:
        if runs and runs[-1][1] == page * _HUGE_PAGE:
            runs[-1] = (runs[-1][0], (page + 1) * _HUGE_PAGE)
        else:
            runs.append((page * _HUGE_PAGE, (page + 1) * _HUGE_PAGE))
    return runs


def tensor_bytes(tensor: torch.Tensor) -> tuple[int, int]:
    """Where a plain (strided, contiguous) tensor's bytes lie: [start, end)."""
    start = tensor.data_ptr()
    return start, start + tensor.numel() * tensor.element_size()


def collapse_to_huge_pages(ranges: Iterable[tuple[int, int]]) -> int:
    """Move memory already written, such as weights packed at load, onto 2 MiB pages
    (Linux's MADV_COLLAPSE, 6.1 and later); returns how many bytes moved, 0 where it
    cannot be done. The data stays as it is.

    Whole huge pages are collapsed, so the ranges' neighbours in the heap may move too:
    harmless, since every page stays mapped and holds what it held. A decode step streams
    every weight once, and on 4 KiB pages that is a TLB miss every 4 KiB, with the hardware
    prefetchers stopping at each page (measured on an AMX Xeon, 33 packed weights of the
    bench model at 48 rows: bfloat16 3-13% and float32 4% less GEMM time). Unlike
    ``advise_huge_pages`` this needs no say over where the memory was allocated: oneDNN
    allocates the packed weights itself.
    """
    madvise = _madvise()
    if madvise is None:
        return 0
    runs = huge_page_runs(ranges)
    moved = 0
    for first, last in runs:
        # Page by page, so that one page that cannot move (EINVAL where THP is "never" or
        # on memory that is not plain anonymous; EAGAIN/ENOMEM without a free huge page)
        # leaves only itself on small pages.
        for page in range(first, last, _HUGE_PAGE):
            if int(madvise(page, _HUGE_PAGE, _MADV_COLLAPSE)) == 0:
                moved += _HUGE_PAGE
            elif page == runs[0][0] and ctypes.get_errno() == errno.EINVAL:
                # A kernel before Linux 6.1 does not know MADV_COLLAPSE and answers every
                # call so: no later page or run could move, and none was asked before.
                return 0
    return moved


_MADV_POPULATE_WRITE = 23
# The base page (4 KiB on x86, up to 64 KiB on arm64): madvise wants its starts aligned.
_SMALL_PAGE = mmap.PAGESIZE
# Pages are populated in steps this large, so a multi-GiB pool reports its progress.
_POPULATE_STEP = 256 << 20


def populate_pages(
    tensor: torch.Tensor, progress: Callable[[int, int], None] | None = None
) -> None:
    """Back every page of a contiguous CPU tensor with memory now, keeping what it holds, as
    its first writes would (Linux's MADV_POPULATE_WRITE, 5.14 and later; before that, one
    write per page of the byte already there). ``progress(done, total)`` follows in bytes.

    For a big tensor whose pages would otherwise be first touched on a hot path (the KV
    cache: kv/kv_cache.py's prefault_host_cache says what that costs). Where the memory is
    not there, this fails now (MemoryError) instead of the process being killed later.
    """
    if tensor.device.type != "cpu" or tensor.numel() == 0:
        return
    if not tensor.is_contiguous():
        raise ValueError("populate_pages takes a contiguous tensor")
    start, end = tensor_bytes(tensor)
    madvise = _madvise()
    for done in range(start, end, _POPULATE_STEP):
        step_end = min(done + _POPULATE_STEP, end)
        if madvise is not None and not _advise_populate(madvise, done, step_end):
            madvise = None
        if madvise is None:
            _touch_pages(tensor, done - start, step_end - start)
        if progress is not None:
            progress(step_end - start, end - start)


def _advise_populate(madvise: Callable[[int, int, int], int], first: int, last: int) -> bool:
    """MADV_POPULATE_WRITE over bytes [first, last); False where the kernel does not know it."""
    page = first // _SMALL_PAGE * _SMALL_PAGE
    if int(madvise(page, last - page, _MADV_POPULATE_WRITE)) == 0:
        return True
    code = ctypes.get_errno()
    if code == errno.ENOMEM:
        raise MemoryError(f"could not back {last - first} bytes with memory: {os.strerror(code)}")
    # EINVAL from a kernel before 5.14, which does not know the advice.
    return False


def _touch_pages(tensor: torch.Tensor, first: int, last: int) -> None:
    """Write each page's first byte within bytes [first, last) of ``tensor`` back in place."""
    flat = tensor.reshape(-1).view(torch.uint8)[first:last]
    offset = -tensor_bytes(tensor)[0] - first
    # The first byte of every page the range reaches (the range's own first byte first).
    head = flat[:1]
    head.copy_(head.clone())
    pages = flat[offset % _SMALL_PAGE :: _SMALL_PAGE]
    pages.copy_(pages.clone())


class CpuRuntime:
    kind = "cpu"
    kernel_families: tuple[str, ...] = ("cpu",)

    def __init__(self) -> None:
        self._local = threading.local()
        if not keep_freed_memory_in_heap():
            logger.info("could not tune malloc (not glibc?); CPU steps will page-fault more")

    def bind(self, device: Device) -> None:
        if device.kind != "cpu":
            raise ValueError(f"the CPU runtime cannot bind {device}")
        # torch's own setter, so code that asks torch for the current device stays consistent.
        torch.cpu.set_device(str(device.torch_device()))
        self._local.device = device

    def torch_device(self, device: Device) -> torch.device:
        return device.torch_device()

    def current_device(self) -> Device | None:
        device: Device | None = getattr(self._local, "device", None)
        return device

    def current_stream(self) -> Any:
        return torch.cpu.current_stream()

    def synchronize(self) -> None:
        torch.cpu.synchronize()

    def memory_info(self, device: Device) -> MemoryInfo:
        total = _meminfo_bytes("MemTotal")
        free = _meminfo_bytes("MemAvailable")
        if total is None or free is None:
            pages = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
            return MemoryInfo(total_bytes=pages, free_bytes=pages)
        return MemoryInfo(total_bytes=total, free_bytes=free)

    def load_kernel(
        self, name: str, impl: Callable[..., Any], device: Device
    ) -> Callable[..., Any]:
        # CPU kernels are the Python/torch implementations themselves.
        return impl

    def new_stream(self, name: str) -> TaskThread:
        # A CPU stream is an ordered executor of its own: a thread that runs work in order.
        return TaskThread(name)

    def device_count(self) -> int:
        # CPU devices are logical: as many as the user names.
        return os.cpu_count() or 1
