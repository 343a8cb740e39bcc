"""The native CPU attention kernels (decode and prefill) through the attention layer against
the torch reference path: ragged lengths, grouped-query heads, head sizes 64 and 128, block
sizes 16 and 32, float32 and bfloat16; decode steps and prefill chunks with and without
tokens cached before them; how the kernels are built, shared and resolved through the
kernel registry. (The prefill kernel's own shapes and builds: test_prefill_attention.py.)"""

from __future__ import annotations

import logging
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any

import pytest
import torch

from tandem.core.kernels import handles
from tandem.core.kernels.attention_metadata import AttentionMetadata
from tandem.core.kernels.cpu import attention_groups, native_build
from tandem.core.kernels.cpu import paged_attention as paged_attention_cpu
from tandem.core.kernels.cpu import prefill_attention as prefill_attention_cpu
from tandem.core.kernels.cpu.attention_groups import native_group_kernel
from tandem.core.kernels.cpu.native_build import KernelBuildError
from tandem.core.kernels.cpu.paged_attention import (
    NativePagedAttention,
    build_library,
    native_paged_attention,
)
from tandem.core.kernels.cpu.prefill_attention import native_prefill_attention
from tandem.core.kernels.handle import KernelHandle
from tandem.core.kernels.reference import paged_attention as attention_reference
from tandem.core.kernels.reference.paged_attention import reference_decode, reference_prefill
from tandem.core.llm.attention_metadata import build_attention_metadata
from tandem.device import Device, KernelKey, process_kernel_registry

from .attention_steps import force_reference, make_layer, make_step, run_layer

NATIVE = native_paged_attention()
needs_native = pytest.mark.skipif(
    NATIVE is None or native_prefill_attention() is None,
    reason="no C++ compiler to build the kernels",
)


STEPS = {
    # Under 4 tokens per thread (2 threads): one work item per (token, KV head).
    "decode": ([37, 1, 300, 129, 16, 64, 17], []),
    # Enough tokens for one work item per token, all heads, reading each block front to back.
    "decode_wide": ([37, 1, 300, 129, 16, 64, 17, 90, 2, 33, 250, 48], []),
    "prefill_fresh": ([], [(0, 19), (0, 1), (0, 40)]),
    "prefill_dense": ([], [(0, 24), (0, 24), (0, 24)]),
    # Chunks after cached tokens, short and long: both parts read in place.
    "prefill_cached": ([], [(48, 7), (0, 12), (135, 9), (16, 1)]),
    "prefill_cached_long": ([], [(48, 30), (0, 12), (135, 40)]),
    "mixed": ([5, 211, 33], [(0, 9), (77, 5)]),
}


@needs_native
@pytest.mark.parametrize("step", sorted(STEPS))
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("block_size", [16, 32])
@pytest.mark.parametrize("heads", [(8, 2), (4, 4)])
def test_native_float32_matches_the_reference_path(
    step: str, head_dim: int, block_size: int, heads: tuple[int, int]
) -> None:
    gen = torch.Generator().manual_seed(hash((step, head_dim, block_size, heads)) % 2**31)
    num_blocks = 80
    shape = (num_blocks, block_size, heads[1], head_dim)
    caches = (torch.randn(shape, generator=gen), torch.randn(shape, generator=gen))
    fi = make_step(*STEPS[step], block_size=block_size, num_blocks=num_blocks, gen=gen)
    t = fi.num_tokens
    qkv = (
        torch.randn(t, heads[0], head_dim, generator=gen),
        torch.randn(t, heads[1], head_dim, generator=gen),
        torch.randn(t, heads[1], head_dim, generator=gen),
    )
    meta = build_attention_metadata(fi, torch.device("cpu"))
    native = run_layer(make_layer(heads, head_dim, caches), qkv, meta)
    reference_layer = make_layer(heads, head_dim, caches)
    force_reference(reference_layer, torch.float32)
    reference = run_layer(reference_layer, qkv, meta)
    assert (native - reference).abs().max().item() <= 1e-5


@needs_native
@pytest.mark.parametrize("step", sorted(STEPS))
def test_native_bfloat16_stays_within_rounding_of_float32(step: str) -> None:
    gen = torch.Generator().manual_seed(7)
    heads, head_dim, block_size, num_blocks = (16, 8), 64, 16, 80
    shape = (num_blocks, block_size, heads[1], head_dim)
    caches = tuple(torch.randn(shape, generator=gen).bfloat16() for _ in range(2))
    fi = make_step(*STEPS[step], block_size=block_size, num_blocks=num_blocks, gen=gen)
    t = fi.num_tokens
    qkv = tuple(
        torch.randn(t, h, head_dim, generator=gen).bfloat16() for h in (heads[0], *heads[1:] * 2)
    )
    meta = build_attention_metadata(fi, torch.device("cpu"))
    native = run_layer(make_layer(heads, head_dim, (caches[0], caches[1])), qkv, meta)
    assert native.dtype is torch.bfloat16
    # The same bfloat16 values, attended in float32 by the reference path.
    exact_layer = make_layer(heads, head_dim, (caches[0].float(), caches[1].float()))
    force_reference(exact_layer, torch.float32)
    exact = run_layer(exact_layer, tuple(x.float() for x in qkv), meta)
    error = (native.float() - exact).abs()
    if step.startswith("decode"):
        # Computed in float32, rounded once: within half a bfloat16 unit in the last place.
        assert bool((error <= exact.abs() * 2.0**-8 + 1e-5).all())
    else:
        # Prefill rounds the probabilities to bfloat16 for the value product, as torch's
        # CPU flash attention does: a couple of units at most.
        assert error.max().item() <= 2e-2


@needs_native
@pytest.mark.parametrize(
    "step", ["prefill_fresh", "prefill_cached", "prefill_cached_long", "mixed"]
)
def test_every_prefill_chunk_reads_the_cache_in_place(
    step: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Short or long, after cached tokens or not: no chunk is copied out (the reference
    way); the prefill kernel reads its cached context and its own tokens in place."""
    gen = torch.Generator().manual_seed(3)
    calls: list[str] = []

    def counted(*args: Any) -> torch.Tensor:
        calls.append("reference")
        return reference_prefill(*args)

    monkeypatch.setattr(attention_reference, "reference_prefill", counted)
    caches = (torch.randn(80, 16, 2, 64, generator=gen), torch.randn(80, 16, 2, 64, generator=gen))
    fi = make_step(*STEPS[step], block_size=16, num_blocks=80, gen=gen)
    t = fi.num_tokens
    qkv = tuple(torch.randn(t, h, 64, generator=gen) for h in (4, 2, 2))
    layer = make_layer((4, 2), 64, caches)
    run_layer(layer, qkv, build_attention_metadata(fi, torch.device("cpu")))
    assert calls == []
    assert layer._prefill._resolved is not None
    assert layer._prefill._resolved[1] not in (reference_prefill, counted)


@needs_native
def test_queries_split_from_a_wider_projection_are_read_right() -> None:
    """A gated query arrives as a strided view (query and gate interleaved per head)."""
    gen = torch.Generator().manual_seed(5)
    caches = (torch.randn(40, 16, 2, 64, generator=gen), torch.randn(40, 16, 2, 64, generator=gen))
    fi = make_step([30, 70], [(20, 3)], block_size=16, num_blocks=40, gen=gen)
    t = fi.num_tokens
    q = torch.randn(t, 4, 128, generator=gen)[..., :64]
    assert not q.is_contiguous()
    kv = tuple(torch.randn(t, 2, 64, generator=gen) for _ in range(2))
    meta = build_attention_metadata(fi, torch.device("cpu"))
    native = run_layer(make_layer((4, 2), 64, caches), (q, *kv), meta)
    reference_layer = make_layer((4, 2), 64, caches)
    force_reference(reference_layer, torch.float32)
    reference = run_layer(reference_layer, (q.contiguous(), *kv), meta)
    assert (native - reference).abs().max().item() <= 1e-5


@needs_native
def test_a_query_with_nothing_to_attend_gets_zero() -> None:
    assert NATIVE is not None
    q = torch.randn(2, 4, 64)
    cache = torch.randn(4, 16, 2, 64)
    out = torch.full_like(q, 7.0)
    tables = torch.tensor([[1, 2], [3, 0]])
    NATIVE(out, q, cache, cache, tables, torch.tensor([0, 1]), torch.tensor([0, 20]), 0.125)
    assert bool((out[0] == 0).all()) and bool(torch.isfinite(out[1]).all())
    assert not bool((out[1] == 0).all())


@needs_native
def test_the_kernel_refuses_rows_it_cannot_read() -> None:
    assert NATIVE is not None
    q = torch.randn(4, 2, 64).transpose(0, 1)  # heads not contiguous within a token
    cache = torch.randn(4, 16, 2, 64)
    index = torch.zeros(2, dtype=torch.int64)
    with pytest.raises(ValueError, match="contiguous"):
        NATIVE(torch.empty(2, 4, 64), q, cache, cache, index.view(2, 1), index, index, 1.0)
    assert not NATIVE.supports(80, torch.float32)
    assert not NATIVE.supports(64, torch.float16)


@needs_native
def test_the_layer_resolves_the_native_kernel_through_the_process_registry() -> None:
    layer = make_layer((4, 2), 64, (torch.zeros(8, 16, 2, 64), torch.zeros(8, 16, 2, 64)))
    fi = make_step([5, 9], [], block_size=16, num_blocks=8, gen=torch.Generator().manual_seed(0))
    qkv = (torch.randn(2, 4, 64), torch.randn(2, 2, 64), torch.randn(2, 2, 64))
    run_layer(layer, qkv, build_attention_metadata(fi, torch.device("cpu")))
    key = KernelKey("paged_attention_decode", Device("cpu", 0), "torch.float32,head_dim=64")
    handle = process_kernel_registry().lookup(key)
    assert handle is not None and handle is not reference_decode
    assert layer._decode._resolved is not None and layer._decode._resolved[1] is handle


@needs_native
def test_a_head_size_the_kernel_lacks_does_not_decide_for_others() -> None:
    """One device, two head sizes: the first (unsupported) must not pin the second to the
    reference path through a shared registry entry."""
    gen = torch.Generator().manual_seed(2)
    resolved = []
    for head_dim in (32, 64):
        cache = torch.zeros(8, 16, 2, head_dim)
        layer = make_layer((4, 2), head_dim, (cache, cache))
        fi = make_step([5, 9], [], block_size=16, num_blocks=8, gen=gen)
        qkv = tuple(torch.randn(2, h, head_dim) for h in (4, 2, 2))
        run_layer(layer, qkv, build_attention_metadata(fi, torch.device("cpu")))
        assert layer._decode._resolved is not None
        resolved.append(layer._decode._resolved[1])
    assert resolved[0] is reference_decode and resolved[1] is not reference_decode


def test_without_a_native_kernel_the_reference_is_chosen_and_said(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setattr(native_build, "find_cxx", lambda: None)
    # A debug line: the missing compiler itself is warned about once, at start-up
    # (test_kernels_at_startup.py).
    with caplog.at_level(logging.DEBUG, logger=paged_attention_cpu.__name__):
        assert paged_attention_cpu.load_native_paged_attention(Path("/nonexistent")) is None
    assert "torch reference path" in caplog.text
    with pytest.raises(KernelBuildError, match="no C\\+\\+ compiler"):
        build_library(Path("/nonexistent"))
    slot = KernelHandle(
        "x",
        reference_decode,
        native_group_kernel("x", lambda: None, lambda k: reference_prefill, 64),
    )
    assert slot.choose(("cpu",), torch.float32) is reference_decode


@needs_native
def test_an_unhandled_dtype_falls_back_once_in_the_log(caplog: pytest.LogCaptureFixture) -> None:
    slots = [
        KernelHandle(
            "fp16_probe",
            reference_decode,
            native_group_kernel(
                "fp16_probe", native_paged_attention, lambda k: reference_prefill, 64
            ),
        )
        for _ in range(2)
    ]
    with caplog.at_level(logging.INFO, logger=attention_groups.__name__):
        chosen = [slot.choose(("cpu",), torch.float16) for slot in slots]
    assert chosen == [reference_decode, reference_decode]
    assert caplog.text.count("does not handle head_dim 64 in torch.float16") == 1


def test_the_torch_switch_forces_the_reference(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TANDEM_PAGED_ATTENTION", "torch")
    assert paged_attention_cpu.load_native_paged_attention() is None
    assert prefill_attention_cpu.load_native_prefill_attention() is None


@needs_native
def test_concurrent_first_builds_share_one_library(tmp_path: Path) -> None:
    """Two processes (as pytest-xdist runs them) and two threads build into an empty
    cache at once: one library results and every caller loads it."""
    script = (
        "import sys; from pathlib import Path\n"
        "from tandem.core.kernels.cpu.paged_attention import build_library\n"
        "print(build_library(Path(sys.argv[1])))\n"
    )
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", script, str(tmp_path)], stdout=subprocess.PIPE, text=True
        )
        for _ in range(2)
    ]
    paths: list[str] = []
    threads = [
        threading.Thread(target=lambda: paths.append(str(build_library(tmp_path))))
        for _ in range(2)
    ]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(120)
    for proc in procs:
        out, _ = proc.communicate(timeout=120)
        assert proc.returncode == 0
        paths.append(out.strip())
    assert len(set(paths)) == 1
    assert [p.name for p in tmp_path.glob("*.so")] == [Path(paths[0]).name]
    assert NativePagedAttention(Path(paths[0])).supports(64, torch.bfloat16)


def test_the_kernel_links_the_openmp_runtime_torch_ships(tmp_path: Path) -> None:
    assert native_build.openmp_link_args(tmp_path) == ["-fopenmp"]
    (tmp_path / "libgomp.so.1").touch()
    assert native_build.openmp_link_args(tmp_path) == ["-fopenmp"]
    (tmp_path / "libgomp.so.1").unlink()
    renamed = tmp_path / "libgomp-0123abcd.so.1"
    renamed.touch()
    assert native_build.openmp_link_args(tmp_path) == [
        str(renamed),
        f"-Wl,-rpath,{tmp_path}",
    ]


@needs_native
def test_the_builds_run_the_code_path_of_their_isa_level() -> None:
    expected = native_build.expected_path(native_build.selected_isa())
    assert NATIVE is not None and NATIVE.compiled_path == expected
    prefill = native_prefill_attention()
    assert prefill is not None and prefill.compiled_path == expected


def _kv_step(
    dtype: torch.dtype, tokens: int, heads: int = 2, head_dim: int = 64, blocks: int = 40
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, AttentionMetadata]:
    """A step's k as the attention layer hands it over (a section of one projection
    [T, q | k | v], so its rows lie far apart), v with rows of another stride, random
    caches and distinct random slots."""
    gen = torch.Generator().manual_seed(tokens)
    width = heads * head_dim
    qkv = torch.randn(tokens, 4 * width, generator=gen).to(dtype)
    k = qkv[:, 2 * width : 3 * width].view(tokens, heads, head_dim)
    v = torch.randn(tokens, heads, head_dim, generator=gen).to(dtype)
    k_cache = torch.randn(blocks, 16, heads, head_dim, generator=gen).to(dtype)
    slots = torch.randperm(blocks * 16, generator=gen)[:tokens]
    meta = AttentionMetadata(slot_mapping=slots, num_decode_tokens=0, decode=None, prefill=None)
    return k, v, k_cache, k_cache.clone().neg_(), meta


@needs_native
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize(
    ("tokens", "heads", "head_dim"), [(1, 2, 64), (48, 2, 64), (600, 2, 64), (600, 8, 128)]
)
def test_the_native_kv_cache_write_equals_the_reference(
    dtype: torch.dtype, tokens: int, heads: int, head_dim: int
) -> None:
    """Row copies, so equal bit for bit, every other slot left as it was. The last shape
    moves over the kernel's 4 MiB threshold in float32 (2 x 600 rows of 4 KiB), where the
    copy is shared by the threads."""
    assert NATIVE is not None
    k, v, k_cache, v_cache, meta = _kv_step(dtype, tokens, heads, head_dim)
    want_k, want_v = k_cache.clone(), v_cache.clone()
    attention_reference.write_kv_cache(k, v, want_k, want_v, meta)
    NATIVE.write_kv_cache(k, v, k_cache, v_cache, meta)
    assert torch.equal(k_cache, want_k) and torch.equal(v_cache, want_v)


@needs_native
def test_the_native_kv_cache_write_refuses_a_slot_outside_the_cache_writing_nothing() -> None:
    assert NATIVE is not None
    k, v, k_cache, v_cache, meta = _kv_step(torch.float32, 5)
    before = k_cache.clone()
    for bad in (-1, 40 * 16):
        meta.slot_mapping[3] = bad
        with pytest.raises(ValueError, match="a slot outside the cache's 640"):
            NATIVE.write_kv_cache(k, v, k_cache, v_cache, meta)
        assert torch.equal(k_cache, before)


@needs_native
def test_rows_the_kernel_cannot_copy_whole_go_to_the_reference() -> None:
    """Heads not back to back in a token's row (a transposed view): still written right."""
    assert NATIVE is not None
    k, v, k_cache, v_cache, meta = _kv_step(torch.float32, 7)
    k_apart = k.transpose(1, 2).contiguous().transpose(1, 2)
    assert k_apart.stride(1) != k_apart.shape[2]
    want_k, want_v = k_cache.clone(), v_cache.clone()
    attention_reference.write_kv_cache(k, v, want_k, want_v, meta)
    NATIVE.write_kv_cache(k_apart, v, k_cache, v_cache, meta)
    assert torch.equal(k_cache, want_k) and torch.equal(v_cache, want_v)


@needs_native
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_the_kv_cache_write_handle_picks_the_native_kernel_on_cpu(dtype: torch.dtype) -> None:
    assert NATIVE is not None
    assert handles.write_kv_cache().choose(("cpu",), dtype) == NATIVE.write_kv_cache
