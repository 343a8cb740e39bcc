"""``tandem quantize SRC DST --scheme w8a8``: write a quantized copy of a float model folder,
in the compressed-tensors layout that Tandem and vLLM both read."""

from __future__ import annotations

import argparse
import logging
from pathlib import Path
from typing import Any

from safetensors import SafetensorError

from tandem.core.errors import ModelLoadError
from tandem.core.models.w8a8_writer import write_w8a8

logger = logging.getLogger(__name__)

SCHEMES = ("w8a8",)


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
        "as llm-compressor's W8A8 writes it); embeddings, norms and lm_head stay float",
    )
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    try:
        count = write_w8a8(Path(args.src), Path(args.dst))
    except (OSError, SafetensorError) as exc:
        raise ModelLoadError(f"quantize {args.src} -> {args.dst}: {exc}") from None
    logger.info(
        "quantized %d linear weights of %s into %s (%s)", count, args.src, args.dst, args.scheme
    )
    return 0
