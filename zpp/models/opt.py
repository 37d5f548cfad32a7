"""OPT (Zhang et al. 2022, "OPT: Open Pre-trained Transformer Language Models"), one pipeline stage.

Follows HF transformers' ``modeling_opt.py``: learned positions read 2 rows into their table
(``OPTLearnedPositionalEmbedding``), LayerNorm before (``do_layer_norm_before=True``, most sizes)
or after (``False``, OPT-350m) each sub-block, ReLU MLP (``fc1``/``fc2``), queries scaled before
attention, ``project_in`` / ``project_out`` when ``word_embed_proj_dim != hidden_size`` and an LM
head tied to ``embed_tokens``.

Only the hidden states travel between stages (``num_acts = 1``): each layer adds its residual
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
from zpp.models.layers.linear import Linear, LMHead, MergedLinear, PositionEmbedding, VocabEmbedding
from zpp.models.layers.norm import LayerNorm

_POSITION_OFFSET = 2


class OPTAttention(nn.Module):
    def __init__(self, cfg: dict[str, Any]):
        super().__init__()
        hidden, self.num_heads = cfg["hidden_size"], cfg["num_attention_heads"]
        self.head_dim = hidden // self.num_heads
        self.scaling = self.head_dim ** -0.5
        bias = cfg.get("enable_bias", True)
        self.qkv_proj = MergedLinear(hidden, [hidden, hidden, hidden], bias=bias)
        self.out_proj = Linear(hidden, hidden, bias=bias)
        self.attn = Attention(self.num_heads, self.head_dim, self.num_heads, scale=1.0)

    def forward(self, x: torch.Tensor, kv_cache: Optional[torch.Tensor], meta) -> torch.Tensor:
        q, k, v = self.qkv_proj(x).chunk(3, dim=-1)                      # [T, hidden] each
        return self.out_proj(self.attn(q * self.scaling, k, v, kv_cache, meta))


class OPTDecoderLayer(nn.Module):
    def __init__(self, cfg: dict[str, Any]):
        super().__init__()
        hidden, bias = cfg["hidden_size"], cfg.get("enable_bias", True)
        affine = cfg.get("layer_norm_elementwise_affine", True)
        self.do_layer_norm_before = cfg.get("do_layer_norm_before", True)
        self.self_attn = OPTAttention(cfg)
        self.self_attn_layer_norm = LayerNorm(hidden, elementwise_affine=affine)
        self.fc1 = Linear(hidden, cfg["ffn_dim"], bias=bias)
        self.fc2 = Linear(cfg["ffn_dim"], hidden, bias=bias)
        self.act = get_activation(cfg.get("activation_function", "relu"))
        self.final_layer_norm = LayerNorm(hidden, elementwise_affine=affine)

    def forward(self, x, kv_cache, meta):
        residual = x
        if self.do_layer_norm_before:
            x = self.self_attn_layer_norm(x)
        x = residual + self.self_attn(x, kv_cache, meta)
        if not self.do_layer_norm_before:
            x = self.self_attn_layer_norm(x)
        residual = x
        if self.do_layer_norm_before:
            x = self.final_layer_norm(x)
        x = residual + self.fc2(self.act(self.fc1(x)))
        if not self.do_layer_norm_before:
            x = self.final_layer_norm(x)
        return x


class OPTForCausalLM(StageModel):
    """One stage of OPT.

    forward(input_ids [T] int64 | None, positions [T] int64, acts [1, T, H] | None, kv_caches, meta)
    returns ``[1, T, H]`` on non-last stages and, on the last, the hidden states after the final
    norm (if any) and ``project_out`` (if any): ``[T, word_embed_proj_dim]``.
    """

    num_acts = 1
    packed_modules = {"q_proj": ("qkv_proj", 0), "k_proj": ("qkv_proj", 1), "v_proj": ("qkv_proj", 2)}
    tied_names = ("model.decoder.embed_tokens.weight",)
    tie_word_embeddings_default = True
    _FIRST = ("model.decoder.embed_tokens.", "model.decoder.embed_positions.", "model.decoder.project_in.")

    @classmethod
    def check_config(cls, cfg: dict[str, Any]) -> None:
        check_activation(cfg, "activation_function", "relu")
        if cfg["hidden_size"] % cfg["num_attention_heads"]:
            raise ConfigError(f"hidden_size {cfg['hidden_size']} is not divisible by "
                              f"num_attention_heads {cfg['num_attention_heads']}")

    def __init__(self, cfg: dict[str, Any], stage: StageInfo, max_positions: int):
        super().__init__(cfg, stage)
        self.hidden_size = cfg["hidden_size"]
        self.num_kv_heads = cfg["num_attention_heads"]
        self.head_dim = self.hidden_size // self.num_kv_heads
        proj_dim = cfg.get("word_embed_proj_dim") or self.hidden_size
        projected = proj_dim != self.hidden_size
        affine = cfg.get("layer_norm_elementwise_affine", True)
        d = nn.Module()
        if stage.is_first:
            d.embed_tokens = VocabEmbedding(cfg["vocab_size"], proj_dim)
            d.embed_positions = PositionEmbedding(cfg.get("max_position_embeddings", 2048) + _POSITION_OFFSET,
                                                  self.hidden_size, offset=_POSITION_OFFSET)
            if projected:
                d.project_in = Linear(proj_dim, self.hidden_size)
        d.layers = nn.ModuleList(
            OPTDecoderLayer(cfg) if stage.owns_layer(i) else MissingLayer() for i in range(cfg["num_hidden_layers"]))
        if stage.is_last:
            if cfg.get("do_layer_norm_before", True) and not cfg.get("_remove_final_layer_norm", False):
                d.final_layer_norm = LayerNorm(self.hidden_size, elementwise_affine=affine)
            if projected:
                d.project_out = Linear(self.hidden_size, proj_dim)
            self.lm_head = LMHead(cfg["vocab_size"], proj_dim)
        self.model = nn.Module()
        self.model.decoder = d

    def map_weight_name(self, name: str) -> Optional[list[tuple[str, Optional[int]]]]:
        """Also accepts metaseq-converted names without the ``model.`` prefix (``decoder.*``)."""
        if name.startswith("decoder."):
            name = "model." + name
        return super().map_weight_name(name)

    def stage_owns(self, name: str) -> bool:
        i = layer_index(name)
        if i is not None:
            return self.stage.owns_layer(i)
        if name.startswith(self._FIRST):
            return self.stage.is_first
        return self.stage.is_last  # final_layer_norm, project_out, lm_head

    def forward(self, input_ids, positions, acts, kv_caches, meta):
        d = self.model.decoder
        if self.stage.is_first:
            h = d.embed_tokens(input_ids)                                      # [T, proj_dim]
            if hasattr(d, "project_in"):
                h = d.project_in(h)                                            # [T, H]
            h = h + d.embed_positions(positions)
        else:
            h = acts[0]
        for j, i in enumerate(range(self.stage.layer_start, self.stage.layer_end)):
            h = d.layers[i](h, kv_caches[j], meta)
        if not self.stage.is_last:
            return h.unsqueeze(0)                                              # [1, T, H]
        if hasattr(d, "final_layer_norm"):
            h = d.final_layer_norm(h)
        if hasattr(d, "project_out"):
            h = d.project_out(h)                                               # [T, proj_dim]
        return h

    def compute_logits(self, h: torch.Tensor, upcast: bool = True) -> torch.Tensor:
        return self.lm_head(h, upcast)                                                 # [N, V] float32
