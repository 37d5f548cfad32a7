"""Rotary position embedding (Su et al. 2021, RoFormer), in HF transformers' "rotate_half" layout.

Supported ``rope_scaling`` / ``rope_parameters`` types: ``default``, ``linear``, ``llama3``, ``yarn``
(Peng et al. 2023, "YaRN"; accepted for gpt-oss only so far), each following HF ``modeling_rope_utils``.
Anything else raises :class:`zpp.config.ConfigError` when the model is resolved (before weights load).
"""
from __future__ import annotations

import math
from typing import Any, Optional

import torch
from torch import nn

from zpp.config import ConfigError

SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3")
"""The types every family accepts; YaRN only where a family's tests cover it (gpt-oss)."""


def rope_params(cfg: dict[str, Any], default_theta: float = 10000.0,
                types: tuple[str, ...] = SUPPORTED_ROPE_TYPES) -> tuple[float, dict[str, Any]]:
    """(theta, scaling dict) from an HF config, old (``rope_theta``/``rope_scaling``) or new
    (``rope_parameters``) style. Raises ConfigError for scaling types not in ``types``."""
    params = dict(cfg.get("rope_parameters") or {})
    scaling = dict(cfg.get("rope_scaling") or {})
    theta = float(params.get("rope_theta", cfg.get("rope_theta", default_theta)))
    return theta, check_rope_scaling({**scaling, **params}, cfg.get("max_position_embeddings"), types)


def check_rope_scaling(scaling: dict[str, Any], max_position_embeddings: Optional[int] = None,
                       types: tuple[str, ...] = SUPPORTED_ROPE_TYPES) -> dict[str, Any]:
    """The scaling dict with ``rope_type`` set (``type`` is its old name) and, for YaRN, HF's defaults
    filled in (``original_max_position_embeddings`` = ``max_position_embeddings``; ``factor`` = their
    ratio). Raises ConfigError for a type not in ``types`` or a YaRN setting without its lengths."""
    merged = dict(scaling)
    rtype = merged.get("rope_type", merged.get("type", "default")) or "default"
    if rtype not in types:
        raise ConfigError(f"rope scaling type {rtype!r} is not supported (supported: {', '.join(types)})")
    merged["rope_type"] = rtype
    if rtype == "yarn":
        if merged.get("original_max_position_embeddings") is None:
            merged["original_max_position_embeddings"] = max_position_embeddings
        if merged["original_max_position_embeddings"] is None:
            raise ConfigError("yarn rope scaling needs original_max_position_embeddings or max_position_embeddings")
        if merged.get("factor") is None:
            if max_position_embeddings is None:
                raise ConfigError("yarn rope scaling needs a factor")
            merged["factor"] = max_position_embeddings / merged["original_max_position_embeddings"]
    return merged


def _yarn(dim: int, theta: float, scaling: dict[str, Any]) -> tuple[torch.Tensor, float]:
    """(inverse frequencies, attention factor) of YaRN, as HF's ``_compute_yarn_parameters``."""
    factor = float(scaling["factor"])
    old_len = float(scaling["original_max_position_embeddings"])
    attention_factor = scaling.get("attention_factor")
    mscale, mscale_all_dim = scaling.get("mscale"), scaling.get("mscale_all_dim")

    def get_mscale(scale, m=1.0):
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    if attention_factor is None:
        if mscale and mscale_all_dim:
            attention_factor = float(get_mscale(factor, mscale) / get_mscale(factor, mscale_all_dim))
        else:
            attention_factor = get_mscale(factor)
    beta_fast = scaling.get("beta_fast") or 32
    beta_slow = scaling.get("beta_slow") or 1

    def correction_dim(rotations):
        return (dim * math.log(old_len / (rotations * 2 * math.pi))) / (2 * math.log(theta))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if scaling.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # as HF: no division by zero
    ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
    pos_freqs = theta ** (torch.arange(0, dim, 2).to(dtype=torch.float) / dim)
    extrapolation, interpolation = 1.0 / pos_freqs, 1.0 / (factor * pos_freqs)
    keep = 1 - ramp                                                   # share of the extrapolated frequency
    return interpolation * (1 - keep) + extrapolation * keep, float(attention_factor)


def _inv_freq(dim: int, theta: float, scaling: dict[str, Any]) -> tuple[torch.Tensor, float]:
    """(inverse frequencies ``[dim // 2]`` float32, factor applied to cos and sin)."""
    rtype = scaling.get("rope_type", "default")
    if rtype == "yarn":
        return _yarn(dim, theta, scaling)
    inv = 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.int64).to(torch.float32) / dim))
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
    return inv, 1.0


class RotaryEmbedding(nn.Module):
    """Applies RoPE to query and key heads.

    ``forward(positions [T] int64, q [T, Hq, D], k [T, Hk, D])`` -> rotated ``(q, k)`` (new tensors,
    same dtype). cos/sin are precomputed in float32 for ``max_positions`` and cast per call.
    """

    def __init__(self, head_dim: int, max_positions: int, theta: float,
                 scaling: Optional[dict[str, Any]] = None, rotary_dim: Optional[int] = None):
        super().__init__()
        self.rotary_dim = rotary_dim or head_dim
        inv, attention_factor = _inv_freq(self.rotary_dim, theta, scaling or {})
        t = torch.arange(max_positions, dtype=torch.int64).float()
        freqs = t[:, None] * inv[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        cos, sin = emb.cos(), emb.sin()
        if attention_factor != 1.0:  # YaRN scales cos and sin (so q.k by its square)
            cos, sin = cos * attention_factor, sin * attention_factor
        self.register_buffer("cos", cos, persistent=False)  # [max_positions, rotary_dim]
        self.register_buffer("sin", sin, persistent=False)

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
