"""``tandem doctor``: what this host gives Tandem on CPU: the CPU and its instruction sets,
the compiler, the kernel libraries (built now if the cache lacks them) and which one serves
each kind of layer, and the dtype a bfloat16 checkpoint runs in here. Exit status 0, 1 where
no compiler is found (the report says what runs slower for it), 2 for a bad
``TANDEM_CPU_ISA``."""

from __future__ import annotations

import argparse
from typing import Any

import torch

from tandem.core.errors import ConfigError
from tandem.core.kernels.cpu.native_build import KernelBuildError, selected_isa
from tandem.core.kernels.cpu.startup import prepare_cpu_kernels
from tandem.core.models.loader import resolve_dtype


def add_parser(subparsers: Any, parents: list[argparse.ArgumentParser]) -> None:
    p: argparse.ArgumentParser = subparsers.add_parser(
        "doctor",
        help="check this host: CPU features, compiler, the CPU kernels chosen (builds them)",
        parents=parents,
    )
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    del args
    try:
        selected_isa()
    except KernelBuildError as exc:
        raise ConfigError(str(exc)) from None
    report = prepare_cpu_kernels()
    bf16 = resolve_dtype("auto", "bfloat16", "cpu")
    lines = [
        report.describe(),
        f"torch {torch.__version__}, {torch.get_num_threads()} threads; oneDNN packs "
        f"bfloat16: {bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())}",
        f"a bfloat16 checkpoint runs in {str(bf16).removeprefix('torch.')} here "
        "(--dtype overrides)",
    ]
    slower = report.slower
    if report.compiler is None:
        lines.append(
            "no C++ compiler: install one (Debian/Ubuntu: apt install g++) or set CXX, then "
            "run `tandem doctor` again"
        )
    elif slower:
        lines.append(f"on slower paths: {', '.join(slower)} (the lines above say why)")
    else:
        lines.append("every CPU kernel is built for this CPU")
    print("\n".join(lines))
    return 1 if report.compiler is None else 0
