"""Build a model from a Hugging Face folder, reading each rank's shard tensor by tensor."""

from __future__ import annotations

import json
import logging
from collections.abc import Callable, Iterable, Iterator
from contextlib import ExitStack
from pathlib import Path
from typing import Any, Protocol, TypeVar

import torch
from safetensors import SafetensorError, safe_open
from torch import nn
from tqdm import tqdm

from tandem.collectives import ProcessGroup
from tandem.core.errors import ModelLoadError
from tandem.core.kernels.cpu.packed_linear import pack_linear_weights
from tandem.core.layers.fused_moe import pack_expert_weights
from tandem.core.layers.int8_packing import pack_int8_weights
from tandem.core.layers.linear_attention_state import state_bytes_per_slot
from tandem.core.layers.npu_packing import pack_npu_quantized_weights
from tandem.core.layers.quantized_linear import QuantizableLinear
from tandem.core.layers.quantized_moe import QuantizedMoeExperts
from tandem.core.layers.weights import LazyTensor
from tandem.core.models.causal_lm import CausalLM
from tandem.core.models.model_config import ModelConfig
from tandem.core.models.registry import model_class
from tandem.device import bound_context
from tandem.device.cpu import cpu_flags

logger = logging.getLogger(__name__)

TORCH_DTYPES = {
    "float32": torch.float32,
    "float": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
    "half": torch.float16,
}


# CPU flags under which bfloat16 matmuls have a native path (AMX tiles, AVX512-BF16 dot
# products): 3-8x faster than float32 there, about 100x slower without them.
FAST_BF16_FLAGS = ("amx_bf16", "avx512_bf16")


def resolve_dtype(
    requested: str,
    checkpoint_dtype: str,
    device_kind: str,
    flags: frozenset[str] | None = None,
) -> torch.dtype:
    """The dtype to run in: the flag if given; else the checkpoint's, except on a CPU that
    has no fast path for it, which runs float32. ``flags``: the CPU's (read when None)."""
    if requested != "auto":
        return TORCH_DTYPES[requested]
    dtype = TORCH_DTYPES.get(checkpoint_dtype, torch.float32)
    if device_kind != "cpu" or dtype is torch.float32:
        return dtype
    fast = [f for f in FAST_BF16_FLAGS if f in (cpu_flags() if flags is None else flags)]
    if dtype is torch.bfloat16 and fast:
        logger.info(
            "checkpoint is bfloat16 and the CPU reports %s: running in bfloat16 (pass "
            "--dtype float32 to override)",
            " and ".join(fast),
        )
        return dtype
    why = (
        "this CPU reports neither AMX nor AVX512-BF16, and bfloat16 matmuls are about 100x "
        "slower than float32 without them"
        if dtype is torch.bfloat16
        else "CPUs have no fast float16 matmuls"
    )
    logger.info(
        "checkpoint is %s; running in float32 on CPU: %s; pass --dtype %s to keep it",
        checkpoint_dtype,
        why,
        checkpoint_dtype,
    )
    return torch.float32


def weight_files(folder: Path) -> list[Path]:
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text(encoding="utf-8"))["weight_map"]
        except (json.JSONDecodeError, KeyError) as exc:
            raise ModelLoadError(f"{index} is malformed: {exc}") from None
        files = [folder / name for name in sorted(set(weight_map.values()))]
        missing = [f.name for f in files if not f.is_file()]
        if missing:
            raise ModelLoadError(
                f"{index.name} names weight files that are missing: {', '.join(missing)}"
            )
        return files
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise ModelLoadError(f"{folder} has no *.safetensors weight files")
    return files


def iter_checkpoint(files: list[Path], desc: str) -> Iterator[tuple[str, LazyTensor]]:
    """Yield every tensor of the checkpoint as a lazy slice, with a progress bar."""
    with ExitStack() as stack:
        handles = [stack.enter_context(_open_checkpoint(f)) for f in files]
        names = [(h, n) for h in handles for n in h.keys()]  # noqa: SIM118 - safe_open handles are not dicts
        # disable=None: a bar on terminals, silence in logs and test output.
        for handle, name in tqdm(names, desc=desc, unit="tensor", leave=False, disable=None):
            yield name, handle.get_slice(name)


def _open_checkpoint(file: Path) -> Any:
    try:
        return safe_open(str(file), framework="pt")
    except (SafetensorError, OSError) as exc:
        raise ModelLoadError(
            f"{file} is not a readable safetensors file ({exc}): download or save it again"
        ) from None


class Loadable(Protocol):
    def load_weights(self, weights: Iterable[tuple[str, LazyTensor]]) -> set[str]: ...

    def expected_parameters(self) -> set[str]: ...

    def eval(self) -> Any: ...


def fill_from_checkpoint(model: Loadable, files: list[Path], desc: str) -> None:
    """Load every checkpoint tensor into ``model`` (each rank its shard); every parameter
    must be covered."""
    try:
        loaded = model.load_weights(iter_checkpoint(files, desc))
    except (ValueError, OSError) as exc:
        raise ModelLoadError(str(exc)) from None
    missing = model.expected_parameters() - loaded
    if missing:
        raise ModelLoadError(
            f"the checkpoint lacks {len(missing)} tensors the model needs, e.g. "
            + ", ".join(sorted(missing)[:5])
        )
    model.eval()


def _kernel_families() -> tuple[str, ...]:
    """The kernel families the loading worker's runtime launches: the CPU's where no device
    is bound; not the CPU kernels on the simulator's NPU, whose tensors are host memory too
    but which runs what an NPU would."""
    context = bound_context()
    return ("cpu",) if context is None else tuple(context.runtime.kernel_families)


def load_model(
    folder: Path,
    config: ModelConfig,
    group: ProcessGroup,
    dtype: torch.dtype,
    device: torch.device,
) -> CausalLM:
    """The model the engine serves: dense, MoE or hybrid (linear-attention) decoders."""
    return _load(model_class(config.architecture), folder, config, group, dtype, device)


def state_slot_bytes_before_load(
    config: ModelConfig, group: ProcessGroup, dtype: torch.dtype
) -> int | None:
    """What one sequence's linear-attention state takes on this rank, from the model built on
    the meta device (no storage, no weights read); None where the config does not build (the
    load then says why)."""
    try:
        with torch.device("meta"):
            model = model_class(config.architecture)(config, group, dtype)
    except ValueError:
        return None
    return state_bytes_per_slot(model.linear_attention_layers(), dtype)


def _load(
    cls: type[CausalLM],
    folder: Path,
    config: ModelConfig,
    group: ProcessGroup,
    dtype: torch.dtype,
    device: torch.device,
) -> CausalLM:
    model = materialize(lambda: cls(config, group, dtype), folder, dtype, device)
    if config.tie_word_embeddings:
        model.lm_head.weight = model.embed_tokens.weight
    # Padding rows of a vocab-parallel shard must stay zero.
    model.embed_tokens.weight.data.zero_()
    model.lm_head.weight.data.zero_()
    fill_from_checkpoint(model, weight_files(folder), f"loading {folder.name} (rank {group.rank})")
    finish_quantized_layers(model)
    families = _kernel_families()
    if "cpu" in families:
        pack_linear_weights(model, device, dtype)
        pack_expert_weights(model, device, dtype)
        pack_int8_weights(model, device)
    pack_npu_quantized_weights(model, dtype, families)
    logger.info(
        "loaded %s (%s, %d layers) in %s", folder, config.architecture, config.num_layers, dtype
    )
    return model


def finish_quantized_layers(model: nn.Module) -> None:
    """Pack each 4-bit layer's (and 4-bit routed experts') loaded checkpoint tensors into its
    kernel's layout, once."""
    try:
        for name, module in model.named_modules():
            if isinstance(module, QuantizableLinear | QuantizedMoeExperts):
                module.finish_loading(name)
    except ValueError as exc:
        raise ModelLoadError(str(exc)) from None


M = TypeVar("M", bound=nn.Module)


def materialize(
    build: Callable[[], M], folder: Path, dtype: torch.dtype, device: torch.device
) -> M:
    """``build()`` on the meta device, then its storage made in place on ``device`` in
    ``dtype``: no float32 detour, no second copy. Buffers computed at construction (rotary
    tables) are computed again; a config the layers cannot build is a ModelLoadError."""
    try:
        with torch.device("meta"):
            model = build()
    except ValueError as exc:  # activation, rope or tensor-parallel split not buildable
        raise ModelLoadError(f"{folder}: {exc}") from None
    # Not ``to_empty``: its ``empty_like`` on meta tensors runs torch's Python reference
    # implementation, a millisecond a tensor (a tenth of a test model's load).
    model = model.to(dtype)._apply(  # type: ignore[no-untyped-call]
        lambda t: torch.empty(t.shape, dtype=t.dtype, device=device), recurse=True
    )
    for module in model.modules():
        reset = getattr(module, "reset_buffers", None)
        if callable(reset):
            reset()
    return model
