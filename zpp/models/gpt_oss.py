"""gpt-oss (``GptOssForCausalLM``, bf16 / fp32 checkpoints), one pipeline stage of it.

Follows HF transformers' ``modeling_gpt_oss.py`` (5.24):

* pre-norm blocks (``input_layernorm`` -> attention -> residual, ``post_attention_layernorm`` ->
  MoE -> residual) with RMSNorm whose weight multiplies in float32 before the cast;
* attention: q/k/v/o with biases, grouped-query heads, YaRN RoPE (theta 150000, factor 32 by
  default), scores scaled by ``head_dim ** -0.5``, a learned sink logit per query head in the
  softmax's denominator (``self_attn.sinks``), and ``layer_types``: ``sliding_attention`` layers
  (window ``sliding_window``, 128) alternating with ``full_attention`` ones;
* MoE: a router with bias picks the top-k experts by logit and softmaxes their k logits; each
  expert is ``down(swiglu(x W_gu + b_gu)) + b_d`` where the gate and up halves of ``W_gu`` are
  interleaved columns (gate = even, up = odd) and ``swiglu(g, u) = (clamp(u, -l, l) + 1) *
  g' * sigmoid(alpha g')`` with ``g' = min(g, l)`` (``swiglu_limit`` l = 7, ``swiglu_alpha`` 1.702);
* untied LM head.

Checkpoints as ``save_pretrained`` writes them: fused experts ``mlp.experts.gate_up_proj``
``[E, H, 2I]`` (+ ``_bias`` ``[E, 2I]``), ``mlp.experts.down_proj`` ``[E, I, H]`` (+ ``_bias``
``[E, H]``), ``mlp.router.weight`` / ``.bias``. An MXFP4 checkpoint (``quantization_config``, the
openai/gpt-oss-* originals) is refused in one line: dequantize it to bf16 first.

The experts here are a plain PyTorch stand-in (:class:`GptOssExperts`: tokens sorted by expert, one
pair of matmuls per expert, the per-expert counts read on the host), so no CUDA graphs and no tensor
parallelism for this family yet; the generalised MoE layer (``zpp/models/layers/moe.py``, branch
``moe``) is meant to replace it.
"""
from __future__ import annotations

from typing import Any, Optional

import torch
import torch.nn.functional as F
from torch import nn

from zpp.config import ConfigError
from zpp.models.base import MissingLayer, StageInfo, StageModel, layer_index
from zpp.models.layers.attention import Attention, AttentionMetadata
from zpp.models.layers.linear import LMHead, MergedLinear, RowParallelLinear, VocabEmbedding, default_weight_loader
from zpp.models.layers.norm import RMSNorm
from zpp.models.layers.rotary import SUPPORTED_ROPE_TYPES, get_rope, rope_params

SLIDING, FULL = "sliding_attention", "full_attention"

# HF GptOssConfig's defaults, for keys a config.json omits.
DEFAULTS: dict[str, Any] = {
    "num_hidden_layers": 36, "num_local_experts": 128, "vocab_size": 201088, "hidden_size": 2880,
    "intermediate_size": 2880, "head_dim": 64, "num_attention_heads": 64, "num_key_value_heads": 8,
    "sliding_window": 128, "tie_word_embeddings": False, "max_position_embeddings": 131072, "rms_norm_eps": 1e-5,
    "num_experts_per_tok": 4, "swiglu_alpha": 1.702, "swiglu_limit": 7.0, "attention_bias": True,
}
DEFAULT_THETA = 150000.0
DEFAULT_ROPE = {"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False,
                "original_max_position_embeddings": 4096}


def layer_types(cfg: dict[str, Any]) -> list[str]:
    """``layer_types``, else HF's default: even layers sliding, odd layers full."""
    types = cfg.get("layer_types")
    if types is None:
        types = [SLIDING if (i + 1) % 2 else FULL for i in range(int(cfg["num_hidden_layers"]))]
    return list(types)


def rope(cfg: dict[str, Any]) -> tuple[float, dict[str, Any]]:
    """(theta, scaling) as HF GptOssConfig: YaRN x32 over 4096 positions when the config gives none."""
    if not cfg.get("rope_parameters") and not cfg.get("rope_scaling"):
        cfg = {**cfg, "rope_parameters": DEFAULT_ROPE}
    return rope_params(cfg, DEFAULT_THETA)


class GptOssAttention(nn.Module):
    """``forward(positions [T], x [T, hidden])`` -> ``[T, hidden]``: biased q/k/v/o, YaRN RoPE,
    the layer's window (sliding layers) and its sinks ``[H]``."""

    def __init__(self, cfg: dict[str, Any], layer: int, max_positions: int):
        super().__init__()
        hidden = cfg["hidden_size"]
        H, Hk, D = cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_dim"]
        self.q_size, self.kv_size = H * D, Hk * D
        bias = bool(cfg["attention_bias"])
        self.qkv_proj = MergedLinear(hidden, [H * D, Hk * D, Hk * D], bias=bias)
        self.o_proj = RowParallelLinear(H * D, hidden, bias=bias)
        self.sinks = nn.Parameter(torch.empty(H))
        self.sinks.weight_loader = default_weight_loader
        theta, scaling = rope(cfg)
        self.rotary = get_rope(D, max_positions, theta, scaling)
        window = int(cfg["sliding_window"]) if layer_types(cfg)[layer] == SLIDING else None
        self.attn = Attention(H, D, Hk, scale=D ** -0.5, sliding_window=window)

    def forward(self, positions: torch.Tensor, x: torch.Tensor, kv_cache: Optional[torch.Tensor],
                meta: AttentionMetadata) -> torch.Tensor:
        q, k, v = self.qkv_proj(x).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        out = self.attn(q, k, v, kv_cache, meta, positions=positions, rotary=self.rotary, sinks=self.sinks)
        return self.o_proj(out)                                            # [T, hidden]


class GptOssRouter(nn.Module):
    """``forward(x [T, H])`` -> ``(weights [T, k] in x's dtype, expert ids [T, k] int64)``: the top-k
    experts by logit (``x W^T + b``), their logits softmaxed (HF ``GptOssTopKRouter``)."""

    def __init__(self, hidden_size: int, num_experts: int, top_k: int):
        super().__init__()
        self.top_k = top_k
        self.weight = nn.Parameter(torch.empty(num_experts, hidden_size))
        self.bias = nn.Parameter(torch.empty(num_experts))
        self.weight.weight_loader = self.bias.weight_loader = default_weight_loader

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        logits = F.linear(x, self.weight, self.bias)                       # [T, E]
        top, ids = torch.topk(logits, self.top_k, dim=-1)                  # [T, k]
        return F.softmax(top, dim=1, dtype=top.dtype), ids


class GptOssExperts(nn.Module):
    """gpt-oss's experts (HF ``GptOssExperts``), a plain PyTorch stand-in until the shared MoE layer
    covers them. ``forward(x [T, H], weights [T, k], ids [T, k])`` -> ``[T, H]`` in ``x.dtype``.

    Parameters: ``gate_up_proj`` ``[E, H, 2I]`` (gate = even columns, up = odd), ``gate_up_proj_bias``
    ``[E, 2I]``, ``down_proj`` ``[E, I, H]``, ``down_proj_bias`` ``[E, H]``. Tokens are sorted by expert
    once (the per-expert counts come to the host: no CUDA graphs); each expert with tokens runs its
    two matmuls; each token's k weighted outputs are summed in slot order, as HF's default experts
    implementation (``grouped_mm``) does."""

    def __init__(self, num_experts: int, hidden_size: int, intermediate_size: int, alpha: float, limit: float):
        super().__init__()
        E, H, inter = num_experts, hidden_size, intermediate_size
        self.num_experts, self.alpha, self.limit = E, alpha, limit
        self.gate_up_proj = nn.Parameter(torch.empty(E, H, 2 * inter))
        self.gate_up_proj_bias = nn.Parameter(torch.empty(E, 2 * inter))
        self.down_proj = nn.Parameter(torch.empty(E, inter, H))
        self.down_proj_bias = nn.Parameter(torch.empty(E, H))
        for p in (self.gate_up_proj, self.gate_up_proj_bias, self.down_proj, self.down_proj_bias):
            p.weight_loader = default_weight_loader

    def forward(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        T, k = ids.shape
        flat = ids.reshape(-1)                                                # [T*k]
        order = torch.argsort(flat, stable=True)
        counts = torch.bincount(flat, minlength=self.num_experts).tolist()
        x_sorted = x[order // k]                                              # [T*k, H] by expert
        y = torch.empty_like(x_sorted)
        start = 0
        for e, n in enumerate(counts):
            if n == 0:
                continue
            xs = x_sorted[start:start + n]
            gate_up = xs @ self.gate_up_proj[e] + self.gate_up_proj_bias[e]      # [n, 2I]
            gate = gate_up[:, ::2].clamp(max=self.limit)
            up = gate_up[:, 1::2].clamp(min=-self.limit, max=self.limit)
            h = (up + 1) * (gate * torch.sigmoid(gate * self.alpha))              # [n, I]
            y[start:start + n] = h @ self.down_proj[e] + self.down_proj_bias[e]   # [n, H]
            start += n
        y = y * weights.reshape(-1)[order, None]
        out = torch.empty_like(y)
        out[order] = y                                                        # back to (token, slot) order
        return out.view(T, k, -1).sum(dim=1).to(x.dtype)                      # [T, H]


class GptOssMoE(nn.Module):
    """Router + experts: ``forward(x [T, H])`` -> ``[T, H]``."""

    def __init__(self, cfg: dict[str, Any]):
        super().__init__()
        E, k = int(cfg["num_local_experts"]), int(cfg["num_experts_per_tok"])
        self.router = GptOssRouter(cfg["hidden_size"], E, k)
        self.experts = GptOssExperts(E, cfg["hidden_size"], cfg["intermediate_size"], float(cfg["swiglu_alpha"]),
                                     float(cfg["swiglu_limit"]))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, ids = self.router(x)
        return self.experts(x, weights, ids)


class GptOssDecoderLayer(nn.Module):
    def __init__(self, cfg: dict[str, Any], layer: int, max_positions: int):
        super().__init__()
        H, eps = cfg["hidden_size"], cfg["rms_norm_eps"]
        self.self_attn = GptOssAttention(cfg, layer, max_positions)
        self.mlp = GptOssMoE(cfg)
        self.input_layernorm = RMSNorm(H, eps, weight_in_float32=True)
        self.post_attention_layernorm = RMSNorm(H, eps, weight_in_float32=True)

    def forward(self, positions, x, residual, kv_cache, meta):
        if residual is None:
            residual = x
            x = self.input_layernorm(x)
        else:
            x, residual = self.input_layernorm(x, residual)
        x = self.self_attn(positions, x, kv_cache, meta)
        x, residual = self.post_attention_layernorm(x, residual)
        return self.mlp(x), residual


class GptOssForCausalLM(StageModel):
    """One stage of gpt-oss. forward(input_ids [T] | None, positions [T], acts [2, T, H] | None,
    kv_caches, meta) -> ``[2, T, H]`` (hidden, residual) on non-last stages, the final normed
    hidden ``[T, H]`` on the last."""

    num_acts = 2
    supports_cuda_graphs = False  # the stand-in experts read per-expert counts on the host
    supports_tensor_parallel = False
    packed_modules = {"q_proj": ("qkv_proj", 0), "k_proj": ("qkv_proj", 1), "v_proj": ("qkv_proj", 2)}
    tied_names = ("model.embed_tokens.weight",)

    @classmethod
    def normalize_config(cls, cfg: dict[str, Any]) -> dict[str, Any]:
        out = {**DEFAULTS, **cfg}
        if out.get("head_dim") is None:
            out["head_dim"] = out["hidden_size"] // out["num_attention_heads"]
        if out.get("num_key_value_heads") is None:
            out["num_key_value_heads"] = out["num_attention_heads"]
        return out

    @classmethod
    def num_layers_of(cls, cfg: dict[str, Any]) -> int:
        return int(cls.normalize_config(cfg)["num_hidden_layers"])

    @classmethod
    def check_config(cls, cfg: dict[str, Any]) -> None:
        cfg = cls.normalize_config(cfg)
        q = cfg.get("quantization_config")
        if q:
            method = q.get("quant_method", "?") if isinstance(q, dict) else q
            raise ConfigError(f"quantized checkpoints (quantization_config.quant_method={method!r}) are not "
                              "supported; use a bf16 checkpoint")
        types = layer_types(cfg)
        if len(types) != int(cfg["num_hidden_layers"]) or set(types) - {SLIDING, FULL}:
            raise ConfigError(f"layer_types must list {cfg['num_hidden_layers']} entries of {SLIDING} / {FULL}, "
                              f"got {types}")
        if SLIDING in types and (not isinstance(cfg["sliding_window"], int) or cfg["sliding_window"] < 1):
            raise ConfigError(f"sliding_window must be a positive integer, got {cfg['sliding_window']!r}")
        e, k = int(cfg["num_local_experts"]), int(cfg["num_experts_per_tok"])
        if not 1 <= k <= e:
            raise ConfigError(f"num_experts_per_tok={k} must be between 1 and num_local_experts={e}")
        rope(cfg)

    def __init__(self, cfg: dict[str, Any], stage: StageInfo, max_positions: int):
        cfg = self.normalize_config(cfg)
        super().__init__(cfg, stage)
        self.hidden_size = H = cfg["hidden_size"]
        self.model = nn.Module()
        if stage.is_first:
            self.model.embed_tokens = VocabEmbedding(cfg["vocab_size"], H)
        self.model.layers = nn.ModuleList(
            GptOssDecoderLayer(cfg, i, max_positions) if stage.owns_layer(i) else MissingLayer()
            for i in range(cfg["num_hidden_layers"]))
        if stage.is_last:
            self.model.norm = RMSNorm(H, cfg["rms_norm_eps"], weight_in_float32=True)
            self.lm_head = LMHead(cfg["vocab_size"], H)
        self.num_kv_heads = cfg["num_key_value_heads"]
        self.head_dim = cfg["head_dim"]

    def stage_owns(self, name: str) -> bool:
        i = layer_index(name)
        if i is not None:
            return self.stage.owns_layer(i)
        if name.startswith("model.embed_tokens."):
            return self.stage.is_first
        return self.stage.is_last  # model.norm, lm_head

    def forward(self, input_ids, positions, acts, kv_caches, meta):
        if self.stage.is_first:
            h, residual = self.model.embed_tokens(input_ids), None         # [T, H]
        else:
            h, residual = acts[0], acts[1]
        for j, i in enumerate(range(self.stage.layer_start, self.stage.layer_end)):
            h, residual = self.model.layers[i](positions, h, residual, kv_caches[j], meta)
        if not self.stage.is_last:
            return torch.stack([h, residual])                              # [2, T, H]
        h, _ = self.model.norm(h, residual)
        return h

    def compute_logits(self, h: torch.Tensor, upcast: bool = True) -> torch.Tensor:
        return self.lm_head(h, upcast)                                     # [N, V]
