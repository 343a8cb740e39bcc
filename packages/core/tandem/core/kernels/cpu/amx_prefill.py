"""Causal attention of prefill chunks on AMX tiles (``csrc/amx_prefill.cpp``), bfloat16: every
chunk of a prefill group it takes in one call, both products on tiles, K/V read from the paged
cache (packed once per layer for the heads that share them), where torch's flash attention
took a call per prompt (two and a merge after cached tokens, which it gathered). Built on first
use (see ``native_build``); None where the CPU (or the ISA level asked for) has no AMX-BF16,
Linux does not grant the tile state, or no compiler exists: long chunks then go to torch's
flash attention (``flash_prefill``)."""

from __future__ import annotations

import logging
import os
from pathlib import Path

from tandem.core.kernels.cpu.native_build import (
    AMX_EMULATION_DEFINE,
    BASE_FLAGS,
    CSRC,
    WIDE_VECTOR_FLAGS,
    IsaLevel,
    KernelBuildError,
    amx_tiles_granted,
    build_library,
    log_unbuilt,
    selected_isa,
)
from tandem.core.kernels.cpu.prefill_attention import NativePrefillAttention
from tandem.core.kernels.process_once import ProcessOnce

logger = logging.getLogger(__name__)

SOURCE = CSRC / "amx_prefill.cpp"
# Chunks of at least this many tokens go to the tile kernel; shorter ones to the native
# vector kernel (prefill_attention), which packs nothing. Fresh prompts, one layer, AMX Xeon,
# 2 threads, ms (benchmarks/prefill_chunk_attention.py):
#     8 query / 2 KV heads of 64    tiles   native      16 / 8 heads    tiles   native
#         48 prompts x 8            0.291    0.131                      0.810    0.411
#         32 x 16                   0.207    0.178                      0.634    0.425
#         16 x 32                   0.177    0.225                      0.509    0.528
#         16 x 64                   0.358    0.650                      1.063    1.513
#          8 x 256                  1.235    3.712                      3.196    8.630
TILE_MIN_TOKENS = 32
# Chunks of longer sequences stay with the vector kernel, which reads the cache in place: the
# tile kernel packs a sequence's keys and values for each call, 4 bytes a head dimension a KV
# head a token (128 MiB at this bound for 8 KV heads of 128), written and read once per layer.
# Below it the tiles win whatever the cached share; a chunk after 8192 cached tokens, one
# layer, ms (benchmarks/prefill_chunk_attention.py --cached 8192):
#     new tokens     8 / 2 heads of 64: tiles  native     16 / 8: tiles  native
#         64                            2.35    6.51             5.72   13.62
#        256                            6.95   26.02            15.88   55.40
#       2048                            57.6   228.6            123.7   512.2
TILE_MAX_KEYS = 32768
_REQUIRED_FLAGS = frozenset({"amx_bf16", "amx_tile"})
_INSTEAD = "long prefill chunks attend through torch's flash attention"


def build_amx_prefill(
    build_dir: Path | None = None, isa: IsaLevel | None = None, emulated: bool = False
) -> Path:
    """The library, built if needed. ``emulated``: the test build whose tile instructions are
    software (``amx_tiles.h``), which any CPU runs."""
    defines = (f"-D{AMX_EMULATION_DEFINE}",) if emulated else ()
    flags = (*BASE_FLAGS, *WIDE_VECTOR_FLAGS, *defines)
    return build_library(SOURCE, "tandem_amx_prefill", flags, build_dir=build_dir, isa=isa)


class AmxPrefillAttention(NativePrefillAttention):
    """The loaded kernel: ``NativePrefillAttention``'s arguments and checks; the library
    takes bfloat16 only (``tandem_tiles_supports``) and refuses anything else."""

    entry = "tandem_tile_prefill_attention"
    supports_symbol = "tandem_tiles_supports"

    def __init__(self, path: Path) -> None:
        super().__init__(path)
        built = int(self.lib.tandem_prefill_tiles())
        if built == 0:
            raise OSError("this build has no AMX-BF16 (the CPU, or the ISA level asked for)")
        self.emulated = built == 2
        if not self.emulated and not amx_tiles_granted():
            raise OSError("Linux did not grant the AMX tile state (arch_prctl)")


def load_amx_prefill(
    build_dir: Path | None = None, isa: IsaLevel | None = None, emulated: bool = False
) -> AmxPrefillAttention | None:
    """Build (if needed) and load the kernel; None, with the reason logged, where it cannot
    be had. ``TANDEM_PREFILL_TILES=off`` keeps torch's flash attention (the A side of an
    A/B)."""
    if not emulated and os.environ.get("TANDEM_PREFILL_TILES", "").lower() == "off":
        logger.info("TANDEM_PREFILL_TILES=off: long prefill chunks attend through torch's flash")
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
