"""Rotary position embedding (Su et al. 2021, RoFormer), in HF transformers' "rotate_half" layout.

Supported ``rope_scaling`` / ``rope_parameters`` types: ``default``, ``linear``, ``llama3``, ``yarn``
(Peng et al. 2023, "YaRN: Efficient Context Window Extension of Large Language Models", computed as HF
transformers' ``_compute_yarn_parameters``: blended inverse frequencies, and the attention factor
folded into the cos/sin tables), ``longrope`` (LongRoPE, Ding et al. 2024, "LongRoPE: Extending LLM
Context Window Beyond 2 Million Tokens"; Phi-3 / Phi-4-mini). Anything else raises
:class:`zpp.config.ConfigError` when the model is resolved (before weights load).

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

from zpp.errors import ConfigError

SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3", "yarn", "longrope")


def rope_params(cfg: dict[str, Any], default_theta: float = 10000.0,
                types: tuple[str, ...] = SUPPORTED_ROPE_TYPES) -> tuple[float, dict[str, Any]]:
    """(theta, scaling dict) from an HF config, old (``rope_theta``/``rope_scaling``) or new
    (``rope_parameters``) style. Raises ConfigError for scaling types not in ``types``."""
    params = dict(cfg.get("rope_parameters") or {})
    scaling = dict(cfg.get("rope_scaling") or {})
    theta = float(params.get("rope_theta", cfg.get("rope_theta", default_theta)))
    merged = {**scaling, **params}
    if cfg.get("original_max_position_embeddings") and merged.get("rope_type", merged.get("type")) in ("yarn",
                                                                                                     "longrope"):
        # HF's standardize_rope_params: a top-level original_max_position_embeddings wins.
        merged["original_max_position_embeddings"] = cfg["original_max_position_embeddings"]
    return theta, check_rope_scaling(merged, cfg.get("max_position_embeddings"), types)


def check_rope_scaling(scaling: dict[str, Any], max_position_embeddings: Optional[int] = None,
                       types: tuple[str, ...] = SUPPORTED_ROPE_TYPES) -> dict[str, Any]:
    """The scaling dict with ``rope_type`` set (``type`` is its old name) and, for YaRN and LongRoPE,
    HF's defaults filled in (``original_max_position_embeddings`` = ``max_position_embeddings``; YaRN's
    ``factor`` = their ratio; LongRoPE keeps ``max_position_embeddings`` for its attention factor).
    Raises ConfigError for a type not in ``types``, a YaRN setting without its lengths, or LongRoPE
    factors that are not lists of numbers."""
    merged = dict(scaling)
    rtype = merged.get("rope_type", merged.get("type", "default")) or "default"
    if rtype not in types:
        raise ConfigError(f"rope scaling type {rtype!r} is not supported (supported: {', '.join(types)})")
    merged["rope_type"] = rtype
    if rtype == "yarn":
        orig = merged.get("original_max_position_embeddings") or max_position_embeddings
        if orig is None:
            raise ConfigError("yarn rope scaling needs original_max_position_embeddings or max_position_embeddings")
        merged["original_max_position_embeddings"] = orig
        if merged.get("factor") is None:
            if max_position_embeddings is None:
                raise ConfigError("yarn rope scaling without a factor needs max_position_embeddings")
            merged["factor"] = max_position_embeddings / orig
    if rtype == "longrope":
        for key in ("short_factor", "long_factor"):
            if not isinstance(merged.get(key), list) or not all(isinstance(x, (int, float)) for x in merged[key]):
                raise ConfigError(f"rope scaling longrope needs {key} as a list of numbers, got {merged.get(key)!r}")
        orig = merged.get("original_max_position_embeddings") or max_position_embeddings
        if orig is None:
            raise ConfigError("longrope rope scaling needs original_max_position_embeddings or max_position_embeddings")
        merged["original_max_position_embeddings"] = orig
        merged["max_position_embeddings"] = max_position_embeddings
    return merged


def _yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    """YaRN's attention temperature factor ``0.1 * mscale * ln(scale) + 1`` (1 for ``scale <= 1``)."""
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def rope_attention_factor(scaling: dict[str, Any]) -> float:
    """The factor HF multiplies cos and sin by (``attention_scaling`` of its rotary embedding): 1
    except for YaRN, where it is ``attention_factor`` if given, else ``mscale(factor, mscale) /
    mscale(factor, mscale_all_dim)`` when both are set (DeepSeek), else ``mscale(factor)``; and
    LongRoPE (HF ``_compute_longrope_parameters``), where it is ``attention_factor`` if given, else
    ``sqrt(1 + ln(s) / ln(original_max_position_embeddings))`` with ``s = factor`` or
    ``max_position_embeddings / original_max_position_embeddings`` (1 when ``s <= 1``)."""
    if scaling.get("rope_type") == "longrope":
        if scaling.get("attention_factor") is not None:
            return float(scaling["attention_factor"])
        orig = float(scaling["original_max_position_embeddings"])
        s = scaling.get("factor")
        s = float(s) if s is not None else float(scaling.get("max_position_embeddings") or orig) / orig
        return 1.0 if s <= 1.0 else math.sqrt(1 + math.log(s) / math.log(orig))
    if scaling.get("rope_type") != "yarn":
        return 1.0
    if scaling.get("attention_factor") is not None:
        return float(scaling["attention_factor"])
    factor = float(scaling["factor"])
    mscale, mscale_all_dim = scaling.get("mscale"), scaling.get("mscale_all_dim")
    if mscale and mscale_all_dim:
        return float(_yarn_mscale(factor, mscale) / _yarn_mscale(factor, mscale_all_dim))
    return _yarn_mscale(factor)


def yarn_softmax_scale(scaling: dict[str, Any], scale: float) -> float:
    """DeepSeek's attention scale (HF ``yarn_apply_mscale``): ``scale * mscale(factor, mscale_all_dim)^2``
    when the rope type is not ``default`` and ``mscale_all_dim`` is set, else ``scale`` unchanged."""
    if scaling.get("rope_type", "default") != "default" and scaling.get("mscale_all_dim"):
        m = _yarn_mscale(float(scaling["factor"]), scaling["mscale_all_dim"])
        scale = scale * m * m
    return scale


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
    elif rtype == "yarn":
        inv = _yarn_inv_freq(dim, theta, scaling)
    return inv


def _yarn_inv_freq(dim: int, theta: float, scaling: dict[str, Any]) -> torch.Tensor:
    """YaRN's inverse frequencies ``[dim / 2]`` float32, step for step as HF's
    ``_compute_yarn_parameters``: interpolated (divided by ``factor``) below the ``beta_slow``
    rotation count over the original context, extrapolated (unchanged) above ``beta_fast``, a
    linear ramp between."""
    factor = float(scaling["factor"])
    orig = scaling["original_max_position_embeddings"]
    beta_fast = scaling.get("beta_fast") or 32
    beta_slow = scaling.get("beta_slow") or 1

    def correction_dim(rotations: float) -> float:
        return (dim * math.log(orig / (rotations * 2 * math.pi))) / (2 * math.log(theta))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if scaling.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # HF: avoids a division by zero
    pos_freqs = theta ** (torch.arange(0, dim, 2).to(torch.float32) / dim)
    extrapolation = 1.0 / pos_freqs
    interpolation = 1.0 / (factor * pos_freqs)
    ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
    extrapolation_factor = 1 - ramp
    return interpolation * (1 - extrapolation_factor) + extrapolation * extrapolation_factor


def longrope_inv_freqs(dim: int, theta: float, scaling: dict[str, Any]) -> tuple[torch.Tensor, torch.Tensor]:
    """LongRoPE's short and long inverse frequencies ``[dim / 2]`` float32 for a rotary width of
    ``dim``, as HF's ``_compute_longrope_parameters``: ``1 / (factor_i * theta ** (2i / dim))`` with
    ``short_factor`` / ``long_factor``.

    Raises:
        ValueError: a factor list's length is not ``dim / 2``.
    """
    shape = torch.arange(0, dim, 2, dtype=torch.int64).float() / dim
    out = []
    for key in ("short_factor", "long_factor"):
        ext = torch.tensor(scaling[key], dtype=torch.float32)
        if ext.shape != shape.shape:
            raise ValueError(f"longrope {key} has {ext.numel()} entries, the rotary width {dim} needs {dim // 2}")
        out.append(1.0 / (ext * theta ** shape))
    return out[0], out[1]


class RotaryEmbedding(nn.Module):
    """Applies RoPE to query and key heads (to the first ``rotary_dim`` dims of each head; the rest
    pass through, HF's partial rotary).

    ``forward(rows [T] int64, q [T, Hq, D], k [T, Hk, D])`` -> rotated ``(q, k)`` (new tensors,
    same dtype). cos/sin are precomputed in float32 (``[rows, rotary_dim]``) and cast per call; they
    include the YaRN / LongRoPE attention factor (:func:`rope_attention_factor`), as HF's do.
    ``rows`` are the positions, except with LongRoPE, where :meth:`rope_rows` maps positions to rows.

    LongRoPE (``scaling["rope_type"] == "longrope"``): ``switch_len`` is
    ``original_max_position_embeddings``; rows ``[0, switch_len)`` hold the short factors' positions
    and, when ``max_positions > switch_len``, rows ``[switch_len, switch_len + max_positions)`` the long
    factors' (``long_offset = switch_len``). Otherwise both are None.
    """

    def __init__(self, head_dim: int, max_positions: int, theta: float,
                 scaling: Optional[dict[str, Any]] = None, rotary_dim: Optional[int] = None):
        super().__init__()
        self.rotary_dim = rotary_dim or head_dim
        scaling = scaling or {}
        self.switch_len: Optional[int] = None
        self.long_offset: Optional[int] = None
        if scaling.get("rope_type") == "longrope":
            short, long = longrope_inv_freqs(self.rotary_dim, theta, scaling)
            self.switch_len = int(scaling["original_max_position_embeddings"])
            parts = [torch.arange(min(max_positions, self.switch_len), dtype=torch.int64).float()[:, None] * short]
            if max_positions > self.switch_len:
                self.long_offset = self.switch_len
                parts.append(torch.arange(max_positions, dtype=torch.int64).float()[:, None] * long)
            freqs = torch.cat(parts)
        else:
            inv = _inv_freq(self.rotary_dim, theta, scaling)
            t = torch.arange(max_positions, dtype=torch.int64).float()
            freqs = t[:, None] * inv[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        factor = rope_attention_factor(scaling)
        cos, sin = emb.cos(), emb.sin()
        if factor != 1.0:
            cos, sin = cos * factor, sin * factor
        self.register_buffer("cos", cos, persistent=False)  # [rows, rotary_dim]
        self.register_buffer("sin", sin, persistent=False)

    def _apply(self, fn, recurse=True):
        # get_rope shares one module among every model of the process built with the same shape and
        # device: a model's .to(dtype) must not cast the float32 tables under the others (forward
        # and the kernels convert at use), so a dtype change on the same device keeps them
        before = dict(self._buffers)
        super()._apply(fn, recurse)
        for name, old in before.items():
            new = self._buffers.get(name)
            if old is not None and new is not None and new.device == old.device and new.dtype != old.dtype:
                self._buffers[name] = old
        return self

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
