"""The AMX tile emulation (``csrc/amx_tiles.h``) against the rules it transcribes from Intel's
SDM, through the int8 and bfloat16 libraries' emulated builds: TDPBSSD's signed products
summed into 32-bit lanes that wrap; TDPBF16PS's even and odd sums, denormals read as zero and
flushed; the tile's rows and bytes past its shape zeroed, and the faults (#UD for
tiles whose shapes do not multiply, #GP for a configuration past palette 1's limits) ending
the process as the hardware's exceptions would. The int8 kernel's own tests run its AMX path
on this emulation (``test_int8_gemm.py``); these make sure the emulation is the instruction.
"""

from __future__ import annotations

import ctypes
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tandem.core.kernels.cpu import amx_linear
from tandem.core.kernels.cpu.int8_gemm import load_native_int8
from tandem.core.kernels.cpu.native_build import AMX_EMULATION_DEFINE, NATIVE_ISA
from tandem.core.kernels.cpu.native_linear import load_kernel_library

_i32, _vp = ctypes.c_int32, ctypes.c_void_p


@pytest.fixture(scope="module")
def library(tmp_path_factory: pytest.TempPathFactory) -> Path:
    built = load_native_int8(tmp_path_factory.mktemp("amx-emulated"), NATIVE_ISA,
                             (AMX_EMULATION_DEFINE,))  # fmt: skip
    if built is None:
        pytest.skip("no C++ compiler, or TANDEM_INT8=torch")
    return built.path


def dpbssd(
    path: Path, c: torch.Tensor, a: torch.Tensor, b: torch.Tensor, b_rows: int | None = None
) -> torch.Tensor:
    """c += a . b on emulated tiles 0, 1, 2 (c int32 [rows, n], a int8 [rows, 4k], b int8
    [k, 4n]); returns the whole 16 x 64-byte register of c afterwards, as int32 [16, 16]."""
    fn = ctypes.CDLL(str(path)).tandem_amx_emulated_dpbssd
    fn.argtypes = [_vp] * 3 + [_i32] * 4 + [_vp]
    whole = torch.empty(16, 16, dtype=torch.int32)
    rows, a_colsb, c_colsb = a.shape[0], a.shape[1], c.shape[1] * 4
    fn(c.data_ptr(), a.data_ptr(), b.data_ptr(), rows, a_colsb, c_colsb,
       b.shape[0] if b_rows is None else b_rows, whole.data_ptr())  # fmt: skip
    return whole


def reference(c: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """The SDM's DPBD in exact integers, then the 32-bit lane's wrap."""
    k, n = b.shape[0], b.shape[1] // 4
    a4 = a.long().view(a.shape[0], k, 4)
    b4 = b.long().view(k, n, 4)
    exact = c.long() + torch.einsum("mki,kni->mn", a4, b4)
    wrapped = (exact + 2**31) % 2**32 - 2**31
    return wrapped.to(torch.int32)


def test_products_are_signed_bytes_summed_in_wrapping_lanes(library: Path) -> None:
    gen = torch.Generator().manual_seed(0)
    a = torch.randint(-128, 128, (5, 64), dtype=torch.int8, generator=gen)
    b = torch.randint(-128, 128, (16, 40), dtype=torch.int8, generator=gen)
    a[0], b[:, :4] = -128, -128  # (-128)^2 64 times: 2^20, from the most negative bytes
    c = torch.randint(-(2**31), 2**31 - 1, (5, 10), dtype=torch.int32, generator=gen)
    c[1] = 2**31 - 1  # past the top: wraps to negative
    expected = reference(c, a, b)
    assert (c.long() + (reference(torch.zeros_like(c), a, b)).long()).max() > 2**31 - 1
    whole = dpbssd(library, c, a, b)
    assert torch.equal(c, expected)
    assert torch.equal(whole[:5, :10], expected)


def test_rows_and_bytes_past_the_tiles_shape_are_zero(library: Path) -> None:
    """After a load and a TDPBSSD the register reads zero past the tile's rows and bytes."""
    a = torch.ones(3, 8, dtype=torch.int8)
    b = torch.ones(2, 12, dtype=torch.int8)
    c = torch.zeros(3, 3, dtype=torch.int32)
    whole = dpbssd(library, c, a, b)
    assert torch.equal(whole[:3, :3], torch.full((3, 3), 8, dtype=torch.int32))
    assert int(whole[:3, 3:].abs().sum()) == 0 and int(whole[3:].abs().sum()) == 0


def _run_fault(library: Path, rows: int, b_rows: int) -> subprocess.CompletedProcess[str]:
    script = (
        "import ctypes, sys\n"
        "fn = ctypes.CDLL(sys.argv[1]).tandem_amx_emulated_dpbssd\n"
        "fn.argtypes = [ctypes.c_void_p] * 3 + [ctypes.c_int32] * 4 + [ctypes.c_void_p]\n"
        "buf = ctypes.create_string_buffer(8192)\n"
        "p = ctypes.addressof(buf)\n"
        f"fn(p, p, p, {rows}, 64, 64, {b_rows}, p)\n"
        "print('returned')\n"
    )
    return subprocess.run([sys.executable, "-c", script, str(library)], capture_output=True,
                          text=True, timeout=60, check=False)  # fmt: skip


def test_tiles_whose_shapes_do_not_multiply_are_an_invalid_opcode(library: Path) -> None:
    done = _run_fault(library, rows=4, b_rows=15)  # a has 64 / 4 = 16 k groups
    assert done.returncode != 0 and "returned" not in done.stdout
    assert "emulated AMX: #UD: TDPBSSD's tile shapes do not match" in done.stderr


def test_a_configuration_past_16_rows_is_a_general_protection_fault(library: Path) -> None:
    done = _run_fault(library, rows=17, b_rows=16)
    assert done.returncode != 0 and "returned" not in done.stdout
    assert "emulated AMX: #GP: a tile larger than 16 x 64 bytes" in done.stderr


# --- TDPBF16PS, through the AMX bfloat16 kernel's emulated build.


@pytest.fixture(scope="module")
def bf16_library(tmp_path_factory: pytest.TempPathFactory) -> ctypes.CDLL:
    lib = load_kernel_library("AMX (emulated)", amx_linear.SOURCE, frozenset(),
                              tmp_path_factory.mktemp("amx-bf16-emulated"), None,
                              (AMX_EMULATION_DEFINE,))  # fmt: skip
    if lib is None:
        pytest.skip("no C++ compiler")
    assert lib.tandem_amx_emulated() == 1
    return lib


def dpbf16ps(lib: ctypes.CDLL, c: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> None:
    """c (float32 [rows, n]) += a (bfloat16 [rows, 2k]) . b (bfloat16 [k, 2n]), in place."""
    fn = lib.tandem_amx_emulated_dpbf16ps
    fn.argtypes = [_vp] * 3 + [_i32] * 4
    fn(c.data_ptr(), a.data_ptr(), b.data_ptr(), a.shape[0], a.shape[1] * 2, c.shape[1] * 4,
       b.shape[0])  # fmt: skip


def test_even_and_odd_pairs_sum_apart_then_once_into_the_accumulator(
    bf16_library: ctypes.CDLL,
) -> None:
    """The SDM's order: per column, the even elements' products in one float32 sum and the
    odd ones' in another, over k, then their sum added to c. Even: 2^24 + 1 rounds back to
    2^24 (a tie, to even); odd: 1 + 1 = 2; c = 2^24 + 2. Pair by pair in one sum (2^24, +1,
    +1, +1) every 1 would round away: 2^24."""
    a = torch.tensor([[2.0**12, 1.0, 1.0, 1.0]]).bfloat16()  # k pairs (2^12, 1), (1, 1)
    b = torch.tensor([[2.0**12, 1.0], [1.0, 1.0]]).bfloat16()  # one column, pairs per k
    c = torch.zeros(1, 1)
    dpbf16ps(bf16_library, c, a, b)
    assert c.item() == 2.0**24 + 2


def test_denormal_inputs_read_as_zero_and_denormal_sums_are_flushed(
    bf16_library: ctypes.CDLL,
) -> None:
    tiny = torch.tensor([2.0**-130]).bfloat16()  # a bfloat16 denormal (below 2^-126)
    assert tiny.item() != 0.0
    a = torch.cat([tiny, torch.tensor([2.0**-70]).bfloat16()]).reshape(1, 2)
    b = torch.tensor([[2.0**100, 2.0**-70]]).bfloat16()
    c = torch.zeros(1, 1)
    # Even: a denormal times 2^100 (2^-30 if it were read) is zero; odd: 2^-140, denormal.
    dpbf16ps(bf16_library, c, a, b)
    assert c.item() == 0.0


def test_a_denormal_sum_of_normal_products_is_flushed(bf16_library: ctypes.CDLL) -> None:
    """Even 1.5 x 2^-126 and odd -2^-126, each normal; their sum 2^-127 is denormal: 0."""
    a = torch.tensor([[1.5 * 2.0**-63, -(2.0**-63)]]).bfloat16()
    b = torch.tensor([[2.0**-63, 2.0**-63]]).bfloat16()
    c = torch.zeros(1, 1)
    dpbf16ps(bf16_library, c, a, b)
    assert c.item() == 0.0
