"""FP8 (e4m3) numerics in PyTorch, on any device: weights quantized per output channel, per tensor or
per block; any of those dequantized (the CPU's rule for FP8 checkpoints, and the reference of the GPU
kernels); the GPU kernels' activation quantization as a reference."""
from __future__ import annotations

from typing import Optional

import torch

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = 448.0
"""Largest finite float8_e4m3fn value."""


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



def quantize_per_channel(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``w [N, K]`` -> (float8_e4m3fn ``[N, K]``, float32 scale ``[N]``), ``w ~= q * scale[:, None]``,
    ``scale = amax(|w_row|) / 448`` (all-zero rows get scale 1). Computed in float32 on ``w``'s device."""
    wf = w.float()
    scale = wf.abs().amax(dim=1) / FP8_MAX
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))
    q = (wf / scale[:, None]).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    return q, scale


def quantize_per_tensor(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``w`` -> (float8_e4m3fn, float32 scalar scale ``[]``), ``scale = amax(|w|) / 448``."""
    wf = w.float()
    scale = wf.abs().amax() / FP8_MAX
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))
    return (wf / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE), scale


def quantize_block(w: torch.Tensor, block: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor]:
    """``w [N, K]`` -> (float8_e4m3fn ``[N, K]``, float32 scale ``[ceil(N/bn), ceil(K/bk)]``): one
    scale per ``bn x bk`` tile (the last row / column of tiles may be partial), ``amax / 448``,
    as DeepSeek-V3's ``weight_block_size`` checkpoints."""
    N, K = w.shape
    bn, bk = block
    nb, kb = -(-N // bn), -(-K // bk)
    wf = torch.zeros(nb * bn, kb * bk, dtype=torch.float32, device=w.device)
    wf[:N, :K] = w.float()
    tiles = wf.view(nb, bn, kb, bk)
    scale = tiles.abs().amax(dim=(1, 3)) / FP8_MAX                                 # [nb, kb]
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))
    q = (tiles / scale[:, None, :, None]).clamp(-FP8_MAX, FP8_MAX).view(nb * bn, kb * bk)[:N, :K]
    return q.to(FP8_DTYPE).contiguous(), scale


def expand_block_scale(scale: torch.Tensor, shape: tuple[int, int], block: tuple[int, int]) -> torch.Tensor:
    """A block grid ``[ceil(N/bn), ceil(K/bk)]`` -> the per-element scale ``[N, K]`` (float32)."""
    N, K = shape
    return scale.float().repeat_interleave(block[0], 0)[:N].repeat_interleave(block[1], 1)[:, :K]


def dequantize(w: torch.Tensor, scale: torch.Tensor, block: Optional[tuple[int, int]], dtype: torch.dtype) -> torch.Tensor:
    """``w_fp8.float() * scale`` in ``dtype``; ``scale``: a scalar / ``[1]`` (per tensor), ``[N]`` or
    ``[N, 1]`` (per channel), or with ``block`` the grid ``[ceil(N/bn), ceil(K/bk)]``. Works for 2-D
    weights and for stacked experts ``[E, N, K]`` with ``[E, ...]`` scales (``[E]`` / ``[E, 1]``: one per expert).

    Raises:
        ValueError: the scale's shape fits none of these.
    """
    wf = w.float()
    s = scale.float().to(w.device)
    if s.numel() == 1:
        return (wf * s.reshape(())).to(dtype)
    N, K = w.shape[-2:]
    lead = tuple(w.shape[:-2])
    if s.shape in (lead + (N,), lead + (N, 1)):
        return (wf * s.reshape(lead + (N, 1))).to(dtype)
    if lead and s.shape in (lead, lead + (1,), lead + (1, 1)):          # one scale per expert
        return (wf * s.reshape(lead + (1, 1))).to(dtype)
    if block is not None:
        grid = lead + (-(-N // block[0]), -(-K // block[1]))
        if tuple(s.shape) == grid:
            if lead:
                full = torch.stack([expand_block_scale(si, (N, K), block) for si in s.reshape(-1, *grid[-2:])])
                return (wf * full.reshape(wf.shape)).to(dtype)
            return (wf * expand_block_scale(s, (N, K), block)).to(dtype)
    raise ValueError(f"scale of shape {tuple(s.shape)} fits neither per-tensor, per-channel nor "
                     f"{'block ' + str(block) if block else 'block'} scaling of a weight {tuple(w.shape)}")


def fused_moe_fp8_reference(x: torch.Tensor, w_gate_up: torch.Tensor, w_down: torch.Tensor,
                            gate_up_scale: torch.Tensor, down_scale: torch.Tensor, weights: torch.Tensor,
                            ids: torch.Tensor, act, block: Optional[tuple[int, int]] = None,
                            b_gate_up: Optional[torch.Tensor] = None, b_down: Optional[torch.Tensor] = None,
                            quantize_activations: bool = True) -> torch.Tensor:
    """What :func:`zpp.models.quantization.fp8_moe_kernels.fused_moe_fp8` computes, in PyTorch float32 on any device (weights dequantized,
    experts looped): with ``quantize_activations`` the GEMM path's per-token (group) activation
    quantization, without it the GEMV path's W8A16 products. For tests and CPU checks."""
    E = w_gate_up.shape[0]

    def deq(w, s):
        if block is None and s.numel() > 1:
            s = s.reshape(E, -1).expand(E, w.shape[1])
        return dequantize(w, s, block, torch.float32)
    wg, wd = deq(w_gate_up, gate_up_scale), deq(w_down, down_scale)
    q = (lambda t: quantize_activations_reference(t, None, block[1] if block else None)) if quantize_activations \
        else (lambda t: t.float())
    T, k = ids.shape
    out = torch.zeros(T, x.shape[1], dtype=torch.float32, device=x.device)
    xf = q(x)
    for t in range(T):
        for j in range(k):
            e = int(ids[t, j])
            g = xf[t] @ wg[e].t()
            if b_gate_up is not None:
                g = g + b_gate_up[e].float()
            h = act(g[None].to(x.dtype)).float() if quantize_activations else act(g[None]).float()
            y = q(h.to(x.dtype) if quantize_activations else h)[0] @ wd[e].t()
            if b_down is not None:
                y = y + b_down[e].float()
            out[t] += float(weights[t, j]) * y
    return out.to(x.dtype)
