"""Linear layers whose parameters carry their own ``weight_loader`` (the nano-vllm / vLLM pattern).

A checkpoint tensor is copied into its parameter by ``param.weight_loader(param, tensor[, shard])``;
merged layers (q/k/v -> qkv, gate/up -> gate_up) place each shard at its offset along dim 0, so one
matmul replaces several while checkpoint names stay those of HF transformers.
"""
from __future__ import annotations

from typing import Optional, Sequence

import torch
import torch.nn.functional as F
from torch import nn


def default_weight_loader(param: nn.Parameter, loaded: torch.Tensor) -> None:
    """Copy ``loaded`` into ``param``. Raises ValueError on a shape mismatch."""
    if param.shape != loaded.shape:
        raise ValueError(f"shape mismatch: parameter {tuple(param.shape)} vs checkpoint {tuple(loaded.shape)}")
    param.data.copy_(loaded)


class Linear(nn.Module):
    """``y = x W^T + b``; ``x: [T, in_features]`` -> ``[T, out_features]``.

    ``transposed=True`` loads checkpoints that store ``W`` as ``[in, out]`` (GPT-2's Conv1D).
    """

    def __init__(self, in_features: int, out_features: int, bias: bool = False, transposed: bool = False):
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.weight = nn.Parameter(torch.empty(out_features, in_features))
        self.weight.weight_loader = self._load_weight if transposed else default_weight_loader
        self.bias = nn.Parameter(torch.empty(out_features)) if bias else None
        if self.bias is not None:
            self.bias.weight_loader = default_weight_loader

    @staticmethod
    def _load_weight(param: nn.Parameter, loaded: torch.Tensor) -> None:
        if loaded.dim() != 2 or loaded.shape[::-1] != param.shape:
            raise ValueError(f"shape mismatch: parameter {tuple(param.shape)} (stored transposed, "
                             f"{tuple(param.shape[::-1])}) vs checkpoint {tuple(loaded.shape)}")
        param.data.copy_(loaded.t())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias)


class MergedLinear(Linear):
    """Several linear layers sharing one input, stacked along the output dim.

    ``output_sizes`` are the shards' widths; ``weight_loader(param, tensor, shard_index)``.
    """

    def __init__(self, in_features: int, output_sizes: Sequence[int], bias: bool = False,
                 transposed: bool = False):
        super().__init__(in_features, sum(output_sizes), bias)
        self.output_sizes = list(output_sizes)
        self.transposed = transposed
        self.weight.weight_loader = self._load_shard
        if self.bias is not None:
            self.bias.weight_loader = self._load_shard

    def _load_shard(self, param: nn.Parameter, loaded: torch.Tensor, shard: Optional[int] = None) -> None:
        if shard is None:  # already merged in the checkpoint (e.g. GPT-2 c_attn)
            default_weight_loader(param, loaded.t() if (self.transposed and loaded.dim() == 2) else loaded)
            return
        if self.transposed and loaded.dim() == 2:
            loaded = loaded.t()
        offset = sum(self.output_sizes[:shard])
        size = self.output_sizes[shard]
        dst = param.data.narrow(0, offset, size)
        if dst.shape != loaded.shape:
            raise ValueError(f"shape mismatch: shard {shard} {tuple(dst.shape)} vs checkpoint {tuple(loaded.shape)}")
        dst.copy_(loaded)


class VocabEmbedding(nn.Embedding):
    """Token embedding ``[vocab_size, hidden_size]``; ``forward(ids [T])`` -> ``[T, hidden_size]``."""

    def __init__(self, num_embeddings: int, embedding_dim: int):
        super().__init__(num_embeddings, embedding_dim)
        self.weight.weight_loader = default_weight_loader


class PositionEmbedding(nn.Embedding):
    """Learned absolute positions (GPT-2 ``wpe``, OPT ``embed_positions``).

    ``forward(positions [T] int64)`` -> ``[T, embedding_dim]``, reading row ``position + offset``
    (OPT's table starts 2 rows late, HF ``OPTLearnedPositionalEmbedding``; GPT-2's offset is 0).
    ``num_embeddings`` is the table's size as stored in the checkpoint, offset rows included.
    """

    def __init__(self, num_embeddings: int, embedding_dim: int, offset: int = 0):
        super().__init__(num_embeddings, embedding_dim)
        self.offset = offset
        self.weight.weight_loader = default_weight_loader

    def forward(self, positions: torch.Tensor) -> torch.Tensor:
        return super().forward(positions + self.offset if self.offset else positions)


class LMHead(nn.Module):
    """Output projection ``[vocab_size, hidden_size]``; ``forward(h [N, H])`` -> float32 logits ``[N, V]``."""

    def __init__(self, vocab_size: int, hidden_size: int, bias: bool = False):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(vocab_size, hidden_size))
        self.weight.weight_loader = default_weight_loader
        self.bias = nn.Parameter(torch.empty(vocab_size)) if bias else None
        if self.bias is not None:
            self.bias.weight_loader = default_weight_loader

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return F.linear(h, self.weight, self.bias).float()
