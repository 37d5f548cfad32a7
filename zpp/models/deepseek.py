"""DeepSeek-V2 / V3 (multi-head latent attention + DeepSeekMoE), one pipeline stage of it.

Follows HF transformers 5.x ``modeling_deepseek_v2.py`` / ``modeling_deepseek_v3.py`` for the
numerics (DeepSeek-AI 2024, "DeepSeek-V2: A Strong, Economical, and Efficient Mixture-of-Experts
Language Model", arXiv:2405.04434; "DeepSeek-V3 Technical Report", arXiv:2412.19437):

* **Multi-head latent attention (MLA)** with a compressed KV cache. Per token the cache holds the
  latent ``kv_c = kv_a_layernorm(kv_a_proj_with_mqa(x)[:kv_lora_rank])`` and the rotated shared
  rope key ``k_pe`` (``qk_rope_head_dim``): one row of ``kv_lora_rank + qk_rope_head_dim`` values
  per layer, instead of ``2 x heads x head_dim``. Attention runs in the paper's "absorbed" form (as
  vLLM's MLA backends do): ``kv_b_proj``'s key part ``W_UK [H, nope, L]`` is folded into the query
  (``q_lat = q_nope @ W_UK``, per head), so every head attends, MQA-style, over the one latent
  "head" ``[kv_c | k_pe]`` with query ``[q_lat | q_pe]``; the value of a cached row is its ``kv_c``
  part, and ``kv_b_proj``'s value part ``W_UV [H, v, L]`` is applied after attention. This equals
  HF's expanded form (``k = [W_UK kv_c | k_pe]``, ``v = W_UV kv_c``) up to rounding. The softmax
  scale is HF's: ``qk_head_dim ** -0.5``, times ``mscale(factor, mscale_all_dim) ** 2`` under YaRN.
* **RoPE** on the ``qk_rope_head_dim`` part only. DeepSeek pairs adjacent dims ``(x0, x1), (x2,
  x3), ...`` (V2's complex multiply, V3's ``rope_interleave=True``); the pairs are de-interleaved
  (``[x0, x2, ... | x1, x3, ...]``) and rotated with the rotate-half tables, which gives V3's output
  exactly and V2's output permuted -- the same for q and k, so the same scores. V3 with
  ``rope_interleave=False`` rotates halves directly. YaRN scaling: :mod:`zpp.models.layers.rotary`.
* **DeepSeekMoE**: layers ``< first_k_dense_replace`` have a dense gated MLP
  (``intermediate_size``); the others ``n_shared_experts`` shared experts (one gated MLP of
  ``moe_intermediate_size * n_shared_experts``) plus ``n_routed_experts`` routed experts
  (``moe_intermediate_size``, :class:`zpp.models.layers.moe.FusedExperts`) picked by
  :class:`DeepseekRouter` (V2: softmax, ``greedy`` / ``group_limited_greedy``; V3: ``noaux_tc``,
  sigmoid scores plus ``e_score_correction_bias`` for choosing).

Tensor parallelism: the attention heads are split (``q_proj`` / ``q_b_proj`` / ``kv_b_proj``
column-parallel by head, ``o_proj`` row-parallel); the latent projections and the KV cache are
replicated on every TP rank (each holds the whole latent row); the dense MLPs and the shared
experts are split as LLaMA's MLP; every routed expert's intermediate dim is split too
(:class:`zpp.models.layers.moe.FusedExperts`), and an MoE layer adds its routed and shared
experts' partial sums before ONE all-reduce. The router is replicated (every rank routes alike).

CUDA graphs: the router (top-k with masks, no indexing by data) and the CUDA experts (grouped
Triton GEMMs, :mod:`zpp.models.layers.fused_moe`) never read device values on the host, so every
stage, with or without MoE layers, is captured.

``--pp-layer-partition auto`` times a dense and an MoE layer apart (:meth:`DeepseekV2ForCausalLM.
layer_kinds`: the first ``first_k_dense_replace`` layers are ``"dense"``, the rest ``"moe"``).

Checkpoints: the names HF's ``save_pretrained`` writes and the original DeepSeek checkpoints use
(``mlp.experts.{e}.gate_proj/up_proj/down_proj.weight``, ``mlp.gate.weight``,
``mlp.gate.e_score_correction_bias``) and HF 5.x's fused in-memory expert tensors
(``mlp.experts.gate_up_proj`` ``[E, 2I, H]``, ``mlp.experts.down_proj`` ``[E, H, I]``). V3's
multi-token-prediction module (``model.layers.{num_hidden_layers}.*`` in the released
checkpoints) is skipped unless speculative decoding with method ``mtp`` asks for it: then the last
stage builds and loads it (:mod:`zpp.models.deepseek_mtp`).
"""
from __future__ import annotations

import re
from typing import Any, Optional

import torch
import torch.nn.functional as F
from torch import nn

from zpp.errors import ConfigError
from zpp.models.base import PreNormDecoder, StageInfo, layer_index
from zpp.models.deepseek_mtp import build_mtp_layers, mtp_weight_targets
from zpp.models.layers.activation import GatedMLP, check_activation
from zpp.models.layers.attention import Attention, AttentionMetadata
from zpp.models.layers.linear import Linear, MergedLinear, RowParallelLinear
from zpp.models.layers.linear import default_weight_loader
from zpp.models.layers.moe import FusedExperts
from zpp.models.layers.norm import RMSNorm
from zpp.models.layers.rotary import get_rope, rope_params, yarn_softmax_scale
from zpp.transport.tensor_parallel import tp_all_reduce

_EXPERT_RE = re.compile(r"\.mlp\.experts\.(\d+)\.(gate_proj|up_proj|down_proj)\.(weight|weight_scale|qweight|scales|zeros)$")
_SUFFIX = {"weight": "", "weight_scale": "_scale",  # an FP8 expert's canonical scale -> experts.*_proj_scale
           "qweight": "_qweight", "scales": "_scales", "zeros": "_zeros"}  # a 4-bit one's (w4_base.py)


def _deinterleave(x: torch.Tensor) -> torch.Tensor:
    """``[..., R]`` with pairs ``(x0, x1), (x2, x3), ...`` -> ``[x0, x2, ..., x1, x3, ...]`` (new tensor)."""
    return x.unflatten(-1, (-1, 2)).transpose(-1, -2).flatten(-2)


class DeepseekAttention(nn.Module):
    """Multi-head latent attention (absorbed form, see the module docstring):
    ``forward(positions [T], x [T, hidden], kv_cache, meta)`` -> ``[T, hidden]``.

    ``kv_cache``: ``[num_blocks, block_size, 1, kv_lora_rank + qk_rope_head_dim]`` (row ``[kv_c |
    k_pe]``), or None for a profiling pass. With ``tp_size > 1`` this rank computes heads
    ``[tp_rank * H / tp, (tp_rank + 1) * H / tp)``; ``o_proj`` all-reduces."""

    def __init__(self, cfg: dict[str, Any], max_positions: int, interleaved: bool, tp_rank: int = 0,
                 tp_size: int = 1):
        super().__init__()
        hidden, heads = cfg["hidden_size"], cfg["num_attention_heads"]
        self.num_heads = heads // tp_size
        self.nope = int(cfg["qk_nope_head_dim"])
        self.rope = int(cfg["qk_rope_head_dim"])
        self.v_dim = int(cfg["v_head_dim"])
        self.kv_lora_rank = int(cfg["kv_lora_rank"])
        self.q_lora_rank = cfg.get("q_lora_rank")
        self.interleaved = interleaved
        qk_head_dim = self.nope + self.rope
        bias = bool(cfg.get("attention_bias", False))
        tp = dict(tp_rank=tp_rank, tp_size=tp_size)
        if self.q_lora_rank is None:
            self.q_proj = MergedLinear(hidden, [heads * qk_head_dim], **tp)
        else:
            self.q_a_proj = Linear(hidden, self.q_lora_rank, bias=bias)
            self.q_a_layernorm = RMSNorm(self.q_lora_rank)  # HF: the default eps (1e-6), not rms_norm_eps
            self.q_b_proj = MergedLinear(self.q_lora_rank, [heads * qk_head_dim], **tp)
        self.kv_a_proj_with_mqa = Linear(hidden, self.kv_lora_rank + self.rope, bias=bias)
        self.kv_a_layernorm = RMSNorm(self.kv_lora_rank)
        self.kv_b_proj = MergedLinear(self.kv_lora_rank, [heads * (self.nope + self.v_dim)], **tp)
        self.o_proj = RowParallelLinear(heads * self.v_dim, hidden, bias=bias, **tp)
        theta, scaling = rope_params(cfg)
        self.rotary = get_rope(self.rope, max_positions, theta, scaling)
        scale = yarn_softmax_scale(scaling, qk_head_dim ** -0.5)
        self.attn = Attention(self.num_heads, self.kv_lora_rank + self.rope, 1, scale=scale,
                              v_head_dim=self.kv_lora_rank)

    def forward(self, positions: torch.Tensor, x: torch.Tensor, kv_cache: Optional[torch.Tensor],
                meta: AttentionMetadata) -> torch.Tensor:
        T, H, L = x.shape[0], self.num_heads, self.kv_lora_rank
        if self.q_lora_rank is None:
            q = self.q_proj(x)
        else:
            q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x)))
        q = q.view(T, H, self.nope + self.rope)
        q_nope, q_pe = q.split([self.nope, self.rope], dim=-1)                  # [T, H, nope], [T, H, R]
        kv_c, k_pe = self.kv_a_proj_with_mqa(x).split([L, self.rope], dim=-1)   # [T, L], [T, R]
        kv_c = self.kv_a_layernorm(kv_c.contiguous())
        k_pe = k_pe.view(T, 1, self.rope)
        if self.interleaved:
            q_pe, k_pe = _deinterleave(q_pe), _deinterleave(k_pe)
        q_pe, k_pe = self.rotary(positions, q_pe, k_pe)                          # [T, H, R], [T, 1, R]
        w = self.kv_b_proj.weight.view(H, self.nope + self.v_dim, L)            # [H, nope + v, L]
        q_lat = torch.bmm(q_nope.transpose(0, 1), w[:, :self.nope])             # [H, T, L]
        q = torch.cat([q_lat.transpose(0, 1), q_pe], dim=-1)                    # [T, H, L + R]
        k = torch.cat([kv_c, k_pe.view(T, self.rope)], dim=-1)                  # [T, L + R]: the cached row
        o_lat = self.attn(q, k, None, kv_cache, meta).view(T, H, L)             # [T, H, L]
        o = torch.bmm(o_lat.transpose(0, 1), w[:, self.nope:].transpose(1, 2))  # [H, T, v]
        return self.o_proj(o.transpose(0, 1).reshape(T, H * self.v_dim))        # [T, hidden]


class DeepseekRouter(nn.Module):
    """Top-k expert choice of DeepSeekMoE: ``forward(x [T, H])`` -> ``(weights [T, k] float32,
    expert ids [T, k] int64)``, as HF's ``DeepseekV2TopkRouter`` / ``DeepseekV3TopkRouter``.

    Logits ``x W^T`` in float32 (``weight`` ``[E, H]`` is kept in float32, as HF does), then
      * ``greedy`` (V2): softmax scores, the top-k;
      * ``group_limited_greedy`` (V2): softmax scores; the ``topk_group`` of ``n_group`` groups
        with the highest max score stay, the others' scores become 0; the top-k;
      * ``noaux_tc`` (V3): sigmoid scores; choice scores = scores + ``e_score_correction_bias``;
        groups ranked by the sum of their top-2 choice scores, the ``topk_group`` best kept (others
        -inf); the top-k by choice score, weighted by their (uncorrected) scores, renormalised to
        sum to 1 (+1e-20) if ``norm_topk_prob``;
    and every weight times ``routed_scaling_factor``. Group limits are masks over all ``E``
    experts (top-k of the group scores scattered into a ``[T, G]`` mask), never indexing by data:
    no host read and shapes fixed by ``T``, so the router is captured in CUDA graphs.
    """

    def __init__(self, hidden_size: int, num_experts: int, top_k: int, method: str, num_groups: int,
                 topk_group: int, norm_topk_prob: bool, routed_scaling_factor: float):
        super().__init__()
        self.num_experts, self.top_k, self.method = num_experts, top_k, method
        self.num_groups, self.topk_group = num_groups, topk_group
        self.norm_topk_prob, self.routed_scaling_factor = norm_topk_prob, routed_scaling_factor
        self.weight = nn.Parameter(torch.empty(num_experts, hidden_size, dtype=torch.float32))
        self.weight.weight_loader = default_weight_loader
        if method == "noaux_tc":
            self.e_score_correction_bias = nn.Parameter(torch.empty(num_experts, dtype=torch.float32))
            self.e_score_correction_bias.weight_loader = default_weight_loader

    def _group_mask(self, group_scores: torch.Tensor) -> torch.Tensor:
        """``[T, n_group]`` scores -> ``[T, E]`` bool, True for the experts of each token's kept groups."""
        idx = torch.topk(group_scores, k=self.topk_group, dim=-1, sorted=False)[1]
        mask = torch.zeros_like(group_scores).scatter_(1, idx, 1).bool()              # [T, G]
        T, G = mask.shape  # expand, not repeat_interleave (which may read its output size on the host)
        return mask[:, :, None].expand(T, G, self.num_experts // G).reshape(T, -1)   # [T, E]

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        T, E, G = x.shape[0], self.num_experts, self.num_groups
        logits = F.linear(x.float(), self.weight)                                # [T, E] float32
        if self.method == "noaux_tc":
            scores = logits.sigmoid()
            choice = scores + self.e_score_correction_bias
            group_scores = choice.view(T, G, E // G).topk(2, dim=-1)[0].sum(dim=-1)  # [T, G]
            choice = choice.masked_fill(~self._group_mask(group_scores), float("-inf"))
            ids = torch.topk(choice, k=self.top_k, dim=-1, sorted=False)[1]
            weights = scores.gather(1, ids)
            if self.norm_topk_prob:
                weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
        else:
            scores = logits.softmax(dim=-1)
            if self.method == "group_limited_greedy":
                group_scores = scores.view(T, G, E // G).max(dim=-1).values       # [T, G]
                scores = scores.masked_fill(~self._group_mask(group_scores), 0.0)
            weights, ids = torch.topk(scores, k=self.top_k, dim=-1, sorted=False)
        return weights * self.routed_scaling_factor, ids


class DeepseekMoE(nn.Module):
    """``forward(x [T, H])`` -> routed experts' weighted sum + shared experts(x), ``[T, H]``.
    Parameters (``I_l = moe_intermediate_size / tp_size``): ``gate.weight`` ``[E, H]`` (+
    ``gate.e_score_correction_bias`` ``[E]`` for V3), ``experts.gate_up_proj`` ``[E, 2 I_l, H]``,
    ``experts.down_proj`` ``[E, H, I_l]``, ``shared_experts.gate_up_proj`` / ``down_proj`` (the
    shared experts' ``n_shared_experts * moe_intermediate_size`` split likewise). With
    ``tp_size > 1`` each rank computes its partial sum of both and one all-reduce completes it."""

    def __init__(self, cfg: dict[str, Any], method: str, norm_topk_prob: bool, mlp_bias: bool,
                 tp_rank: int = 0, tp_size: int = 1):
        super().__init__()
        hidden, inter = cfg["hidden_size"], cfg["moe_intermediate_size"]
        num_experts = int(cfg["n_routed_experts"])
        act = cfg.get("hidden_act", "silu")
        self.gate = DeepseekRouter(hidden, num_experts, int(cfg["num_experts_per_tok"]), method,
                                   int(cfg.get("n_group") or 1), int(cfg.get("topk_group") or 1), norm_topk_prob,
                                   float(cfg.get("routed_scaling_factor", 1.0)))
        self.experts = FusedExperts(num_experts, hidden, inter, act, tp_rank=tp_rank, tp_size=tp_size)
        n_shared = int(cfg.get("n_shared_experts") or 0)
        self.shared_experts = GatedMLP(hidden, inter * n_shared, act, bias=mlp_bias, tp_rank=tp_rank,
                                       tp_size=tp_size) if n_shared else None
        self.tp_size = tp_size

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, ids = self.gate(x)                                   # [T, k] float32, [T, k] int64
        out = self.experts(x, weights, ids, reduce=False)             # [T, H] this rank's partial sum
        if self.shared_experts is not None:
            out = out + self.shared_experts(x, reduce=False)          # HF: routed + shared
        return tp_all_reduce(out) if self.tp_size > 1 else out


class DeepseekDecoderLayer(nn.Module):
    """Pre-norm block: MLA, then a dense MLP or DeepSeekMoE; residual stream as LLaMA's."""

    def __init__(self, attn: nn.Module, mlp: nn.Module, hidden_size: int, eps: float):
        super().__init__()
        self.self_attn = attn
        self.mlp = mlp
        self.input_layernorm = RMSNorm(hidden_size, eps)
        self.post_attention_layernorm = RMSNorm(hidden_size, eps)

    def forward(self, positions, x, residual, kv_cache, meta):
        if residual is None:
            residual = x
            x = self.input_layernorm(x)
        else:
            x, residual = self.input_layernorm(x, residual)
        x = self.self_attn(positions, x, kv_cache, meta)
        x, residual = self.post_attention_layernorm(x, residual)
        return self.mlp(x), residual


class DeepseekV2ForCausalLM(PreNormDecoder):
    """One stage of a DeepSeek-V2 causal LM (V2, V2-Lite, V2.5).

    forward(input_ids [T] int64 | None, positions [T] int64, acts [2, T, H] | None, kv_caches, meta)
    returns ``[2, T, H]`` (hidden, residual) on non-last stages, final normed hidden ``[T, H]`` last.
    KV cache per layer: ``[num_blocks, block_size, 1, kv_lora_rank + qk_rope_head_dim]``
    (:meth:`kv_cache_shape`), the same on every TP rank.
    """

    num_acts = 2
    supports_tensor_parallel = True
    supports_cuda_graphs = True  # router and CUDA experts never read device values on the host
    packed_modules = {"gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1)}
    tied_names = ("model.embed_tokens.weight",)
    version = 2
    defaults: dict[str, Any] = {  # HF DeepseekV2Config's, for keys config.json leaves out
        "first_k_dense_replace": 0, "kv_lora_rank": 512, "q_lora_rank": 1536, "qk_nope_head_dim": 128,
        "qk_rope_head_dim": 64, "v_head_dim": 128, "n_routed_experts": 64, "n_shared_experts": 2,
        "moe_intermediate_size": 1407, "routed_scaling_factor": 1.0, "topk_method": "greedy",
        "norm_topk_prob": False, "n_group": None, "topk_group": None, "mlp_bias": False}

    @classmethod
    def with_defaults(cls, cfg: dict[str, Any]) -> dict[str, Any]:
        """``cfg`` with HF's config-class defaults for the DeepSeek keys it lacks (a key present
        with null keeps null: ``q_lora_rank: null`` means a plain ``q_proj``)."""
        return {**cls.defaults, **cfg}

    @classmethod
    def check_config(cls, cfg: dict[str, Any]) -> None:
        cfg = cls.with_defaults(cfg)
        rope_params(cfg)
        check_activation(cfg, "hidden_act", "silu")
        if cfg.get("num_experts_per_tok") is None:
            raise ConfigError("num_experts_per_tok is not set")
        if int(cfg["qk_rope_head_dim"]) % 2:
            raise ConfigError(f"qk_rope_head_dim={cfg['qk_rope_head_dim']} must be even")
        if int(cfg.get("moe_layer_freq", 1)) != 1:
            raise ConfigError(f"moe_layer_freq={cfg['moe_layer_freq']} is not supported (HF transformers puts an "
                              f"MoE block in every layer from first_k_dense_replace on)")
        method = cls._topk_method(cfg)
        scoring = cfg.get("scoring_func", "sigmoid" if method == "noaux_tc" else "softmax")
        if scoring != ("sigmoid" if method == "noaux_tc" else "softmax"):
            raise ConfigError(f"scoring_func={scoring!r} with topk_method={method!r} is not supported")
        e, k = int(cfg["n_routed_experts"]), int(cfg["num_experts_per_tok"])
        groups, topk_group = int(cfg.get("n_group") or 1), int(cfg.get("topk_group") or 1)
        if not 1 <= k <= e:
            raise ConfigError(f"num_experts_per_tok={k} must be between 1 and n_routed_experts={e}")
        if method != "greedy" and (e % groups or not 1 <= topk_group <= groups):
            raise ConfigError(f"n_group={groups} / topk_group={topk_group} do not fit n_routed_experts={e}")
        if method == "noaux_tc" and e // groups < 2:
            raise ConfigError(f"noaux_tc routing needs at least 2 experts per group (n_routed_experts={e}, "
                              f"n_group={groups})")

    @classmethod
    def layer_kinds(cls, cfg: dict[str, Any]) -> list[str]:
        """``"dense"`` for the first ``first_k_dense_replace`` layers (gated MLP of
        ``intermediate_size``), ``"moe"`` for the others (DeepSeekMoE)."""
        first_dense = int(cls.with_defaults(cfg).get("first_k_dense_replace") or 0)
        return ["dense" if i < first_dense else "moe" for i in range(cls.num_layers_of(cfg))]

    @classmethod
    def _topk_method(cls, cfg: dict[str, Any]) -> str:
        method = cfg.get("topk_method") or "greedy"
        if method not in ("greedy", "group_limited_greedy"):
            raise ConfigError(f"topk_method={method!r} is not supported for DeepSeek-V2 "
                              f"(supported: greedy, group_limited_greedy)")
        if cfg.get("norm_topk_prob"):
            raise ConfigError("norm_topk_prob=true is not supported for DeepSeek-V2 (HF transformers' "
                              "DeepseekV2 router ignores it)")
        return method

    @classmethod
    def check_tensor_parallel(cls, cfg: dict[str, Any], tp_size: int) -> None:
        cfg = cls.with_defaults(cfg)
        sizes = {"num_attention_heads": cfg["num_attention_heads"]}
        kinds = set(cls.layer_kinds(cfg))
        if "dense" in kinds:
            sizes["intermediate_size"] = cfg["intermediate_size"]
        if "moe" in kinds:  # routed experts split; the shared experts' n_shared multiple then too
            sizes["moe_intermediate_size"] = cfg["moe_intermediate_size"]
        cls.check_divisible(sizes, tp_size)

    def __init__(self, cfg: dict[str, Any], stage: StageInfo, max_positions: int):
        cfg = self.with_defaults(cfg)
        super().__init__(cfg, stage)
        self.build_decoder(cfg["vocab_size"], cfg["hidden_size"], cfg["num_hidden_layers"],
                           lambda i: self.make_layer(cfg, i, max_positions),
                           lambda: RMSNorm(cfg["hidden_size"], cfg.get("rms_norm_eps", 1e-6)))
        # Speculative decoding with MTP: the last stage also holds the multi-token-prediction layer(s).
        self.num_mtp_layers = build_mtp_layers(self, cfg, lambda i: self.make_layer(cfg, i, max_positions))
        self.kv_lora_rank = int(cfg["kv_lora_rank"])
        self.num_kv_heads = 1  # the latent row, shared by every head (and replicated over TP ranks)
        self.head_dim = self.kv_lora_rank + int(cfg["qk_rope_head_dim"])

    def kv_cache_shape(self, num_blocks: int, block_size: int) -> tuple[int, ...]:
        """``[num_blocks, block_size, 1, kv_lora_rank + qk_rope_head_dim]``: the compressed latent
        ``kv_c`` and the rotated rope key ``k_pe`` of each token (one row, no separate V)."""
        return (num_blocks, block_size, 1, self.head_dim)

    def _interleaved(self, cfg: dict[str, Any]) -> bool:
        return True  # V2 rotates adjacent pairs (its complex-number RoPE)

    def make_layer(self, cfg: dict[str, Any], i: int, max_positions: int) -> nn.Module:
        tp = dict(tp_rank=self.stage.tp_rank, tp_size=self.stage.tp_size)
        mlp_bias = bool(cfg.get("mlp_bias")) and self.version == 2  # HF's V3 MLPs have no bias
        attn = DeepseekAttention(cfg, max_positions, self._interleaved(cfg), **tp)
        if i >= int(cfg.get("first_k_dense_replace") or 0):
            mlp = DeepseekMoE(cfg, self._topk_method(cfg), bool(cfg.get("norm_topk_prob")), mlp_bias, **tp)
        else:
            mlp = GatedMLP(cfg["hidden_size"], cfg["intermediate_size"], cfg.get("hidden_act", "silu"),
                           bias=mlp_bias, **tp)
        return DeepseekDecoderLayer(attn, mlp, cfg["hidden_size"], cfg.get("rms_norm_eps", 1e-6))

    def stage_owns(self, name: str) -> bool:
        """Layers by index (so the multi-token-prediction layer ``model.layers.{num_hidden_layers}``
        belongs to no stage, unless MTP speculative decoding built it on the last stage), the
        embedding on the first stage, final norm / lm_head on the last."""
        i = layer_index(name)
        if i is not None and self.num_mtp_layers:
            n = int(self.cfg["num_hidden_layers"])
            if n <= i < n + self.num_mtp_layers:
                return True
        return super().stage_owns(name)

    @property
    def num_local_layers(self) -> int:
        """The stage's decoder layers, and its MTP layers (each has a KV cache of its own)."""
        return self.stage.layer_end - self.stage.layer_start + getattr(self, "num_mtp_layers", 0)

    def map_weight_name(self, name: str) -> Optional[list[tuple[str, Optional[int]]]]:
        """Per-expert ``gate_proj`` / ``up_proj`` -> shard ``2e`` / ``2e+1`` of
        ``mlp.experts.gate_up_proj``, ``down_proj`` -> shard ``e`` of ``mlp.experts.down_proj``;
        shared experts and dense MLPs: gate / up merged into ``gate_up_proj``."""
        if self.num_mtp_layers:
            targets = mtp_weight_targets(self, name)
            if targets is not None:
                return targets
        match = _EXPERT_RE.search(name)
        if match is None:
            return super().map_weight_name(name)
        if not self.stage_owns(name):
            return None
        prefix, e, w = name[:match.start()], int(match.group(1)), match.group(2)
        if w == "down_proj":
            return [(f"{prefix}.mlp.experts.down_proj{_SUFFIX[match.group(3)]}", e)]
        return [(f"{prefix}.mlp.experts.gate_up_proj{_SUFFIX[match.group(3)]}", 2 * e + (0 if w == "gate_proj" else 1))]



class DeepseekV3ForCausalLM(DeepseekV2ForCausalLM):
    """One stage of a DeepSeek-V3 / R1 causal LM: DeepSeek-V2's block with ``noaux_tc`` routing
    (sigmoid scores, ``e_score_correction_bias``, ``norm_topk_prob``) and ``rope_interleave``
    (default true). Same inputs / outputs as :class:`DeepseekV2ForCausalLM`."""

    version = 3
    defaults: dict[str, Any] = {  # HF DeepseekV3Config's
        "first_k_dense_replace": 3, "kv_lora_rank": 512, "q_lora_rank": 1536, "qk_nope_head_dim": 128,
        "qk_rope_head_dim": 64, "v_head_dim": 128, "n_routed_experts": 256, "n_shared_experts": 1,
        "moe_intermediate_size": 2048, "routed_scaling_factor": 2.5, "norm_topk_prob": True, "n_group": 8,
        "topk_group": 4, "num_experts_per_tok": 8, "rope_interleave": True, "mlp_bias": False}

    @classmethod
    def _topk_method(cls, cfg: dict[str, Any]) -> str:
        method = cfg.get("topk_method") or "noaux_tc"
        if method != "noaux_tc":
            raise ConfigError(f"topk_method={method!r} is not supported for DeepSeek-V3 (supported: noaux_tc)")
        return method

    def _interleaved(self, cfg: dict[str, Any]) -> bool:
        return bool(cfg["rope_interleave"])
