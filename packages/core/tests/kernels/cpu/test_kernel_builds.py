"""Every CPU kernel library builds where this machine calls for it. A library whose build
fails falls back at run time (logged), and its own tests then skip as on a CPU without the
features: a source that does not compile on, say, an AMX machine would leave that machine's
CI green with the kernel never run. Loaded through the kernel cache as the engine loads them
(a failed build leaves nothing cached, so it is tried again here and its failure seen)."""

from __future__ import annotations

import logging
from collections.abc import Callable
from functools import partial
from typing import Any

import pytest

from tandem.core.kernels.cpu.amx_linear import load_amx_linear
from tandem.core.kernels.cpu.avx2_linear import load_avx2_linear
from tandem.core.kernels.cpu.avx512_linear import load_avx512_linear
from tandem.core.kernels.cpu.elementwise import load_native_elementwise
from tandem.core.kernels.cpu.int4_linear import load_native_int4_linear
from tandem.core.kernels.cpu.int8_gemm import load_native_int8
from tandem.core.kernels.cpu.linear_attention import load_native_linear_attention
from tandem.core.kernels.cpu.moe_routing import load_native_moe_routing
from tandem.core.kernels.cpu.native_build import AMX_EMULATION_DEFINE, find_cxx
from tandem.core.kernels.cpu.paged_attention import load_native_paged_attention
from tandem.core.kernels.cpu.prefill_attention import load_native_prefill_attention

LOADERS: dict[str, Callable[[], Any]] = {
    "amx": load_amx_linear,
    # The test builds on emulated tiles, which every CPU's suite runs.
    "amx-emulated": partial(load_amx_linear, emulated=True),
    "int8-amx-emulated": partial(load_native_int8, defines=(AMX_EMULATION_DEFINE,)),
    "avx512": load_avx512_linear,
    "avx2": load_avx2_linear,
    "int8": load_native_int8,
    "elementwise": load_native_elementwise,
    "moe-routing": load_native_moe_routing,
    "paged-attention": load_native_paged_attention,
    "prefill-attention": load_native_prefill_attention,
    "int4": load_native_int4_linear,
    "linear-attention": load_native_linear_attention,
}


@pytest.mark.parametrize("library", sorted(LOADERS))
def test_every_library_this_cpu_calls_for_builds(
    library: str, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    if find_cxx() is None:
        pytest.skip("no C++ compiler")
    # TANDEM_GEMM=onednn would keep the linear kernels from building at all.
    monkeypatch.delenv("TANDEM_GEMM", raising=False)
    caplog.set_level(logging.WARNING)
    LOADERS[library]()
    failed = [r.getMessage() for r in caplog.records if " failed: " in r.getMessage()]
    assert not failed, failed[0][:3000]
