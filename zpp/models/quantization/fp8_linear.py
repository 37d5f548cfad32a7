"""The forward of a linear layer whose weight is FP8 (e4m3): which kernel runs it (the ``apply`` of
:class:`zpp.models.quantization.fp8.Fp8LinearMethod`; called by :func:`zpp.models.layers.linear.linear`).

On CUDA (a GPU of compute capability >= 8.9; elsewhere no weight stays FP8,
see :mod:`zpp.models.quantization.fp8`):

* decode batches of M <= 4 tokens: :func:`~zpp.models.quantization.fp8_kernels.fp8_gemv` (W8A16: the
  float8 weight read once, scaled in float32; the activations stay in the model dtype, so nothing is
  quantized on the hot batch-1 path);
* per-channel weights: activations quantized per token (or with the static ``input_scale``) by
  :func:`~zpp.models.quantization.fp8_kernels.per_token_quant`, then ``torch._scaled_mm`` with row-wise
  scales (``scale_a [M, 1]``, ``scale_b [1, N]`` float32, bf16 out; cuBLASLt / CUTLASS row-wise
  FP8 on Hopper);
* block-scaled weights: activations quantized per token and ``bk``-wide group, then the Triton
  :func:`~zpp.models.quantization.fp8_kernels.block_gemm`.

On the CPU (unit tests only) the same numerics in PyTorch: activations quantized as above (the
GEMV's W8A16 included), weights dequantized.

``ZPP_FP8_GEMV=0``: no W8A16 GEMV (every batch through the W8A8 GEMMs), for A/B runs.

A gated MLP quantizes its down projection's input inside the SiLU-and-mul kernel
(:func:`~zpp.models.quantization.fp8_kernels.silu_mul_quant`, where :func:`fuses_input_quant` allows it)
and calls :func:`fp8_linear_quantized`; ``ZPP_FP8_FUSED_QUANT=0`` keeps the two kernels apart.

A LLaMA-family decoder layer hands its RMSNorm to the projection after it (:func:`rms_norm_fp8_linear`,
where :func:`fuses_norm` allows it): past the GEMV's rows the norm quantizes its output per token in
the same kernel (:func:`~zpp.models.quantization.fp8_kernels.rms_norm_quant`; ``ZPP_FP8_FUSED_QUANT=0``
keeps norm and quantization apart). A batch the W8A16 GEMV takes runs the norm on its own (the norm
inside the GEMV measured slower on an H100, 3.65 vs 3.58 ms batch-1 TPOT, and was removed).
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F

from zpp import envs
from zpp.models.quantization.fp8_utils import dequantize, quantize_activations_reference

_FP8_GEMV = envs.ZPP_FP8_GEMV
_FUSED_QUANT = envs.ZPP_FP8_FUSED_QUANT
_FAST_ACCUM = envs.ZPP_FP8_FAST_ACCUM


def fp8_linear(x: torch.Tensor, w: torch.Tensor, p, bias: Optional[torch.Tensor] = None) -> torch.Tensor:
    """``x [M, K]`` (bf16/fp16) times the FP8 weight ``w [N, K]`` with scales ``p``
    (:class:`zpp.models.quantization.fp8.Fp8Params`) -> ``[M, N]`` in ``x``'s dtype (+ ``bias``)."""
    if not x.is_cuda:
        return fp8_linear_reference(x, w, p, bias)
    from zpp.models.quantization import fp8_kernels as K
    if _gemv_rows(x.shape[0]) and x.stride(-1) == 1:
        return K.fp8_gemv(x, w, p.weight_scale, p.block, bias, **K.fp8_gemv_config(w.shape[0], w.shape[1]))
    if x.stride(-1) != 1:
        x = x.contiguous()
    if p.block is None:
        xq, xs = K.per_token_quant(x, p.input_scale)
        return fp8_linear_quantized(xq, xs, w, p, bias, x.dtype)
    xq, xs = K.per_token_group_quant(x, p.block[1])
    return K.block_gemm(xq, xs, w, p.weight_scale, p.block, x.dtype, bias)


def _gemv_rows(m: int) -> bool:
    """Whether a CUDA batch of ``m`` rows goes to the W8A16 GEMV (given unit stride in a row):
    ``0 < m <= FP8_GEMV_MAX_M`` with ``ZPP_FP8_GEMV`` on. The fusions below apply past it."""
    from zpp.models.quantization.fp8_kernels import FP8_GEMV_MAX_M
    return 0 < m <= FP8_GEMV_MAX_M and _FP8_GEMV


def fp8_linear_quantized(xq: torch.Tensor, xs: torch.Tensor, w: torch.Tensor, p, bias: Optional[torch.Tensor],
                         dtype: torch.dtype) -> torch.Tensor:
    """The W8A8 row-wise product of :func:`fp8_linear` on activations already quantized per token:
    ``xq [M, K]`` float8_e4m3fn, ``xs [M, 1]`` float32, per-channel weight ``w [N, K]`` (CUDA) ->
    ``[M, N]`` in ``dtype`` (+ ``bias``). The FP8 tensor-core partial sums stay in the MMA's own
    accumulator (``use_fast_accum``, as vLLM's CUTLASS and TensorRT-LLM's FP8 GEMMs run) unless
    ``ZPP_FP8_FAST_ACCUM=0``."""
    y = torch._scaled_mm(xq, w.t(), scale_a=xs, scale_b=p.weight_scale.view(1, -1), out_dtype=torch.bfloat16,
                         use_fast_accum=_FAST_ACCUM)
    if bias is not None:
        y = y + bias
    return y if y.dtype == dtype else y.to(dtype)


def fuses_input_quant(p, m: int, x: torch.Tensor) -> bool:
    """Whether a producer of the ``m``-row input ``x`` of an FP8 layer with scales ``p`` may hand it
    over already quantized per token (:func:`fp8_linear_quantized`): on CUDA, per-channel weights
    with dynamic activation scales, a batch past the W8A16 GEMV's rows; not with
    ``ZPP_FP8_FUSED_QUANT=0``."""
    if p is None or not x.is_cuda or p.block is not None or p.input_scale is not None or not _FUSED_QUANT:
        return False
    return not _gemv_rows(m)


def fuses_norm(norm, layer, x: torch.Tensor) -> bool:
    """Whether the RMSNorm module ``norm`` of the ``[M, K]`` input ``x`` may run fused with the FP8
    linear ``layer`` it feeds (:func:`rms_norm_fp8_linear`): on CUDA, ``M > 0``, ``norm`` a plain
    LLaMA :class:`~zpp.models.layers.norm.RMSNorm` (weight multiplied in the model dtype), ``layer``
    a column-parallel :class:`~zpp.models.layers.linear.MergedLinear` (no all-reduce after its
    product) with per-channel FP8 weights and dynamic activation scales, a batch past the W8A16
    GEMV's (not ``0 < M <= FP8_GEMV_MAX_M`` with ``ZPP_FP8_GEMV`` on: that batch runs the norm, then
    the GEMV), and ``ZPP_FP8_FUSED_QUANT`` on (the norm and the activation quantization in one
    kernel, ``K <= RMS_NORM_QUANT_MAX_K``)."""
    if not x.is_cuda or x.shape[0] == 0:
        return False
    from zpp.models.layers.norm import RMSNorm
    p = getattr(layer, "fp8", None)
    # a MergedLinear (column-parallel: no all-reduce after it), told by its attribute: importing
    # zpp.models.layers.linear here would close an import cycle (it imports this module)
    if p is None or p.block is not None or p.input_scale is not None or not hasattr(layer, "output_sizes"):
        return False
    if type(norm) is not RMSNorm or norm.weight_in_float32:
        return False
    from zpp.models.quantization.fp8_kernels import RMS_NORM_QUANT_MAX_K
    return not _gemv_rows(x.shape[0]) and _FUSED_QUANT and x.shape[1] <= RMS_NORM_QUANT_MAX_K


def rms_norm_fp8_linear(x: torch.Tensor, residual: Optional[torch.Tensor], norm, layer
                        ) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    """``layer(norm(x, residual))`` with the norm fused, where :func:`fuses_norm` allows it: ``x [M, K]``,
    ``residual [M, K]`` or None -> ``(layer's output [M, N]`` in ``x``'s dtype, ``x + residual)``
    (None without ``residual``): :func:`~zpp.models.quantization.fp8_kernels.rms_norm_quant` (the norm and
    the per-token quantization in one pass) then :func:`fp8_linear_quantized`."""
    from zpp.models.quantization import fp8_kernels as K
    xq, xs, summed = K.rms_norm_quant(x, residual, norm.weight, norm.eps)
    return fp8_linear_quantized(xq, xs, layer.weight, layer.fp8, layer.bias, x.dtype), summed


def fp8_linear_reference(x: torch.Tensor, w: torch.Tensor, p, bias: Optional[torch.Tensor] = None) -> torch.Tensor:
    """What :func:`fp8_linear` computes, in PyTorch on any device (float32 math)."""
    wf = dequantize(w, p.weight_scale, p.block, torch.float32)
    M = x.shape[0]
    if 0 < M <= 4 and _FP8_GEMV:
        xf = x.float()                                   # the W8A16 GEMV
    else:
        xf = quantize_activations_reference(x, p.input_scale if p.block is None else None,
                                            p.block[1] if p.block is not None else None)
    y = F.linear(xf, wf, None if bias is None else bias.float())
    return y.to(x.dtype)

