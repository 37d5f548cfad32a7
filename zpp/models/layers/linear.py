"""Linear layers whose parameters carry their own ``weight_loader`` (the nano-vllm / vLLM pattern).

A checkpoint tensor is copied into its parameter by ``param.weight_loader(param, tensor[, shard])``;
merged layers (q/k/v -> qkv, gate/up -> gate_up) place each shard at its offset along dim 0, so one
matmul replaces several while checkpoint names stay those of HF transformers.

Tensor parallelism (Megatron-LM, Shoeybi et al. 2019, "Megatron-LM: Training Multi-Billion
Parameter Language Models Using Model Parallelism"; the layer split of vLLM's
``ColumnParallelLinear`` / ``RowParallelLinear``): with ``tp_size > 1`` a :class:`MergedLinear` is
*column-parallel* -- rank ``r`` holds rows ``[r * n / tp, (r + 1) * n / tp)`` of every shard's
output dim, so its output is the rank's slice of each shard (its heads, its part of the MLP's
intermediate dim) -- and a :class:`RowParallelLinear` is *row-parallel* -- rank ``r`` holds the
matching slice of the input dim, computes a partial sum, and the partial sums are added over the
TP group by one all-reduce. A column-parallel layer followed by a row-parallel one thus needs no
communication in between. The loaders slice full checkpoint tensors, so a checkpoint loads
unchanged at any ``tp_size`` that divides the sliced dims.
"""
from __future__ import annotations

from typing import Optional, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from zpp import envs
from zpp.models.layers.cpu_linear import PackableWeight, dense_weight, packed_for, packed_linear
from zpp.transport.tensor_parallel import tp_all_reduce


# Batch-1 decode on CUDA uses zpp's Triton GEMV instead of cuBLAS (ZPP_TRITON_GEMV=0: cuBLAS, for A/B runs).
# Measured inside CUDA graphs on one H200 (scripts/gemv_sweep.py, Llama-3-8B shapes): 107 us per layer's
# four products vs cuBLAS's 117 us (cuBLAS picks split-K kernels plus a reduce kernel for o and down).
_TRITON_GEMV = envs.ZPP_TRITON_GEMV


def linear(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor] = None, fp8=None) -> torch.Tensor:
    """``F.linear(x, weight, bias)``: ``x [T, in]``, ``weight [out, in]`` -> ``[T, out]``. A single
    CUDA token in bf16/fp16 (decode at batch 1) goes to :func:`~zpp.models.layers.triton_ops.gemv`.
    ``fp8`` (a :class:`zpp.models.quantization.fp8.Fp8Params`): ``weight`` is float8_e4m3fn with those
    scales, computed by :func:`zpp.models.quantization.fp8_linear.fp8_linear`."""
    if fp8 is not None:
        from zpp.models.quantization.fp8_linear import fp8_linear
        return fp8_linear(x, weight, fp8, bias)
    if (_TRITON_GEMV and x.is_cuda and x.dim() == 2 and x.shape[0] == 1 and x.dtype in (torch.bfloat16, torch.float16)
            and x.stride(1) == 1 and weight.stride(1) == 1 and weight.dtype == x.dtype):
        from zpp.models.layers.triton_ops import gemv, gemv_config
        return gemv(x, weight, bias, **gemv_config(weight.shape[0], weight.shape[1]))
    return F.linear(x, weight, bias)


def default_weight_loader(param: nn.Parameter, loaded: torch.Tensor) -> None:
    """Copy ``loaded`` into ``param``. Raises ValueError on a shape mismatch."""
    if param.shape != loaded.shape:
        raise ValueError(f"shape mismatch: parameter {tuple(param.shape)} vs checkpoint {tuple(loaded.shape)}")
    param.data.copy_(loaded)


class Linear(PackableWeight):
    """``y = x W^T + b``; ``x: [T, in_features]`` -> ``[T, out_features]``.

    ``transposed=True`` loads checkpoints that store ``W`` as ``[in, out]`` (GPT-2's Conv1D).

    FP8 (``zpp.models.quantization``): ``fp8`` is None unless the weight was made float8_e4m3fn, with
    a ``weight_scale`` (and maybe ``input_scale``) next to it; ``fp8_allowed = False`` on an instance
    keeps its weight in the model dtype (a family that reads the weight outside ``forward``).
    """

    fp8 = None
    fp8_allowed = True
    quant_method = None
    """The :class:`zpp.models.quantization.base.LinearMethod` that made the weight quantized, else None."""
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
        if self.weight is None:  # a quantized method holds the weight in its own parameters (W4A16)
            return self.quant_method.apply(self, x, self.bias)
        packed = packed_for(self, x)
        if packed is not None:
            return packed_linear(x, packed, self.bias)
        return linear(x, dense_weight(self), self.bias, self.fp8)


class MergedLinear(Linear):
    """Several linear layers sharing one input, stacked along the output dim; column-parallel when
    ``tp_size > 1``.

    ``output_sizes`` are the shards' full widths (as in the checkpoint); this rank holds
    ``output_sizes[i] // tp_size`` rows of shard ``i``, namely rows
    ``[tp_rank * w_i, (tp_rank + 1) * w_i)`` with ``w_i = output_sizes[i] // tp_size``, so
    ``forward(x [T, in_features])`` returns ``[T, sum(w_i)]``: the rank's slice of every shard,
    concatenated. ``self.output_sizes`` holds the local widths ``w_i``.
    ``weight_loader(param, tensor, shard_index)`` takes the full checkpoint tensor of one shard
    (``shard_index=None``: all shards already concatenated, e.g. GPT-2 ``c_attn``).

    Raises:
        ValueError: an output size is not divisible by ``tp_size`` (construction), or a checkpoint
            tensor's shape does not match (loading).
    """

    def __init__(self, in_features: int, output_sizes: Sequence[int], bias: bool = False,
                 transposed: bool = False, tp_rank: int = 0, tp_size: int = 1):
        if any(n % tp_size for n in output_sizes):
            raise ValueError(f"output sizes {list(output_sizes)} are not divisible by tensor-parallel size {tp_size}")
        local = [n // tp_size for n in output_sizes]
        super().__init__(in_features, sum(local), bias)
        self.output_sizes = local
        self.full_output_sizes = list(output_sizes)
        self.tp_rank, self.tp_size = tp_rank, tp_size
        self.transposed = transposed
        self.weight.weight_loader = self._load_shard
        if self.bias is not None:
            self.bias.weight_loader = self._load_shard

    def _load_shard(self, param: nn.Parameter, loaded: torch.Tensor, shard: Optional[int] = None) -> None:
        if self.transposed and loaded.dim() == 2:
            loaded = loaded.t()
        if shard is None:  # already merged in the checkpoint (e.g. GPT-2 c_attn)
            if self.tp_size == 1:
                default_weight_loader(param, loaded)
                return
            if loaded.shape[0] != sum(self.full_output_sizes):
                raise ValueError(f"shape mismatch: merged checkpoint tensor {tuple(loaded.shape)} vs output "
                                 f"sizes {self.full_output_sizes}")
            for i, part in enumerate(loaded.split(self.full_output_sizes, dim=0)):
                self._copy_shard(param, part, i)
            return
        self._copy_shard(param, loaded, shard)

    def _copy_shard(self, param: nn.Parameter, loaded: torch.Tensor, shard: int) -> None:
        """Copy this rank's rows of shard ``shard`` (full tensor ``loaded``, output dim first)."""
        size = self.output_sizes[shard]
        dst = param.data.narrow(0, sum(self.output_sizes[:shard]), size)
        full = (self.full_output_sizes[shard],) + tuple(dst.shape[1:])
        if tuple(loaded.shape) != full:
            raise ValueError(f"shape mismatch: shard {shard} {full} vs checkpoint {tuple(loaded.shape)}")
        dst.copy_(loaded.narrow(0, self.tp_rank * size, size) if self.tp_size > 1 else loaded)


class RowParallelLinear(Linear):
    """``y = x W^T + b`` with ``W``'s input dim split over the tensor-parallel group (Megatron-LM's
    row-parallel linear layer; vLLM's ``RowParallelLinear``).

    ``in_features`` is the full input width; this rank holds columns
    ``[tp_rank * k, (tp_rank + 1) * k)`` of ``W`` (``k = in_features // tp_size``), so ``weight`` is
    ``[out_features, k]`` and ``forward(x [T, k])`` -- ``x`` being this rank's slice of the input, as
    a column-parallel layer produces it -- computes the partial product, sums it over the TP group
    with one all-reduce (:func:`zpp.transport.tensor_parallel.tp_all_reduce`) and then adds the
    (replicated, full) bias once: ``[T, out_features]``, identical on every rank. With
    ``tp_size == 1`` it is exactly :class:`Linear` (no all-reduce).

    Raises:
        ValueError: ``in_features`` is not divisible by ``tp_size`` (construction), or a checkpoint
            tensor's shape does not match (loading).
    """

    def __init__(self, in_features: int, out_features: int, bias: bool = False, tp_rank: int = 0,
                 tp_size: int = 1):
        if in_features % tp_size:
            raise ValueError(f"input size {in_features} is not divisible by tensor-parallel size {tp_size}")
        super().__init__(in_features // tp_size, out_features, bias)
        self.full_in_features = in_features
        self.tp_rank, self.tp_size = tp_rank, tp_size
        self.weight.weight_loader = self._load_weight_slice

    def _load_weight_slice(self, param: nn.Parameter, loaded: torch.Tensor) -> None:
        k = self.in_features
        if tuple(loaded.shape) != (self.out_features, self.full_in_features):
            raise ValueError(f"shape mismatch: parameter {(self.out_features, self.full_in_features)} (before the "
                             f"tensor-parallel split) vs checkpoint {tuple(loaded.shape)}")
        param.data.copy_(loaded.narrow(1, self.tp_rank * k, k) if self.tp_size > 1 else loaded)

    def forward(self, x: torch.Tensor, reduce: bool = True) -> torch.Tensor:
        """``reduce=False``: this rank's partial product ``[T, out_features]`` without the
        all-reduce, the bias added on TP rank 0 only (so a caller summing several row-parallel
        partials and all-reducing once adds it once)."""
        if self.weight is None:  # a quantized method holds the weight in its own parameters (W4A16)
            return self._reduced(lambda bias: self.quant_method.apply(self, x, bias), reduce)
        packed = packed_for(self, x)
        if packed is not None:
            return self._reduced(lambda bias: packed_linear(x, packed, bias), reduce)
        return self._reduced(lambda bias: linear(x, dense_weight(self), bias, self.fp8), reduce)

    def forward_fp8_input(self, xq: torch.Tensor, xs: torch.Tensor, dtype: torch.dtype,
                          reduce: bool = True) -> torch.Tensor:
        """:meth:`forward` of an input its producer already quantized per token (``xq [T, k]``
        float8_e4m3fn, ``xs [T, 1]`` float32; only where :func:`~zpp.models.quantization.fp8_linear.fuses_input_quant`
        allows it), output in ``dtype``."""
        from zpp.models.quantization.fp8_linear import fp8_linear_quantized
        return self._reduced(lambda bias: fp8_linear_quantized(xq, xs, self.weight, self.fp8, bias, dtype), reduce)

    def _reduced(self, mm, reduce: bool) -> torch.Tensor:
        """``mm(bias)`` (this rank's product) summed over the tensor-parallel group as :meth:`forward` says."""
        if self.tp_size == 1:
            return mm(self.bias)
        if not reduce:
            return mm(self.bias if self.tp_rank == 0 else None)
        y = tp_all_reduce(mm(None))
        return y if self.bias is None else y + self.bias


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


class LMHead(PackableWeight):
    """Output projection ``[vocab_size, hidden_size]``; ``forward(h [N, H])`` -> float32 logits ``[N, V]``
    (``upcast=False``: in the weights' dtype, for callers that only take the argmax, which is the
    same either way since every bf16 / fp16 value is exact in float32)."""

    def __init__(self, vocab_size: int, hidden_size: int, bias: bool = False):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(vocab_size, hidden_size))
        self.weight.weight_loader = default_weight_loader
        self.bias = nn.Parameter(torch.empty(vocab_size)) if bias else None
        if self.bias is not None:
            self.bias.weight_loader = default_weight_loader

    def forward(self, h: torch.Tensor, upcast: bool = True) -> torch.Tensor:
        packed = packed_for(self, h)
        if packed is not None:
            out = packed_linear(h, packed, self.bias)
        else:
            # through linear(): a batch-1 CUDA step takes zpp's Triton GEMV, which read the Llama-3
            # LM head (128256 x 4096 bf16) in 328 us against cuBLAS's 353 on one H100 (in a CUDA
            # graph, scripts/fp8_gemv_card_sweep.py)
            out = linear(h, dense_weight(self), self.bias)
        return out.float() if upcast else out
