"""The forward of a linear layer whose weight is FP8 (e4m3): which kernel runs it.

On CUDA (a GPU of compute capability >= 8.9; elsewhere no weight stays FP8,
see :mod:`zpp.models.quantization`):

* decode batches of M <= 4 tokens: :func:`~zpp.models.layers.fp8_kernels.fp8_gemv` (W8A16: the
  float8 weight read once, scaled in float32; the activations stay in the model dtype, so nothing is
  quantized on the hot batch-1 path);
* per-channel weights: activations quantized per token (or with the static ``input_scale``) by
  :func:`~zpp.models.layers.fp8_kernels.per_token_quant`, then ``torch._scaled_mm`` with row-wise
  scales (``scale_a [M, 1]``, ``scale_b [1, N]`` float32, bf16 out; cuBLASLt / CUTLASS row-wise
  FP8 on Hopper);
* block-scaled weights: activations quantized per token and ``bk``-wide group, then the Triton
  :func:`~zpp.models.layers.fp8_kernels.block_gemm`.

On the CPU (unit tests only) the same numerics in PyTorch: activations quantized as above (the
GEMV's W8A16 included), weights dequantized.

``ZPP_FP8_GEMV=0``: no W8A16 GEMV (every batch through the W8A8 GEMMs), for A/B runs.
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F

from zpp import envs

_FP8_GEMV = envs.ZPP_FP8_GEMV
FP8_MAX = 448.0


def fp8_linear(x: torch.Tensor, w: torch.Tensor, p, bias: Optional[torch.Tensor] = None) -> torch.Tensor:
    """``x [M, K]`` (bf16/fp16) times the FP8 weight ``w [N, K]`` with scales ``p``
    (:class:`zpp.models.quantization.Fp8Params`) -> ``[M, N]`` in ``x``'s dtype (+ ``bias``)."""
    M = x.shape[0]
    if not x.is_cuda:
        return fp8_linear_reference(x, w, p, bias)
    from zpp.models.layers import fp8_kernels as K
    if 0 < M <= K.FP8_GEMV_MAX_M and _FP8_GEMV and x.stride(-1) == 1:
        return K.fp8_gemv(x, w, p.weight_scale, p.block, bias, **K.fp8_gemv_config(w.shape[0], w.shape[1]))
    if x.stride(-1) != 1:
        x = x.contiguous()
    if p.block is None:
        xq, xs = K.per_token_quant(x, p.input_scale)
        y = torch._scaled_mm(xq, w.t(), scale_a=xs, scale_b=p.weight_scale.view(1, -1), out_dtype=torch.bfloat16)
        if bias is not None:
            y = y + bias
        return y if y.dtype == x.dtype else y.to(x.dtype)
    xq, xs = K.per_token_group_quant(x, p.block[1])
    return K.block_gemm(xq, xs, w, p.weight_scale, p.block, x.dtype, bias)


def quantize_activations_reference(x: torch.Tensor, input_scale: Optional[torch.Tensor] = None,
                                   group: Optional[int] = None) -> torch.Tensor:
    """The GPU kernels' activation quantization in PyTorch, returned dequantized (float32 ``[M, K]``):
    per token (``amax / 448``), static (``input_scale``), or per token and ``group`` columns."""
    xf = x.float()
    M, K = xf.shape
    if group is not None:
        G = -(-K // group)
        pad = torch.zeros(M, G * group, dtype=torch.float32, device=x.device)
        pad[:, :K] = xf
        t = pad.view(M, G, group)
        s = (t.abs().amax(-1, keepdim=True).clamp_min(1e-10) / FP8_MAX)
        q = (t / s).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn).float() * s
        return q.view(M, G * group)[:, :K]
    if input_scale is not None:
        s = input_scale.float().reshape(1, 1)
    else:
        s = xf.abs().amax(-1, keepdim=True).clamp_min(1e-10) / FP8_MAX
    return (xf / s).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn).float() * s


def fp8_linear_reference(x: torch.Tensor, w: torch.Tensor, p, bias: Optional[torch.Tensor] = None) -> torch.Tensor:
    """What :func:`fp8_linear` computes, in PyTorch on any device (float32 math)."""
    from zpp.models.quantization import dequantize
    wf = dequantize(w, p.weight_scale, p.block, torch.float32)
    M = x.shape[0]
    if 0 < M <= 4 and _FP8_GEMV:
        xf = x.float()                                   # the W8A16 GEMV
    else:
        xf = quantize_activations_reference(x, p.input_scale if p.block is None else None,
                                            p.block[1] if p.block is not None else None)
    y = F.linear(xf, wf, None if bias is None else bias.float())
    return y.to(x.dtype)
