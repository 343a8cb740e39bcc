"""oneMKL's vector math functions resolved on one thread, before workers call them at once.

ATen hands float32 and float64 unary ops (cos, sin, exp, log, sqrt, ...) to oneMKL's VML, asking
for its high-accuracy kernels, and oneMKL picks each function's kernel on that function's first
call. First calls made on several threads at once can run a low-accuracy kernel on one of them
for that whole call (pytorch/pytorch#188792; oneMKL 2024.2, build 20240605, the one torch
2.13's x86 wheel reports). The next call is correct, so the damage lasts only where the result
is kept.

Here it was kept: the workers of a single-process engine build their rotary tables at the same
moment, and under load one rank's cos/sin table came out of the enhanced-performance kernel
(about 12 correct bits; bit for bit what ``vmsCos`` gives with ``VML_EP``). That rank's half
precision q/k moved by an ulp here and there, and a greedy tie went the other way: the float16
all-reduce test's flake. One worker's intra-op threads splitting a long table can race the same
way. One call of each function in each dtype, on one thread, before any worker computes, settles
the dispatch for the process, as the upstream fix does (pytorch/pytorch#188791: one element per
function and precision).
"""

from __future__ import annotations

import logging

import torch

from tandem.core.kernels.process_once import ProcessOnce

logger = logging.getLogger(__name__)

# The unary ops that aten/src/ATen/cpu/vml.h sends to VML (``IMPLEMENT_VML_MKL``), by torch name.
# Calling one that a torch build computes elsewhere costs a microsecond and nothing else.
VML_OPS = (
    "acos", "asin", "atan", "cos", "erf", "erfc", "erfinv", "exp", "log", "log10", "log2",
    "sin", "sqrt", "tan", "tanh", "trunc",
)  # fmt: skip
VML_DTYPES = (torch.float32, torch.float64)
# In every op's domain (erfinv's is (-1, 1)).
WARM_UP_VALUE = 0.5


def _resolve() -> None:
    for dtype in VML_DTYPES:
        # One element: the call stays on this thread (no intra-op split). On the CPU whatever
        # default device a caller has set: elsewhere no VML call would happen.
        x = torch.full((1,), WARM_UP_VALUE, dtype=dtype, device="cpu")
        for name in VML_OPS:
            getattr(torch, name)(x)
    logger.debug("resolved oneMKL's vector math dispatch (%d functions)", len(VML_OPS))


# Once per process; a second worker arriving meanwhile waits on the lock instead of racing.
resolve_vml_dispatch = ProcessOnce(_resolve)
