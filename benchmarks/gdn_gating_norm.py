"""The two elementwise pieces of a bench-size Gated DeltaNet layer (``tandem make-demo-model
--kind qwen3_5 --preset bench``: 8 value heads of 64, 4 key heads of 64, bfloat16) through the
torch references and the native CPU kernels, on the views the layer hands them: the gated
RMSNorm of the core output times ``silu(z)`` (z a section of the qkvz projection), and the
gates (g, beta) from the b and a columns of the ba projection. Decode (48 rows) and prefill
(256 and 1,024 rows), two threads, interleaved, median of seven rounds of 20 calls each:

    python benchmarks/gdn_gating_norm.py
"""

from __future__ import annotations

import statistics
import timeit
from collections.abc import Callable
from typing import Any

import torch

from tandem.core.kernels.cpu.elementwise import native_elementwise
from tandem.core.kernels.reference.elementwise import rms_norm_gated
from tandem.core.kernels.reference.gated_delta_rule import gdn_gating

ROUNDS, CALLS = 7, 20
V_HEADS, V_DIM, K_HEADS, K_DIM = 8, 64, 4, 64


def cases(tokens: int) -> dict[str, Callable[[], Any]]:
    kernels = native_elementwise()
    if kernels is None:
        raise SystemExit("no native elementwise kernels here (no compiler?)")
    dt, gen = torch.bfloat16, torch.Generator().manual_seed(tokens)
    value = V_HEADS * V_DIM
    conv_channels = 2 * K_HEADS * K_DIM + value
    qkvz = torch.randn(tokens, conv_channels + value, generator=gen).to(dt)
    z = qkvz[:, conv_channels:].view(tokens, V_HEADS, V_DIM)
    core = torch.randn(tokens, V_HEADS, V_DIM, generator=gen).to(dt)
    weight = (1 + 0.1 * torch.randn(V_DIM, generator=gen)).to(dt)
    ba = (torch.randn(tokens, 2 * V_HEADS, generator=gen) * 2).to(dt)
    b, a = torch.split(ba, [V_HEADS, V_HEADS], dim=-1)
    a_log = torch.rand(V_HEADS, generator=gen).to(dt)
    dt_bias = torch.randn(V_HEADS, generator=gen).to(dt)
    return {
        "norm torch": lambda: rms_norm_gated(core, z, weight, 1e-6),
        "norm native": lambda: kernels.rms_norm_gated(core, z, weight, 1e-6),
        "gating torch": lambda: gdn_gating(a, b, a_log, dt_bias),
        "gating native": lambda: kernels.gdn_gating(a, b, a_log, dt_bias),
    }


def main() -> None:
    torch.set_num_threads(2)
    print(f"torch threads {torch.get_num_threads()}", flush=True)
    for tokens in (48, 256, 1024):
        # timeit per side, the sides alternating round by round (the first round warms up).
        timers = {name: timeit.Timer(run) for name, run in cases(tokens).items()}
        samples: dict[str, list[float]] = {name: [] for name in timers}
        for _ in range(ROUNDS):
            for name, timer in timers.items():
                samples[name].append(timer.timeit(CALLS) / CALLS * 1e6)
        row = "  ".join(f"{name} {statistics.median(t):.1f} us" for name, t in samples.items())
        print(f"rows {tokens}: {row}", flush=True)


if __name__ == "__main__":
    main()
