"""The GPU methods of 4-bit weights (W4A16: bf16 / fp16 activations, 4-bit weights dequantized in
registers by :mod:`zpp.models.quantization.w4a16_kernels`): :class:`W4A16LinearMethod` for a linear
layer, :class:`W4A16MoEMethod` for a :class:`~zpp.models.layers.moe.FusedExperts`. A format
(MXFP4, compressed-tensors ``pack-quantized``, GPTQ, AWQ) repacks its checkpoint tensors into the
one 4-bit layout (:mod:`zpp.models.quantization.w4_layout`) and hands them to these parameters'
loaders under canonical names; the methods keep them as they are (the kernels read that layout).

Linear layer parameters (``N`` this rank's output rows, ``K`` its input columns, ``G`` the group
size; the model-dtype ``weight`` is removed):

* ``qweight`` uint8 ``[N, K // 2]``, ``scales`` ``[N, K // G]`` (uint8 E8M0 for ``mxfp4``; the model
  dtype for ``int4``, whatever float dtype the format hands over is converted), ``zeros`` uint8
  ``[N, K // G]`` (``int4`` with zero points only);
* canonical names ``X.qweight`` / ``X.scales`` / ``X.zeros`` for a checkpoint layer ``X``, mapped by
  the family like ``X.weight`` (``q_proj`` -> shard 0 of ``qkv_proj``): a merged (column-parallel)
  layer's loader takes one shard's full tensors (or all shards concatenated, shard None) and keeps
  this rank's rows; a row-parallel layer's keeps this rank's columns (``K // 2`` bytes, ``K // G``
  groups: ``K`` a multiple of ``G`` on every rank).

Expert parameters (``I_l = I / tp_size``; ``gate_up_proj`` / ``down_proj`` are removed, biases stay
as they are):

* ``gate_up_proj_qweight`` ``[E, 2 I_l, H // 2]``, ``gate_up_proj_scales`` / ``_zeros``
  ``[E, 2 I_l, H // G]``; ``down_proj_qweight`` ``[E, H, I_l // 2]``, ``down_proj_scales`` /
  ``_zeros`` ``[E, H, I_l // G]``;
* canonical names: per expert, the family maps ``experts.{e}.gate_proj.qweight`` as its weight, to
  shard ``2e`` of ``experts.gate_up_proj_qweight`` (``up_proj``: ``2e + 1``, ``down_proj``: shard ``e``
  of ``experts.down_proj_qweight``; likewise ``scales`` / ``zeros``: the ``_suffix`` convention of
  the FP8 experts' ``X_scale``); fused, ``experts.gate_up_proj_qweight`` ``[E, 2I, H // 2]`` (never
  transposed: the layout is always ``[.., N, K // 2]``) with gate rows then up rows, or for
  ``checkpoint_layout="gpt_oss"`` interleaved rows (gate even, up odd) as gpt-oss's ``*_blocks`` hold
  them, and ``experts.down_proj_qweight`` ``[E, H, I // 2]``.

The product: CUDA -> :func:`~zpp.models.quantization.w4a16_kernels.w4a16_linear` /
:func:`~zpp.models.quantization.w4a16_kernels.fused_moe_w4a16` (gpt-oss's expert biases and clamped
SwiGLU included); elsewhere (the CPU tests of the loading path) the weights are dequantized with
:func:`~zpp.models.quantization.w4_layout.dequantize_w4` inside the forward.
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

from zpp.models.quantization.base import FusedMoEMethod, LinearMethod
from zpp.models.quantization.w4_layout import FORMATS, dequantize_w4

GROUP_SIZES = (32, 64, 128)


def _check_args(fmt: str, group_size: int, zeros: bool) -> None:
    if fmt not in FORMATS:
        raise ValueError(f"unknown 4-bit format {fmt!r} (one of {', '.join(FORMATS)})")
    if group_size not in GROUP_SIZES:
        raise ValueError(f"W4A16 group size {group_size} is not one of {GROUP_SIZES}")
    if zeros and fmt != "int4":
        raise ValueError("zero points exist for int4 weights only")


def _param(t: torch.Tensor, loader) -> nn.Parameter:
    p = nn.Parameter(t, requires_grad=False)
    p.weight_loader = loader
    return p


def _copy(dst: torch.Tensor, src: torch.Tensor, what: str) -> None:
    if dst.shape != src.shape:
        raise ValueError(f"shape mismatch: {what} {tuple(dst.shape)} vs checkpoint {tuple(src.shape)}")
    dst.copy_(src)


def _cols(param: nn.Parameter, loaded: torch.Tensor, tp_rank: int, tp_size: int, what: str) -> torch.Tensor:
    """This rank's slice of the last (packed K or group) dim of a full tensor ``loaded``."""
    w = param.shape[-1]
    if loaded.shape[-1] != w * tp_size:
        raise ValueError(f"shape mismatch: {what} has {loaded.shape[-1]} columns, expected {w * tp_size} "
                         f"(before the tensor-parallel split)")
    return loaded.narrow(loaded.dim() - 1, tp_rank * w, w) if tp_size > 1 else loaded


# --- linear layers --------------------------------------------------------------------------------------
def w4_linear_layout_ok(mod: nn.Module, group_size: int) -> bool:
    """Whether a linear layer can hold 4-bit weights of ``group_size``: not a transposed (Conv1D)
    layer, not marked ``fp8_allowed = False`` (a layer whose weight the family reads itself), and
    this rank's input width a multiple of the group size."""
    if getattr(mod, "transposed", False) or not getattr(mod, "fp8_allowed", True):
        return False
    return mod.in_features % group_size == 0


class W4A16LinearMethod(LinearMethod):
    """A linear layer with a 4-bit weight: ``fmt`` ``int4`` / ``mxfp4``, ``group_size`` 32, 64 or
    128, ``zeros``: the format carries zero points (``int4`` only; else the symmetric 8).

    Raises:
        ValueError: an unknown format or group size, zero points for mxfp4, or (``create_weights``)
            a layer whose input width is not a multiple of the group size.
    """

    def __init__(self, fmt: str, group_size: int, zeros: bool = False):
        _check_args(fmt, group_size, zeros)
        self.fmt, self.group_size, self.has_zeros = fmt, group_size, zeros

    def create_weights(self, layer: nn.Module) -> None:
        from zpp.models.layers.linear import MergedLinear, RowParallelLinear, default_weight_loader
        if not w4_linear_layout_ok(layer, self.group_size):
            raise ValueError(f"a linear layer of {layer.in_features} input columns cannot hold 4-bit weights "
                             f"of group size {self.group_size}")
        old = layer.weight
        N, K, G = layer.out_features, layer.in_features, self.group_size
        device = old.device
        if isinstance(layer, MergedLinear):
            loader = layer._load_shard                    # rows of a shard, this rank's slice: any trailing dims
        elif isinstance(layer, RowParallelLinear) and layer.tp_size > 1:
            def loader(param, loaded, _m=layer):
                _copy(param.data, _cols(param, loaded, _m.tp_rank, _m.tp_size, "4-bit weight"), "4-bit weight")
        else:
            loader = default_weight_loader
        sdtype = torch.uint8 if self.fmt == "mxfp4" else (old.dtype if old.dtype.is_floating_point else torch.bfloat16)
        layer.qweight = _param(torch.zeros(N, K // 2, dtype=torch.uint8, device=device), loader)
        layer.scales = _param(torch.zeros(N, K // G, dtype=sdtype, device=device), loader)
        layer.zeros = _param(torch.zeros(N, K // G, dtype=torch.uint8, device=device), loader) \
            if self.has_zeros else None
        layer.weight = None
        layer.quant_method = self
        del old

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        """Nothing to repack: the kernels read the loaded layout (made contiguous)."""
        for name in ("qweight", "scales", "zeros"):
            p = getattr(layer, name, None)
            if p is not None and not p.is_contiguous():
                p.data = p.data.contiguous()

    def apply(self, layer: nn.Module, x: torch.Tensor, bias: Optional[torch.Tensor]) -> torch.Tensor:
        if x.is_cuda:
            from zpp.models.quantization.w4a16_kernels import w4a16_linear
            return w4a16_linear(x, layer.qweight, layer.scales, layer.zeros, self.group_size, self.fmt, bias)
        w = dequantize_w4(layer.qweight, layer.scales, layer.zeros, self.group_size, self.fmt, x.dtype)
        return F.linear(x, w, bias)

    def dequantized(self, layer: nn.Module, dtype: torch.dtype) -> torch.Tensor:
        """The weight ``[N, K]`` in ``dtype`` (the reference)."""
        return dequantize_w4(layer.qweight, layer.scales, layer.zeros, self.group_size, self.fmt, dtype)


# --- experts -----------------------------------------------------------------------------------------------
def w4_moe_layout_ok(experts: nn.Module, group_size: int) -> bool:
    """Whether experts can hold 4-bit weights of ``group_size``: the hidden size and this rank's
    intermediate size multiples of it (the K of gate_up and of down)."""
    return experts.hidden_size % group_size == 0 and experts.intermediate_size % group_size == 0


class W4A16MoEMethod(FusedMoEMethod):
    """Experts with 4-bit weights (arguments as :class:`W4A16LinearMethod`'s).

    Raises:
        ValueError: as :class:`W4A16LinearMethod`; (``create_weights``) experts whose hidden or
            per-rank intermediate size is not a multiple of the group size.
    """

    def __init__(self, fmt: str, group_size: int, zeros: bool = False):
        _check_args(fmt, group_size, zeros)
        self.fmt, self.group_size, self.has_zeros = fmt, group_size, zeros

    def create_weights(self, experts: nn.Module) -> None:
        if not w4_moe_layout_ok(experts, self.group_size):
            raise ValueError(f"experts of hidden size {experts.hidden_size} and intermediate size "
                             f"{experts.intermediate_size} (this rank) cannot hold 4-bit weights of group size "
                             f"{self.group_size}")
        E, H, I, G = experts.num_experts, experts.hidden_size, experts.intermediate_size, self.group_size
        old = experts.gate_up_proj
        device = old.device
        sdtype = torch.uint8 if self.fmt == "mxfp4" else (old.dtype if old.dtype.is_floating_point else torch.bfloat16)
        for proj, N, K, loader, shards in (("gate_up_proj", 2 * I, H, self._load_gate_up, 2 * E),
                                           ("down_proj", H, I, self._load_down, E)):
            parts = [("qweight", K // 2, torch.uint8), ("scales", K // G, sdtype)]
            if self.has_zeros:
                parts.append(("zeros", K // G, torch.uint8))
            for suffix, cols, dt in parts:
                p = _param(torch.zeros(E, N, cols, dtype=dt, device=device),
                           lambda param, loaded, shard=None, _f=loader, _m=experts: _f(_m, param, loaded, shard))
                p.num_shards = shards
                setattr(experts, f"{proj}_{suffix}", p)
            if not self.has_zeros:
                setattr(experts, f"{proj}_zeros", None)
            setattr(experts, proj, None)
        experts.quant_method = self
        del old

    # --- loaders (the w4_layout's tensors: rows first, packed K or groups last) ------------------------
    @staticmethod
    def _load_gate_up(experts, param, loaded: torch.Tensor, shard: Optional[int]) -> None:
        """Shard ``2e`` / ``2e + 1``: expert ``e``'s gate / up ``[I, cols]``; None: all experts
        fused ``[E, 2I, cols]`` (gate rows then up rows, interleaved for the gpt_oss layout)."""
        I = experts.intermediate_size
        if shard is not None:
            e, part = divmod(shard, 2)
            if not 0 <= e < experts.num_experts:
                raise ValueError(f"expert {e} out of range (the layer has {experts.num_experts})")
            _copy(param.data[e].narrow(0, part * I, I), experts._slice(loaded, 0), f"4-bit expert shard {shard}")
            return
        if loaded.dim() != 3 or loaded.shape[1] != 2 * experts.full_intermediate_size:
            raise ValueError(f"shape mismatch: fused 4-bit gate/up {tuple(loaded.shape)}, expected "
                             f"{2 * experts.full_intermediate_size} rows per expert")
        if experts.layout == "gpt_oss":
            gate, up = loaded[:, 0::2], loaded[:, 1::2]
        else:
            gate, up = loaded.chunk(2, dim=1)
        _copy(param.data, torch.cat([experts._slice(gate, 1), experts._slice(up, 1)], dim=1), "fused 4-bit gate/up")

    @staticmethod
    def _load_down(experts, param, loaded: torch.Tensor, shard: Optional[int]) -> None:
        """Shard ``e``: expert ``e``'s ``[H, cols]``; None: all experts ``[E, H, cols]``; this rank's
        columns of the intermediate (K) dim."""
        src = _cols(param, loaded, experts.tp_rank, experts.tp_size, "4-bit down")
        if shard is None:
            _copy(param.data, src, "fused 4-bit down")
            return
        if not 0 <= shard < experts.num_experts:
            raise ValueError(f"expert {shard} out of range (the layer has {experts.num_experts})")
        _copy(param.data[shard], src, f"4-bit expert shard {shard}")

    # --- compute -------------------------------------------------------------------------------------------
    def weights(self, experts: nn.Module) -> tuple[tuple, tuple]:
        """``((qweight, scales, zeros) of gate_up, (...) of down)``."""
        return tuple(tuple(getattr(experts, f"{p}_{s}") for s in ("qweight", "scales", "zeros"))
                     for p in ("gate_up_proj", "down_proj"))

    def apply(self, experts: nn.Module, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        gu, dn = self.weights(experts)
        if x.is_cuda:
            from zpp.models.quantization.w4a16_kernels import fused_moe_w4a16
            return fused_moe_w4a16(x, gu, dn, self.group_size, self.fmt, weights, ids, experts.act,
                                   experts.gate_up_proj_bias, experts._down_bias)
        return experts.forward_loop(x, weights, ids, self.dequantized(experts, x.dtype))

    def dequantized(self, experts: nn.Module, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """``(gate_up [E, 2 I_l, H], down [E, H, I_l])`` dequantized to ``dtype`` (the reference path)."""
        gu, dn = self.weights(experts)
        return (dequantize_w4(*gu, self.group_size, self.fmt, dtype), dequantize_w4(*dn, self.group_size, self.fmt, dtype))

    def variant(self, experts: nn.Module, num_assignments: int) -> tuple:
        """The Triton variants a forward of ``num_assignments`` (``T * k``) launches (for
        :func:`zpp.models.layers.moe_warmup.moe_variant`)."""
        from zpp.models.quantization import w4a16_kernels as K
        E, I2 = experts.gate_up_proj_qweight.shape[:2]
        H = experts.hidden_size
        M = num_assignments
        if K.use_w4_moe_gemv(M, E, I2, H):
            return ("w4-gemv",)
        c1 = K.w4_moe_gemm_config(M, E, I2, H)
        c2 = dict(K.w4_moe_gemm_config(M, E, H, I2 // 2), BLOCK_M=c1["BLOCK_M"])
        return ("w4-gemm", tuple(sorted(c1.items())), tuple(sorted(c2.items())), 1 if M == 1 else 16 if M % 16 == 0 else 0)
