"""Qwen3 (dense), one pipeline stage of it.

Follows HF transformers' ``modeling_qwen3.py``: the LLaMA block (RMSNorm, RoPE, grouped-query
attention, gated SiLU MLP) plus a per-head RMSNorm of the queries and keys (``q_norm`` /
``k_norm``, weight ``[head_dim]``), applied to each head after the q/k projections and before
RoPE. No q/k/v bias unless ``attention_bias`` (which also adds one to ``o_proj``); ``head_dim`` is
explicit (Qwen3-8B: 128 with hidden 4096 / 32 heads, but Qwen3-30B-A3B: 128 with hidden 2048 / 32
heads); embeddings tied where ``tie_word_embeddings`` says so.

Tensor parallelism: LLaMA's (heads split over the ranks); the QK norm is per head, so each rank
norms its own heads with the full (replicated) ``[head_dim]`` weights. On CUDA the norm of q and
k is one Triton launch (:func:`zpp.models.layers.triton_ops.qk_rms_norm`) whose outputs feed the
fused RoPE + KV-cache write.

Sliding-window attention (``use_sliding_window: true``, ``layer_types`` other than
``full_attention``) is refused.
"""
from __future__ import annotations

from typing import Any, Optional

import torch
from torch import nn

from zpp.errors import ConfigError
from zpp.models.layers.attention import AttentionMetadata
from zpp.models.layers.norm import RMSNorm
from zpp.models.llama import FUSED_NORM_MODULES, LlamaAttention, LlamaDecoderLayer, LlamaForCausalLM

QWEN3_HEAD_DIM_DEFAULT = 128
"""HF ``Qwen3Config.head_dim``'s default, used when ``config.json`` omits the key."""


class Qwen3Attention(LlamaAttention):
    """:class:`LlamaAttention` with per-head RMSNorm on q and k before RoPE (HF ``Qwen3Attention``).
    ``forward(positions [T], x [T, hidden])`` -> ``[T, hidden]`` (LlamaAttention's: the projection,
    then this class's :meth:`forward_qkv`)."""

    def __init__(self, cfg: dict[str, Any], max_positions: int, qkv_bias: bool, tp_rank: int = 0, tp_size: int = 1):
        super().__init__(cfg, max_positions, qkv_bias, tp_rank, tp_size)
        eps = cfg.get("rms_norm_eps", 1e-6)
        self.q_norm = RMSNorm(self.head_dim, eps)
        self.k_norm = RMSNorm(self.head_dim, eps)

    def forward_qkv(self, positions: torch.Tensor, qkv: torch.Tensor, kv_cache: Optional[torch.Tensor],
                    meta: AttentionMetadata) -> torch.Tensor:
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        T, D = qkv.shape[0], self.head_dim
        if q.is_cuda:
            from zpp.models.layers.triton_ops import qk_rms_norm
            q, k = qk_rms_norm(q, k, self.q_norm.weight, self.k_norm.weight, self.q_norm.eps, D)
        else:
            q = self.q_norm(q.view(T, self.num_heads, D)).view(T, self.q_size)        # [T, Hq*D]
            k = self.k_norm(k.view(T, self.num_kv_heads, D)).view(T, self.kv_size)    # [T, Hk*D]
        out = self.attn(q, k, v, kv_cache, meta, positions=positions, rotary=self.rotary)
        return self.o_proj(out)                                                       # [T, hidden]


FUSED_NORM_MODULES.add(Qwen3Attention)  # its forward_qkv takes the decoder layer's fused RMSNorm + qkv projection


def with_qwen3_defaults(cfg: dict[str, Any], head_dim_default: Optional[int]) -> dict[str, Any]:
    """``cfg`` with ``head_dim`` filled in from HF's config-class default when absent (Qwen3Config:
    128; Qwen3MoeConfig has no such field: None keeps LLaMA's ``hidden_size // heads``)."""
    if cfg.get("head_dim") or head_dim_default is None:
        return cfg
    return {**cfg, "head_dim": head_dim_default}


def check_no_sliding_window(cfg: dict[str, Any]) -> None:
    """ConfigError (one line) for Qwen3's sliding-window options."""
    if cfg.get("use_sliding_window"):
        raise ConfigError(f"use_sliding_window=true (sliding_window={cfg.get('sliding_window')}) is not supported")
    if any(t != "full_attention" for t in cfg.get("layer_types") or []):
        raise ConfigError("layer_types other than full_attention (sliding-window layers) are not supported")


class Qwen3ForCausalLM(LlamaForCausalLM):
    """One stage of a Qwen3 causal LM; same inputs / outputs as :class:`LlamaForCausalLM`
    (``[2, T, H]`` hidden + residual between stages, final normed hidden ``[T, H]`` on the last)."""

    head_dim_default: Optional[int] = QWEN3_HEAD_DIM_DEFAULT

    @classmethod
    def check_config(cls, cfg: dict[str, Any]) -> None:
        check_no_sliding_window(cfg)
        super().check_config(cfg)

    def __init__(self, cfg: dict[str, Any], stage, max_positions: int):
        super().__init__(with_qwen3_defaults(cfg, self.head_dim_default), stage, max_positions)

    def make_attention(self, cfg: dict[str, Any], max_positions: int) -> nn.Module:
        return Qwen3Attention(cfg, max_positions, bool(cfg.get("attention_bias", False)),
                              self.stage.tp_rank, self.stage.tp_size)

    def make_layer(self, cfg: dict[str, Any], max_positions: int, layer_idx: int) -> nn.Module:
        tp_rank, tp_size = self.stage.tp_rank, self.stage.tp_size
        return LlamaDecoderLayer(cfg, max_positions, False, tp_rank=tp_rank, tp_size=tp_size,
                                 attn=self.make_attention(cfg, max_positions))
