"""LLaMA family (LLaMA 2/3, SmolLM2, Mistral, Qwen2 with qkv bias), one pipeline stage of it.
Sliding-window layers where Mistral's, Mixtral's and Qwen2's configs ask for them
(:func:`layer_windows`).

Follows HF transformers' ``modeling_llama.py`` (reference numerics) and vLLM's ``llama.py`` (stage
split with placeholder layers so layer indices and checkpoint names stay global; the residual
stream travels between stages next to the hidden states).
"""
from __future__ import annotations

from typing import Any, Optional

import torch
from torch import nn

from zpp.errors import ConfigError
from zpp.models.base import PreNormDecoder, StageInfo
from zpp.models.layers.activation import GatedMLP, check_activation
from zpp.models.layers.attention import Attention, AttentionMetadata
from zpp.models.quantization.fp8_linear import fuses_norm, rms_norm_fp8_linear
from zpp.models.layers.linear import MergedLinear, RowParallelLinear
from zpp.models.layers.norm import RMSNorm
from zpp.models.layers.rotary import get_rope, rope_params


def layer_windows(cfg: dict[str, Any]) -> list[Optional[int]]:
    """Each layer's sliding window (None: full attention), as HF's configs and models read it:
    Mistral: ``sliding_window`` on every layer (MistralConfig's default 4096 when the key is absent;
    null = none); Mixtral: ``sliding_window`` (default none); Qwen2 with ``use_sliding_window``: the
    layers ``layer_types`` marks ``sliding_attention`` (default: those from ``max_window_layers``
    on); LLaMA: none."""
    n = int(cfg["num_hidden_layers"])
    kind = cfg.get("model_type")
    if kind == "mistral":
        return [cfg.get("sliding_window", 4096)] * n
    if kind == "mixtral":
        return [cfg.get("sliding_window")] * n
    if kind == "qwen2":
        w = cfg.get("sliding_window", 4096) if cfg.get("use_sliding_window", False) else None
        types = cfg.get("layer_types") or [
            "sliding_attention" if w is not None and i >= int(cfg.get("max_window_layers", 28)) else "full_attention"
            for i in range(n)]
        return [w if t == "sliding_attention" else None for t in types]
    return [None] * n


class LlamaAttention(nn.Module):
    """Grouped-query self-attention with RoPE: ``forward(positions [T], x [T, hidden])`` ->
    ``[T, hidden]``. With ``tp_size > 1`` this rank computes heads
    ``[tp_rank * H / tp, (tp_rank + 1) * H / tp)`` (and the KV heads they read) and ``o_proj``
    all-reduces the partial outputs."""

    def __init__(self, cfg: dict[str, Any], max_positions: int, qkv_bias: bool, tp_rank: int = 0, tp_size: int = 1):
        super().__init__()
        hidden = cfg["hidden_size"]
        heads = cfg["num_attention_heads"]
        kv_heads = cfg.get("num_key_value_heads") or heads
        self.head_dim = cfg.get("head_dim") or hidden // heads
        self.num_heads = heads // tp_size             # this rank's query heads
        self.num_kv_heads = kv_heads // tp_size       # this rank's KV heads
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        self.qkv_proj = MergedLinear(hidden, [heads * self.head_dim, kv_heads * self.head_dim, kv_heads * self.head_dim],
                                     bias=qkv_bias, tp_rank=tp_rank, tp_size=tp_size)
        self.o_proj = RowParallelLinear(heads * self.head_dim, hidden, bias=bool(cfg.get("attention_bias", False)),
                                        tp_rank=tp_rank, tp_size=tp_size)
        theta, scaling = rope_params(cfg)
        self.rotary = get_rope(self.head_dim, max_positions, theta, scaling)
        self.attn = Attention(self.num_heads, self.head_dim, self.num_kv_heads)

    def forward(self, positions: torch.Tensor, x: torch.Tensor, kv_cache: Optional[torch.Tensor],
                meta: AttentionMetadata) -> torch.Tensor:
        return self.forward_qkv(positions, self.qkv_proj(x), kv_cache, meta)

    def forward_qkv(self, positions: torch.Tensor, qkv: torch.Tensor, kv_cache: Optional[torch.Tensor],
                    meta: AttentionMetadata) -> torch.Tensor:
        """:meth:`forward` from ``qkv_proj``'s output ``qkv [T, q_size + 2 * kv_size]``, for a caller
        that computed that product itself (:class:`LlamaDecoderLayer` with its RMSNorm fused into it)."""
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        out = self.attn(q, k, v, kv_cache, meta, positions=positions, rotary=self.rotary)
        return self.o_proj(out)                                        # [T, hidden]


FUSED_NORM_MODULES: set[type] = {LlamaAttention, GatedMLP}
"""The attention and MLP classes (exact types: a subclass opts in by adding itself, as
:class:`zpp.models.qwen3.Qwen3Attention` does) whose input projection a :class:`LlamaDecoderLayer`
may compute together with the RMSNorm before it (FP8 weights, see
:meth:`LlamaDecoderLayer.fuses_norm`): they take that product through ``forward_qkv`` /
``forward_gate_up``. Mixtral's and Qwen3-MoE's sparse blocks, Phi-3's attention, are not in it."""


class LlamaDecoderLayer(nn.Module):
    """Pre-norm block; ``mlp`` replaces the gated MLP (Mixtral passes its sparse MoE block),
    ``attn`` the attention (Qwen3 passes its QK-normed one).
    ``tp_rank`` / ``tp_size``: this rank's tensor-parallel slice of attention and MLP."""

    def __init__(self, cfg: dict[str, Any], max_positions: int, qkv_bias: bool, mlp: Optional[nn.Module] = None,
                 tp_rank: int = 0, tp_size: int = 1, attn: Optional[nn.Module] = None):
        super().__init__()
        eps = cfg.get("rms_norm_eps", 1e-6)
        self.self_attn = attn if attn is not None else LlamaAttention(cfg, max_positions, qkv_bias, tp_rank, tp_size)
        self.mlp = mlp if mlp is not None else GatedMLP(
            cfg["hidden_size"], cfg["intermediate_size"], cfg.get("hidden_act", "silu"),
            bias=bool(cfg.get("mlp_bias", False)), tp_rank=tp_rank, tp_size=tp_size)
        self.input_layernorm = RMSNorm(cfg["hidden_size"], eps)
        self.post_attention_layernorm = RMSNorm(cfg["hidden_size"], eps)

    def forward(self, positions, x, residual, kv_cache, meta):
        if self.fuses_norm("attn", x):      # RMSNorm fused with the FP8 qkv projection
            qkv, summed = rms_norm_fp8_linear(x, residual, self.input_layernorm, self.self_attn.qkv_proj)
            residual = x if residual is None else summed
            x = self.self_attn.forward_qkv(positions, qkv, kv_cache, meta)
        else:
            if residual is None:
                residual = x
                x = self.input_layernorm(x)
            else:
                x, residual = self.input_layernorm(x, residual)
            x = self.self_attn(positions, x, kv_cache, meta)
        if self.fuses_norm("mlp", x):       # RMSNorm fused with the FP8 gate_up projection
            norm, proj = self.post_attention_layernorm, self.mlp.gate_up_proj
            gate_up, residual = rms_norm_fp8_linear(x, residual, norm, proj)
            return self.mlp.forward_gate_up(gate_up), residual
        x, residual = self.post_attention_layernorm(x, residual)
        return self.mlp(x), residual

    def fuses_norm(self, which: str, x: torch.Tensor) -> bool:
        """Whether the RMSNorm before ``which`` (``"attn"``: ``input_layernorm`` then ``qkv_proj``;
        ``"mlp"``: ``post_attention_layernorm`` then ``gate_up_proj``) runs fused with that FP8
        projection for the input ``x [T, hidden]``: the module's type in :data:`FUSED_NORM_MODULES`,
        and :func:`zpp.models.quantization.fp8_linear.fuses_norm` (CUDA, a LLaMA RMSNorm, per-channel FP8 weights
        with dynamic activation scales, a batch past the W8A16 GEMV's: the norm with the activation
        quantization)."""
        if which == "attn":
            module, norm, proj = self.self_attn, self.input_layernorm, "qkv_proj"
        else:
            module, norm, proj = self.mlp, self.post_attention_layernorm, "gate_up_proj"
        return type(module) in FUSED_NORM_MODULES and fuses_norm(norm, getattr(module, proj), x)


class LlamaForCausalLM(PreNormDecoder):
    """One stage of a LLaMA-architecture causal LM.

    forward(input_ids [T] int64 | None, positions [T] int64, acts [2, T, H] | None, kv_caches, meta)
    returns ``[2, T, H]`` (hidden, residual) on non-last stages, final normed hidden ``[T, H]`` last;
    with tensor parallelism the same, whole, on every TP rank of the stage.
    """

    num_acts = 2
    supports_tensor_parallel = True
    packed_modules = {"q_proj": ("qkv_proj", 0), "k_proj": ("qkv_proj", 1), "v_proj": ("qkv_proj", 2),
                      "gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1)}
    tied_names = ("model.embed_tokens.weight",)
    qkv_bias = False

    @classmethod
    def check_config(cls, cfg: dict[str, Any]) -> None:
        rope_params(cfg)
        check_activation(cfg, "hidden_act", "silu")
        if cfg.get("model_type") != "qwen2" and any(t != "full_attention" for t in cfg.get("layer_types") or []):
            raise ConfigError("layer_types other than full_attention (sliding-window layers) are not supported")
        for w in layer_windows(cfg):
            if w is not None and (not isinstance(w, int) or w < 1):
                raise ConfigError(f"sliding_window must be a positive integer, got {w!r}")

    @classmethod
    def check_tensor_parallel(cls, cfg: dict[str, Any], tp_size: int) -> None:
        heads = cfg["num_attention_heads"]
        cls.check_divisible({"num_attention_heads": heads, "num_key_value_heads": cfg.get("num_key_value_heads") or heads,
                             "intermediate_size": cfg["intermediate_size"]}, tp_size)

    def __init__(self, cfg: dict[str, Any], stage: StageInfo, max_positions: int):
        super().__init__(cfg, stage)
        self.build_decoder(cfg["vocab_size"], cfg["hidden_size"], cfg["num_hidden_layers"],
                           lambda i: self.make_layer(cfg, max_positions, i),
                           lambda: RMSNorm(cfg["hidden_size"], cfg.get("rms_norm_eps", 1e-6)))
        self.num_kv_heads = (cfg.get("num_key_value_heads") or cfg["num_attention_heads"]) // stage.tp_size
        self.head_dim = cfg.get("head_dim") or self.hidden_size // cfg["num_attention_heads"]
        for i, window in enumerate(layer_windows(cfg)):  # sliding-window layers (Mistral, Qwen2, Mixtral)
            if stage.owns_layer(i) and window is not None and window < max_positions:  # else never reached
                self.model.layers[i].self_attn.attn.sliding_window = window

    def make_layer(self, cfg: dict[str, Any], max_positions: int, layer_idx: int) -> nn.Module:
        """Decoder layer ``layer_idx`` (global index) of this stage."""
        return LlamaDecoderLayer(cfg, max_positions, self.qkv_bias or bool(cfg.get("attention_bias", False)),
                                 tp_rank=self.stage.tp_rank, tp_size=self.stage.tp_size)



class Qwen2ForCausalLM(LlamaForCausalLM):
    """Qwen2: the LLaMA block with a bias on q/k/v (HF ``modeling_qwen2.py``)."""

    qkv_bias = True
