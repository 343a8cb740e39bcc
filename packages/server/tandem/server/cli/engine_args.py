"""Engine flags shared by every subcommand that starts an engine, mapped onto EngineConfig."""

from __future__ import annotations

import argparse

from tandem.core import CacheConfig, EngineConfig, ModelLoadConfig, SchedulerConfig
from tandem.core.config import DTYPES


def add_engine_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("engine")
    g.add_argument(
        "--model",
        required=True,
        help="Hugging Face model folder (config.json, *.safetensors, tokenizer.json)",
    )
    g.add_argument(
        "--dtype",
        choices=DTYPES,
        default="auto",
        help="weights and activations dtype; auto = the checkpoint's, but float32 "
        "for half-precision checkpoints on CPU",
    )
    g.add_argument("--device", default="cpu:0", help="device to run on, e.g. cpu:0")
    g.add_argument(
        "--max-model-len",
        type=int,
        default=None,
        help="cap the context length (default: the model's)",
    )
    g.add_argument("--block-size", type=int, default=16, help="tokens per KV-cache block")
    g.add_argument(
        "--num-blocks", type=int, default=None, help="KV-cache blocks (default: sized from memory)"
    )
    g.add_argument(
        "--max-memory-utilization",
        type=float,
        default=0.9,
        help="fraction of device memory (CPU: of --cpu-memory-gb) for weights + KV",
    )
    g.add_argument(
        "--cpu-memory-gb", type=float, default=4.0, help="RAM budget in GiB for a CPU device"
    )
    g.add_argument(
        "--enable-prefix-cache",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="reuse KV blocks of identical prompt prefixes",
    )
    g.add_argument(
        "--max-tokens-per-batch", type=int, default=2048, help="token budget of one engine step"
    )
    g.add_argument(
        "--max-seqs-per-batch", type=int, default=64, help="sequence budget of one engine step"
    )
    g.add_argument(
        "--enable-chunked-prefill",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="split long prompts across steps",
    )
    g.add_argument(
        "--engine-seed",
        type=int,
        default=0,
        help="seed of the sampler for requests without their own seed",
    )


def engine_config_from_args(args: argparse.Namespace) -> EngineConfig:
    return EngineConfig(
        model=ModelLoadConfig(
            model=args.model,
            dtype=args.dtype,
            max_model_len=args.max_model_len,
            seed=args.engine_seed,
        ),
        cache=CacheConfig(
            block_size=args.block_size,
            num_blocks=args.num_blocks,
            max_memory_utilization=args.max_memory_utilization,
            cpu_memory_gb=args.cpu_memory_gb,
            enable_prefix_cache=args.enable_prefix_cache,
        ),
        scheduler=SchedulerConfig(
            max_tokens_per_batch=args.max_tokens_per_batch,
            max_seqs_per_batch=args.max_seqs_per_batch,
            enable_chunked_prefill=args.enable_chunked_prefill,
        ),
        device=args.device,
    )
