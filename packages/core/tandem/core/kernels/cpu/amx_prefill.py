"""Fresh prompts' causal attention on AMX tiles (``csrc/amx_prefill.cpp``), bfloat16: every
fresh prompt of a prefill group in one call, both products on tiles, where torch's flash
attention took a call per prompt. Built on first use (see ``native_build``); None where the CPU
(or the ISA level asked for) has no AMX-BF16, Linux does not grant the tile state, or no
compiler exists: long fresh prompts then go to torch's flash attention (``flash_prefill``)."""

from __future__ import annotations

import ctypes
import logging
import os
from pathlib import Path

import torch

from tandem.core.kernels.cpu.native_build import (
    AMX_EMULATION_DEFINE,
    BASE_FLAGS,
    CSRC,
    WIDE_VECTOR_FLAGS,
    IsaLevel,
    KernelBuildError,
    amx_tiles_granted,
    build_library,
    compiled_path,
    log_unbuilt,
    selected_isa,
)
from tandem.core.kernels.process_once import ProcessOnce

logger = logging.getLogger(__name__)

SOURCE = CSRC / "amx_prefill.cpp"
HEAD_DIMS = frozenset({64, 128, 256})
# Fresh prompts of at least this many tokens go to the tile kernel; shorter ones to the
# native vector kernel (prefill_attention), which packs nothing. One layer, AMX Xeon, 2
# threads, ms (benchmarks/fresh_prefill_attention.py):
#     8 query / 2 KV heads of 64    tiles   native      16 / 8 heads    tiles   native
#         48 prompts x 8            0.291    0.131                      0.810    0.411
#         32 x 16                   0.207    0.178                      0.634    0.425
#         16 x 32                   0.177    0.225                      0.509    0.528
#         16 x 64                   0.358    0.650                      1.063    1.513
#          8 x 256                  1.235    3.712                      3.196    8.630
TILE_MIN_TOKENS = 32
_REQUIRED_FLAGS = frozenset({"amx_bf16", "amx_tile"})
_INSTEAD = "long fresh prompts attend through torch's flash attention"
_vp, _i64 = ctypes.c_void_p, ctypes.c_int64


def build_amx_prefill(
    build_dir: Path | None = None, isa: IsaLevel | None = None, emulated: bool = False
) -> Path:
    """The library, built if needed. ``emulated``: the test build whose tile instructions are
    software (``amx_tiles.h``), which any CPU runs."""
    defines = (f"-D{AMX_EMULATION_DEFINE}",) if emulated else ()
    flags = (*BASE_FLAGS, *WIDE_VECTOR_FLAGS, *defines)
    return build_library(SOURCE, "tandem_amx_prefill", flags, build_dir=build_dir, isa=isa)


class AmxPrefillAttention:
    """The loaded kernel."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.lib = ctypes.CDLL(str(path))
        self.compiled_path = compiled_path(self.lib)
        built = int(self.lib.tandem_fresh_tiles())
        if built == 0:
            raise OSError("this build has no AMX-BF16 (the CPU, or the ISA level asked for)")
        self.emulated = built == 2
        if not self.emulated and not amx_tiles_granted():
            raise OSError("Linux did not grant the AMX tile state (arch_prctl)")
        self._run = self.lib.tandem_fresh_attention
        self._run.argtypes = [_vp] * 6 + [_i64] * 8 + [ctypes.c_float, ctypes.c_int32]
        self._run.restype = ctypes.c_int

    @staticmethod
    def supports(head_dim: int, dtype: torch.dtype) -> bool:
        return dtype is torch.bfloat16 and head_dim in HEAD_DIMS

    def __call__(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        starts: torch.Tensor,
        lens: torch.Tensor,
        scale: float,
        out: torch.Tensor,
    ) -> None:
        """Prompt ``i`` is rows ``starts[i] .. + lens[i]`` of ``q``/``out`` [N, H, D] and of
        ``k``/``v`` [N, Hkv, D] (bfloat16, each row's [heads, D] contiguous, rows any distance
        apart: views of a fused projection); each of its tokens attends the prompt's keys up
        to its own. ``starts``/``lens``: contiguous int64, lengths at least 1."""
        rows, heads, dim = q.shape
        kv_heads = k.shape[1]
        for t in (q, k, v, out):
            if t.dtype is not torch.bfloat16 or t.device.type != "cpu" or t.dim() != 3:
                raise ValueError("the tile prefill attention takes bfloat16 [N, H, D] on the CPU")
            if t.shape[0] != rows or t.shape[2] != dim or t.stride(2) != 1 or t.stride(1) != dim:
                raise ValueError("q, k, v and out need the same rows, each [H, D] contiguous")
        if out.shape[1] != heads or v.shape[1] != kv_heads or heads % max(kv_heads, 1) != 0:
            raise ValueError(f"heads {heads} / KV heads {kv_heads} do not group")
        for t in (starts, lens):
            if t.dtype is not torch.int64 or t.dim() != 1 or t.stride(0) != 1:
                raise ValueError("starts and lens must be contiguous int64 vectors")
        if starts.shape != lens.shape:
            raise ValueError("one start and one length a prompt")
        if lens.numel() and (
            int(lens.min()) < 1 or int(starts.min()) < 0 or int((starts + lens).max()) > rows
        ):
            raise ValueError(f"a prompt's rows fall outside the {rows} rows of q")
        code = self._run(
            out.data_ptr(), q.data_ptr(), k.data_ptr(), v.data_ptr(),
            starts.data_ptr(), lens.data_ptr(), lens.shape[0], heads, kv_heads, dim,
            q.stride(0), k.stride(0), v.stride(0), out.stride(0), scale,
            torch.get_num_threads(),
        )  # fmt: skip
        if code != 0:
            raise ValueError(
                f"the tile prefill attention refused its arguments (code {code}): "
                f"heads {heads}/{kv_heads}, head_dim {dim}"
            )


def load_amx_prefill(
    build_dir: Path | None = None, isa: IsaLevel | None = None, emulated: bool = False
) -> AmxPrefillAttention | None:
    """Build (if needed) and load the kernel; None, with the reason logged, where it cannot
    be had. ``TANDEM_PREFILL_TILES=off`` keeps torch's flash attention (the A side of an
    A/B)."""
    if not emulated and os.environ.get("TANDEM_PREFILL_TILES", "").lower() == "off":
        logger.info("TANDEM_PREFILL_TILES=off: fresh prompts attend through torch's flash")
        return None
    if not emulated and not _REQUIRED_FLAGS.issubset((isa or selected_isa()).cpu_flags()):
        return None
    try:
        path = build_amx_prefill(build_dir, isa, emulated)
    except KernelBuildError as exc:
        log_unbuilt(logger, exc, "no AMX tile prefill attention (%s); %s", exc, _INSTEAD)
        return None
    try:
        return AmxPrefillAttention(path)
    except OSError as exc:
        logger.info("no AMX tile prefill attention (%s); %s", exc, _INSTEAD)
        return None


# The process's kernel, built and loaded on first use.
amx_prefill = ProcessOnce(load_amx_prefill)
