"""Typed configuration for every part of the engine; flags map onto these dataclasses once."""

from __future__ import annotations

import json
from dataclasses import dataclass, field

from tandem.core.errors import ConfigError
from tandem.core.faults import FaultConfig
from tandem.device import parse_devices

DTYPES = ("auto", "float32", "bfloat16", "float16")


@dataclass(frozen=True)
class CacheConfig:
    block_size: int = 16
    # Explicit block count; None sizes the cache from the memory budget.
    num_blocks: int | None = None
    # Explicit count of linear-attention state slots (hybrid models only); None sizes them
    # with the KV blocks (see kv/cache_sizing.py).
    num_state_slots: int | None = None
    max_memory_utilization: float = 0.9
    # RAM budget in GiB that CPU "devices" may use for weights plus KV cache.
    cpu_memory_gb: float = 4.0
    enable_prefix_cache: bool = True
    # Hybrid models' prefix cache: MiB of linear-attention state snapshots (kv/state_snapshots.py)
    # per rank (--state-cache-mb); None: two per state slot (kv/cache_sizing.py).
    state_cache_mb: float | None = None
    # A snapshot at the end of a prefill chunk at least this many tokens past the last one
    # (--state-snapshot-interval; 0: only at the other places, see llm/scheduler.py).
    state_snapshot_interval: int = 512
    # CPU: back the KV cache's pages with memory at start-up (--[no-]prefault-kv-cache), not
    # at their first write inside a step (kv/kv_cache.py, prefault_host_cache).
    prefault_kv_cache: bool = True

    def __post_init__(self) -> None:
        if self.block_size < 1:
            raise ConfigError(f"--block-size must be >= 1, got {self.block_size}")
        if self.num_blocks is not None and self.num_blocks < 1:
            raise ConfigError(f"--num-blocks must be >= 1, got {self.num_blocks}")
        if self.num_state_slots is not None and self.num_state_slots < 1:
            raise ConfigError(f"--num-state-slots must be >= 1, got {self.num_state_slots}")
        if not 0.0 < self.max_memory_utilization <= 1.0:
            raise ConfigError(
                f"--max-memory-utilization must be in (0, 1], got {self.max_memory_utilization}"
            )
        if self.cpu_memory_gb <= 0:
            raise ConfigError(f"--cpu-memory-gb must be > 0, got {self.cpu_memory_gb}")
        if self.state_cache_mb is not None and self.state_cache_mb < 0:
            raise ConfigError(f"--state-cache-mb must be >= 0, got {self.state_cache_mb}")
        if self.state_snapshot_interval < 0:
            raise ConfigError(
                f"--state-snapshot-interval must be >= 0, got {self.state_snapshot_interval}"
            )


@dataclass(frozen=True)
class SchedulerConfig:
    max_tokens_per_batch: int = 2048
    max_seqs_per_batch: int = 64
    enable_chunked_prefill: bool = True
    # Seconds the engine may hold requests without launching or completing a step before
    # the watchdog logs its state and fails them (a safety net: a live engine never idles
    # with work it could do).
    stall_timeout_s: float = 60.0
    # Requests that may wait beside the max_seqs_per_batch that can run: past both, new ones
    # are refused with "overloaded" (HTTP 503, Retry-After); None = no bound.
    max_waiting_requests: int | None = None

    def __post_init__(self) -> None:
        if self.max_waiting_requests is not None and self.max_waiting_requests < 1:
            raise ConfigError(
                f"--max-waiting-requests must be >= 1, got {self.max_waiting_requests}"
            )
        if self.stall_timeout_s <= 0:
            raise ConfigError(f"--stall-timeout-s must be > 0, got {self.stall_timeout_s}")
        if self.max_tokens_per_batch < 1:
            raise ConfigError(
                f"--max-tokens-per-batch must be >= 1, got {self.max_tokens_per_batch}"
            )
        if self.max_seqs_per_batch < 1:
            raise ConfigError(f"--max-seqs-per-batch must be >= 1, got {self.max_seqs_per_batch}")


@dataclass(frozen=True)
class ModelLoadConfig:
    model: str
    # "auto": the checkpoint's dtype, except half precision on CPU (which runs in float32).
    dtype: str = "auto"
    # Cap on the context length; None takes the model's max_position_embeddings.
    max_model_len: int | None = None
    seed: int = 0

    def __post_init__(self) -> None:
        if self.dtype not in DTYPES:
            raise ConfigError(f"--dtype must be one of {', '.join(DTYPES)}, got {self.dtype!r}")
        if self.max_model_len is not None and self.max_model_len < 2:
            raise ConfigError(f"--max-model-len must be >= 2, got {self.max_model_len}")

    def context_length(self, model_limit: int) -> int:
        """The longest sequence served: ``max_model_len``, within the model's own limit."""
        return min(self.max_model_len or model_limit, model_limit)


@dataclass(frozen=True)
class ParallelConfig:
    # This node's devices, e.g. "cpu:0,cpu:1"; one worker per device.
    devices: str = "cpu:0"
    # Ranks over all nodes; None = every device of every node.
    tensor_parallel_size: int | None = None
    # One process drives all local devices (TANDEM_ENABLE_SINGLE_PROCESS=1 / --single-process).
    single_process: bool = False
    # HOST:PORT of the rendezvous: one process per device, or several nodes.
    master_node_addr: str | None = None
    nnodes: int = 1
    node_rank: int = 0
    # torch.distributed backend of the process world: "auto" = gloo on CPU; on NPU/CUDA hccl/
    # nccl when the collectives run on torch.distributed, else gloo (it only carries ids).
    dist_backend: str = "auto"
    # Collectives among the devices of one single-process node: "auto" (by device kind:
    # inprocess on CPU, hccl on NPU, nccl on CUDA), "inprocess" (one communicator set for all
    # local devices, host memory), "hccl"/"nccl" (HcclCommInitAll / ncclCommInitAll, from
    # tandem-hw), or "torch" (torch.distributed's default group, which cannot host two ranks
    # in one process and is refused there).
    local_collectives: str = "auto"
    # Collectives among processes: "auto" (torch on CPU, hccl on NPU, nccl on CUDA), "torch"
    # (torch.distributed with dist_backend), "hccl"/"nccl" (root info / unique id exchanged
    # over the CPU world group, then HcclCommInitRootInfo / ncclCommInitRank).
    process_collectives: str = "auto"
    # Seconds a step, a collective or a worker call may wait before it fails instead of
    # hanging (--step-timeout-s).
    timeout_s: float = 300.0
    # Seconds a step may run before /health reports the engine unhealthy (it fails at
    # timeout_s): a stopped or stuck worker shows this soon.
    health_timeout_s: float = 60.0

    def __post_init__(self) -> None:
        if self.timeout_s <= 0:
            raise ConfigError(f"--step-timeout-s must be > 0, got {self.timeout_s}")
        if self.health_timeout_s <= 0:
            raise ConfigError(f"--health-step-timeout-s must be > 0, got {self.health_timeout_s}")
        if self.nnodes < 1:
            raise ConfigError(f"--nnodes must be >= 1, got {self.nnodes}")
        if not 0 <= self.node_rank < self.nnodes:
            raise ConfigError(
                f"--node-rank must be in [0, {self.nnodes}) for --nnodes {self.nnodes}, "
                f"got {self.node_rank}"
            )
        if self.tensor_parallel_size is not None and self.tensor_parallel_size < 1:
            raise ConfigError(
                f"--tensor-parallel-size must be >= 1, got {self.tensor_parallel_size}"
            )


@dataclass(frozen=True)
class PipelineConfig:
    # Steps a worker may run at once, each in a pipeline lane with its own stream, input
    # staging and communicator set, all on one copy of the weights.
    max_concurrency: int = 1
    # Experiment switches (off by default): serialize the lanes' input preparation, or their
    # forwards, to measure what running them at once gains.
    serialize_prepare: bool = False
    serialize_forward: bool = False
    # One step at a time (max_concurrency 1): when a step leaves nothing but decodes to do,
    # launch the next before processing its outputs (detokenizing, stop strings, delivery),
    # so that host work runs beside the forward instead of between forwards. None: on for
    # accelerators, off on CPU, where the host work takes cores from the forward (measured
    # on two cores: 5% less throughput and later first tokens with it).
    overlap_steps: bool | None = None

    def __post_init__(self) -> None:
        if self.max_concurrency < 1:
            raise ConfigError(f"--max-concurrency must be >= 1, got {self.max_concurrency}")

    def launches_ahead(self, devices: str) -> bool:
        """Whether steps are launched ahead (``overlap_steps``) on these ``--devices``."""
        if self.max_concurrency > 1:
            return False
        if self.overlap_steps is not None:
            return self.overlap_steps
        try:
            parsed = parse_devices(devices)
        except ValueError as exc:
            raise ConfigError(f"--devices: {exc}") from None
        return any(device.kind != "cpu" for device in parsed)


@dataclass(frozen=True)
class RecConfig:
    """The fixed-steps scheduler of generative recommendation."""

    # Requests per batch (a batch runs its prefill and every decode round together).
    max_batch_size: int = 16
    # Beams per request; 0 = the model's beam_width. A request asking for more candidates
    # than beams gets as many beams as candidates.
    beam_width: int = 0
    # Decode rounds after the prefill; None = what the model needs (num_codebooks - 1).
    max_decode_rounds: int | None = None

    def __post_init__(self) -> None:
        if self.max_batch_size < 1:
            raise ConfigError(f"--rec-max-batch-size must be >= 1, got {self.max_batch_size}")
        if self.beam_width < 0:
            raise ConfigError(f"--beam-width must be >= 0, got {self.beam_width}")


@dataclass(frozen=True)
class StructuredOutputConfig:
    """The grammar engine behind response_format and the structured_outputs extras."""

    # Threads compiling grammars, off the server's event loop and the engine's thread.
    compile_threads: int = 2
    # How much nicer than the rest of the process those threads run (Linux keeps a niceness
    # per thread): a burst of compiles then yields the cores to the event loop and the
    # engine instead of sharing them evenly, as the preparation processes do (+10).
    compile_niceness: int = 10
    # Compiled grammars kept for reuse (most recently used first).
    cache_size: int = 256
    # Let JSON grammars allow free whitespace between tokens. Off by default: a weak model
    # can then loop on whitespace forever (vLLM's --structured-outputs-config
    # disable_any_whitespace, the other way round).
    whitespace_flexible: bool = False
    # Budgets a grammar must fit before a request's first token; one that does not is
    # refused with a 400 naming the budget (docs/reliability.md, "Grammars").
    # Bytes of the schema, regex, choice list or grammar text.
    max_grammar_bytes: int = 1 << 20
    # Seconds one compilation may take, probe included.
    compile_timeout_s: float = 10.0
    # Nesting of objects and arrays in a JSON schema (a schema's every level of properties
    # takes two: the properties map and the subschema).
    max_schema_depth: int = 64
    # Tokens the compile-time probe walks through the grammar, as generation would, so that
    # the lexer limits llguidance would otherwise hit mid-generation are hit before the
    # request starts (0: no probe).
    probe_tokens: int = 256

    def __post_init__(self) -> None:
        if self.compile_threads < 1:
            raise ConfigError(f"compile_threads must be >= 1, got {self.compile_threads}")
        if not 0 <= self.compile_niceness <= 19:
            raise ConfigError(f"compile_niceness must be in [0, 19], got {self.compile_niceness}")
        if self.cache_size < 1:
            raise ConfigError(f"cache_size must be >= 1, got {self.cache_size}")
        if self.max_grammar_bytes < 1:
            raise ConfigError(f"--max-grammar-bytes must be >= 1, got {self.max_grammar_bytes}")
        if self.compile_timeout_s <= 0:
            raise ConfigError(
                f"--grammar-compile-timeout-s must be > 0, got {self.compile_timeout_s}"
            )
        if self.max_schema_depth < 1:
            raise ConfigError(f"--max-schema-depth must be >= 1, got {self.max_schema_depth}")
        if self.probe_tokens < 0:
            raise ConfigError(f"--grammar-probe-tokens must be >= 0, got {self.probe_tokens}")


SPECULATIVE_METHODS = ("ngram", "mtp")
# Methods vLLM has that Tandem does not serve yet, named so that the refusal says so.
_LATER_METHODS = ("eagle", "eagle3", "medusa", "mlp_speculator", "draft_model", "suffix")
SPECULATIVE_KEYS = ("method", "num_speculative_tokens", "prompt_lookup_max", "prompt_lookup_min")
# A verify step runs 1 + K query tokens per sequence; past this, rejected drafts cost more
# than the weight pass they could save.
MAX_SPECULATIVE_TOKENS = 64


@dataclass(frozen=True)
class SpeculativeConfig:
    """Speculative decoding (``--speculative-config``, vLLM's JSON keys and defaults): n-gram
    (prompt lookup) drafts of ``num_speculative_tokens`` tokens, taken from what followed the
    longest suffix n-gram (``prompt_lookup_max`` down to ``prompt_lookup_min`` tokens) that
    occurred earlier in the prompt and output; or ("mtp") drafts from the checkpoint's own
    multi-token-prediction head (Qwen3.5's ``mtp.*``). Either is verified by the target
    model in one step."""

    method: str = "ngram"
    num_speculative_tokens: int = 1
    prompt_lookup_max: int = 5
    prompt_lookup_min: int = 5

    @property
    def drafts_with_head(self) -> bool:
        """Whether the model's own multi-token-prediction head drafts ("mtp"): the workers
        build and run it, and the steps carry its inputs."""
        return self.method == "mtp"

    def __post_init__(self) -> None:
        flag = "--speculative-config"
        if self.method not in SPECULATIVE_METHODS:
            later = " (not served yet)" if self.method in _LATER_METHODS else ""
            raise ConfigError(
                f"{flag}: method {self.method!r}{later} is not supported; supported: "
                + ", ".join(repr(m) for m in SPECULATIVE_METHODS)
            )
        if not 1 <= self.num_speculative_tokens <= MAX_SPECULATIVE_TOKENS:
            raise ConfigError(
                f"{flag}: num_speculative_tokens must be in [1, {MAX_SPECULATIVE_TOKENS}], "
                f"got {self.num_speculative_tokens}"
            )
        if self.prompt_lookup_min < 1:
            raise ConfigError(
                f"{flag}: prompt_lookup_min must be >= 1, got {self.prompt_lookup_min}"
            )
        if self.prompt_lookup_max < self.prompt_lookup_min:
            raise ConfigError(
                f"{flag}: prompt_lookup_min ({self.prompt_lookup_min}) must be <= "
                f"prompt_lookup_max ({self.prompt_lookup_max})"
            )

    @classmethod
    def from_json(cls, text: str) -> SpeculativeConfig:
        """The config of a ``--speculative-config`` JSON object. As in vLLM, a missing
        prompt_lookup bound takes the other's value, and 5 when both are missing."""
        flag = "--speculative-config"
        try:
            raw = json.loads(text)
        except json.JSONDecodeError as exc:
            raise ConfigError(f"{flag} is not valid JSON ({exc.msg} at char {exc.pos})") from None
        if not isinstance(raw, dict):
            raise ConfigError(f"{flag} must be a JSON object, e.g. " + _SPECULATIVE_EXAMPLE)
        unknown = sorted(set(raw) - set(SPECULATIVE_KEYS))
        if unknown:
            raise ConfigError(
                f"{flag}: unsupported key(s) {', '.join(unknown)}; supported: "
                f"{', '.join(SPECULATIVE_KEYS)}"
            )
        if "method" not in raw or "num_speculative_tokens" not in raw:
            raise ConfigError(
                f"{flag} needs method and num_speculative_tokens, e.g. " + _SPECULATIVE_EXAMPLE
            )
        method = raw["method"]
        if not isinstance(method, str):
            raise ConfigError(f"{flag}: method must be a string, got {method!r}")
        for key in SPECULATIVE_KEYS[1:]:
            value = raw.get(key)
            if value is not None and (not isinstance(value, int) or isinstance(value, bool)):
                raise ConfigError(f"{flag}: {key} must be an integer, got {value!r}")
        low, high = raw.get("prompt_lookup_min"), raw.get("prompt_lookup_max")
        low = high if low is None else low
        high = low if high is None else high
        return cls(
            method=method,
            num_speculative_tokens=raw["num_speculative_tokens"],
            prompt_lookup_max=5 if high is None else high,
            prompt_lookup_min=5 if low is None else low,
        )


_SPECULATIVE_EXAMPLE = '{"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 4}'


@dataclass(frozen=True)
class EngineConfig:
    model: ModelLoadConfig
    cache: CacheConfig = field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    pipeline: PipelineConfig = field(default_factory=PipelineConfig)
    rec: RecConfig = field(default_factory=RecConfig)
    structured_output: StructuredOutputConfig = field(default_factory=StructuredOutputConfig)
    # None: no speculative decoding.
    speculative: SpeculativeConfig | None = None
    # Off unless TANDEM_FAULTS names faults (tests only).
    faults: FaultConfig = field(default_factory=FaultConfig)
