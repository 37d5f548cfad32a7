"""Gemma 3 text models (``Gemma3ForCausalLM``, and the language model of
``Gemma3ForConditionalGeneration`` checkpoints), one pipeline stage of it.

Follows HF transformers' ``modeling_gemma3.py`` (5.24):

* embeddings scaled by ``sqrt(hidden_size)``, the factor rounded to the model's dtype first (HF's
  ``Gemma3TextScaledWordEmbedding``: 55.4256 becomes 55.5 in bfloat16);
* each layer: ``h = x + post_attention_norm(attn(input_norm(x)))``, then
  ``h + post_feedforward_norm(mlp(pre_feedforward_norm(h)))``; every norm is Gemma's
  ``(1 + weight)`` RMSNorm in float32 (:class:`~zpp.models.layers.norm.GemmaRMSNorm`);
* attention: RMSNorm over each query and key head (QK norm) before RoPE; scores scaled by
  ``query_pre_attn_scalar ** -0.5``; ``layer_types[i]`` says which layers are
  ``sliding_attention`` (window ``sliding_window``, RoPE base ``rope_local_base_freq`` /
  ``rope_parameters["sliding_attention"]``) and which ``full_attention`` (the global RoPE, with its
  scaling, e.g. linear x8 on the 4B+ models); older configs give ``sliding_window_pattern`` (every
  n-th layer global) instead of ``layer_types``;
* GELU-tanh gated MLP; final RMSNorm; LM head tied to the embeddings by default; logits
  soft-capped by ``final_logit_softcapping`` when set.

Refused in one line: ``attn_logit_softcapping`` (Gemma 2's, null in Gemma 3 checkpoints),
``use_bidirectional_attention`` (EmbeddingGemma).

Between stages only the hidden states travel (``num_acts = 1``): a Gemma layer adds its own
residual after the post-norms.

``Gemma3ForConditionalGeneration`` checkpoints (multimodal): :meth:`Gemma3ForCausalLM.normalize_config`
flattens ``text_config`` into the top level, and the language model's tensors
(``language_model.model.*`` as HF writes them, or ``model.language_model.*``) load into the same
parameters; the vision tower and projector are never read, so only text prompts are served.
"""
from __future__ import annotations

import math
from typing import Any, Optional

import torch
from torch import nn

from zpp.errors import ConfigError
from zpp.models.base import StageInfo, StageModel
from zpp.models.layers.activation import GatedMLP, check_activation
from zpp.models.layers.attention import Attention, AttentionMetadata
from zpp.models.layers.linear import MergedLinear, RowParallelLinear
from zpp.models.layers.norm import GemmaRMSNorm
from zpp.models.layers.rotary import check_rope_scaling, get_rope

SLIDING, FULL = "sliding_attention", "full_attention"

# HF Gemma3TextConfig's defaults: hub configs (those of multimodal checkpoints above all) omit keys.
TEXT_DEFAULTS: dict[str, Any] = {
    "vocab_size": 262_208, "hidden_size": 2304, "intermediate_size": 9216, "num_hidden_layers": 26,
    "num_attention_heads": 8, "num_key_value_heads": 4, "head_dim": 256, "hidden_activation": "gelu_pytorch_tanh",
    "max_position_embeddings": 131_072, "rms_norm_eps": 1e-6, "tie_word_embeddings": True,
    "attention_bias": False, "query_pre_attn_scalar": 256, "sliding_window": 4096,
    "final_logit_softcapping": None, "attn_logit_softcapping": None, "use_bidirectional_attention": False,
    "pad_token_id": 0, "eos_token_id": 1, "bos_token_id": 2,
}
_GLOBAL_THETA, _LOCAL_THETA = 1_000_000.0, 10_000.0

# Multimodal checkpoint prefixes of the language model -> this model's names; prefixes never read.
_TEXT_PREFIXES = (("language_model.model.", "model."), ("model.language_model.", "model."),
                  ("language_model.lm_head.", "lm_head."))
_VISION_PREFIXES = ("vision_tower.", "multi_modal_projector.", "model.vision_tower.",
                    "model.multi_modal_projector.")


def layer_types(cfg: dict[str, Any]) -> list[str]:
    """Each layer's attention type: ``layer_types`` when given, else HF's rule for
    ``sliding_window_pattern`` n (default 6): layer i is global iff ``(i + 1) % n == 0``."""
    n = int(cfg["num_hidden_layers"])
    types = cfg.get("layer_types")
    if types is None:
        pattern = int(cfg.get("sliding_window_pattern", cfg.get("_sliding_window_pattern", 6)))
        types = [SLIDING if (i + 1) % pattern else FULL for i in range(n)]
    return list(types)


def rope_by_layer_type(cfg: dict[str, Any]) -> dict[str, tuple[float, dict[str, Any]]]:
    """``{"full_attention" | "sliding_attention": (theta, scaling)}`` as HF Gemma3TextConfig's
    ``convert_rope_params_to_dict``: nested ``rope_parameters``, else the old keys (``rope_theta``,
    ``rope_scaling`` -- global layers only --, ``rope_local_base_freq``)."""
    params = cfg.get("rope_parameters") or {}
    full = dict(params.get(FULL) or {"rope_type": "default"})
    if cfg.get("rope_scaling"):
        full.update(cfg["rope_scaling"])
    full.setdefault("rope_theta", cfg.get("rope_theta", _GLOBAL_THETA))
    local = dict(params.get(SLIDING) or {"rope_type": "default"})
    local.setdefault("rope_theta", cfg.get("rope_local_base_freq", _LOCAL_THETA))
    out = {}
    for kind, p in ((FULL, full), (SLIDING, local)):
        out[kind] = (float(p["rope_theta"]), check_rope_scaling(p, cfg.get("max_position_embeddings")))
    return out


class Gemma3Attention(nn.Module):
    """QK-normed grouped-query attention: ``forward(positions [T], x [T, hidden])`` -> ``[T, hidden]``.
    With ``tp_size > 1`` this rank holds ``H / tp`` query heads and ``Hk / tp`` KV heads (the LLaMA
    split; the QK norms act per head and are replicated)."""

    def __init__(self, cfg: dict[str, Any], layer: int, max_positions: int, tp_rank: int = 0, tp_size: int = 1):
        super().__init__()
        hidden = cfg["hidden_size"]
        heads, kv_heads = cfg["num_attention_heads"], cfg["num_key_value_heads"]
        self.head_dim = D = cfg["head_dim"]
        self.num_heads, self.num_kv_heads = heads // tp_size, kv_heads // tp_size
        self.q_size, self.kv_size = self.num_heads * D, self.num_kv_heads * D
        bias = bool(cfg["attention_bias"])
        self.qkv_proj = MergedLinear(hidden, [heads * D, kv_heads * D, kv_heads * D], bias=bias,
                                     tp_rank=tp_rank, tp_size=tp_size)
        self.o_proj = RowParallelLinear(heads * D, hidden, bias=bias, tp_rank=tp_rank, tp_size=tp_size)
        self.q_norm = GemmaRMSNorm(D, cfg["rms_norm_eps"])
        self.k_norm = GemmaRMSNorm(D, cfg["rms_norm_eps"])
        kind = layer_types(cfg)[layer]
        theta, scaling = rope_by_layer_type(cfg)[kind]
        self.rotary = get_rope(D, max_positions, theta, scaling)
        window = int(cfg["sliding_window"]) if kind == SLIDING else None
        self.attn = Attention(self.num_heads, D, self.num_kv_heads, scale=float(cfg["query_pre_attn_scalar"]) ** -0.5,
                              sliding_window=window)

    def forward(self, positions: torch.Tensor, x: torch.Tensor, kv_cache: Optional[torch.Tensor],
                meta: AttentionMetadata) -> torch.Tensor:
        T, D = x.shape[0], self.head_dim
        q, k, v = self.qkv_proj(x).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = self.q_norm(q.reshape(T, self.num_heads, D))                  # [T, H, D]
        k = self.k_norm(k.reshape(T, self.num_kv_heads, D))               # [T, Hk, D]
        out = self.attn(q, k, v, kv_cache, meta, positions=positions, rotary=self.rotary)
        return self.o_proj(out)                                            # [T, hidden]


class Gemma3DecoderLayer(nn.Module):
    """``forward(positions, x [T, hidden], kv_cache, meta)`` -> ``[T, hidden]`` (residual included)."""

    def __init__(self, cfg: dict[str, Any], layer: int, max_positions: int, tp_rank: int = 0, tp_size: int = 1):
        super().__init__()
        hidden, eps = cfg["hidden_size"], cfg["rms_norm_eps"]
        self.self_attn = Gemma3Attention(cfg, layer, max_positions, tp_rank, tp_size)
        self.mlp = GatedMLP(hidden, cfg["intermediate_size"], cfg["hidden_activation"], tp_rank=tp_rank,
                            tp_size=tp_size)
        self.input_layernorm = GemmaRMSNorm(hidden, eps)
        self.post_attention_layernorm = GemmaRMSNorm(hidden, eps)
        self.pre_feedforward_layernorm = GemmaRMSNorm(hidden, eps)
        self.post_feedforward_layernorm = GemmaRMSNorm(hidden, eps)

    def forward(self, positions, x, kv_cache, meta):
        h = self.self_attn(positions, self.input_layernorm(x), kv_cache, meta)
        h, x = self.pre_feedforward_layernorm(self.post_attention_layernorm(h), x)  # x += post-norm(attn)
        h = self.mlp(h)
        return x + self.post_feedforward_layernorm(h)


class Gemma3ForCausalLM(StageModel):
    """One stage of a Gemma 3 text model.

    forward(input_ids [T] int64 | None, positions [T] int64, acts [1, T, H] | None, kv_caches, meta)
    returns ``[1, T, H]`` on non-last stages and the final normed hidden ``[T, H]`` on the last.
    """

    num_acts = 1
    supports_tensor_parallel = True
    packed_modules = {"q_proj": ("qkv_proj", 0), "k_proj": ("qkv_proj", 1), "v_proj": ("qkv_proj", 2),
                      "gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1)}
    tied_names = ("model.embed_tokens.weight",)
    tie_word_embeddings_default = True

    @classmethod
    def normalize_config(cls, cfg: dict[str, Any]) -> dict[str, Any]:
        """HF's defaults filled in; a multimodal config's ``text_config`` flattened into the top
        level (its keys win; ``architectures`` stays)."""
        if isinstance(cfg.get("text_config"), dict):
            top = {k: v for k, v in cfg.items() if k not in ("text_config", "vision_config")}
            cfg = {**top, **cfg["text_config"], "architectures": cfg.get("architectures")}
        out = {**TEXT_DEFAULTS, **cfg}
        if out.get("head_dim") is None:
            out["head_dim"] = out["hidden_size"] // out["num_attention_heads"]
        return out

    @classmethod
    def num_layers_of(cls, cfg: dict[str, Any]) -> int:
        return int(cls.normalize_config(cfg)["num_hidden_layers"])

    @classmethod
    def check_config(cls, cfg: dict[str, Any]) -> None:
        cfg = cls.normalize_config(cfg)
        if cfg.get("attn_logit_softcapping") is not None:
            raise ConfigError(f"attn_logit_softcapping={cfg['attn_logit_softcapping']} is not supported")
        if cfg.get("use_bidirectional_attention"):
            raise ConfigError("use_bidirectional_attention=true is not supported")
        check_activation(cfg, "hidden_activation", "gelu_pytorch_tanh")
        types = layer_types(cfg)
        if len(types) != int(cfg["num_hidden_layers"]) or set(types) - {SLIDING, FULL}:
            raise ConfigError(f"layer_types must list {cfg['num_hidden_layers']} entries of {SLIDING} / {FULL}, "
                              f"got {types}")
        if SLIDING in types and (not isinstance(cfg["sliding_window"], int) or cfg["sliding_window"] < 1):
            raise ConfigError(f"sliding_window must be a positive integer, got {cfg['sliding_window']!r}")
        rope_by_layer_type(cfg)

    @classmethod
    def check_tensor_parallel(cls, cfg: dict[str, Any], tp_size: int) -> None:
        cfg = cls.normalize_config(cfg)
        cls.check_divisible({k: cfg[k] for k in ("num_attention_heads", "num_key_value_heads", "intermediate_size")},
                            tp_size)

    def __init__(self, cfg: dict[str, Any], stage: StageInfo, max_positions: int):
        cfg = self.normalize_config(cfg)
        super().__init__(cfg, stage)
        H = cfg["hidden_size"]
        self.build_decoder(cfg["vocab_size"], H, cfg["num_hidden_layers"],
                           lambda i: Gemma3DecoderLayer(cfg, i, max_positions, stage.tp_rank, stage.tp_size),
                           lambda: GemmaRMSNorm(H, cfg["rms_norm_eps"]))
        self.num_kv_heads = cfg["num_key_value_heads"] // stage.tp_size
        self.head_dim = cfg["head_dim"]
        self.softcap = cfg.get("final_logit_softcapping")
        # sqrt(hidden) rounded to the model dtype, as HF does; a buffer on the stage's device (made at
        # construction under the loader's default device and dtype): no host-to-device copy per step,
        # which a CUDA-graph capture refuses.
        self.register_buffer("embed_scale", torch.tensor(math.sqrt(H)), persistent=False)

    def map_weight_name(self, name: str) -> Optional[list[tuple[str, Optional[int]]]]:
        """Also the language-model tensors of a ``Gemma3ForConditionalGeneration`` checkpoint;
        its vision tower and projector are skipped (never read)."""
        if name.startswith(_VISION_PREFIXES):
            return None
        for prefix, ours in _TEXT_PREFIXES:
            if name.startswith(prefix):
                name = ours + name[len(prefix):]
                break
        return super().map_weight_name(name)

    def forward(self, input_ids, positions, acts, kv_caches, meta):
        if self.stage.is_first:
            h = self.model.embed_tokens(input_ids)                         # [T, H]
            h = h * self.embed_scale.to(h.dtype)                           # the factor in the model dtype
        else:
            h = acts[0]
        for j, i in enumerate(range(self.stage.layer_start, self.stage.layer_end)):
            h = self.model.layers[i](positions, h, kv_caches[j], meta)
        if not self.stage.is_last:
            return h.unsqueeze(0)                                          # [1, T, H]
        return self.model.norm(h)

    def compute_logits(self, h: torch.Tensor, upcast: bool = True) -> torch.Tensor:
        """``[N, V]``: soft-capped (``cap * tanh(logits / cap)``) in the model's dtype as HF does,
        then float32 unless ``upcast=False``."""
        logits = self.lm_head(h, upcast=False)
        if self.softcap is not None:
            logits = torch.tanh(logits / self.softcap) * self.softcap
        return logits.float() if upcast else logits
