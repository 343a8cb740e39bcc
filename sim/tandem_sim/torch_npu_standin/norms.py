"""RMS norms: ``npu_rms_norm`` and ``npu_add_rms_norm``."""

from __future__ import annotations

import torch

from ._rules import (
    FLOATS,
    NpuDtypeError,
    require,
    require_dtype,
    require_rank,
    same_device,
)

_RMS = "npu_rms_norm"
_RMS_DOC = (
    "torch_npu.npu_rms_norm, op-plugin docs/zh/custom_APIs/torch_npu/"
    "（beta）torch_npu-npu_rms_norm.md; schema op_plugin/config/op_plugin_functions.yaml"
)
_ADD = "npu_add_rms_norm"
_ADD_DOC = (
    "torch_npu.npu_add_rms_norm, op-plugin docs/zh/custom_APIs/torch_npu/"
    "torch_npu-npu_add_rms_norm.md; schema op_plugin/config/op_plugin_functions.yaml"
)

# (x dtype, gamma dtype) pairs the npu_rms_norm page lists for Atlas A2/A3.
_RMS_PAIRS = {
    (torch.float16, torch.float32),
    (torch.bfloat16, torch.float32),
    (torch.float16, torch.float16),
    (torch.bfloat16, torch.bfloat16),
    (torch.float32, torch.float32),
}


def _rms(
    op: str, doc: str, x: torch.Tensor, gamma: torch.Tensor, epsilon: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Float32 ``x * rsqrt(mean(x^2) + eps) * gamma`` over gamma's trailing dims; returns
    (y in float32, rstd in float32 with the normalised dims kept as 1)."""
    require(
        gamma.dim() <= x.dim() and tuple(x.shape[x.dim() - gamma.dim() :]) == tuple(gamma.shape),
        op,
        f"gamma's shape must equal x's trailing dims, got x {tuple(x.shape)} and gamma "
        f"{tuple(gamma.shape)}",
        doc,
    )
    dims = tuple(range(x.dim() - gamma.dim(), x.dim()))
    xf = x.float()
    rstd = torch.rsqrt(xf.pow(2).mean(dim=dims, keepdim=True) + epsilon)
    return xf * rstd * gamma.float(), rstd


def npu_rms_norm(
    self: torch.Tensor, gamma: torch.Tensor, epsilon: float = 1e-06
) -> tuple[torch.Tensor, torch.Tensor]:
    """RMSNorm: ``y = x / sqrt(mean(x^2) + epsilon) * gamma``; returns ``(y, rstd)``.

    Schema: ``npu_rms_norm(Tensor self, Tensor gamma, float epsilon=1e-06) -> (Tensor,
    Tensor)`` (the first argument is named ``self``). Rules (op-plugin page):

    - x (``self``) 2 to 8 dims; gamma's shape equals x's trailing dims (usually the last).
      The page says gamma has 2-8 dims too, yet also "usually x's last dim" (1-D); the
      stand-in allows gamma 1 to 8 dims.
    - dtype pairs (Atlas A2/A3): x/gamma float16/float32, bfloat16/float32, float16/float16,
      bfloat16/bfloat16, float32/float32.
    - y: x's dtype and shape. rstd: float32, x's shape with the normalised dims set to 1
      (the page: "x's leading dims"; op-plugin's rms_norm_npu_output_size keeps them as 1,
      as the npu_add_rms_norm page's examples show).
    - Rounding: the page is silent; the stand-in computes in float32 and rounds once.
    """
    x = self
    same_device(_RMS, {"self": x, "gamma": gamma})
    require_rank(_RMS, "self", x, range(2, 9), _RMS_DOC)
    require_rank(_RMS, "gamma", gamma, range(1, 9), _RMS_DOC)
    require_dtype(_RMS, "self", x, FLOATS, _RMS_DOC)
    require_dtype(_RMS, "gamma", gamma, FLOATS, _RMS_DOC)
    if (x.dtype, gamma.dtype) not in _RMS_PAIRS:
        raise NpuDtypeError(
            f"{_RMS}: (self, gamma) dtypes must be one of the listed pairs, got "
            f"({x.dtype}, {gamma.dtype}) ({_RMS_DOC})"
        )
    y, rstd = _rms(_RMS, _RMS_DOC, x, gamma, float(epsilon))
    return y.to(x.dtype), rstd


def npu_add_rms_norm(
    x1: torch.Tensor, x2: torch.Tensor, gamma: torch.Tensor, epsilon: float = 1e-06
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``x = x1 + x2``, then RMSNorm of x; returns ``(y, rstd, x)``.

    Schema: ``npu_add_rms_norm(Tensor x1, Tensor x2, Tensor gamma, float epsilon=1e-06) ->
    (Tensor, Tensor, Tensor)``. Rules (op-plugin page):

    - x1, x2: 1 to 8 dims, float32 / float16 / bfloat16, not empty; gamma: x1's dtype, its
      shape x1's trailing dims. x2 must match x1 (the formula adds them element-wise; the
      page gives no broadcasting).
    - y and x: x1's dtype and shape; rstd float32, x1's shape with the normalised dims set
      to 1 (the page's examples: x1 (2,3,4,8), gamma (8) -> rstd (2,3,4,1)).
    - Rounding: silent on the page. The stand-in adds in float32, normalises that float32
      sum and rounds y and x once each to x1's dtype.
    """
    same_device(_ADD, {"x1": x1, "x2": x2, "gamma": gamma})
    for name, t in (("x1", x1), ("x2", x2)):
        require_rank(_ADD, name, t, range(1, 9), _ADD_DOC)
        require_dtype(_ADD, name, t, FLOATS, _ADD_DOC)
        require(t.numel() > 0, _ADD, f"{name} must not be empty", _ADD_DOC)
    if not (x1.dtype == x2.dtype == gamma.dtype):
        raise NpuDtypeError(
            f"{_ADD}: x2 and gamma must have x1's dtype, got {x1.dtype}, {x2.dtype}, "
            f"{gamma.dtype} ({_ADD_DOC})"
        )
    require(
        tuple(x1.shape) == tuple(x2.shape),
        _ADD,
        f"x1 and x2 must have the same shape, got {tuple(x1.shape)} and {tuple(x2.shape)}",
        _ADD_DOC,
    )
    x = x1.float() + x2.float()
    y, rstd = _rms(_ADD, _ADD_DOC, x, gamma, float(epsilon))
    return y.to(x1.dtype), rstd, x.to(x1.dtype)
