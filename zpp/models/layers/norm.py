"""Normalisation layers, numerically matching HF transformers' reference implementations."""
from __future__ import annotations

from typing import Optional

import torch
from torch import nn
import torch.nn.functional as F


class RMSNorm(nn.Module):
    """Root-mean-square norm (Zhang & Sennrich 2019), as HF ``LlamaRMSNorm``: statistics in float32.

    ``forward(x)`` -> normed ``x``; ``forward(x, residual)`` -> ``(norm(x + residual), x + residual)``,
    the pre-norm residual pattern of vLLM's fused add-norm. Shapes: ``[num_tokens, hidden_size]``.
    ``weight_in_float32``: multiply by the weight in float32 and cast after (HF ``GptOssRMSNorm``),
    not cast and then multiply (LLaMA); the same in float32, not in bfloat16.
    """

    def __init__(self, hidden_size: int, eps: float = 1e-6, weight_in_float32: bool = False):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.eps = eps
        self.weight_in_float32 = weight_in_float32

    def _norm(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        h = x.to(torch.float32)
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        if self.weight_in_float32:
            return (self.weight.float() * h).to(dtype)
        return self.weight * h.to(dtype)

    def forward(self, x: torch.Tensor, residual: Optional[torch.Tensor] = None):
        if x.is_cuda:
            from zpp.models.layers.triton_ops import rms_norm
            return rms_norm(x, self.weight, self.eps, residual, weight_in_float32=self.weight_in_float32)
        if residual is None:
            return self._norm(x)
        residual = x + residual
        return self._norm(residual), residual


class GemmaRMSNorm(nn.Module):
    """Gemma's RMSNorm (HF ``Gemma3RMSNorm``): ``x * rsqrt(mean(x^2) + eps) * (1 + weight)``, all in
    float32, cast back to ``x``'s dtype at the end (LLaMA's casts before the weight). The weight is
    stored as the offset from 1 (zeros = identity scale). ``forward(x [..., dim])`` -> same shape;
    used on ``[T, hidden]`` and, for the QK norms, on ``[T, heads, head_dim]``.
    ``forward(x, residual)`` -> ``(norm(x + residual), x + residual)`` as :class:`RMSNorm` (the sum
    in ``x``'s dtype). On CUDA one Triton kernel (``triton_ops.rms_norm`` with ``offset``)."""

    def __init__(self, dim: int, eps: float = 1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor, residual: Optional[torch.Tensor] = None):
        if x.is_cuda:
            return self.triton_forward(x, residual)
        if residual is not None:
            residual = x + residual
            return self._norm(residual), residual
        return self._norm(x)

    def _norm(self, x: torch.Tensor) -> torch.Tensor:
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return (h * (1.0 + self.weight.float())).to(x.dtype)

    def triton_forward(self, x: torch.Tensor, residual: Optional[torch.Tensor] = None):
        """The CUDA path (any device under ``TRITON_INTERPRET=1``): rows of the last dim, copied
        contiguous when they are not (a head view of a q/k slice)."""
        from zpp.models.layers.triton_ops import rms_norm
        shape = x.shape
        x2 = x.reshape(-1, shape[-1])
        if x2.stride(-1) != 1:
            x2 = x2.contiguous()
        if residual is None:
            return rms_norm(x2, self.weight, self.eps, offset=True).view(shape)
        y, r = rms_norm(x2, self.weight, self.eps, residual.reshape(-1, shape[-1]).contiguous(), offset=True)
        return y.view(shape), r.view(shape)


class LayerNorm(nn.LayerNorm):
    """``nn.LayerNorm`` with the same ``(x, residual)`` calling convention as :class:`RMSNorm`."""

    def forward(self, x: torch.Tensor, residual: Optional[torch.Tensor] = None):
        if residual is None:
            return F.layer_norm(x, self.normalized_shape, self.weight, self.bias, self.eps)
        residual = x + residual
        return F.layer_norm(residual, self.normalized_shape, self.weight, self.bias, self.eps), residual
