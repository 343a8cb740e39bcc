"""Engine flags shared by every subcommand that starts an engine, mapped onto EngineConfig."""

from __future__ import annotations

import argparse
import os

from tandem.collectives.torch_distributed import TORCHRUN_ADDRESS, Rendezvous
from tandem.core import CacheConfig, ConfigError, EngineConfig, ModelLoadConfig, SchedulerConfig
from tandem.core.config import (
    DTYPES,
    ParallelConfig,
    PipelineConfig,
    RecConfig,
    SpeculativeConfig,
    StructuredOutputConfig,
)
from tandem.core.demo.pretrained import stories260k_folder
from tandem.core.faults import FaultConfig
from tandem.core.kernels.cpu.native_build import KernelBuildError, selected_isa
from tandem.core.parallel.collective_choice import (
    local_collectives_choices,
    process_collectives_choices,
)


def _dtype(name: str) -> str:
    """vLLM's other names for two dtypes, as Tandem names them."""
    return {"half": "float16", "float": "float32"}.get(name, name)


def add_engine_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("engine")
    g.add_argument(
        "--model",
        default=None,
        help="Hugging Face model folder (config.json, *.safetensors, tokenizer.json); "
        "default: the bundled stories260k TinyStories model",
    )
    g.add_argument(
        "--dtype",
        choices=[*DTYPES, "half", "float"],
        default="auto",
        help="weights, activations and KV cache dtype; auto = the checkpoint's, except on "
        "CPUs: bfloat16 only where the CPU reports AMX or AVX512-BF16, else float32",
    )
    p = parser.add_argument_group("parallelism")
    p.add_argument(
        "--devices",
        "--device",
        dest="devices",
        default="cpu:0",
        help="this node's devices, one worker each, e.g. cpu:0,cpu:1",
    )
    p.add_argument(
        "--tensor-parallel-size",
        "-tp",
        type=int,
        default=None,
        help="ranks over all nodes (default: every listed device of every node)",
    )
    p.add_argument(
        "--single-process",
        action="store_true",
        help="one process drives every local device (same as TANDEM_ENABLE_SINGLE_PROCESS=1)",
    )
    p.add_argument(
        "--master-node-addr",
        default=None,
        help="HOST:PORT where the processes meet: one process per device, or several nodes",
    )
    p.add_argument("--nnodes", type=int, default=1)
    p.add_argument("--node-rank", type=int, default=0)
    p.add_argument(
        "--dist-backend",
        default="auto",
        help="torch.distributed backend of the process world (auto, gloo, hccl, nccl); auto: "
        "gloo on CPU, else the device's backend when --process-collectives is torch",
    )
    p.add_argument(
        "--local-collectives",
        choices=local_collectives_choices(),
        default="auto",
        help="collectives among one process's devices; auto: inprocess on CPU, else the "
        "installed backend of the device kind (hccl: HcclCommInitAll on NPU, nccl: "
        "ncclCommInitAll on CUDA)",
    )
    p.add_argument(
        "--process-collectives",
        choices=process_collectives_choices(),
        default="auto",
        help="collectives among processes; auto: torch.distributed on CPU, else the installed "
        "backend of the device kind (hccl: HcclCommInitRootInfo on NPU, nccl: "
        "ncclCommInitRank on CUDA)",
    )
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
        "--num-state-slots",
        type=int,
        default=None,
        help="linear-attention state slots of a hybrid model, one per running sequence "
        "(default: --max-seqs-per-batch, within half of the memory left after the weights)",
    )
    g.add_argument(
        "--max-memory-utilization",
        "--gpu-memory-utilization",
        dest="max_memory_utilization",
        type=float,
        default=0.9,
        help="fraction of device memory (CPU: of --cpu-memory-gb) for weights + KV",
    )
    g.add_argument(
        "--cpu-memory-gb", type=float, default=4.0, help="RAM budget in GiB for a CPU device"
    )
    g.add_argument(
        "--enable-prefix-cache",
        "--enable-prefix-caching",
        dest="enable_prefix_cache",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="reuse KV blocks of identical prompt prefixes (hybrid models: and the "
        "linear-attention state where they end)",
    )
    g.add_argument(
        "--prefault-kv-cache",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="CPU: back the KV cache with memory at start-up, as vLLM's CPU build does; "
        "otherwise as first used: less resident memory while the pool is not yet used, and "
        "slower first requests (on a cloud VM 11-13%% of the bench workload's output rate). "
        "Default: on, but off for tandem generate, which uses only what its prompts need",
    )
    g.add_argument(
        "--state-cache-mb",
        type=float,
        default=None,
        help="MiB per device of linear-attention state snapshots for a hybrid model's prefix "
        "cache (default: two snapshots per state slot, at least 16, within half of the memory "
        "left after the weights; 0 turns its prefix caching off)",
    )
    g.add_argument(
        "--state-snapshot-interval",
        type=int,
        default=512,
        help="hybrid models: also snapshot the state at the end of a prefill chunk this many "
        "tokens past the last snapshot (0: only at prompt ends, sequence ends and shared "
        "prefixes)",
    )
    g.add_argument(
        "--max-tokens-per-batch",
        "--max-num-batched-tokens",
        dest="max_tokens_per_batch",
        type=int,
        default=2048,
        help="token budget of one engine step",
    )
    g.add_argument(
        "--max-seqs-per-batch",
        "--max-num-seqs",
        dest="max_seqs_per_batch",
        type=int,
        default=64,
        help="sequence budget of one engine step (recommender: requests in flight at once)",
    )
    g.add_argument(
        "--max-waiting-requests",
        type=int,
        default=None,
        help="requests that may wait beside the --max-num-seqs running ones; past both, new "
        "ones are refused with 503 and Retry-After (default: no bound)",
    )
    g.add_argument(
        "--enable-chunked-prefill",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="split long prompts across steps",
    )
    g.add_argument(
        "--stall-timeout-s",
        type=float,
        default=60.0,
        help="seconds with requests but no step launched or completed before the engine "
        "logs its state and fails them",
    )
    g.add_argument(
        "--step-timeout-s",
        type=float,
        default=300.0,
        help="seconds a step (or a collective) may take before the engine fails it, naming "
        "the ranks still running",
    )
    g.add_argument(
        "--health-step-timeout-s",
        type=float,
        default=60.0,
        help="seconds a step may run before /health answers 503 (a stopped or stuck worker "
        "shows this soon; the step fails at --step-timeout-s)",
    )
    g.add_argument(
        "--max-concurrency",
        type=int,
        default=1,
        help="steps each worker runs at once, each in a pipeline lane with its own stream "
        "(one copy of the weights)",
    )
    g.add_argument(
        "--overlap-steps",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="with one step at a time, launch the next decode step before processing the "
        "last one's outputs, so that host work runs beside the forward (default: on for "
        "NPU/CUDA devices, off on CPU, where it takes cores from the forward)",
    )
    g.add_argument(
        "--serialize-prepare",
        action="store_true",
        help="experiment: let one lane at a time prepare its inputs",
    )
    g.add_argument(
        "--serialize-forward",
        action="store_true",
        help="experiment: let one lane at a time run its forward",
    )
    g.add_argument(
        "--rec-max-batch-size",
        type=int,
        default=16,
        help="recommender: requests per batch (prefill and decode rounds run together)",
    )
    g.add_argument(
        "--beam-width",
        type=int,
        default=0,
        help="recommender: beams per request (default: the model's beam_width)",
    )
    g.add_argument(
        "--max-decode-rounds",
        type=int,
        default=None,
        help="recommender: decode rounds after the prefill (must be the model's: "
        "num_codebooks - 1)",
    )
    g.add_argument(
        "--speculative-config",
        default=None,
        help="speculative decoding, as a JSON object with vLLM's keys, e.g. '{\"method\": "
        '"ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 4, "prompt_lookup_min": '
        "2}'; method: ngram (prompt lookup), or mtp (num_speculative_tokens 1: the "
        "checkpoint's multi-token-prediction head, Qwen3.5); steps run one at a time",
    )
    g.add_argument(
        "--engine-seed",
        type=int,
        default=0,
        help="seed of the sampler for requests without their own seed",
    )
    add_structured_output_args(parser)


def add_structured_output_args(parser: argparse.ArgumentParser) -> None:
    d = StructuredOutputConfig()
    g = parser.add_argument_group(
        "structured outputs", "budgets a grammar must fit, else its request is answered 400"
    )
    g.add_argument(
        "--max-grammar-bytes",
        type=int,
        default=d.max_grammar_bytes,
        help="largest JSON schema, regex, choice list or grammar, in bytes of its text",
    )
    g.add_argument(
        "--grammar-compile-timeout-s",
        type=float,
        default=d.compile_timeout_s,
        help="seconds a grammar may take to compile, its probe included",
    )
    g.add_argument(
        "--max-schema-depth",
        type=int,
        default=d.max_schema_depth,
        help="deepest nesting of objects and arrays in a JSON schema",
    )
    g.add_argument(
        "--grammar-probe-tokens",
        type=int,
        default=d.probe_tokens,
        help="tokens a new grammar is walked through before its request starts, so that "
        "one too complex for the grammar engine is refused then rather than mid-output "
        "(0: no probe)",
    )


def _structured_output(args: argparse.Namespace) -> StructuredOutputConfig:
    # getattr: subcommands that do not add these flags get the defaults.
    d = StructuredOutputConfig()
    return StructuredOutputConfig(
        max_grammar_bytes=getattr(args, "max_grammar_bytes", d.max_grammar_bytes),
        compile_timeout_s=getattr(args, "grammar_compile_timeout_s", d.compile_timeout_s),
        max_schema_depth=getattr(args, "max_schema_depth", d.max_schema_depth),
        probe_tokens=getattr(args, "grammar_probe_tokens", d.probe_tokens),
    )


def _speculative(args: argparse.Namespace) -> SpeculativeConfig | None:
    # getattr: subcommands that do not add the flag serve without it.
    text = getattr(args, "speculative_config", None)
    return None if text is None else SpeculativeConfig.from_json(text)


def _parallel_from_torchrun(args: argparse.Namespace) -> None:
    """Under torchrun (one process per node), its environment names this node."""
    rdzv = Rendezvous.from_torchrun_env()
    if rdzv is None or args.master_node_addr is not None:
        return
    args.master_node_addr = TORCHRUN_ADDRESS
    args.nnodes = rdzv.world_size
    args.node_rank = rdzv.rank


def model_folder(args: argparse.Namespace) -> str:
    """The model to load: the one named, else the bundled stories260k."""
    return str(args.model) if args.model is not None else str(stories260k_folder())


def engine_config_from_args(args: argparse.Namespace) -> EngineConfig:
    _parallel_from_torchrun(args)
    try:
        # A misspelt level would otherwise leave every CPU kernel unbuilt: refuse it now.
        selected_isa()
    except KernelBuildError as exc:
        raise ConfigError(str(exc)) from None
    return EngineConfig(
        model=ModelLoadConfig(
            model=model_folder(args),
            dtype=_dtype(args.dtype),
            max_model_len=args.max_model_len,
            seed=args.engine_seed,
        ),
        cache=CacheConfig(
            block_size=args.block_size,
            num_blocks=args.num_blocks,
            num_state_slots=args.num_state_slots,
            max_memory_utilization=args.max_memory_utilization,
            cpu_memory_gb=args.cpu_memory_gb,
            enable_prefix_cache=args.enable_prefix_cache,
            state_cache_mb=args.state_cache_mb,
            state_snapshot_interval=args.state_snapshot_interval,
            prefault_kv_cache=args.prefault_kv_cache,
        ),
        scheduler=SchedulerConfig(
            max_tokens_per_batch=args.max_tokens_per_batch,
            max_seqs_per_batch=args.max_seqs_per_batch,
            enable_chunked_prefill=args.enable_chunked_prefill,
            stall_timeout_s=args.stall_timeout_s,
            max_waiting_requests=args.max_waiting_requests,
        ),
        pipeline=PipelineConfig(
            max_concurrency=args.max_concurrency,
            serialize_prepare=args.serialize_prepare,
            serialize_forward=args.serialize_forward,
            overlap_steps=args.overlap_steps,
        ),
        rec=RecConfig(
            max_batch_size=args.rec_max_batch_size,
            beam_width=args.beam_width,
            max_decode_rounds=args.max_decode_rounds,
        ),
        parallel=ParallelConfig(
            devices=args.devices,
            tensor_parallel_size=args.tensor_parallel_size,
            single_process=args.single_process or _env_flag("TANDEM_ENABLE_SINGLE_PROCESS"),
            master_node_addr=args.master_node_addr,
            nnodes=args.nnodes,
            node_rank=args.node_rank,
            dist_backend=args.dist_backend,
            local_collectives=args.local_collectives,
            process_collectives=args.process_collectives,
            timeout_s=args.step_timeout_s,
            health_timeout_s=args.health_step_timeout_s,
        ),
        structured_output=_structured_output(args),
        speculative=_speculative(args),
        # Tests only; read once here and handed down (to worker processes with the config).
        faults=FaultConfig.from_env(os.environ),
    )


def _env_flag(name: str) -> bool:
    return os.environ.get(name, "").strip().lower() in ("1", "true", "yes", "on")
