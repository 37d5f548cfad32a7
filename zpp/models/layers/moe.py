"""Sparse mixture-of-experts feed-forward layers: a router, the experts, the block joining them.

A router maps tokens ``x [T, H]`` to ``(weights [T, k] float32, ids [T, k] int64)``: the ``k``
experts of each token and the weight of each one's output. :class:`FusedExperts` takes any such
pair (so routers written elsewhere -- DeepSeek's grouped / sigmoid ones -- reuse it) and returns
``sum_j weights[t, j] * expert_{ids[t, j]}(x[t])``.

References (numerics follow HF transformers 5.x):

* Mixtral (Jiang et al. 2024, "Mixtral of Experts"), HF ``MixtralTopKRouter`` / ``MixtralExperts``:
  softmax over all experts in float32, top-k, renormalised to sum to 1;
* Qwen3-MoE, HF ``Qwen3MoeTopKRouter``: the same, renormalised only with ``norm_topk_prob``;
* gpt-oss, HF ``GptOssTopKRouter`` / ``GptOssExperts``: router with a bias, top-k of the logits then a
  softmax over those k; expert biases; the clamped SwiGLU (:class:`ClampedSwiGLU`) whose gate and
  up columns are interleaved in the checkpoint (de-interleaved here at load, see
  :class:`FusedExperts`' ``checkpoint_layout``).

Experts are gated MLPs ``down(act(gate(x)) * up(x))`` held as 3-D tensors: ``gate_up_proj[e]``
``[2I, H]`` (gate rows first) and ``down_proj[e]`` ``[H, I]`` -- HF 5.x's in-memory layout.

Compute paths of :meth:`FusedExperts.forward`:

* CPU: assignments sorted by expert once (one host read of the per-expert counts, free on the
  CPU), then two matmuls per expert that received tokens, accumulated expert by expert in index
  order (as HF);
* CUDA: grouped GEMMs in Triton (:mod:`zpp.models.layers.fused_moe`): one launch for every
  expert's gate/up, one for every expert's down, no per-expert Python loop and no host
  synchronisation, so MoE layers run inside CUDA graphs.

Tensor parallelism (Megatron-LM's MLP split applied to each expert): every expert's intermediate
dim is split over the TP ranks -- ``gate_up_proj`` column-parallel (rank ``r`` holds gate rows and
up rows ``[r * I / tp, (r + 1) * I / tp)``), ``down_proj`` row-parallel (the matching columns) --
so each rank computes a partial sum of every token's output and one all-reduce completes it. The
router is replicated (every rank routes identically). A down-projection bias is added by TP rank 0
only, so that the all-reduce adds it once.
"""
from __future__ import annotations

from typing import Callable, Optional, Union

import torch
import torch.nn.functional as F
from torch import nn

from zpp import envs
from zpp.models.layers.activation import get_activation
from zpp.models.layers.linear import default_weight_loader
from zpp.transport.tensor_parallel import tp_all_reduce

SCORINGS = ("softmax", "topk_softmax")
_FUSED_ROUTER = envs.ZPP_MOE_FUSED_ROUTER

RouterFn = Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor]]
"""The router contract: ``x [T, H]`` -> ``(weights [T, k] float32, ids [T, k] int64)``."""


class TopKRouter(nn.Module):
    """Top-k router: ``forward(x [T, H])`` -> ``(weights [T, k] float32, ids [T, k] int64)``.

    Args:
        scoring: ``"softmax"``: softmax over all ``E`` logits in float32, then the top ``k``
            (Mixtral, Qwen3-MoE); ``"topk_softmax"``: top ``k`` of the logits, then a softmax over
            those ``k`` in float32 (gpt-oss).
        renormalize: with ``"softmax"``, divide the k weights by their sum (Mixtral;
            Qwen3-MoE's ``norm_topk_prob``). Ignored by ``"topk_softmax"`` (its weights sum to 1).
        bias: a learned ``[E]`` bias on the logits (gpt-oss).

    Parameters: ``weight`` ``[E, H]`` (checkpoint ``...mlp.gate.weight`` in Mixtral / Qwen3-MoE),
    ``bias`` ``[E]``. Raises ValueError for an unknown ``scoring`` or ``top_k`` outside ``[1, E]``.
    """

    def __init__(self, hidden_size: int, num_experts: int, top_k: int, renormalize: bool = True,
                 scoring: str = "softmax", bias: bool = False):
        super().__init__()
        if scoring not in SCORINGS:
            raise ValueError(f"router scoring {scoring!r} is not one of {SCORINGS}")
        if not 1 <= top_k <= num_experts:
            raise ValueError(f"top_k={top_k} must be between 1 and the number of experts {num_experts}")
        self.num_experts, self.top_k, self.renormalize, self.scoring = num_experts, top_k, renormalize, scoring
        self.weight = nn.Parameter(torch.empty(num_experts, hidden_size))
        self.weight.weight_loader = default_weight_loader
        self.bias = nn.Parameter(torch.empty(num_experts)) if bias else None
        if self.bias is not None:
            self.bias.weight_loader = default_weight_loader

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        logits = F.linear(x, self.weight, self.bias)                          # [T, E] model dtype
        if logits.is_cuda and _FUSED_ROUTER:                                  # one Triton launch
            from zpp.models.layers.fused_moe import topk_route
            return topk_route(logits, self.top_k, self.scoring, self.renormalize)
        if self.scoring == "topk_softmax":
            top, ids = torch.topk(logits, self.top_k, dim=-1)                 # [T, k]
            return F.softmax(top.float(), dim=-1), ids
        probs = F.softmax(logits.float(), dim=-1)                             # [T, E] float32
        weights, ids = torch.topk(probs, self.top_k, dim=-1)                  # [T, k]
        if self.renormalize:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return weights, ids


# --- activations between the two expert GEMMs -----------------------------------------------------
class GatedActivation:
    """``act(gate) * up``: ``__call__(gate_up [R, 2I])`` (gate columns first) -> ``[R, I]``.

    ``name``: an HF ``hidden_act`` (``silu``, ``gelu``, ...; KeyError if unknown).
    ``triton_kind``: ``(kind, alpha, limit)`` of the fused Triton kernel
    (:func:`zpp.models.layers.fused_moe.gated_act`), None where only PyTorch implements it.
    """

    def __init__(self, name: str = "silu"):
        self.name = name
        self.fn = get_activation(name)
        self.triton_kind = (0, 1.0, 0.0) if self.fn is F.silu else None

    def __call__(self, gate_up: torch.Tensor) -> torch.Tensor:
        gate, up = gate_up.chunk(2, dim=-1)
        return self.fn(gate) * up

    def __repr__(self) -> str:
        return f"GatedActivation({self.name!r})"


class ClampedSwiGLU(GatedActivation):
    """gpt-oss's activation (HF ``GptOssExperts._apply_gate``): ``gate = min(gate, limit)``,
    ``up = clamp(up, -limit, limit)``, ``(up + 1) * gate * sigmoid(alpha * gate)``. Same calling
    convention as :class:`GatedActivation` (gate | up halves; the checkpoint's interleaved columns
    are de-interleaved at load)."""

    def __init__(self, alpha: float = 1.702, limit: float = 7.0):
        self.name = "swiglu_clamped"
        self.alpha, self.limit = float(alpha), float(limit)
        self.triton_kind = (1, self.alpha, self.limit)

    def __call__(self, gate_up: torch.Tensor) -> torch.Tensor:
        gate, up = gate_up.chunk(2, dim=-1)
        gate = gate.clamp(max=self.limit)
        up = up.clamp(min=-self.limit, max=self.limit)
        return (up + 1) * (gate * torch.sigmoid(gate * self.alpha))

    def __repr__(self) -> str:
        return f"ClampedSwiGLU(alpha={self.alpha}, limit={self.limit})"


CHECKPOINT_LAYOUTS = ("hf", "gpt_oss")


class FusedExperts(nn.Module):
    """``num_experts`` gated MLPs held as 3-D tensors, optionally tensor-parallel.

    ``forward(x [T, H], weights [T, k] float32, ids [T, k] int64, reduce=True)`` -> ``[T, H]`` in
    ``x.dtype``; with ``tp_size > 1`` the sum over the TP group (one all-reduce), or this rank's
    partial sum when ``reduce=False`` (a caller that adds other row-parallel partials, e.g. shared
    experts, and all-reduces once).

    Args:
        act: the activation between the GEMMs: an HF ``hidden_act`` name (``act(gate) * up``) or a
            :class:`GatedActivation` such as :class:`ClampedSwiGLU`.
        bias: per-expert biases ``gate_up_proj_bias`` ``[E, 2I]`` and ``down_proj_bias`` ``[E, H]``.
        tp_rank, tp_size: this rank's slice of every expert's intermediate dim (``I / tp_size``).
        checkpoint_layout: how fused checkpoint tensors (shard ``None``) are laid out:
            ``"hf"``: ``gate_up_proj`` ``[E, 2I, H]`` (gate rows then up rows), ``down_proj``
            ``[E, H, I]``, ``gate_up_proj_bias`` ``[E, 2I]`` (Mixtral / Qwen3-MoE in HF 5.x memory);
            ``"gpt_oss"``: transposed and interleaved, ``gate_up_proj`` ``[E, H, 2I]`` with gate in
            the even columns and up in the odd ones, ``gate_up_proj_bias`` ``[E, 2I]`` likewise,
            ``down_proj`` ``[E, I, H]`` (HF ``GptOssExperts``).

    Parameters (local sizes, ``I_l = I / tp_size``): ``gate_up_proj`` ``[E, 2 I_l, H]``,
    ``down_proj`` ``[E, H, I_l]``, and with ``bias`` ``gate_up_proj_bias`` ``[E, 2 I_l]``,
    ``down_proj_bias`` ``[E, H]``. Per-expert checkpoint tensors load by shard index:
    ``gate_up_proj`` shard ``2e`` / ``2e + 1`` = expert ``e``'s gate / up ``[I, H]`` (bias ``[I]``),
    ``down_proj`` shard ``e`` = its ``[H, I]`` (bias ``[H]``); every loader takes full
    (unsplit) tensors and keeps this rank's slice. Each parameter's ``num_shards`` (``2E`` /
    ``E``) tells :meth:`zpp.models.base.StageModel.load_weights` which shards exist: a checkpoint
    expert id ``>= num_experts`` is reported there as an unexpected tensor (for every MoE family),
    never handed to a loader.

    Raises:
        ValueError: ``intermediate_size % tp_size``, an unknown layout (construction); a shape
            mismatch or an expert out of range (loading, called directly).
    """

    quant_method = None
    """The :class:`zpp.models.quantization.base.FusedMoEMethod` holding quantized expert weights
    (FP8: :class:`zpp.models.quantization.fp8_moe.Fp8MoEMethod`), else None."""

    def __init__(self, num_experts: int, hidden_size: int, intermediate_size: int,
                 act: Union[str, GatedActivation] = "silu", bias: bool = False, tp_rank: int = 0, tp_size: int = 1,
                 checkpoint_layout: str = "hf"):
        super().__init__()
        if intermediate_size % tp_size:
            raise ValueError(f"expert intermediate size {intermediate_size} is not divisible by "
                             f"tensor-parallel size {tp_size}")
        if checkpoint_layout not in CHECKPOINT_LAYOUTS:
            raise ValueError(f"expert checkpoint layout {checkpoint_layout!r} is not one of {CHECKPOINT_LAYOUTS}")
        self.num_experts, self.hidden_size = num_experts, hidden_size
        self.full_intermediate_size = intermediate_size
        self.intermediate_size = I = intermediate_size // tp_size            # this rank's share
        self.tp_rank, self.tp_size = tp_rank, tp_size
        self.layout = checkpoint_layout
        self.act = act if isinstance(act, GatedActivation) else GatedActivation(act)
        self.gate_up_proj = nn.Parameter(torch.empty(num_experts, 2 * I, hidden_size))
        self.gate_up_proj.weight_loader = self._load_gate_up
        self.gate_up_proj.num_shards = 2 * num_experts
        self.down_proj = nn.Parameter(torch.empty(num_experts, hidden_size, I))
        self.down_proj.weight_loader = self._load_down
        self.down_proj.num_shards = num_experts
        self.gate_up_proj_bias = self.down_proj_bias = None
        if bias:
            self.gate_up_proj_bias = nn.Parameter(torch.empty(num_experts, 2 * I))
            self.gate_up_proj_bias.weight_loader = self._load_gate_up
            self.gate_up_proj_bias.num_shards = 2 * num_experts
            self.down_proj_bias = nn.Parameter(torch.empty(num_experts, hidden_size))
            self.down_proj_bias.weight_loader = self._load_down_bias
            self.down_proj_bias.num_shards = num_experts

    # --- loading --------------------------------------------------------------------------------
    def _slice(self, t: torch.Tensor, dim: int) -> torch.Tensor:
        """This rank's ``I_l`` of a full intermediate dim ``dim``."""
        if t.shape[dim] != self.full_intermediate_size:
            raise ValueError(f"intermediate size {t.shape[dim]}, expected {self.full_intermediate_size}")
        return t.narrow(dim, self.tp_rank * self.intermediate_size, self.intermediate_size)

    def _load_gate_up(self, param: nn.Parameter, loaded: torch.Tensor, shard: Optional[int] = None) -> None:
        """Weight or bias of gate/up. Shard ``None``: all experts fused (``checkpoint_layout``);
        shard ``2e`` / ``2e + 1``: expert ``e``'s gate / up, ``[I, H]`` (weight) or ``[I]`` (bias)."""
        if shard is not None:
            e, part = divmod(shard, 2)
            if not 0 <= e < self.num_experts:
                raise ValueError(f"expert {e} out of range (the layer has {self.num_experts})")
            _copy_into(param.data[e].narrow(0, part * self.intermediate_size, self.intermediate_size),
                       self._slice(loaded, 0), f"expert shard {shard}")
            return
        is_bias = param.dim() == 2
        if self.layout == "gpt_oss":
            if not is_bias:
                loaded = loaded.transpose(1, 2)                               # [E, H, 2I] -> [E, 2I, H]
            gate, up = loaded[:, 0::2], loaded[:, 1::2]                       # interleaved columns
        else:
            if loaded.shape[1] != 2 * self.full_intermediate_size:
                raise ValueError(f"shape mismatch: fused gate/up {tuple(loaded.shape)}, expected "
                                 f"{2 * self.full_intermediate_size} rows per expert")
            gate, up = loaded.chunk(2, dim=1)
        _copy_into(param.data, torch.cat([self._slice(gate, 1), self._slice(up, 1)], dim=1), "fused gate/up")

    def _load_down(self, param: nn.Parameter, loaded: torch.Tensor, shard: Optional[int] = None) -> None:
        """Shard ``None``: all experts fused (``[E, H, I]``, or ``[E, I, H]`` for gpt-oss); shard
        ``e``: expert ``e``'s ``[H, I]``."""
        if shard is not None:
            if not 0 <= shard < self.num_experts:
                raise ValueError(f"expert {shard} out of range (the layer has {self.num_experts})")
            _copy_into(param.data[shard], self._slice(loaded, 1), f"expert shard {shard}")
            return
        if self.layout == "gpt_oss":
            loaded = loaded.transpose(1, 2)                                   # [E, I, H] -> [E, H, I]
        _copy_into(param.data, self._slice(loaded, 2), "fused down")

    def _load_down_bias(self, param: nn.Parameter, loaded: torch.Tensor, shard: Optional[int] = None) -> None:
        if shard is None:
            return default_weight_loader(param, loaded)
        _copy_into(param.data[shard], loaded, f"expert shard {shard}")

    # --- compute --------------------------------------------------------------------------------
    @property
    def _down_bias(self) -> Optional[torch.Tensor]:
        """The down bias this rank adds: all of it on TP rank 0, none elsewhere (one add after the sum)."""
        return self.down_proj_bias if self.tp_rank == 0 else None

    def forward(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor, reduce: bool = True) -> torch.Tensor:
        if self.quant_method is not None:
            out = self.quant_method.apply(self, x, weights, ids)
        elif x.is_cuda:
            from zpp.models.layers.fused_moe import fused_moe
            out = fused_moe(x, self.gate_up_proj, self.down_proj, weights, ids, self.act,
                            self.gate_up_proj_bias, self._down_bias)
        else:
            out = self.forward_loop(x, weights, ids)
        if self.tp_size > 1 and reduce:
            out = tp_all_reduce(out)
        return out

    def forward_loop(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor,
                     expert_weights: Optional[tuple[torch.Tensor, torch.Tensor]] = None) -> torch.Tensor:
        """The PyTorch path (any device; reads the per-expert counts on the host): this rank's
        partial output ``[T, H]``, no all-reduce. ``expert_weights``: ``(gate_up, down)`` in place of
        the parameters (a quantized method's dequantized weights)."""
        w_gu, w_down = expert_weights if expert_weights is not None else (self.gate_up_proj, self.down_proj)
        k = ids.shape[1]
        flat = ids.reshape(-1)                                                # [T*k]
        order = torch.argsort(flat, stable=True)
        counts = torch.bincount(flat, minlength=self.num_experts).tolist()
        token_of = order // k                                                 # [T*k] token of each assignment
        weight_of = weights.reshape(-1)[order]                                # [T*k] float32
        out = torch.zeros_like(x)                                             # [T, H]
        b_gu, b_down = self.gate_up_proj_bias, self._down_bias
        start = 0
        for e, n in enumerate(counts):
            if n == 0:
                continue
            tok = token_of[start:start + n]
            gate_up = F.linear(x[tok], w_gu[e], None if b_gu is None else b_gu[e])  # [n, 2I]
            h = F.linear(self.act(gate_up), w_down[e], None if b_down is None else b_down[e])  # [n, H]
            out.index_add_(0, tok, (h * weight_of[start:start + n, None]).to(x.dtype))
            start += n
        return out


class SparseMoeBlock(nn.Module):
    """Router + experts (HF ``MixtralSparseMoeBlock`` / ``Qwen3MoeSparseMoeBlock``);
    ``forward(x [T, H])`` -> ``[T, H]`` (summed over the TP group).

    Parameters: ``gate.weight`` ``[E, H]``, ``experts.gate_up_proj`` ``[E, 2I_l, H]``,
    ``experts.down_proj`` ``[E, H, I_l]`` (see :class:`FusedExperts`). ``router``: any module
    mapping ``x [T, H]`` to ``(weights [T, k] float32, ids [T, k] int64)`` in place of the
    :class:`TopKRouter` built from ``top_k`` / ``renormalize``.
    """

    def __init__(self, hidden_size: int, intermediate_size: int, num_experts: int, top_k: int,
                 act: Union[str, GatedActivation] = "silu", renormalize: bool = True, tp_rank: int = 0,
                 tp_size: int = 1, router: Optional[nn.Module] = None):
        super().__init__()
        self.gate = router if router is not None else TopKRouter(hidden_size, num_experts, top_k, renormalize)
        self.experts = FusedExperts(num_experts, hidden_size, intermediate_size, act, tp_rank=tp_rank,
                                    tp_size=tp_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, ids = self.gate(x)
        return self.experts(x, weights, ids)


def _copy_into(dst: torch.Tensor, loaded: torch.Tensor, what: str) -> None:
    if dst.shape != loaded.shape:
        raise ValueError(f"shape mismatch: {what} {tuple(dst.shape)} vs checkpoint {tuple(loaded.shape)}")
    dst.copy_(loaded)

