"""Rotary position embedding (Su et al. 2021, RoFormer), in HF transformers' "rotate_half" layout.

Supported ``rope_scaling`` / ``rope_parameters`` types: ``default``, ``linear``, ``llama3``,
``longrope`` (LongRoPE, Ding et al. 2024, "LongRoPE: Extending LLM Context Window Beyond 2 Million
Tokens"; Phi-3 / Phi-4-mini). Anything else raises :class:`zpp.config.ConfigError` when the model is
resolved (before weights load).

LongRoPE has two sets of per-frequency factors: ``short_factor`` for sequences of at most
``original_max_position_embeddings`` tokens, ``long_factor`` for longer ones, and scales cos/sin by an
attention factor. HF transformers (``modeling_rope_utils._compute_longrope_parameters`` and the
``longrope`` branch of ``dynamic_rope_update``) picks the set from the sequence length of each forward,
and its ``Phi3ForCausalLM.prepare_inputs_for_generation`` drops the KV cache and recomputes the whole
sequence with the long factors when a sequence grows past ``original_max_position_embeddings``: a
sequence's keys and queries all use one set, the long one once it is longer. zpp does the same: the
table holds ``original_max_position_embeddings`` short rows then ``max_positions`` long rows
(:meth:`RotaryEmbedding.rope_rows`), the model runner says per token whether its sequence is long,
and the scheduler recomputes a sequence when it crosses the length (see
``zpp.engine.scheduler.Scheduler``).
"""
from __future__ import annotations

import math
from typing import Any, Optional

import torch
from torch import nn

from zpp.config import ConfigError

SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3", "longrope")


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
    if rtype == "longrope":
        for key in ("short_factor", "long_factor"):
            if not isinstance(merged.get(key), list) or not all(isinstance(x, (int, float)) for x in merged[key]):
                raise ConfigError(f"rope scaling longrope needs {key} as a list of numbers, got {merged.get(key)!r}")
        # HF: a top-level original_max_position_embeddings (Phi-3 keeps it there) wins over the
        # rope dict's, which defaults to max_position_embeddings (PreTrainedConfig.standardize_rope_params).
        if cfg.get("original_max_position_embeddings") is not None:
            merged["original_max_position_embeddings"] = cfg["original_max_position_embeddings"]
        merged.setdefault("original_max_position_embeddings", cfg.get("max_position_embeddings"))
        if merged["original_max_position_embeddings"] is None:
            raise ConfigError("rope scaling longrope needs original_max_position_embeddings")
        merged["max_position_embeddings"] = cfg.get("max_position_embeddings")
    return theta, merged


def longrope_parameters(dim: int, theta: float, scaling: dict[str, Any]) -> tuple[torch.Tensor, torch.Tensor, float]:
    """LongRoPE's ``(short inverse frequencies [dim / 2], long ones [dim / 2], attention factor)`` for
    a rotary width of ``dim``, as HF transformers' ``_compute_longrope_parameters`` computes them:
    ``inv = 1 / (factor_i * theta ** (2i / dim))``; the attention factor is ``scaling["attention_factor"]``
    if given, else ``sqrt(1 + ln(s) / ln(original_max_position_embeddings))`` with
    ``s = scaling["factor"]`` or ``max_position_embeddings / original_max_position_embeddings``
    (1.0 when ``s <= 1``).

    Raises:
        ValueError: a factor list's length is not ``dim / 2``.
    """
    orig = float(scaling["original_max_position_embeddings"])
    factor = scaling.get("factor")
    if factor is None:
        factor = float(scaling.get("max_position_embeddings") or orig) / orig
    attention = scaling.get("attention_factor")
    if attention is None:
        attention = 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(orig))
    shape = torch.arange(0, dim, 2, dtype=torch.int64).float() / dim
    out = []
    for key in ("short_factor", "long_factor"):
        ext = torch.tensor(scaling[key], dtype=torch.float32)
        if ext.shape != shape.shape:
            raise ValueError(f"longrope {key} has {ext.numel()} entries, the rotary width {dim} needs {dim // 2}")
        out.append(1.0 / (ext * theta ** shape))
    return out[0], out[1], float(attention)


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
    """Applies RoPE to query and key heads (to the first ``rotary_dim`` dims of each head; the rest
    pass through, HF's partial rotary).

    ``forward(rows [T] int64, q [T, Hq, D], k [T, Hk, D])`` -> rotated ``(q, k)`` (new tensors,
    same dtype). cos/sin are precomputed in float32 (``[rows, rotary_dim]``, the attention factor
    included) and cast per call; ``rows`` are positions, except with LongRoPE, where
    :meth:`rope_rows` maps positions to rows.

    LongRoPE (``scaling["rope_type"] == "longrope"``): ``switch_len`` is
    ``original_max_position_embeddings``; rows ``[0, switch_len)`` hold the short factors' positions
    and, when ``max_positions > switch_len``, rows ``[switch_len, switch_len + max_positions)`` the long
    factors' (``long_offset = switch_len``). Otherwise ``switch_len`` is None.
    """

    def __init__(self, head_dim: int, max_positions: int, theta: float,
                 scaling: Optional[dict[str, Any]] = None, rotary_dim: Optional[int] = None):
        super().__init__()
        self.rotary_dim = rotary_dim or head_dim
        scaling = scaling or {}
        self.switch_len: Optional[int] = None
        self.long_offset: Optional[int] = None
        attention = 1.0
        if scaling.get("rope_type") == "longrope":
            short, long, attention = longrope_parameters(self.rotary_dim, theta, scaling)
            self.switch_len = int(scaling["original_max_position_embeddings"])
            n_short = min(max_positions, self.switch_len)
            parts = [torch.arange(n_short, dtype=torch.int64).float()[:, None] * short[None, :]]
            if max_positions > self.switch_len:
                self.long_offset = self.switch_len
                parts.append(torch.arange(max_positions, dtype=torch.int64).float()[:, None] * long[None, :])
            freqs = torch.cat(parts)
        else:
            inv = _inv_freq(self.rotary_dim, theta, scaling)
            t = torch.arange(max_positions, dtype=torch.int64).float()
            freqs = t[:, None] * inv[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        # HF multiplies cos/sin by the attention factor in float32, then casts to the model's dtype.
        self.register_buffer("cos", emb.cos() * attention, persistent=False)  # [rows, rotary_dim]
        self.register_buffer("sin", emb.sin() * attention, persistent=False)

    def rope_rows(self, positions: torch.Tensor, long: Optional[torch.Tensor] = None) -> torch.Tensor:
        """Table rows of ``positions [T]`` int64: the positions themselves, except with LongRoPE's
        long table, where a token of a long sequence reads row ``position + long_offset``. ``long
        [T]`` (bool or 0/1 int) says which tokens belong to a sequence longer than ``switch_len``;
        None: exactly the tokens at positions ``>= switch_len`` (true of every decode step, since the
        scheduler recomputes a sequence that grows past ``switch_len``; CUDA graphs rely on this).
        Capturable in a CUDA graph (no host sync)."""
        if self.long_offset is None:
            return positions
        if long is None:
            long = positions >= self.switch_len
        return positions + long.to(positions.dtype) * self.long_offset

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
