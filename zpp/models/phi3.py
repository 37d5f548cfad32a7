"""Phi-3 / Phi-3.5-mini / Phi-4-mini (``Phi3ForCausalLM``), one pipeline stage of it.

Follows HF transformers' ``modeling_phi3.py`` (5.24): the LLaMA block (pre-RMSNorm, grouped-query
attention without biases, SiLU-gated MLP; the residual dropouts are identities at inference) with

* fused checkpoint tensors ``self_attn.qkv_proj.weight`` ``[(H + 2 Hk) D, hidden]`` (q rows, then k,
  then v) and ``mlp.gate_up_proj.weight`` ``[2 I, hidden]`` (gate rows, then up), loaded whole into
  zpp's merged layers; with tensor parallelism each rank takes its rows of every part
  (:class:`~zpp.models.layers.linear.MergedLinear` splits a whole tensor by the part widths
  ``H D``, ``Hk D``, ``Hk D``);
* partial rotary: only the first ``int(head_dim * partial_rotary_factor)`` dims of each head are
  rotated (Phi-4-mini: 0.75);
* ``longrope`` RoPE scaling (Phi-3-*-128k, Phi-3.5, Phi-4-mini), see :mod:`zpp.models.layers.rotary`:
  a sequence uses the short factors while it has at most ``original_max_position_embeddings``
  tokens and the long ones (for all its positions) once longer, as HF's ``generate`` does by
  recomputing the KV cache when a sequence crosses that length; zpp's scheduler does the same
  recompute (:meth:`Phi3ForCausalLM.rope_switch_length`).

Config handling mirrors ``Phi3Config``: ``rope_scaling`` (old configs) or ``rope_parameters``;
``type`` ``su`` / ``yarn`` are old names of ``longrope``; the top-level
``original_max_position_embeddings`` (default 4096) wins over the rope dict's; defaults
``rms_norm_eps`` 1e-5, ``hidden_act`` silu, untied embeddings.

``sliding_window`` (Phi-3-mini-4k: 2047): HF's ``Phi3Model`` masks, on every layer, the keys more than
``sliding_window - 1`` positions behind the query (``create_sliding_window_causal_mask``); so does
zpp's attention (``Attention.sliding_window``), set where the window is shorter than the context.
"""
from __future__ import annotations

from typing import Any, Optional

from torch import nn

from zpp.errors import ConfigError
from zpp.models.base import StageInfo
from zpp.models.layers.activation import check_activation
from zpp.models.layers.attention import Attention
from zpp.models.layers.linear import MergedLinear, RowParallelLinear
from zpp.models.layers.rotary import get_rope, rope_params
from zpp.models.llama import LlamaAttention, LlamaDecoderLayer, LlamaForCausalLM

# Phi3Config's defaults for the fields zpp reads.
_DEFAULTS = {"rms_norm_eps": 1e-5, "hidden_act": "silu", "max_position_embeddings": 4096,
             "original_max_position_embeddings": 4096, "tie_word_embeddings": False}


def phi3_config(cfg: dict[str, Any]) -> dict[str, Any]:
    """A copy of an HF Phi-3 ``config.json`` with ``Phi3Config``'s defaults filled in and its RoPE
    settings in one ``rope_parameters`` dict (``rope_type``, ``rope_theta``, ``partial_rotary_factor``,
    LongRoPE's factors), as ``Phi3Config.convert_rope_params_to_dict`` and
    ``standardize_rope_params`` leave them."""
    out = dict(cfg)
    for key, value in _DEFAULTS.items():
        if out.get(key) is None:
            out[key] = value
    out["num_key_value_heads"] = out.get("num_key_value_heads") or out["num_attention_heads"]
    rope = dict(out.pop("rope_scaling", None) or out.get("rope_parameters") or {})
    rope.setdefault("rope_theta", out.get("rope_theta", 10000.0))
    rope.setdefault("partial_rotary_factor", out.get("partial_rotary_factor", 1.0))
    rtype = rope.get("rope_type", rope.get("type", "default")) or "default"
    rope["rope_type"] = "longrope" if rtype in ("su", "yarn") else rtype
    rope.pop("type", None)
    out["rope_parameters"] = rope
    return out


def _rope_settings(cfg: dict[str, Any]) -> tuple[int, int, float, dict[str, Any]]:
    """(head_dim, rotary_dim, theta, scaling) of a :func:`phi3_config` config. Raises ConfigError."""
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    rotary_dim = int(head_dim * float(cfg["rope_parameters"]["partial_rotary_factor"]))
    theta, scaling = rope_params(cfg)
    if scaling["rope_type"] not in ("default", "longrope"):
        raise ConfigError(f"Phi-3 rope type {scaling['rope_type']!r} is not supported (HF allows default, longrope)")
    if rotary_dim < 2 or rotary_dim % 2 or rotary_dim > head_dim:
        raise ConfigError(f"partial_rotary_factor {cfg['rope_parameters']['partial_rotary_factor']} gives a rotary "
                          f"width of {rotary_dim} of head_dim {head_dim}; it must be even, between 2 and head_dim")
    if scaling["rope_type"] == "longrope":
        for key in ("short_factor", "long_factor"):
            if len(scaling[key]) != rotary_dim // 2:
                raise ConfigError(f"longrope {key} has {len(scaling[key])} entries; the rotary width {rotary_dim} "
                                  f"needs {rotary_dim // 2}")
    return head_dim, rotary_dim, theta, scaling


class Phi3Attention(LlamaAttention):
    """LLaMA attention (same ``forward``) whose q/k/v come from one fused checkpoint tensor and whose
    RoPE may be partial and LongRoPE. ``forward(rows, x, kv_cache, meta)``: ``rows`` are the rotary
    table rows of the tokens (:meth:`RotaryEmbedding.rope_rows`), not their positions."""

    def __init__(self, cfg: dict[str, Any], max_positions: int, tp_rank: int = 0, tp_size: int = 1):
        nn.Module.__init__(self)  # LlamaAttention's attributes, built for Phi-3's RoPE
        hidden, heads, kv_heads = cfg["hidden_size"], cfg["num_attention_heads"], cfg["num_key_value_heads"]
        self.head_dim, rotary_dim, theta, scaling = _rope_settings(cfg)
        self.num_heads = heads // tp_size
        self.num_kv_heads = kv_heads // tp_size
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        self.qkv_proj = MergedLinear(hidden, [heads * self.head_dim, kv_heads * self.head_dim,
                                              kv_heads * self.head_dim], tp_rank=tp_rank, tp_size=tp_size)
        self.o_proj = RowParallelLinear(heads * self.head_dim, hidden, tp_rank=tp_rank, tp_size=tp_size)
        self.rotary = get_rope(self.head_dim, max_positions, theta, scaling, rotary_dim)
        self.attn = Attention(self.num_heads, self.head_dim, self.num_kv_heads)


class Phi3ForCausalLM(LlamaForCausalLM):
    """One stage of a Phi-3 causal LM; same inputs / outputs as :class:`LlamaForCausalLM`
    (``[2, T, H]`` hidden + residual between stages, final normed hidden ``[T, H]`` on the last).

    ``rope_switch_len``: LongRoPE's ``original_max_position_embeddings`` when the rotary table has a
    long part (``max_positions`` above it), else None; the model runner then marks the tokens of
    longer sequences in ``AttentionMetadata.rope_long``.
    """

    packed_modules: dict[str, tuple[str, int]] = {}  # qkv_proj and gate_up_proj are fused in the checkpoint
    tie_word_embeddings_default = False

    @classmethod
    def normalize_config(cls, cfg: dict[str, Any]) -> dict[str, Any]:
        return phi3_config(cfg)

    @classmethod
    def check_config(cls, cfg: dict[str, Any]) -> None:
        cfg = phi3_config(cfg)
        _rope_settings(cfg)
        check_activation(cfg, "hidden_act", "silu")
        window = cfg.get("sliding_window")
        if window is not None and (not isinstance(window, int) or window < 1):
            raise ConfigError(f"sliding_window must be a positive integer, got {window!r}")

    @classmethod
    def rope_switch_length(cls, cfg: dict[str, Any]) -> Optional[int]:
        """LongRoPE: ``original_max_position_embeddings`` -- a sequence that grows past it must be
        recomputed with the long factors (the scheduler does it); None without LongRoPE."""
        cfg = phi3_config(cfg)
        _, scaling = rope_params(cfg)
        return int(scaling["original_max_position_embeddings"]) if scaling["rope_type"] == "longrope" else None

    def __init__(self, cfg: dict[str, Any], stage: StageInfo, max_positions: int):
        cfg = phi3_config(cfg)
        super().__init__(cfg, stage, max_positions)
        head_dim, rotary_dim, theta, scaling = _rope_settings(cfg)
        self.rotary = get_rope(head_dim, max_positions, theta, scaling, rotary_dim)  # the layers' table
        self.rope_switch_len = self.rotary.switch_len if self.rotary.long_offset is not None else None
        window = cfg.get("sliding_window")
        if window is not None and window < max_positions:  # else never reached
            for i in range(stage.layer_start, stage.layer_end):
                self.model.layers[i].self_attn.attn.sliding_window = window

    def make_layer(self, cfg: dict[str, Any], max_positions: int, layer_idx: int) -> nn.Module:
        """The LLaMA pre-norm block with :class:`Phi3Attention`; the MLP's ``gate_up_proj`` is the
        fused checkpoint tensor (gate rows first, as HF's ``chunk(2)``)."""
        tp = dict(tp_rank=self.stage.tp_rank, tp_size=self.stage.tp_size)
        return LlamaDecoderLayer(cfg, max_positions, qkv_bias=False, attn=Phi3Attention(cfg, max_positions, **tp), **tp)

    def forward(self, input_ids, positions, acts, kv_caches, meta):
        # The LLaMA forward, with the positions replaced by their rotary-table rows (LongRoPE: the
        # long part for the tokens of sequences longer than original_max_position_embeddings).
        rows = self.rotary.rope_rows(positions, getattr(meta, "rope_long", None))
        return super().forward(input_ids, rows, acts, kv_caches, meta)
