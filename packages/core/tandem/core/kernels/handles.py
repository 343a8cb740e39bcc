"""Every model kernel's handle, in one place: the name it is registered under and the
implementation each device family gets.

A layer asks for its kernels here and never imports an implementation. Each handle holds the
torch reference (``reference/``, what runs on any device without its own) and, where one
exists, the choice of each device family (``cpu/``: C++ built for the host's instruction set;
``triton/``: one Triton source for CUDA and for Ascend through triton-ascend); the handle
resolves one of them per (kernel, device, dtype) through the kernel registry on a worker's
first call. A new implementation for a device is added to its kernel's function
here, so the table below is the whole answer to "what runs where".
"""

from __future__ import annotations

import torch

from tandem.core.kernels.cpu import attention_groups as cpu_attention
from tandem.core.kernels.cpu.elementwise import native_elementwise_kernel
from tandem.core.kernels.cpu.int4_linear import native_int4_kernel
from tandem.core.kernels.cpu.int8_gemm import native_int8_kernel
from tandem.core.kernels.cpu.linear_attention import native_linear_attention_kernel
from tandem.core.kernels.cpu.moe_routing import native_moe_routing_kernel
from tandem.core.kernels.cpu.paged_attention import native_kv_cache_write, native_paged_attention
from tandem.core.kernels.cpu.prefill_attention import native_prefill_attention
from tandem.core.kernels.cpu.quantized_moe import (
    native_moe_int4_grouped_kernel,
    native_moe_int4_kernel,
    native_moe_int8_kernel,
)
from tandem.core.kernels.handle import KernelHandle
from tandem.core.kernels.npu.loading import HALVES, INT8, torch_npu_kernel
from tandem.core.kernels.reference import causal_conv1d as conv_ref
from tandem.core.kernels.reference import elementwise as ref
from tandem.core.kernels.reference import fused_moe as moe_ref
from tandem.core.kernels.reference import gated_delta_rule as delta_ref
from tandem.core.kernels.reference import int4_linear as int4_ref
from tandem.core.kernels.reference import int8_linear as int8_ref
from tandem.core.kernels.reference import linear_attention_verify as verify_ref
from tandem.core.kernels.reference import paged_attention as attention_ref
from tandem.core.kernels.reference import quantized_moe as qmoe_ref
from tandem.core.kernels.triton.loading import triton_kernel

Pair = tuple[torch.Tensor, torch.Tensor]


def rms_norm() -> KernelHandle[torch.Tensor]:
    native = native_elementwise_kernel("rms_norm")
    triton = triton_kernel("norms", "rms_norm")
    npu = torch_npu_kernel("norms", "rms_norm")
    return KernelHandle("rms_norm", ref.rms_norm, native, triton=triton, npu=npu)


def add_rms_norm() -> KernelHandle[Pair]:
    """The residual add and the RMSNorm after it; the CPU kernel writes the new sum into the
    residual tensor it is handed."""
    native = native_elementwise_kernel("add_rms_norm")
    triton = triton_kernel("norms", "add_rms_norm")
    npu = torch_npu_kernel("norms", "add_rms_norm")
    return KernelHandle("add_rms_norm", ref.add_rms_norm, native, triton=triton, npu=npu)


def rms_norm_gated() -> KernelHandle[torch.Tensor]:
    """Qwen3.5's gated RMSNorm of the Gated DeltaNet output; the CPU kernel reads the gate
    (a section of the input projection) in place."""
    native = native_elementwise_kernel("rms_norm_gated")
    triton = triton_kernel("norms", "rms_norm_gated")
    return KernelHandle("rms_norm_gated", ref.rms_norm_gated, native, triton=triton)


def rms_norm_zero_centered() -> KernelHandle[torch.Tensor]:
    native = native_elementwise_kernel("rms_norm_zero_centered")
    triton = triton_kernel("norms", "rms_norm_zero_centered")
    return KernelHandle("rms_norm_zero_centered", ref.rms_norm_zero_centered, native, triton=triton)


def add_rms_norm_zero_centered() -> KernelHandle[Pair]:
    """``add_rms_norm`` with Qwen3.5's zero-centred norm."""
    native = native_elementwise_kernel("add_rms_norm_zero_centered")
    triton = triton_kernel("norms", "add_rms_norm_zero_centered")
    return KernelHandle(
        "add_rms_norm_zero_centered", ref.add_rms_norm_zero_centered, native, triton=triton
    )


def gated_activation(name: str) -> KernelHandle[torch.Tensor]:
    """``act(gate) * up`` over a fused [gate | up] projection."""
    impl = ref.GATED_ACTIVATIONS.get(name)
    if impl is None:
        supported = ", ".join(sorted(ref.GATED_ACTIVATIONS))
        raise ValueError(f"unsupported activation {name!r}; supported: {supported}")
    # SiLU, the activation of every family served, has a fused CPU kernel.
    native = native_elementwise_kernel("silu_mul") if name == "silu" else None
    triton = triton_kernel("activation", f"gated_{name}")
    npu = torch_npu_kernel("activation", "gated_silu") if name == "silu" else None
    return KernelHandle(f"gated_{name}", impl, native, triton=triton, npu=npu)


def rotary() -> KernelHandle[torch.Tensor]:
    triton = triton_kernel("rotary", "rotary")
    npu = torch_npu_kernel("rotary", "rotary")
    return KernelHandle("rotary", ref.rotary, triton=triton, npu=npu)


def qk_norm_rotary() -> KernelHandle[Pair]:
    """Qwen3's per-head q/k RMSNorm and the rotary after it, in place (CPU and Triton); or
    Qwen3.5's zero-centred norm and partial rotary (``zero_centered``, ``rotary_dim``)."""
    native = native_elementwise_kernel("qk_norm_rotary")
    triton = triton_kernel("rotary", "qk_norm_rotary")
    npu = torch_npu_kernel("rotary", "qk_norm_rotary")
    return KernelHandle("qk_norm_rotary", ref.qk_norm_rotary, native, triton=triton, npu=npu)


def write_kv_cache() -> KernelHandle[None]:
    """The step's new K/V into their cache slots, before attention reads them."""
    npu = torch_npu_kernel("attention", "write_kv_cache", HALVES)
    return KernelHandle(
        "write_kv_cache", attention_ref.write_kv_cache, native_kv_cache_write, npu=npu
    )


def paged_attention_decode(head_dim: int) -> KernelHandle[torch.Tensor]:
    """One attention layer's decode group kernel; the head size joins the registry key (other
    shapes on one device must not inherit a choice made for this one)."""
    name = "paged_attention_decode"
    native = cpu_attention.native_group_kernel(
        name, native_paged_attention, cpu_attention.native_decode, head_dim
    )
    triton = triton_kernel("paged_attention", "paged_decode")
    npu = torch_npu_kernel("attention", "paged_decode", HALVES)
    return KernelHandle(
        name,
        attention_ref.reference_decode,
        native,
        f"head_dim={head_dim}",
        triton=triton,
        npu=npu,
    )


def paged_attention_prefill(head_dim: int) -> KernelHandle[torch.Tensor]:
    name = "paged_attention_prefill"
    native = cpu_attention.native_group_kernel(
        name, native_prefill_attention, cpu_attention.native_prefill, head_dim
    )
    triton = triton_kernel("paged_prefill", "paged_prefill")
    npu = torch_npu_kernel("attention", "paged_prefill", HALVES)
    return KernelHandle(
        name,
        attention_ref.reference_prefill,
        native,
        f"head_dim={head_dim}",
        triton=triton,
        npu=npu,
    )


def causal_conv1d_prefill() -> KernelHandle[torch.Tensor]:
    """The conv over prefill tokens; on CPU the native kernel, tokens shared among threads."""
    triton = triton_kernel("causal_conv1d", "causal_conv1d_prefill")
    native = native_linear_attention_kernel("conv_prefill")
    return KernelHandle(
        "causal_conv1d_prefill", conv_ref.causal_conv1d_prefill, native, triton=triton
    )


def causal_conv1d_update() -> KernelHandle[torch.Tensor]:
    """The conv's decode step; on CPU the native kernel, each state shifted in place."""
    triton = triton_kernel("causal_conv1d", "causal_conv1d_update")
    native = native_linear_attention_kernel("conv_update")
    return KernelHandle(
        "causal_conv1d_update", conv_ref.causal_conv1d_update, native, triton=triton
    )


def causal_conv1d_verify() -> KernelHandle[torch.Tensor]:
    """The conv over sequences verifying drafts: on CPU one native call, each sequence's
    positions in order; elsewhere position by position through the decode step it is
    handed (Triton's on the accelerators)."""
    native = native_linear_attention_kernel("conv_verify")
    return KernelHandle("causal_conv1d_verify", verify_ref.conv_verify, native)


def recurrent_gated_delta_verify() -> KernelHandle[torch.Tensor]:
    """The delta rule over sequences verifying drafts, as ``causal_conv1d_verify``."""
    native = native_linear_attention_kernel("recurrent_verify")
    return KernelHandle("recurrent_gated_delta_verify", verify_ref.delta_verify, native)


def gdn_gating() -> KernelHandle[Pair]:
    """Gated DeltaNet's gates (g, beta) of each token and value head: one kernel (native on
    CPU, Triton's on the accelerators) reading ``a`` and ``b`` in place instead of eight
    torch ops."""
    native = native_elementwise_kernel("gdn_gating")
    triton = triton_kernel("gdn_gating", "gdn_gating")
    return KernelHandle("gdn_gating", delta_ref.gdn_gating, native, triton=triton)


def chunk_gated_delta_rule() -> KernelHandle[torch.Tensor]:
    """The delta rule over prefill tokens: in chunks (the reference, Triton); on CPU the
    native recurrence, each sequence's tokens in order with its state in L1."""
    triton = triton_kernel("gated_delta_rule", "chunk_gated_delta_rule")
    native = native_linear_attention_kernel("recurrent_prefill")
    return KernelHandle(
        "chunk_gated_delta_rule", delta_ref.chunk_gated_delta_rule, native, triton=triton
    )


def recurrent_gated_delta_rule() -> KernelHandle[torch.Tensor]:
    """One decode step of Gated DeltaNet; on CPU the fused native kernel, each state read
    and written once in place."""
    triton = triton_kernel("gated_delta_rule", "recurrent_gated_delta_rule")
    return KernelHandle(
        "recurrent_gated_delta_rule",
        delta_ref.recurrent_gated_delta_rule,
        native_linear_attention_kernel("recurrent"),
        triton=triton,
    )


def fused_moe() -> KernelHandle[torch.Tensor]:
    triton = triton_kernel("fused_moe", "fused_moe")
    npu = torch_npu_kernel("fused_moe", "fused_moe")
    return KernelHandle("fused_moe", moe_ref.fused_moe, triton=triton, npu=npu)


def moe_topk_softmax() -> KernelHandle[Pair]:
    """The MoE router's softmax and top-k over its logits; on CPU one native pass
    (``moe_routing.py``) where the library is built."""
    triton = triton_kernel("topk_softmax", "topk_softmax")
    npu = torch_npu_kernel("fused_moe", "topk_softmax")
    native = native_moe_routing_kernel("topk_softmax")
    return KernelHandle("moe_topk_softmax", moe_ref.topk_softmax, native, triton=triton, npu=npu)


def int8_linear() -> KernelHandle[torch.Tensor]:
    """A W8A8 linear: int8 weights [N, K] with per-channel scales, activations quantized per
    token (or with a given scale) inside the kernel, int32 accumulation. On CPU the native
    kernel (AVX512-VNNI, AVX-VNNI, AVX2 or plain loops) over weights packed at load, bit for
    bit the reference; on Ascend torch_npu's ``npu_dynamic_quant`` / ``npu_quantize`` and
    ``npu_quant_matmul`` (float16 and bfloat16 activations, the ones its quantizers take)."""
    npu = torch_npu_kernel("int8_linear", "int8_linear", HALVES)
    return KernelHandle("int8_linear", int8_ref.int8_linear, native_int8_kernel("linear"), npu=npu)


def int8_quantize() -> KernelHandle[Pair]:
    """Activations to int8 codes and their scales: the first step of ``int8_linear``, apart
    where the int32 sums cross ranks before they are scaled (row-parallel layers)."""
    npu = torch_npu_kernel("int8_linear", "int8_quantize", HALVES)
    native = native_int8_kernel("quantize")
    return KernelHandle("int8_quantize", int8_ref.quantize_int8, native, npu=npu)


def int8_matmul() -> KernelHandle[torch.Tensor]:
    """int8 codes times int8 weights, exact int32 sums (resolved by the codes' dtype, int8;
    on Ascend ``npu_quant_matmul``'s int32 output)."""
    npu = torch_npu_kernel("int8_linear", "int8_matmul", INT8)
    return KernelHandle("int8_matmul", int8_ref.int8_matmul, native_int8_kernel("matmul"), npu=npu)


def int8_dequantize() -> KernelHandle[torch.Tensor]:
    """int32 sums times the activation and weight scales, plus the bias. Ascend keeps the
    torch reference: no torch_npu op scales int32 sums by both (the elementwise torch ops
    run on the device as they are)."""
    native = native_int8_kernel("dequantize")
    return KernelHandle("int8_dequantize", int8_ref.dequantize, native)


def int4_linear() -> KernelHandle[torch.Tensor]:
    """A W4A16 linear (GPTQ 4-bit weights, float activations): codes packed once at load
    into [N, K / 8] int32, per-group scales and zero points, dequantized on the fly. On CPU
    the native kernel reads the codes without a float copy of the weight (it keeps the
    reference for layers in activation order); on Ascend torch_npu's
    ``npu_weight_quant_batchmatmul`` over the layout made at load (``kernels/npu/layouts.py``)."""
    npu = torch_npu_kernel("int4_linear", "int4_linear", HALVES)
    return KernelHandle("int4_linear", int4_ref.int4_linear, native_int4_kernel(), npu=npu)


# Routed experts with quantized weights: each step runs every active expert's rows (sorted by
# expert, ``reference/quantized_moe.py``) through the dense quantized kernel of that step. On
# CPU the native int8 / 4-bit kernels over each expert's packed weight; there is no Triton or
# NPU kernel for them yet, so CUDA and Ascend run the torch reference (a loop over active
# experts) for quantized experts while their float experts take the fused kernels above
# (torch_npu's grouped matmul takes int8 and int4 experts too; not wired here yet).


def moe_int8_linear() -> KernelHandle[torch.Tensor]:
    """int8 experts' rows times their weights: quantize, exact int32 product, dequantize."""
    native = native_moe_int8_kernel("linear")
    return KernelHandle("moe_int8_linear", qmoe_ref.moe_int8_linear, native)


def moe_int8_quantize() -> KernelHandle[Pair]:
    """int8 experts' rows to codes and per-row scales (row-parallel down projections)."""
    native = native_moe_int8_kernel("quantize")
    return KernelHandle("moe_int8_quantize", qmoe_ref.moe_int8_quantize, native)


def moe_int8_matmul() -> KernelHandle[torch.Tensor]:
    """int8 experts' codes times their weights, exact int32 sums."""
    native = native_moe_int8_kernel("matmul")
    return KernelHandle("moe_int8_matmul", qmoe_ref.moe_int8_matmul, native)


def moe_int8_dequantize() -> KernelHandle[torch.Tensor]:
    """int8 experts' int32 sums times their rows' and channels' scales."""
    native = native_moe_int8_kernel("dequantize")
    return KernelHandle("moe_int8_dequantize", qmoe_ref.moe_int8_dequantize, native)


def moe_int4_linear() -> KernelHandle[torch.Tensor]:
    """4-bit experts' rows times their weights, dequantized on the fly."""
    return KernelHandle("moe_int4_linear", qmoe_ref.moe_int4_linear, native_moe_int4_kernel())


def moe_int4_grouped_linear() -> KernelHandle[torch.Tensor]:
    """4-bit experts' rows times their weights, every expert in one call given the routing's
    offsets (groups of consecutive inputs: no activation order)."""
    native = native_moe_int4_grouped_kernel()
    return KernelHandle("moe_int4_grouped_linear", qmoe_ref.moe_int4_grouped_linear, native)
