"""The CPU int8 (W8A8) kernels against the torch reference, at every ISA level this machine
runs (AMX-INT8, AVX512-VNNI, AVX-VNNI, AVX2, plain loops), each built in this process; the
vector path beside AMX on AMX CPUs; the AVX-VNNI path's test build (``YMM_VNNI_TEST_DEFINE``:
the same ymm ``vpdpbusd`` in AVX512-VNNI's EVEX encoding) on CPUs with AVX512-VNNI +
AVX512-VL but no AVX-VNNI, which then run that path too; and the AMX path's test build with
emulated tiles (``AMX_EMULATION_DEFINE``) on every CPU.

Every comparison is ``torch.equal``, bit for bit: the int32 sums are exact integers whatever
their order, and the quantize and dequantize run the reference's float32 operations in its
order (a division, not a reciprocal; two roundings for scale then bias), so any difference is
a bug, and greedy tokens must not depend on which kernel ran.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tandem.core.kernels import handles
from tandem.core.kernels.cpu import startup
from tandem.core.kernels.cpu.int8_gemm import (
    YMM_VNNI_TEST_DEFINE,
    NativeInt8,
    load_native_int8,
    native_int8,
    pack_int8_weight,
)
from tandem.core.kernels.cpu.native_build import (
    AMX_EMULATION_DEFINE,
    ISA_LEVELS,
    NATIVE_ISA,
    IsaLevel,
    amx_tiles_granted,
    isa_levels,
    selected_isa,
)
from tandem.core.kernels.reference import int8_linear as ref

# The fixture's builds: every level, the vector path where the native one is AMX, and the
# AVX-VNNI and AMX paths' test builds.
YMM_VNNI, AMX_EMULATED, NATIVE_VECTOR = "ymm-vnni", "amx-emulated", "native-no-amx"
VARIANTS = [*(level.name for level in isa_levels()), NATIVE_VECTOR, YMM_VNNI, AMX_EMULATED]
# The panel each path's registers or tiles take a pass over (see the source).
PANELS = {"AMX-INT8": 32, "AVX512-VNNI": 64, "AVX-VNNI": 16, "AVX2": 16, "plain loops": 64}
# Shapes: odd N and K (off the 64-column panels and the 4-k groups), N below one panel,
# K of one element, and a bench-model-like projection.
SHAPES = [(1, 1), (77, 33), (130, 1001), (64, 64), (200, 260), (129, 7), (192, 1024)]
# Rows: the row blocks of every path, and AMX's tiles of 16 (17: a second tile of one row; 33,
# 48: a block of 32 and the rest).
ROWS = [1, 2, 5, 6, 7, 13, 17, 33, 48, 64, 65, 300]


def expected_path(isa: IsaLevel, amx: bool = True) -> str:
    flags = isa.cpu_flags()
    if amx and {"amx_int8", "amx_tile"} <= flags and amx_tiles_granted():
        return "AMX-INT8"
    if {"avx512_vnni", "avx512bw"} <= flags:
        return "AVX512-VNNI"
    if "avx_vnni" in flags:
        return "AVX-VNNI"
    return "AVX2" if "avx2" in flags else "plain loops"


def ymm_vnni_unavailable() -> str | None:
    """Why this CPU cannot run the AVX-VNNI path's test build, or None where it can."""
    flags = NATIVE_ISA.cpu_flags()
    if {"avx512_vnni", "avx512vl"} <= flags or "avx_vnni" in flags:
        return None
    return "the ymm vpdpbusd needs AVX512-VNNI with AVX512-VL, or AVX-VNNI; this CPU has neither"


def load_ymm_vnni(build_dir: Path) -> NativeInt8 | None:
    return load_native_int8(build_dir, NATIVE_ISA, (YMM_VNNI_TEST_DEFINE,))


@pytest.fixture(scope="module", params=VARIANTS)
def kernels(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> NativeInt8:
    build_dir = tmp_path_factory.mktemp(f"int8-{request.param}")
    if request.param == YMM_VNNI:
        why = ymm_vnni_unavailable()
        if why is not None:
            pytest.skip(why)
        built, expected = load_ymm_vnni(build_dir), "AVX-VNNI"
    elif request.param == AMX_EMULATED:
        built = load_native_int8(build_dir, NATIVE_ISA, (AMX_EMULATION_DEFINE,))
        expected = "AMX-INT8"
    elif request.param == NATIVE_VECTOR:
        if expected_path(NATIVE_ISA) != "AMX-INT8":
            pytest.skip("the native build is already the vector path (no AMX-INT8 here)")
        # At the native level, as the expectation: TANDEM_CPU_ISA may name a lower one.
        built = load_native_int8(build_dir, NATIVE_ISA, amx=False)
        expected = expected_path(NATIVE_ISA, False)
    else:
        isa = ISA_LEVELS[request.param]
        built, expected = load_native_int8(build_dir, isa), expected_path(isa)
    if built is None:
        pytest.skip("no C++ compiler, or TANDEM_INT8=torch")
    assert built.compiled_path == expected
    assert built.emulated == (request.param == AMX_EMULATED)
    assert built.panel == PANELS[expected]
    assert built.k_align == (64 if expected == "AMX-INT8" else 4)
    return built


def _weight(n: int, k: int, gen: torch.Generator) -> torch.Tensor:
    w = torch.randint(-128, 128, (n, k), dtype=torch.int8, generator=gen)
    # The extremes, whole rows of them: the largest sums either sign reaches.
    w[0] = 127 if n > 1 else -128
    if n > 2:
        w[1] = -128
    return w


def _codes(m: int, k: int, gen: torch.Generator) -> torch.Tensor:
    a = torch.randint(-128, 128, (m, k), dtype=torch.int8, generator=gen)
    a[0] = -128
    if m > 2:
        a[1] = 0  # an all-zero row
        a[2] = 127
    return a


@pytest.mark.parametrize("shape", SHAPES)
def test_products_are_the_references_int32(kernels: NativeInt8, shape: tuple[int, int]) -> None:
    n, k = shape
    gen = torch.Generator().manual_seed(n * 1000 + k)
    w = _weight(n, k, gen)
    packed = kernels.pack(w)
    for m in ROWS:
        a = _codes(m, k, gen)
        got = kernels.matmul(a, packed)
        assert got.dtype is torch.int32
        assert torch.equal(got, ref.int8_matmul(a, w)), (m, n, k)


def test_products_of_strided_codes(kernels: NativeInt8) -> None:
    gen = torch.Generator().manual_seed(3)
    w = _weight(70, 90, gen)
    a = _codes(9, 120, gen)[:, 10:100]
    assert torch.equal(kernels.matmul(a, kernels.pack(w)), ref.int8_matmul(a.contiguous(), w))


def test_a_weight_packed_for_another_panel_width_is_refused(kernels: NativeInt8) -> None:
    w = torch.randint(-128, 128, (40, 8), dtype=torch.int8, generator=torch.Generator())
    other = pack_int8_weight(w, 16 if kernels.panel == 64 else 64, kernels.k_align)
    with pytest.raises(ValueError, match="panels of"):
        kernels.matmul(torch.zeros(1, 8, dtype=torch.int8), other)


def test_a_weight_padded_to_another_k_multiple_is_refused(kernels: NativeInt8) -> None:
    """AMX reads K in tile rows of 64: a weight padded only to the 4-k groups would have its
    last tile row read past the weight."""
    if kernels.k_align == 4:
        pytest.skip("this path reads K in groups of 4, which every packing pads to")
    w = torch.randint(-128, 128, (40, 8), dtype=torch.int8, generator=torch.Generator())
    with pytest.raises(ValueError, match="K padded to a multiple of 64"):
        kernels.matmul(torch.zeros(1, 8, dtype=torch.int8), pack_int8_weight(w, kernels.panel))


def _activations(m: int, k: int, dtype: torch.dtype, gen: torch.Generator) -> torch.Tensor:
    x = torch.randn(m, k, generator=gen) * 3
    x[0, : min(k, 4)] = 40.0  # beyond a static scale's range: saturates
    if m > 1:
        x[1] = 0.0  # an all-zero token (its dynamic scale is 1)
    if m > 2:
        # Exact halves of the static scale 0.25: the ties round to even.
        x[2] = (torch.arange(k) % 9 - 4).float() * 0.125
    return x.to(dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("static", [None, 0.25], ids=["dynamic", "static"])
@pytest.mark.parametrize("with_bias", [False, True], ids=["no-bias", "bias"])
def test_the_fused_linear_is_the_references(
    kernels: NativeInt8, dtype: torch.dtype, static: float | None, with_bias: bool
) -> None:
    gen = torch.Generator().manual_seed(7)
    for n, k in SHAPES:
        w = _weight(n, k, gen)
        packed = kernels.pack(w)
        ws = (torch.rand(n, 1, generator=gen) * 0.02).to(dtype)
        bias = torch.randn(n, generator=gen).to(dtype) if with_bias else None
        scale = torch.tensor(static).to(dtype) if static is not None else None
        for m in (1, 3, 7, 65):
            x = _activations(m, k, dtype, gen)
            expected = ref.int8_linear(x, w, ws, scale, bias)
            got = kernels.linear(x, packed, ws, scale, bias)
            assert got.dtype is dtype and torch.equal(got, expected), (m, n, k)


def test_leading_dimensions_are_kept(kernels: NativeInt8) -> None:
    gen = torch.Generator().manual_seed(8)
    w, ws = _weight(40, 24, gen), torch.rand(40, 1, generator=gen)
    x = torch.randn(2, 3, 24, generator=gen)
    got = kernels.linear(x, kernels.pack(w), ws, None, None)
    assert got.shape == (2, 3, 40)
    assert torch.equal(got, ref.int8_linear(x, w, ws, None, None))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("static", [None, 0.25], ids=["dynamic", "static"])
def test_the_separate_steps_are_the_references(
    kernels: NativeInt8, dtype: torch.dtype, static: float | None
) -> None:
    """What row-parallel ranks run: quantize (with the all-rank absmax, or from the rows),
    the int32 product, and the dequantize of the summed products."""
    gen = torch.Generator().manual_seed(9)
    x = _activations(11, 333, dtype, gen)
    w, ws = _weight(100, 333, gen), torch.rand(100, 1, generator=gen)
    bias = torch.randn(100, generator=gen).to(dtype)
    scale = torch.tensor(static) if static is not None else None
    absmax = None if static is not None else x.float().abs().amax(-1, keepdim=True) * 1.5
    for peak in (None, absmax):
        q, s = kernels.quantize(x, scale, peak)
        q_ref, s_ref = ref.quantize_int8(x, scale, peak)
        assert torch.equal(q, q_ref) and torch.equal(s, s_ref)
        acc = kernels.matmul(q, kernels.pack(w))
        out = kernels.dequantize(acc, s, ws, bias, dtype)
        assert torch.equal(out, ref.dequantize(acc, s_ref, ws, bias, dtype))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("static", [False, True], ids=["dynamic", "static"])
def test_the_grouped_linear_is_each_experts_reference(
    kernels: NativeInt8, dtype: torch.dtype, static: bool
) -> None:
    """Every expert's rows through its own packed weight in one call: each expert's rows what
    the reference linear gives with its weight, scales and static scale. Experts of 0, 1, 6,
    7, 13, 70 and 20 rows: none, a decode row, full and split row blocks, a second row task,
    and last a block whose second AMX tile reads rows past the end."""
    gen = torch.Generator().manual_seed(11)
    counts = [7, 0, 1, 13, 6, 70, 20]
    e, n, k = len(counts), 77, 130
    w = torch.stack([_weight(n, k, gen) for _ in range(e)])
    ws = (torch.rand(e, n, 1, generator=gen) * 0.02).to(dtype)
    scales = (torch.rand(e, generator=gen) * 0.1 + 0.01).to(dtype) if static else None
    x = _activations(sum(counts), k, dtype, gen)
    offsets = torch.tensor([0, *torch.tensor(counts).cumsum(0).tolist()], dtype=torch.int64)
    got = kernels.grouped_linear(x, kernels.pack_experts(w), offsets, ws, scales)
    assert got.dtype is dtype and got.shape == (x.shape[0], n)
    for i in range(e):
        lo, hi = int(offsets[i]), int(offsets[i + 1])
        scale = scales[i] if scales is not None else None
        expected = ref.int8_linear(x[lo:hi], w[i], ws[i], scale, None)
        assert torch.equal(got[lo:hi], expected), i


def test_the_ymm_vnni_test_build_is_cached_apart_from_the_native_one(tmp_path: Path) -> None:
    why = ymm_vnni_unavailable()
    if why is not None:
        pytest.skip(why)
    native, ymm = load_native_int8(tmp_path, NATIVE_ISA), load_ymm_vnni(tmp_path)
    if native is None or ymm is None:
        pytest.skip("no C++ compiler, or TANDEM_INT8=torch")
    assert native.path != ymm.path and ymm.compiled_path == "AVX-VNNI"
    assert native.compiled_path == expected_path(NATIVE_ISA)


def test_plain_weights_run_the_reference(kernels: NativeInt8) -> None:
    """A layer nobody packed (built outside the loader) still computes through the handles."""
    gen = torch.Generator().manual_seed(10)
    w, ws = _weight(30, 20, gen), torch.rand(30, 1, generator=gen)
    x = torch.randn(4, 20, generator=gen)
    assert torch.equal(kernels.linear(x, w, ws, None, None), ref.int8_linear(x, w, ws, None, None))
    q, _ = ref.quantize_int8(x, None)
    assert torch.equal(kernels.matmul(q, w), ref.int8_matmul(q, w))


def test_the_handles_choose_the_kernel_built_for_the_isa_level(tmp_path: Path) -> None:
    kernels = native_int8()
    if kernels is None:
        pytest.skip("no C++ compiler, or TANDEM_INT8=torch")
    assert kernels.compiled_path == expected_path(selected_isa())
    families = ("cpu",)
    assert handles.int8_linear().choose(families, torch.bfloat16) == kernels.linear
    assert handles.int8_matmul().choose(families, torch.int8) == kernels.matmul
    assert handles.int8_quantize().choose(families, torch.float32) == kernels.quantize
    assert handles.int8_dequantize().choose(families, torch.int32) == kernels.dequantize
    assert handles.int8_linear().choose((), torch.float32) is ref.int8_linear


def test_packing_pads_to_panels_and_compensates_each_column() -> None:
    w = torch.randint(-128, 128, (70, 9), dtype=torch.int8, generator=torch.Generator())
    packed = pack_int8_weight(w, 64)
    assert packed.packed.shape == (2, 3, 64, 4) and packed.padded_in == 12
    assert torch.equal(packed.packed[1, 2, 5, 0], w[69, 8])
    assert torch.equal(packed.packed[0, 1, 3], w[3, 4:8])
    assert (
        int(packed.packed[1, 2, 6:].abs().sum()) == 0
        and int(packed.packed[:, 2, :, 1:].abs().sum()) == 0
    )
    assert torch.equal(packed.compensation[:70], w.int().sum(1) * 128)
    assert int(packed.compensation[70:].abs().sum()) == 0


def test_the_isa_level_forces_the_variant_and_the_report_names_it(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setenv("TANDEM_CPU_ISA", "avx2")
    forced = load_native_int8(tmp_path)
    if forced is None:
        pytest.skip("no C++ compiler, or TANDEM_INT8=torch")
    assert forced.compiled_path == expected_path(ISA_LEVELS["avx2"])
    monkeypatch.delenv("TANDEM_CPU_ISA")
    kernels = native_int8()
    assert kernels is not None
    row = next(c for c in startup.build_report().choices if c.role == "linear int8 (W8A8)")
    assert row.kernel.startswith(f"native {kernels.compiled_path} ")


def test_without_the_library_the_report_names_the_reference(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("TANDEM_INT8", "torch")
    assert load_native_int8() is None
    monkeypatch.setattr(startup, "native_int8", load_native_int8)
    row = next(c for c in startup.build_report().choices if c.role == "linear int8 (W8A8)")
    assert row.kernel.startswith("torch reference")
