"""Sparse mixture-of-experts feed-forward block (Mixtral; Jiang et al. 2024, "Mixtral of Experts").

Follows HF transformers' ``MixtralSparseMoeBlock`` = ``MixtralTopKRouter`` + ``MixtralExperts``:

* router: ``logits = x W_g^T`` ``[T, E]``; ``probs = softmax(logits)`` in float32; keep the top-k
  experts per token and renormalise their weights to sum to 1;
* experts: each is a gated MLP ``down(act(gate(x)) * up(x))``; expert ``e``'s gate and up matrices
  are stacked in ``gate_up_proj[e]`` ``[2I, H]`` (gate first) and its down matrix is
  ``down_proj[e]`` ``[H, I]`` -- the fused layout HF 5.x keeps in memory;
* output: ``sum_k weight_k * expert_k(x)``, accumulated expert by expert in index order (as HF).

Checkpoints in either layout load: fused 3-D tensors (shard ``None``) or one ``[I, H]`` / ``[H, I]``
matrix per expert (``w1`` = gate, ``w3`` = up, ``w2`` = down), placed by shard index (see
:meth:`FusedExperts.load_gate_up` and :meth:`FusedExperts.load_down`).
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

from zpp.models.layers.activation import get_activation
from zpp.models.layers.linear import default_weight_loader


class TopKRouter(nn.Module):
    """``forward(x [T, H])`` -> ``(weights [T, k] float32, expert ids [T, k] int64)``."""

    def __init__(self, hidden_size: int, num_experts: int, top_k: int, renormalize: bool = True):
        super().__init__()
        self.top_k, self.renormalize = top_k, renormalize
        self.weight = nn.Parameter(torch.empty(num_experts, hidden_size))
        self.weight.weight_loader = default_weight_loader

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        probs = F.softmax(F.linear(x, self.weight).float(), dim=-1)          # [T, E] float32
        weights, ids = torch.topk(probs, self.top_k, dim=-1)                  # [T, k]
        if self.renormalize:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return weights, ids


class FusedExperts(nn.Module):
    """``num_experts`` gated MLPs held as 3-D tensors.

    ``forward(x [T, H], weights [T, k] float32, ids [T, k] int64)`` -> ``[T, H]`` in ``x.dtype``.
    Assignments are sorted by expert once (one host sync for the per-expert counts), then each
    expert that received tokens runs two matmuls on its contiguous slice.
    """

    def __init__(self, num_experts: int, hidden_size: int, intermediate_size: int, act: str = "silu"):
        super().__init__()
        self.num_experts, self.intermediate_size = num_experts, intermediate_size
        self.act = get_activation(act)
        self.gate_up_proj = nn.Parameter(torch.empty(num_experts, 2 * intermediate_size, hidden_size))
        self.gate_up_proj.weight_loader = self.load_gate_up
        self.gate_up_proj.num_shards = 2 * num_experts
        self.down_proj = nn.Parameter(torch.empty(num_experts, hidden_size, intermediate_size))
        self.down_proj.weight_loader = self.load_down
        self.down_proj.num_shards = num_experts

    def load_gate_up(self, param: nn.Parameter, loaded: torch.Tensor, shard: Optional[int] = None) -> None:
        """Shard ``None``: the fused ``[E, 2I, H]`` tensor; shard ``2e`` / ``2e + 1``: expert ``e``'s
        gate (``w1``) / up (``w3``) matrix ``[I, H]``."""
        if shard is None:
            return default_weight_loader(param, loaded)
        e, part = divmod(shard, 2)
        _copy_into(param.data[e].narrow(0, part * self.intermediate_size, self.intermediate_size), loaded, shard)

    def load_down(self, param: nn.Parameter, loaded: torch.Tensor, shard: Optional[int] = None) -> None:
        """Shard ``None``: the fused ``[E, H, I]`` tensor; shard ``e``: expert ``e``'s ``w2`` ``[H, I]``."""
        if shard is None:
            return default_weight_loader(param, loaded)
        _copy_into(param.data[shard], loaded, shard)

    def forward(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        k = ids.shape[1]
        flat = ids.reshape(-1)                                                # [T*k]
        order = torch.argsort(flat, stable=True)
        counts = torch.bincount(flat, minlength=self.num_experts).tolist()
        token_of = order // k                                                 # [T*k] token of each assignment
        weight_of = weights.reshape(-1)[order]                                # [T*k] float32
        out = torch.zeros_like(x)                                             # [T, H]
        start = 0
        for e, n in enumerate(counts):
            if n == 0:
                continue
            tok = token_of[start:start + n]
            gate, up = F.linear(x[tok], self.gate_up_proj[e]).chunk(2, dim=-1)  # [n, I] each
            h = F.linear(self.act(gate) * up, self.down_proj[e])             # [n, H]
            out.index_add_(0, tok, (h * weight_of[start:start + n, None]).to(x.dtype))
            start += n
        return out


class SparseMoeBlock(nn.Module):
    """Router + experts (HF ``MixtralSparseMoeBlock``); ``forward(x [T, H])`` -> ``[T, H]``.

    Parameters: ``gate.weight`` ``[E, H]``, ``experts.gate_up_proj`` ``[E, 2I, H]``,
    ``experts.down_proj`` ``[E, H, I]``.
    """

    def __init__(self, hidden_size: int, intermediate_size: int, num_experts: int, top_k: int,
                 act: str = "silu", renormalize: bool = True):
        super().__init__()
        self.gate = TopKRouter(hidden_size, num_experts, top_k, renormalize)
        self.experts = FusedExperts(num_experts, hidden_size, intermediate_size, act)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, ids = self.gate(x)
        return self.experts(x, weights, ids)


def _copy_into(dst: torch.Tensor, loaded: torch.Tensor, shard: int) -> None:
    if dst.shape != loaded.shape:
        raise ValueError(f"shape mismatch: expert shard {shard} {tuple(dst.shape)} vs checkpoint {tuple(loaded.shape)}")
    dst.copy_(loaded)
