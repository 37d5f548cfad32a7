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
``[E, H]``), ``mlp.router.weight`` / ``.bias``. The openai/gpt-oss-* originals (MXFP4 experts,
``*_blocks`` / ``*_scales``) load through :mod:`zpp.models.quantization.mxfp4`: dequantized on the
CPU to exactly these tensors.

The MoE block is the shared one (:mod:`zpp.models.layers.moe`): :class:`TopKRouter` (``topk_softmax``
scoring, biased) and :class:`FusedExperts` (biases, :class:`ClampedSwiGLU`, the gpt-oss checkpoint
layout de-interleaved at load); on CUDA its grouped Triton GEMMs never read device values on the
host, so decode runs in CUDA graphs.

Tensor parallelism (Megatron-LM): query and KV heads split over the ranks as in the LLaMA family,
each rank holding the sinks of its own query heads; every expert's intermediate dim split
(:class:`FusedExperts`); ``num_attention_heads``, ``num_key_value_heads`` and ``intermediate_size``
must divide. The router, norms, embedding and LM head are replicated.
"""
from __future__ import annotations

from typing import Any, Optional

import torch
from torch import nn

from zpp.errors import ConfigError
from zpp.models.base import PreNormDecoder, StageInfo
from zpp.models.layers.attention import Attention, AttentionMetadata
from zpp.models.layers.linear import MergedLinear, RowParallelLinear, default_weight_loader
from zpp.models.layers.moe import ClampedSwiGLU, FusedExperts, TopKRouter
from zpp.models.layers.norm import RMSNorm
from zpp.models.layers.rotary import get_rope, rope_params

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
    the layer's window (sliding layers) and its sinks.

    With ``tp_size > 1`` this rank computes query heads ``[tp_rank * H / tp, (tp_rank + 1) * H / tp)``
    (and the KV heads they read), as :class:`zpp.models.llama.LlamaAttention`; ``sinks`` holds the
    same heads' sink logits ``[H / tp]``, and ``o_proj`` all-reduces the partial outputs (its bias
    added once)."""

    def __init__(self, cfg: dict[str, Any], layer: int, max_positions: int, tp_rank: int = 0, tp_size: int = 1):
        super().__init__()
        hidden = cfg["hidden_size"]
        H, Hk, D = cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_dim"]
        self.num_heads, self.num_kv_heads = H // tp_size, Hk // tp_size    # this rank's heads
        self.q_size, self.kv_size = self.num_heads * D, self.num_kv_heads * D
        self.tp_rank = tp_rank
        bias = bool(cfg["attention_bias"])
        self.qkv_proj = MergedLinear(hidden, [H * D, Hk * D, Hk * D], bias=bias, tp_rank=tp_rank, tp_size=tp_size)
        self.o_proj = RowParallelLinear(H * D, hidden, bias=bias, tp_rank=tp_rank, tp_size=tp_size)
        self.sinks = nn.Parameter(torch.empty(self.num_heads))             # [H / tp]
        self.sinks.weight_loader = self._load_sinks
        theta, scaling = rope(cfg)
        self.rotary = get_rope(D, max_positions, theta, scaling)
        window = int(cfg["sliding_window"]) if layer_types(cfg)[layer] == SLIDING else None
        self.attn = Attention(self.num_heads, D, self.num_kv_heads, scale=D ** -0.5, sliding_window=window)

    def _load_sinks(self, param: nn.Parameter, loaded: torch.Tensor) -> None:
        """The checkpoint's ``[H]`` sinks -> this rank's heads. Raises ValueError on a shape mismatch."""
        n = self.num_heads
        if loaded.dim() != 1 or loaded.shape[0] % n or loaded.shape[0] // n <= self.tp_rank:
            raise ValueError(f"shape mismatch: sinks of {n} local heads (rank {self.tp_rank}) vs checkpoint "
                             f"{tuple(loaded.shape)}")
        default_weight_loader(param, loaded.narrow(0, self.tp_rank * n, n))

    def forward(self, positions: torch.Tensor, x: torch.Tensor, kv_cache: Optional[torch.Tensor],
                meta: AttentionMetadata) -> torch.Tensor:
        q, k, v = self.qkv_proj(x).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        out = self.attn(q, k, v, kv_cache, meta, positions=positions, rotary=self.rotary, sinks=self.sinks)
        return self.o_proj(out)                                            # [T, hidden]


class GptOssMoE(nn.Module):
    """gpt-oss's MoE block (HF ``GptOssMLP``): ``forward(x [T, H])`` -> ``[T, H]`` (summed over the
    TP group).

    ``router``: :class:`~zpp.models.layers.moe.TopKRouter` with a bias, top-k of the logits then a
    softmax over those k (HF ``GptOssTopKRouter``; its weights stay float32 here, where HF keeps
    them in the model dtype). ``experts``: :class:`~zpp.models.layers.moe.FusedExperts` with
    biases, the clamped SwiGLU and the checkpoint's transposed, interleaved gate/up layout
    (``checkpoint_layout="gpt_oss"``); every expert's intermediate dim split over the TP ranks."""

    def __init__(self, cfg: dict[str, Any], tp_rank: int = 0, tp_size: int = 1):
        super().__init__()
        E, k, H = int(cfg["num_local_experts"]), int(cfg["num_experts_per_tok"]), cfg["hidden_size"]
        self.router = TopKRouter(H, E, k, scoring="topk_softmax", bias=True)
        self.experts = FusedExperts(E, H, cfg["intermediate_size"],
                                    act=ClampedSwiGLU(float(cfg["swiglu_alpha"]), float(cfg["swiglu_limit"])),
                                    bias=True, tp_rank=tp_rank, tp_size=tp_size, checkpoint_layout="gpt_oss")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, ids = self.router(x)                                      # [T, k] float32, [T, k] int64
        return self.experts(x, weights, ids)                               # [T, H]


class GptOssDecoderLayer(nn.Module):
    """Pre-norm block ``forward(positions [T], x [T, H], residual [T, H] | None, kv_cache, meta)`` ->
    ``(mlp output [T, H], residual [T, H])``; ``tp_rank`` / ``tp_size``: this rank's slice of
    attention heads and of every expert."""

    def __init__(self, cfg: dict[str, Any], layer: int, max_positions: int, tp_rank: int = 0, tp_size: int = 1):
        super().__init__()
        H, eps = cfg["hidden_size"], cfg["rms_norm_eps"]
        self.self_attn = GptOssAttention(cfg, layer, max_positions, tp_rank, tp_size)
        self.mlp = GptOssMoE(cfg, tp_rank, tp_size)
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


class GptOssForCausalLM(PreNormDecoder):
    """One stage of gpt-oss. forward(input_ids [T] | None, positions [T], acts [2, T, H] | None,
    kv_caches, meta) -> ``[2, T, H]`` (hidden, residual) on non-last stages, the final normed
    hidden ``[T, H]`` on the last; with tensor parallelism the same, whole, on every TP rank."""

    num_acts = 2
    supports_cuda_graphs = True  # the CUDA experts (grouped Triton GEMMs) never read device values on the host
    supports_tensor_parallel = True  # heads (and their sinks) and every expert's intermediate dim split
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

    @classmethod
    def check_tensor_parallel(cls, cfg: dict[str, Any], tp_size: int) -> None:
        cfg = cls.normalize_config(cfg)
        cls.check_divisible({k: cfg[k] for k in ("num_attention_heads", "num_key_value_heads", "intermediate_size")},
                            tp_size)

    def __init__(self, cfg: dict[str, Any], stage: StageInfo, max_positions: int):
        cfg = self.normalize_config(cfg)
        super().__init__(cfg, stage)
        self.build_decoder(cfg["vocab_size"], cfg["hidden_size"], cfg["num_hidden_layers"],
                           lambda i: GptOssDecoderLayer(cfg, i, max_positions, stage.tp_rank, stage.tp_size),
                           lambda: RMSNorm(cfg["hidden_size"], cfg["rms_norm_eps"], weight_in_float32=True))
        self.num_kv_heads = cfg["num_key_value_heads"] // stage.tp_size  # this rank's
        self.head_dim = cfg["head_dim"]

