"""``tandem quantize SRC DST --scheme w8a8|w4a16``: write a quantized copy of a float model
folder, in a layout that Tandem and vLLM both read (compressed-tensors for W8A8, GPTQ for
W4A16)."""

from __future__ import annotations

import argparse
import logging
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError

from tandem.core.errors import ModelLoadError
from tandem.core.models.calibration import calibration_samples, collect_hessians
from tandem.core.models.gptq_config import GROUP_SIZES
from tandem.core.models.w4a16_writer import write_w4a16
from tandem.core.models.w8a8_writer import write_w8a8

logger = logging.getLogger(__name__)

SCHEMES = ("w8a8", "w4a16")
# AutoGPTQ's and vLLM's usual choice.
DEFAULT_GROUP_SIZE = 128


def add_parser(subparsers: Any, parents: list[argparse.ArgumentParser]) -> None:
    p: argparse.ArgumentParser = subparsers.add_parser(
        "quantize",
        help="write a quantized copy of a float Hugging Face model folder",
        parents=parents,
    )
    p.add_argument("src", help="the float model folder (config.json, safetensors, tokenizer)")
    p.add_argument("dst", help="the folder to write (new, or empty)")
    p.add_argument(
        "--scheme",
        choices=SCHEMES,
        required=True,
        help="w8a8: int8 weights, one scale per output channel (round to nearest), and int8 "
        "activations quantized per token at run time (compressed-tensors 'int-quantized', "
        "as llm-compressor's W8A8 writes it); w4a16: 4-bit weights per group of inputs "
        "(round to nearest), float activations, in GPTQ's format as AutoGPTQ writes it; "
        "a mixture-of-experts model's routed experts are quantized one by one; embeddings, "
        "norms, routers and lm_head stay float",
    )
    p.add_argument(
        "--group-size",
        type=int,
        choices=GROUP_SIZES,
        help="w4a16: inputs that share a scale and zero point (-1: one per output channel); "
        f"a projection whose inputs it does not divide stays float (default: {DEFAULT_GROUP_SIZE})",
    )
    p.add_argument(
        "--no-sym",
        dest="sym",
        action="store_false",
        help="w4a16: a zero point per group (asymmetric) instead of 8 for all; note that "
        "vLLM 0.32 serves only symmetric GPTQ",
    )
    p.add_argument(
        "--calibration",
        metavar="TEXT_FILE",
        help="w4a16: quantize with GPTQ (each weight's rounding error spread over its later "
        "inputs, weighted by the model's own activations on this text) instead of rounding "
        "to nearest; a few hundred KB of text like what the model will serve",
    )
    p.add_argument(
        "--calibration-samples",
        type=int,
        default=128,
        help="with --calibration: at most this many samples of the text (default: 128)",
    )
    p.add_argument(
        "--calibration-len",
        type=int,
        default=512,
        help="with --calibration: tokens per sample (default: 512)",
    )
    p.add_argument(
        "--act-order",
        action="store_true",
        help="with --calibration: quantize the inputs in decreasing order of their "
        "activations' energy (GPTQ's desc_act)",
    )
    p.add_argument(
        "--keep-float",
        action="append",
        default=[],
        metavar="PROJECTION",
        help="leave these projections float (repeatable; a part of a name picks every "
        "projection it is in, e.g. 'linear_attn' for a Qwen3.5's linear-attention ones); the "
        "written quantization_config says so",
    )
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    src, dst = Path(args.src), Path(args.dst)
    if args.scheme == "w8a8" and (args.group_size is not None or not args.sym):
        raise ModelLoadError("--group-size and --no-sym apply to --scheme w4a16 only")
    calibrated = args.calibration is not None
    if (calibrated or args.act_order) and args.scheme != "w4a16":
        raise ModelLoadError("--calibration and --act-order apply to --scheme w4a16 only")
    if args.act_order and not calibrated:
        raise ModelLoadError("--act-order needs --calibration TEXT_FILE (it is GPTQ's)")
    if args.calibration_samples < 1 or args.calibration_len < 2:
        raise ModelLoadError("--calibration-samples must be >= 1 and --calibration-len >= 2")
    group_size = DEFAULT_GROUP_SIZE if args.group_size is None else args.group_size
    keep_float = frozenset(args.keep_float)
    try:
        if args.scheme == "w8a8":
            count = write_w8a8(src, dst, keep_float=keep_float)
        else:
            hessians = _hessians(args, src) if calibrated else None
            count = write_w4a16(
                src, dst, group_size=group_size, sym=args.sym, hessians=hessians,
                act_order=args.act_order, keep_float=keep_float,
            )  # fmt: skip
    except (OSError, SafetensorError) as exc:
        raise ModelLoadError(f"quantize {args.src} -> {args.dst}: {exc}") from None
    logger.info(
        "quantized %d linear weights of %s into %s (%s)", count, args.src, args.dst, args.scheme
    )
    return 0


def _hessians(args: argparse.Namespace, src: Path) -> dict[str, torch.Tensor]:
    """GPTQ's statistics of the float model on the calibration text."""
    try:
        text = Path(args.calibration).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise ModelLoadError(f"--calibration {args.calibration}: {exc}") from None
    try:
        samples = calibration_samples(src, text, args.calibration_samples, args.calibration_len)
    except ValueError as exc:
        raise ModelLoadError(f"--calibration {args.calibration}: {exc}") from None
    logger.info(
        "quantize: calibrating on %d samples (%d tokens)", len(samples), sum(map(len, samples))
    )
    return collect_hessians(src, samples)
