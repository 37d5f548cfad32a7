"""FP8 (e4m3) expert weights of a :class:`~zpp.models.layers.moe.FusedExperts` on a GPU with FP8:
:class:`Fp8MoEMethod` (vLLM's ``Fp8MoEMethod``), chosen by :meth:`zpp.models.quantization.fp8.Fp8Config.moe_method`
for an FP8 checkpoint, and by :func:`quantize_experts` for ``--quantization fp8`` / dummy weights.

Parameters (local sizes, ``I_l = I / tp_size``): ``gate_up_proj`` ``[E, 2 I_l, H]`` and ``down_proj``
``[E, H, I_l]`` float8_e4m3fn (the same loaders as the bf16 ones: per-expert shards or fused), and
float32 scales ``gate_up_proj_scale`` / ``down_proj_scale``:

* per output channel: ``[E, 2 I_l]`` / ``[E, H]`` (a per-tensor checkpoint scale -- one per expert
  projection -- is broadcast to its rows, so gate and up with two scales merge into one gate_up);
* block ``(bn, bk)`` (``weight_scale_inv``): ``[E, 2 I_l / bn, ceil(H / bk)]`` /
  ``[E, ceil(H / bn), I_l / bk]`` (``I_l`` a multiple of ``bn`` and ``bk``, so gate and up never
  share a scale row and each tensor-parallel slice starts on a block).

Checkpoint scales load under canonical names (:meth:`~zpp.models.quantization.fp8.Fp8Config.plan_kept`):
per-expert ``...experts.{e}.gate_proj.weight_scale`` (each family maps it to shard ``2e`` of
``experts.gate_up_proj_scale``, as its weight), fused ``...experts.gate_up_proj_scale``.

The product: the grouped FP8 MoE kernels (:func:`zpp.models.quantization.fp8_moe_kernels.fused_moe_fp8`:
W8A8 grouped GEMMs with activations quantized per token -- per token and ``bk`` group for block
weights -- and a W8A16 grouped GEMV for decode) on CUDA; elsewhere (tests of the loading path on
the CPU) the experts are dequantized inside the forward and run as the bf16 loop.
"""
from __future__ import annotations

from typing import Optional

import torch
from torch import nn

from zpp.models.quantization.base import FusedMoEMethod
from zpp.models.quantization.fp8_utils import FP8_DTYPE, dequantize, quantize_block, quantize_per_channel

MOE_CHECKPOINT_LAYOUTS = ("hf",)
"""Fused checkpoint layouts whose FP8 experts stay FP8 (gpt-oss's interleaved one is dequantized)."""


def moe_layout_ok(experts: nn.Module, block: Optional[tuple[int, int]]) -> bool:
    """Whether the experts' shapes suit the FP8 MoE kernels: with block scales, this rank's
    intermediate size ``I_l`` a multiple of both block sides (gate and up never share a scale row;
    the row-parallel down's K slice starts on a block)."""
    if block is None:
        return True
    I = experts.intermediate_size
    return I % block[0] == 0 and I % block[1] == 0


class Fp8MoEMethod(FusedMoEMethod):
    """Experts with e4m3 weights: ``block`` ``(bn, bk)`` or None (per output channel);
    ``strict_scales``: the scales are parameters the strict loader must fill (a checkpoint), else
    buffers (quantized after loading)."""

    def __init__(self, block: Optional[tuple[int, int]] = None, strict_scales: bool = True):
        self.block, self.strict_scales = block, strict_scales

    # --- parameters -----------------------------------------------------------------------------
    def scale_shapes(self, experts: nn.Module) -> tuple[tuple[int, ...], tuple[int, ...]]:
        """Shapes of ``gate_up_proj_scale`` and ``down_proj_scale``."""
        E, H, I = experts.num_experts, experts.hidden_size, experts.intermediate_size
        if self.block is None:
            return (E, 2 * I), (E, H)
        bn, bk = self.block
        return (E, 2 * I // bn, -(-H // bk)), (E, -(-H // bn), I // bk)

    def create_weights(self, experts: nn.Module) -> None:
        for name in ("gate_up_proj", "down_proj"):
            old = getattr(experts, name)
            w = nn.Parameter(torch.empty(old.shape, dtype=FP8_DTYPE, device=old.device), requires_grad=False)
            w.weight_loader, w.num_shards = old.weight_loader, old.num_shards
            setattr(experts, name, w)
            del old
        gu_shape, d_shape = self.scale_shapes(experts)
        device = experts.gate_up_proj.device
        for name, shape, loader, shards in (
                ("gate_up_proj_scale", gu_shape, self._load_gate_up_scale, 2 * experts.num_experts),
                ("down_proj_scale", d_shape, self._load_down_scale, experts.num_experts)):
            t = torch.ones(shape, dtype=torch.float32, device=device)
            if self.strict_scales:
                p = nn.Parameter(t, requires_grad=False)
                p.weight_loader = lambda param, loaded, shard=None, _f=loader, _m=experts: _f(_m, param, loaded, shard)
                p.num_shards = shards
                setattr(experts, name, p)
            else:
                experts.register_buffer(name, t, persistent=False)
        experts.quant_method = self

    # --- scale loaders (canonical scales: per channel [..., N], or block grids) -----------------
    def _rows(self, experts: nn.Module) -> int:
        """Scale rows of one expert's gate (or up) on this rank."""
        I = experts.intermediate_size
        return I if self.block is None else I // self.block[0]

    def _load_gate_up_scale(self, experts, param, loaded: torch.Tensor, shard: Optional[int]) -> None:
        r = self._rows(experts)
        if shard is not None:
            e, part = divmod(shard, 2)
            if not 0 <= e < experts.num_experts:
                raise ValueError(f"expert {e} out of range (the layer has {experts.num_experts})")
            src = loaded.narrow(0, experts.tp_rank * r, r)
            _copy(param.data[e].narrow(0, part * r, r), src, f"scale of expert shard {shard}")
            return
        E = experts.num_experts
        if loaded.dim() <= 1 or tuple(loaded.shape[1:]) == (1,):   # one scale per expert (or one in all)
            loaded = loaded.reshape(-1, 1).expand(E, 2 * r * experts.tp_size)
        gate, up = loaded.chunk(2, dim=1)
        sl = lambda t: t.narrow(1, experts.tp_rank * r, r)
        _copy(param.data, torch.cat([sl(gate), sl(up)], dim=1), "fused gate/up scale")

    def _load_down_scale(self, experts, param, loaded: torch.Tensor, shard: Optional[int]) -> None:
        E = experts.num_experts
        if shard is None and (loaded.dim() <= 1 or tuple(loaded.shape[1:]) == (1,)):
            loaded = loaded.reshape(-1, 1).expand(E, param.shape[1])
        if self.block is not None:                                  # this rank's block columns
            cols = param.shape[-1]
            loaded = loaded.narrow(loaded.dim() - 1, experts.tp_rank * cols, cols)
        if shard is None:
            _copy(param.data, loaded, "fused down scale")
            return
        if not 0 <= shard < E:
            raise ValueError(f"expert {shard} out of range (the layer has {E})")
        _copy(param.data[shard], loaded, f"scale of expert shard {shard}")

    # --- compute --------------------------------------------------------------------------------
    def apply(self, experts: nn.Module, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        if x.is_cuda:
            from zpp.models.quantization.fp8_moe_kernels import fused_moe_fp8
            return fused_moe_fp8(x, experts.gate_up_proj, experts.down_proj, experts.gate_up_proj_scale,
                                 experts.down_proj_scale, weights, ids, experts.act, self.block,
                                 experts.gate_up_proj_bias, experts._down_bias)
        return experts.forward_loop(x, weights, ids, self.dequantized(experts, x.dtype))

    def dequantized(self, experts: nn.Module, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """``(gate_up [E, 2 I_l, H], down [E, H, I_l])`` dequantized to ``dtype`` (the reference path)."""
        return (dequantize(experts.gate_up_proj, experts.gate_up_proj_scale, self.block, dtype),
                dequantize(experts.down_proj, experts.down_proj_scale, self.block, dtype))


def _copy(dst: torch.Tensor, loaded: torch.Tensor, what: str) -> None:
    if dst.shape != loaded.shape:
        raise ValueError(f"shape mismatch: {what} {tuple(dst.shape)} vs checkpoint {tuple(loaded.shape)}")
    dst.copy_(loaded)


def expert_modules(model: nn.Module):
    """``(name, module)`` of every :class:`~zpp.models.layers.moe.FusedExperts` of ``model``."""
    from zpp.models.layers.moe import FusedExperts
    for name, mod in model.named_modules():
        if isinstance(mod, FusedExperts):
            yield name, mod


@torch.no_grad()
def quantize_expert_layer(ex: nn.Module, block: Optional[tuple[int, int]] = None) -> bool:
    """Quantize one (filled) bf16/fp16 :class:`~zpp.models.layers.moe.FusedExperts` to e4m3, expert
    by expert (so the float32 temporaries are one expert's): per output channel (``block`` None),
    else in ``block`` tiles. Experts already quantized, of another dtype, or whose shapes do not
    suit the kernels (:func:`moe_layout_ok`) keep their dtype. Returns whether they were quantized;
    the bf16 tensors are dropped (freed once no one else holds them)."""
    if getattr(ex, "quant_method", None) is not None or ex.gate_up_proj.dtype not in (torch.bfloat16, torch.float16):
        return False
    if not moe_layout_ok(ex, block):
        return False
    old = {name: getattr(ex, name).data for name in ("gate_up_proj", "down_proj")}
    method = Fp8MoEMethod(block, strict_scales=False)
    method.create_weights(ex)
    if old["gate_up_proj"].is_meta:  # a plan's meta-device build: the layout is all there is
        return True
    for name, w in old.items():
        q, s = getattr(ex, name), getattr(ex, f"{name}_scale")
        for e in range(w.shape[0]):
            qe, se = quantize_per_channel(w[e]) if block is None else quantize_block(w[e], block)
            q.data[e].copy_(qe)
            s[e].copy_(se)
    return True


@torch.no_grad()
def quantize_experts(model: nn.Module, block: Optional[tuple[int, int]] = None) -> int:
    """Quantize every (loaded) bf16/fp16 :class:`~zpp.models.layers.moe.FusedExperts` of ``model`` to
    e4m3 (:func:`quantize_expert_layer`): per output channel (``--quantization fp8``, as vLLM's
    ``Fp8MoEMethod`` without a checkpoint scale), or in ``block`` tiles (dummy weights with a block
    FP8 checkpoint's config). Returns the number of expert layers quantized."""
    return sum(quantize_expert_layer(ex, block) for _, ex in expert_modules(model))
