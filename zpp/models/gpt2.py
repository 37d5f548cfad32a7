"""GPT-2 (Radford et al. 2019), one pipeline stage of it.

Follows HF transformers' ``modeling_gpt2.py``: learned absolute positions (``wpe``), pre-LayerNorm
blocks, multi-head attention from one fused ``c_attn`` matrix, a tanh-GELU MLP, a final ``ln_f``
and an LM head tied to ``wte``. GPT-2's ``Conv1D`` stores weights as ``[in, out]``; they are loaded
transposed into ``Linear(transposed=True)``.

Only the hidden states travel between stages (``num_acts = 1``): the block adds its residual
itself, as the reference does.
"""
from __future__ import annotations

from typing import Any, Optional

import torch
from torch import nn

from zpp.errors import ConfigError
from zpp.models.base import MissingLayer, StageInfo, StageModel, layer_index
from zpp.models.layers.activation import check_activation, get_activation
from zpp.models.layers.attention import Attention
from zpp.models.layers.linear import Linear, LMHead, PositionEmbedding, VocabEmbedding
from zpp.models.layers.norm import LayerNorm


class GPT2Attention(nn.Module):
    def __init__(self, cfg: dict[str, Any], layer_idx: int):
        super().__init__()
        hidden, self.num_heads = cfg["n_embd"], cfg["n_head"]
        self.head_dim = hidden // self.num_heads
        scale = self.head_dim ** -0.5 if cfg.get("scale_attn_weights", True) else 1.0
        if cfg.get("scale_attn_by_inverse_layer_idx", False):
            scale /= float(layer_idx + 1)
        self.c_attn = Linear(hidden, 3 * hidden, bias=True, transposed=True)
        self.c_proj = Linear(hidden, hidden, bias=True, transposed=True)
        self.attn = Attention(self.num_heads, self.head_dim, self.num_heads, scale=scale)

    def forward(self, x: torch.Tensor, kv_cache: Optional[torch.Tensor], meta) -> torch.Tensor:
        q, k, v = self.c_attn(x).chunk(3, dim=-1)                        # [T, hidden] each
        return self.c_proj(self.attn(q, k, v, kv_cache, meta))


class GPT2MLP(nn.Module):
    def __init__(self, cfg: dict[str, Any]):
        super().__init__()
        hidden = cfg["n_embd"]
        inner = cfg.get("n_inner") or 4 * hidden
        self.c_fc = Linear(hidden, inner, bias=True, transposed=True)
        self.c_proj = Linear(inner, hidden, bias=True, transposed=True)
        self.act = get_activation(cfg.get("activation_function", "gelu_new"))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.c_proj(self.act(self.c_fc(x)))


class GPT2Block(nn.Module):
    def __init__(self, cfg: dict[str, Any], layer_idx: int):
        super().__init__()
        eps = cfg.get("layer_norm_epsilon", 1e-5)
        self.ln_1 = LayerNorm(cfg["n_embd"], eps=eps)
        self.attn = GPT2Attention(cfg, layer_idx)
        self.ln_2 = LayerNorm(cfg["n_embd"], eps=eps)
        self.mlp = GPT2MLP(cfg)

    def forward(self, x, kv_cache, meta):
        x = x + self.attn(self.ln_1(x), kv_cache, meta)
        return x + self.mlp(self.ln_2(x))


class GPT2LMHeadModel(StageModel):
    """One stage of GPT-2.

    forward(input_ids [T] int64 | None, positions [T] int64, acts [1, T, H] | None, kv_caches, meta)
    returns ``[1, T, H]`` on non-last stages and the ``ln_f``-normed hidden ``[T, H]`` on the last.
    """

    num_acts = 1
    tied_names = ("transformer.wte.weight",)
    tie_word_embeddings_default = True

    @classmethod
    def check_config(cls, cfg: dict[str, Any]) -> None:
        check_activation(cfg, "activation_function", "gelu_new")
        if cfg.get("add_cross_attention"):
            raise ConfigError("add_cross_attention=true (GPT-2 as a decoder of an encoder) is not supported")
        if cfg["n_embd"] % cfg["n_head"]:
            raise ConfigError(f"n_embd {cfg['n_embd']} is not divisible by n_head {cfg['n_head']}")

    @staticmethod
    def num_layers_of(cfg: dict[str, Any]) -> int:
        return int(cfg["n_layer"])

    def __init__(self, cfg: dict[str, Any], stage: StageInfo, max_positions: int):
        super().__init__(cfg, stage)
        self.hidden_size = cfg["n_embd"]
        self.num_kv_heads = cfg["n_head"]
        self.head_dim = self.hidden_size // cfg["n_head"]
        self.transformer = nn.Module()
        if stage.is_first:
            self.transformer.wte = VocabEmbedding(cfg["vocab_size"], self.hidden_size)
            self.transformer.wpe = PositionEmbedding(cfg.get("n_positions", 1024), self.hidden_size)
        self.transformer.h = nn.ModuleList(
            GPT2Block(cfg, i) if stage.owns_layer(i) else MissingLayer() for i in range(cfg["n_layer"]))
        if stage.is_last:
            self.transformer.ln_f = LayerNorm(self.hidden_size, eps=cfg.get("layer_norm_epsilon", 1e-5))
            self.lm_head = LMHead(cfg["vocab_size"], self.hidden_size)

    def map_weight_name(self, name: str) -> Optional[list[tuple[str, Optional[int]]]]:
        """Also accepts the original OpenAI names (no ``transformer.`` prefix) and skips the causal
        mask buffers (``attn.bias`` / ``attn.masked_bias``) that older checkpoints store."""
        if not name.startswith(("transformer.", "lm_head.")):
            name = "transformer." + name
        if name.endswith((".attn.bias", ".attn.masked_bias")):
            return None
        return super().map_weight_name(name)

    def stage_owns(self, name: str) -> bool:
        i = layer_index(name)
        if i is not None:
            return self.stage.owns_layer(i)
        if name.startswith(("transformer.wte.", "transformer.wpe.")):
            return self.stage.is_first
        return self.stage.is_last  # ln_f, lm_head

    def forward(self, input_ids, positions, acts, kv_caches, meta):
        if self.stage.is_first:
            h = self.transformer.wte(input_ids) + self.transformer.wpe(positions)    # [T, H]
        else:
            h = acts[0]
        for j, i in enumerate(range(self.stage.layer_start, self.stage.layer_end)):
            h = self.transformer.h[i](h, kv_caches[j], meta)
        if not self.stage.is_last:
            return h.unsqueeze(0)                                                  # [1, T, H]
        return self.transformer.ln_f(h)

    def compute_logits(self, h: torch.Tensor, upcast: bool = True) -> torch.Tensor:
        return self.lm_head(h, upcast)                                                     # [N, V] float32
