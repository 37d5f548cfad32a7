"""Qwen3-MoE (Qwen3-30B-A3B, Qwen3-235B-A22B), one pipeline stage of it.

Follows HF transformers' ``modeling_qwen3_moe.py``: Qwen3's attention (per-head QK RMSNorm before
RoPE, :class:`zpp.models.qwen3.Qwen3Attention`) and, per layer, either

* a sparse MoE block (HF ``Qwen3MoeSparseMoeBlock``): router softmax over ``num_experts`` in
  float32, top ``num_experts_per_tok``, renormalised only if ``norm_topk_prob``; experts of
  ``moe_intermediate_size`` (:class:`zpp.models.layers.moe.SparseMoeBlock`), or
* a dense gated MLP of ``intermediate_size`` (HF ``Qwen3MoeMLP``): layer ``i`` is dense when
  ``i in mlp_only_layers``, or ``num_experts == 0``, or ``(i + 1) % decoder_sparse_step != 0``.

Checkpoint names: what HF 5.24's ``save_pretrained`` writes (and the released checkpoints hold),
per expert ``mlp.experts.{e}.gate_proj / up_proj / down_proj.weight`` and the router
``mlp.gate.weight``; HF's in-memory fused ``mlp.experts.gate_up_proj`` ``[E, 2I, H]`` and
``mlp.experts.down_proj`` ``[E, H, I]`` load into the same parameters.

Tensor parallelism: attention as LLaMA's, dense MLPs Megatron-style, every expert's
intermediate dim split over the ranks; ``intermediate_size`` (if a layer is dense) and
``moe_intermediate_size`` must divide. ``--pp-layer-partition auto`` times a dense and a sparse
layer apart (:meth:`Qwen3MoeForCausalLM.layer_kinds`).
"""
from __future__ import annotations

import re
from typing import Any, Optional

from torch import nn

from zpp.errors import ConfigError
from zpp.models.layers.moe import SparseMoeBlock
from zpp.models.llama import LlamaDecoderLayer
from zpp.models.qwen3 import Qwen3ForCausalLM

_EXPERT_RE = re.compile(r"\.mlp\.experts\.(\d+)\.(gate_proj|up_proj|down_proj)\.(weight|weight_scale|qweight|scales|zeros)$")
_SUFFIX = {"weight": "", "weight_scale": "_scale",  # an FP8 expert's canonical scale -> experts.*_proj_scale
           "qweight": "_qweight", "scales": "_scales", "zeros": "_zeros"}  # a 4-bit one's (w4_base.py)


def num_experts(cfg: dict[str, Any]) -> int:
    """Experts per sparse layer: ``num_experts`` (the released configs), or ``num_local_experts``
    (HF 5.x's ``save_pretrained`` writes the attribute-mapped name); HF's default 128."""
    for key in ("num_experts", "num_local_experts"):
        if cfg.get(key) is not None:
            return int(cfg[key])
    return 128


def is_sparse_layer(cfg: dict[str, Any], i: int) -> bool:
    """HF ``Qwen3MoeDecoderLayer``'s choice of a sparse MoE block for layer ``i``."""
    return (i not in (cfg.get("mlp_only_layers") or []) and num_experts(cfg) > 0
            and (i + 1) % int(cfg.get("decoder_sparse_step", 1)) == 0)


class Qwen3MoeForCausalLM(Qwen3ForCausalLM):
    """One stage of a Qwen3-MoE causal LM; same inputs / outputs as
    :class:`zpp.models.llama.LlamaForCausalLM`."""

    supports_tensor_parallel = True
    supports_cuda_graphs = True  # the CUDA experts never read device values on the host
    head_dim_default = None  # Qwen3MoeConfig has no head_dim field: hidden_size // heads unless given

    @classmethod
    def check_config(cls, cfg: dict[str, Any]) -> None:
        super().check_config(cfg)
        e, k = num_experts(cfg), int(cfg.get("num_experts_per_tok", 8))
        step = int(cfg.get("decoder_sparse_step", 1))
        if step < 1:
            raise ConfigError(f"decoder_sparse_step={step} must be >= 1")
        if any(is_sparse_layer(cfg, i) for i in range(cls.num_layers_of(cfg))) and not 1 <= k <= e:
            raise ConfigError(f"num_experts_per_tok={k} must be between 1 and num_experts={e}")

    @classmethod
    def check_tensor_parallel(cls, cfg: dict[str, Any], tp_size: int) -> None:
        heads = cfg["num_attention_heads"]
        sizes = {"num_attention_heads": heads, "num_key_value_heads": cfg.get("num_key_value_heads") or heads}
        kinds = set(cls.layer_kinds(cfg))
        if "dense" in kinds:
            sizes["intermediate_size"] = cfg["intermediate_size"]
        if "moe" in kinds:
            sizes["moe_intermediate_size"] = cfg.get("moe_intermediate_size", 768)
        for key, n in sizes.items():
            if n % tp_size:
                raise ConfigError(f"--tensor-parallel-size {tp_size} does not divide the model's {key} ({n})")

    @classmethod
    def layer_kinds(cls, cfg: dict[str, Any]) -> list[str]:
        """``"moe"`` for a sparse layer, ``"dense"`` for a layer with the dense MLP."""
        return ["moe" if is_sparse_layer(cfg, i) else "dense" for i in range(cls.num_layers_of(cfg))]

    def make_layer(self, cfg: dict[str, Any], max_positions: int, layer_idx: int) -> nn.Module:
        tp_rank, tp_size = self.stage.tp_rank, self.stage.tp_size
        mlp = None  # the dense gated MLP of intermediate_size
        if is_sparse_layer(cfg, layer_idx):
            mlp = SparseMoeBlock(cfg["hidden_size"], cfg.get("moe_intermediate_size", 768), num_experts(cfg),
                                 int(cfg.get("num_experts_per_tok", 8)), act=cfg.get("hidden_act", "silu"),
                                 renormalize=bool(cfg.get("norm_topk_prob", False)), tp_rank=tp_rank, tp_size=tp_size)
        return LlamaDecoderLayer(cfg, max_positions, False, mlp=mlp, tp_rank=tp_rank, tp_size=tp_size,
                                 attn=self.make_attention(cfg, max_positions))

    def map_weight_name(self, name: str) -> Optional[list[tuple[str, Optional[int]]]]:
        """Per-expert ``gate_proj`` / ``up_proj`` -> shard ``2e`` / ``2e + 1`` of
        ``mlp.experts.gate_up_proj``, ``down_proj`` -> shard ``e`` of ``mlp.experts.down_proj``."""
        match = _EXPERT_RE.search(name)
        if match is None:
            return super().map_weight_name(name)
        if not self.stage_owns(name):
            return None
        prefix, e, w = name[:match.start()], int(match.group(1)), match.group(2)
        if w == "down_proj":
            return [(f"{prefix}.mlp.experts.down_proj{_SUFFIX[match.group(3)]}", e)]
        return [(f"{prefix}.mlp.experts.gate_up_proj{_SUFFIX[match.group(3)]}", 2 * e + (0 if w == "gate_proj" else 1))]
