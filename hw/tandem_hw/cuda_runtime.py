"""CUDA GPUs through torch.cuda: the twin of the NPU runtime, so the hardware path can be
checked on GPUs."""

from __future__ import annotations

import os

import torch

from tandem_hw.accelerator_runtime import AcceleratorRuntime


class CudaRuntimeUnavailable(RuntimeError):
    pass


class CudaRuntime(AcceleratorRuntime):
    kind = "cuda"
    kernel_families: tuple[str, ...] = ("triton",)
    stream_attr = "cuda_stream"
    visible_env = "CUDA_VISIBLE_DEVICES"

    def __init__(self) -> None:
        if not torch.cuda.is_available():
            raise CudaRuntimeUnavailable(
                "cuda devices requested but torch sees no GPU (this torch build: "
                f"{torch.__version__}); install a CUDA build of torch 2.13.0 or use --devices cpu:0"
            )
        super().__init__(torch.cuda, dict(os.environ))
