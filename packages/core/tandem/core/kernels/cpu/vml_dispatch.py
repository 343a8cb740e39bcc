"""oneMKL's vector math functions resolved on one thread, before workers call them at once.

ATen hands contiguous float32 and float64 unary ops (cos, sin, exp, log, sqrt, ...) to oneMKL's
VML, asking for its high-accuracy kernels, and oneMKL picks each function's kernel on that
function's first call. First calls made on several threads at once can run a low-accuracy kernel
on one of them for that whole call (pytorch/pytorch#188792, oneMKL 2024.2 as torch's x86 wheels
link it). The next call is correct, so the damage lasts only where the result is kept.

Here it was kept: the workers of a single-process engine build their rotary tables at the same
moment, and under load one rank's cos/sin table came out of the enhanced-performance kernel
(about 12 correct bits; bit for bit what ``vmsCos`` gives with ``VML_EP``). That rank's half
precision q/k moved by an ulp here and there, and a greedy tie went the other way: the float16
all-reduce test's flake. One worker's intra-op threads splitting a long table would race the
same way. One call of each function in each dtype, on one thread, before any worker computes,
settles the dispatch for the process; every call after it is correct whichever threads make it.
"""

from __future__ import annotations

import logging

import torch

from tandem.core.kernels.process_once import ProcessOnce

logger = logging.getLogger(__name__)

# The unary ops ATen sends to VML (``IMPLEMENT_VML_MKL`` in aten/src/ATen/cpu/vml.h), by torch
# name. Calling one that a torch build computes elsewhere costs a microsecond and nothing else.
VML_OPS = (
    "acos", "asin", "atan", "cos", "erf", "erfc", "erfinv", "exp", "log", "log10", "log2",
    "sin", "sqrt", "tan", "tanh", "trunc",
)  # fmt: skip
VML_DTYPES = (torch.float32, torch.float64)


def _resolve() -> int:
    # One element: the call stays on this thread (no intra-op split), and 0.5 lies in every
    # op's domain (erfinv's is (-1, 1)).
    calls = 0
    for dtype in VML_DTYPES:
        x = torch.full((1,), 0.5, dtype=dtype)
        for name in VML_OPS:
            getattr(torch, name)(x)
            calls += 1
    logger.debug("resolved oneMKL's vector math dispatch (%d calls)", calls)
    return calls


# Once per process; a second worker arriving meanwhile waits on the lock instead of racing.
resolve_vml_dispatch = ProcessOnce(_resolve)
