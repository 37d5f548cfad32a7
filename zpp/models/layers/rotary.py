"""Rotary position embedding (Su et al. 2021, RoFormer), in HF transformers' "rotate_half" layout.

Supported ``rope_scaling`` / ``rope_parameters`` types: ``default``, ``linear``, ``llama3``.
Anything else raises :class:`zpp.config.ConfigError` when the model is resolved (before weights load).
"""
from __future__ import annotations

import math
from typing import Any, Optional

import torch
from torch import nn

from zpp.config import ConfigError

SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3")


def rope_params(cfg: dict[str, Any]) -> tuple[float, dict[str, Any]]:
    """(theta, scaling dict) from an HF config, old (``rope_theta``/``rope_scaling``) or new
    (``rope_parameters``) style. Raises ConfigError for unsupported scaling types."""
    params = dict(cfg.get("rope_parameters") or {})
    scaling = dict(cfg.get("rope_scaling") or {})
    theta = float(params.get("rope_theta", cfg.get("rope_theta", 10000.0)))
    merged = {**scaling, **params}
    rtype = merged.get("rope_type", merged.get("type", "default")) or "default"
    if rtype not in SUPPORTED_ROPE_TYPES:
        raise ConfigError(
            f"rope scaling type {rtype!r} is not supported (supported: {', '.join(SUPPORTED_ROPE_TYPES)})")
    merged["rope_type"] = rtype
    return theta, merged


def _inv_freq(dim: int, theta: float, scaling: dict[str, Any]) -> torch.Tensor:
    inv = 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.int64).to(torch.float32) / dim))
    rtype = scaling.get("rope_type", "default")
    if rtype == "linear":
        inv = inv / float(scaling["factor"])
    elif rtype == "llama3":
        # Follows HF transformers' _compute_llama3_parameters.
        factor = float(scaling["factor"])
        low = float(scaling.get("low_freq_factor", 1.0))
        high = float(scaling.get("high_freq_factor", 4.0))
        old_len = float(scaling["original_max_position_embeddings"])
        low_wavelen, high_wavelen = old_len / low, old_len / high
        wavelen = 2 * math.pi / inv
        scaled = torch.where(wavelen > low_wavelen, inv / factor, inv)
        smooth = (old_len / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = ~(wavelen < high_wavelen) & ~(wavelen > low_wavelen)
        inv = torch.where(medium, smoothed, scaled)
    return inv


class RotaryEmbedding(nn.Module):
    """Applies RoPE to query and key heads.

    ``forward(positions [T] int64, q [T, Hq, D], k [T, Hk, D])`` -> rotated ``(q, k)`` (new tensors,
    same dtype). cos/sin are precomputed in float32 for ``max_positions`` and cast per call.
    """

    def __init__(self, head_dim: int, max_positions: int, theta: float,
                 scaling: Optional[dict[str, Any]] = None, rotary_dim: Optional[int] = None):
        super().__init__()
        self.rotary_dim = rotary_dim or head_dim
        inv = _inv_freq(self.rotary_dim, theta, scaling or {})
        t = torch.arange(max_positions, dtype=torch.int64).float()
        freqs = t[:, None] * inv[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        self.register_buffer("cos", emb.cos(), persistent=False)  # [max_positions, rotary_dim]
        self.register_buffer("sin", emb.sin(), persistent=False)

    @staticmethod
    def _rotate_half(x: torch.Tensor) -> torch.Tensor:
        x1, x2 = x.chunk(2, dim=-1)
        return torch.cat((-x2, x1), dim=-1)

    def forward(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor):
        cos = self.cos[positions].to(q.dtype).unsqueeze(1)  # [T, 1, D]
        sin = self.sin[positions].to(q.dtype).unsqueeze(1)
        if self.rotary_dim == q.shape[-1]:
            return q * cos + self._rotate_half(q) * sin, k * cos + self._rotate_half(k) * sin
        r = self.rotary_dim
        qr, qp = q[..., :r], q[..., r:]
        kr, kp = k[..., :r], k[..., r:]
        return (torch.cat((qr * cos + self._rotate_half(qr) * sin, qp), -1),
                torch.cat((kr * cos + self._rotate_half(kr) * sin, kp), -1))


_ROPE_CACHE: dict[tuple, RotaryEmbedding] = {}


def get_rope(head_dim: int, max_positions: int, theta: float, scaling: Optional[dict[str, Any]] = None,
             rotary_dim: Optional[int] = None) -> RotaryEmbedding:
    """A shared RotaryEmbedding (one cos/sin table per stage, not one per layer), built on the
    current default device."""
    key = (head_dim, max_positions, theta, repr(sorted((scaling or {}).items())), rotary_dim,
           str(torch.empty(0).device))
    if key not in _ROPE_CACHE:
        _ROPE_CACHE[key] = RotaryEmbedding(head_dim, max_positions, theta, scaling, rotary_dim)
    return _ROPE_CACHE[key]
