"""Mixtral (sparse mixture of experts), one pipeline stage of it.

Follows HF transformers' ``modeling_mixtral.py``: the LLaMA block (RMSNorm, RoPE, grouped-query
attention without biases) whose MLP is a sparse MoE block -- a router picks the top-2 of 8 experts
per token and renormalises their weights (:class:`zpp.models.layers.moe.SparseMoeBlock`).

Checkpoint names: HF 5.x's in-memory names (``mlp.gate.weight``, fused ``mlp.experts.gate_up_proj``
``[E, 2I, H]`` and ``mlp.experts.down_proj`` ``[E, H, I]``) and the original per-expert names that
``save_pretrained`` writes (``block_sparse_moe.gate.weight``,
``block_sparse_moe.experts.{e}.w1/w2/w3.weight``) both load into the same parameters.

Tensor parallelism: attention as LLaMA's, every expert's intermediate dim split over the ranks
(:class:`zpp.models.layers.moe.FusedExperts`); ``intermediate_size`` must divide. CUDA graphs:
the CUDA experts are grouped Triton GEMMs with no host synchronisation.
"""
from __future__ import annotations

import re
from typing import Any, Optional

from torch import nn

from zpp.errors import ConfigError
from zpp.models.layers.moe import SparseMoeBlock
from zpp.models.llama import LlamaDecoderLayer, LlamaForCausalLM

_EXPERT_RE = re.compile(r"\.block_sparse_moe\.experts\.(\d+)\.(w[123])\.(weight|weight_scale|qweight|scales|zeros)$")
_SUFFIX = {"weight": "", "weight_scale": "_scale",  # an FP8 expert's canonical scale -> experts.*_proj_scale
           "qweight": "_qweight", "scales": "_scales", "zeros": "_zeros"}  # a 4-bit one's (w4_base.py)


class MixtralForCausalLM(LlamaForCausalLM):
    """One stage of a Mixtral causal LM; same inputs / outputs as :class:`LlamaForCausalLM`
    (``[2, T, H]`` hidden + residual between stages, final normed hidden ``[T, H]`` on the last)."""

    packed_modules = {"q_proj": ("qkv_proj", 0), "k_proj": ("qkv_proj", 1), "v_proj": ("qkv_proj", 2)}
    supports_cuda_graphs = True  # the CUDA experts (grouped Triton GEMMs) never read device values on the host
    supports_tensor_parallel = True  # every expert's intermediate dim split over the ranks (layers.moe)

    @classmethod
    def check_config(cls, cfg: dict[str, Any]) -> None:
        super().check_config(cfg)
        e, k = _num_experts(cfg)
        if not 1 <= k <= e:
            raise ConfigError(f"num_experts_per_tok={k} must be between 1 and num_local_experts={e}")

    def make_layer(self, cfg: dict[str, Any], max_positions: int, layer_idx: int) -> nn.Module:
        tp_rank, tp_size = self.stage.tp_rank, self.stage.tp_size
        moe = SparseMoeBlock(cfg["hidden_size"], cfg["intermediate_size"], *_num_experts(cfg),
                             act=cfg.get("hidden_act", "silu"), tp_rank=tp_rank, tp_size=tp_size)
        return LlamaDecoderLayer(cfg, max_positions, qkv_bias=False, mlp=moe, tp_rank=tp_rank, tp_size=tp_size)

    def map_weight_name(self, name: str) -> Optional[list[tuple[str, Optional[int]]]]:
        """Per-expert ``w1``/``w3`` -> shard ``2e``/``2e+1`` of ``mlp.experts.gate_up_proj``, ``w2`` ->
        shard ``e`` of ``mlp.experts.down_proj``; ``block_sparse_moe.gate`` -> ``mlp.gate``."""
        match = _EXPERT_RE.search(name)
        if match is None:
            return super().map_weight_name(name.replace(".block_sparse_moe.gate.", ".mlp.gate."))
        if not self.stage_owns(name):
            return None
        prefix, e, w = name[:match.start()], int(match.group(1)), match.group(2)
        if w == "w2":
            return [(f"{prefix}.mlp.experts.down_proj{_SUFFIX[match.group(3)]}", e)]
        return [(f"{prefix}.mlp.experts.gate_up_proj{_SUFFIX[match.group(3)]}", 2 * e + (0 if w == "w1" else 1))]


def _num_experts(cfg: dict[str, Any]) -> tuple[int, int]:
    """(experts per layer, experts per token), with HF ``MixtralConfig``'s defaults (8, 2)."""
    return int(cfg.get("num_local_experts", 8)), int(cfg.get("num_experts_per_tok", 2))
