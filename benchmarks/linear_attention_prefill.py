"""The prefill and the decode step of one bench-size Gated DeltaNet layer (4 key / 8 value
heads of 64, conv over 1,024 channels, bfloat16) through the torch references (chunked delta
rule, gathered conv; for decodes the one-step rule and conv update) and the native CPU
kernels, interleaved, median of five rounds of two calls each:

    python benchmarks/linear_attention_prefill.py

A decode step's 48 sequences hold slots spread over a pool of 145 (float32 recurrent states,
128 KiB a sequence); before each of its calls 64 MiB streams through the caches, as a decode
step's weights do between two calls of one layer, so that the states come from memory.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import torch

from tandem.core.kernels.cpu.linear_attention import (
    NativeLinearAttention,
    native_linear_attention,
)
from tandem.core.kernels.linear_attention_metadata import build_linear_attention_metadata
from tandem.core.kernels.reference.causal_conv1d import (
    causal_conv1d_prefill,
    causal_conv1d_update,
)
from tandem.core.kernels.reference.gated_delta_rule import (
    chunk_gated_delta_rule,
    recurrent_gated_delta_rule,
)

ROUNDS = 5
DECODES = 48
# Streamed before each decode call: more than this CPU's last-level cache holds.
EVICT_BYTES = 64 << 20


def layer_inputs(n: int, gen: torch.Generator) -> tuple[torch.Tensor, ...]:
    """One layer's inputs for ``n`` tokens: q, k, v, g, beta, the conv input and its taps."""
    dt = torch.bfloat16
    q, k = (torch.randn(n, 4, 64, generator=gen).to(dt) for _ in range(2))
    v = torch.randn(n, 8, 64, generator=gen).to(dt)
    g, beta = -torch.rand(n, 8, generator=gen), torch.rand(n, 8, generator=gen).to(dt)
    x = torch.randn(n, 1024, generator=gen).to(dt)
    taps = torch.randn(1024, 4, generator=gen).to(dt)
    return q, k, v, g, beta, x, taps


def native_kernels() -> NativeLinearAttention:
    kernel = native_linear_attention()
    if kernel is None:
        raise SystemExit("no native linear-attention kernels here (no compiler?)")
    return kernel


def cases(lens: list[int]) -> dict[str, Callable[[], torch.Tensor]]:
    kernel = native_kernels()
    gen = torch.Generator().manual_seed(0)
    query_lens = torch.tensor(lens)
    meta = build_linear_attention_metadata(
        query_lens, query_lens, torch.arange(1, len(lens) + 1), num_decodes=0,
        conv_kernel_size=4, device=torch.device("cpu"),
    )  # fmt: skip
    q, k, v, g, beta, x, taps = layer_inputs(sum(lens), gen)
    states = torch.zeros(len(lens) + 1, 8, 64, 64)
    conv_states = torch.zeros(len(lens) + 1, 1024, 3, dtype=x.dtype)
    return {
        "delta torch": lambda: chunk_gated_delta_rule(q, k, v, g, beta, states, meta),
        "delta native": lambda: kernel.recurrent_prefill(q, k, v, g, beta, states, meta),
        "conv torch": lambda: causal_conv1d_prefill(x, taps, conv_states, meta, "silu"),
        "conv native": lambda: kernel.conv_prefill(x, taps, conv_states, meta, "silu"),
    }


def decode_cases() -> dict[str, Callable[[], torch.Tensor]]:
    """One decode step of ``DECODES`` sequences whose slots are every third of the pool."""
    kernel = native_kernels()
    n, gen = DECODES, torch.Generator().manual_seed(1)
    meta = build_linear_attention_metadata(
        torch.ones(n, dtype=torch.long), torch.full((n,), 300), torch.arange(1, n + 1) * 3,
        num_decodes=n, conv_kernel_size=4, device=torch.device("cpu"),
    )  # fmt: skip
    q, k, v, g, beta, x, taps = layer_inputs(n, gen)
    states = torch.randn(3 * n + 1, 8, 64, 64, generator=gen) * 0.01
    conv_states = torch.randn(3 * n + 1, 1024, 3, generator=gen).to(x.dtype)
    return {
        "delta torch": lambda: recurrent_gated_delta_rule(q, k, v, g, beta, states, meta),
        "delta native": lambda: kernel.recurrent(q, k, v, g, beta, states, meta),
        "conv torch": lambda: causal_conv1d_update(x, taps, conv_states, meta, "silu"),
        "conv native": lambda: kernel.conv_update(x, taps, conv_states, meta, "silu"),
    }


def timed_row(runs: dict[str, Callable[[], torch.Tensor]], evict: torch.Tensor | None) -> str:
    """Each case's median ms a call; ``evict`` streamed through the caches before each."""
    times: dict[str, list[float]] = {name: [] for name in runs}
    for _ in range(ROUNDS):
        for name, run in runs.items():
            run()
            spent = 0.0
            for _ in range(2):
                if evict is not None:
                    evict.add_(1)
                start = time.perf_counter()
                run()
                spent += time.perf_counter() - start
            times[name].append(spent / 2 * 1e3)
    return "  ".join(f"{name} {sorted(t)[ROUNDS // 2]:.3f} ms" for name, t in times.items())


def main() -> None:
    print(f"torch threads {torch.get_num_threads()}", flush=True)
    for lens in ([256], [256] * 4, [2048]):
        print(f"prompts {lens}: {timed_row(cases(lens), None)}", flush=True)
    evict = torch.zeros(EVICT_BYTES, dtype=torch.uint8)
    print(f"decode step, {DECODES} sequences: {timed_row(decode_cases(), evict)}", flush=True)


if __name__ == "__main__":
    main()
