"""FP8 (e4m3) weights, both checkpoint layouts: what the checkpoint holds, how the CPU dequantizes it,
and the method that keeps linear layers in FP8 on a GPU (:class:`Fp8Config`, :class:`Fp8LinearMethod`).

Two FP8 checkpoint layouts load on every family, the families unaware of them:

* **compressed-tensors** (``quantization_config.quant_method == "compressed-tensors"``, format
  ``float-quantized``; what llm-compressor writes, e.g. the ``-FP8`` / ``-FP8-dynamic`` releases):
  ``X.weight`` float8_e4m3fn with ``X.weight_scale`` per tensor (``[]`` / ``[1]``), per output
  channel (``[N, 1]``) or per block (``[ceil(N/bn), ceil(K/bk)]``); activations quantized per token
  at run time (``dynamic``) or with a static per-tensor ``X.input_scale``; layers in ``ignore``
  (``lm_head``) stored in their own dtype. Optional per-layer KV-cache scales
  (``kv_cache_scheme``): ``self_attn.k_scale`` / ``v_scale`` (older: ``k_proj.output_scale``).
* **block FP8** (``quant_method == "fp8"``, HF's ``FineGrainedFP8Config``; DeepSeek-V3/R1 and the
  Qwen3 ``-FP8`` releases): ``X.weight`` float8_e4m3fn with ``X.weight_scale_inv``
  ``[ceil(N/128), ceil(K/128)]`` for ``weight_block_size: [128, 128]``, activations dynamic per
  token and 128-wide group; without ``weight_block_size`` (AutoFP8's older layout) a per-tensor
  ``X.weight_scale`` and, with ``activation_scheme: static``, ``X.input_scale``.

In every layout the weight is dequantized as ``w = w_fp8.float() * scale`` (the scale broadcast
over its block; :func:`~zpp.models.quantization.fp8_utils.dequantize`). What is quantized is read
from the checkpoint itself (a float8 tensor with a scale next to it), not from ``ignore`` /
``targets`` patterns: ``ignore`` only says which layers were left in high precision, and those are
stored so.

Where FP8 cannot run (CPU; a GPU of compute capability < 8.9) every FP8 weight is dequantized on
load to the model's dtype. On a GPU with FP8, a linear layer (:class:`zpp.models.layers.linear.Linear`
and its merged / row-parallel forms) keeps its weight in FP8 (:class:`Fp8LinearMethod`) when every
checkpoint tensor feeding it is FP8 with a supported scale and the shapes suit the kernels
(:func:`fp8_layout_ok`); its scales load, through the same strict loader, into a ``weight_scale``
parameter (``[N_local]`` fp32 per output channel -- a per-tensor scale is broadcast to its rows, so
q/k/v with three scales merge into one qkv -- or the block grid ``[ceil(N_local/bn),
ceil(K_local/bk)]``), and a static ``input_scale`` into ``input_scale`` ``[shards]`` (the largest is
used, as vLLM does for merged layers). MoE experts keep theirs likewise
(:class:`~zpp.models.quantization.fp8_moe.Fp8MoEMethod`, chosen by :meth:`Fp8Config.moe_method`).
Any other FP8 weight (embeddings, DeepSeek's ``kv_b_proj``, layers or experts that fail a check) is
dequantized as on the CPU.

``--quantization fp8`` (vLLM's flag; :func:`quantize_model_fp8`): after a bf16/fp16 checkpoint (or
dummy weights) loaded, every linear layer's weight is quantized to e4m3 per output channel
(``scale = amax(|w_row|) / 448``), activations per token at run time (vLLM's ``Fp8LinearMethod``
without a checkpoint scale). Refused on CPU and on GPUs below compute capability 8.9.
"""
from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import Optional

import torch
from torch import nn

from zpp.errors import ConfigError
from zpp.models.quantization.base import (FusedMoEMethod, Getter, LinearMethod, PlannedTensor, QuantizationConfig, TensorIndex,
                                          TensorInfo, keeps_dtype, linear_modules)
from zpp.models.quantization.fp8_utils import FP8_DTYPE, dequantize, quantize_block, quantize_per_channel

SCALE_SUFFIXES = (".weight_scale_inv", ".weight_scale", ".input_scale", ".activation_scale", "_proj_scale_inv",
                  "_proj_scale")
"""Checkpoint tensors that travel with an FP8 weight."""
KV_SCALE_RE = re.compile(r"^(.*\.layers\.(\d+)\.self_attn)\.(?:(k|v)_scale|(k|v)_proj\.output_scale)$")
"""A KV-cache scale: ``self_attn.k_scale`` / ``v_scale`` (older: ``self_attn.k_proj.output_scale``)."""


def scale_name(base: str, index: TensorIndex) -> Optional[str]:
    """The checkpoint name of the weight scale of ``base.weight`` (``weight_scale_inv`` or
    ``weight_scale``), or, for a fused expert tensor ``base`` without ``.weight`` (HF's
    ``experts.gate_up_proj``), of ``base_scale_inv`` / ``base_scale``; None if the checkpoint has none."""
    for suffix in (".weight_scale_inv", ".weight_scale", "_scale_inv", "_scale"):
        if base + suffix in index:
            return base + suffix
    return None


def _base(name: str) -> str:
    """``X`` of a weight ``X.weight``; a fused expert tensor is its own base."""
    return name[: -len(".weight")] if name.endswith(".weight") else name


def input_scale_name(base: str, index: TensorIndex) -> Optional[str]:
    """The checkpoint name of ``base``'s static activation scale, None if there is none."""
    for suffix in (".input_scale", ".activation_scale"):
        if base + suffix in index:
            return base + suffix
    return None


# --- the checkpoint's quantization_config --------------------------------------------------------
@dataclass(frozen=True)
class Fp8Config(QuantizationConfig):
    """An FP8 checkpoint's scheme, from ``config.json``'s ``quantization_config``
    (:func:`parse_compressed_tensors`, :func:`parse_fp8`).

    method: ``compressed-tensors`` or ``fp8``.
    block: ``(bn, bk)`` for block-scaled weights (output rows x input columns per scale), else None.
    static_activations: activations quantized with the checkpoint's per-tensor ``input_scale``
        (else dynamically per token).
    kv_cache_scales: the checkpoint carries per-layer ``k_scale`` / ``v_scale`` for an FP8 KV cache.
    ignore: the layers the config lists as left unquantized (informational: what is FP8 is read
        from the tensors).
    """

    method: str
    block: Optional[tuple[int, int]] = None
    static_activations: bool = False
    kv_cache_scales: bool = False
    ignore: tuple[str, ...] = ()

    # --- what the checkpoint holds -------------------------------------------------------------
    def is_auxiliary(self, name: str) -> bool:
        return name.endswith(SCALE_SUFFIXES)

    def is_quantized(self, info: TensorInfo) -> bool:
        return info.dtype in ("F8_E4M3", "F8_E5M2")

    def weight_kind(self, index: TensorIndex, name: str) -> Optional[str]:
        """``channel`` (per-tensor or per-channel scale), ``block``, or None (not a usable FP8
        weight: not e4m3, no scale, a scale of another shape). 2-D weights ``[N, K]`` and stacked
        experts ``[E, N, K]`` (with ``[E, ...]`` scales)."""
        info = index[name]
        if info.dtype != "F8_E4M3" or len(info.shape) not in (2, 3):
            return None
        s = scale_name(_base(name), index)
        if s is None:
            return None
        shape = index[s].shape
        lead, (n, k) = info.shape[:-2], info.shape[-2:]
        if lead and shape[:len(lead)] != lead:
            return None
        shape = shape[len(lead):]
        if self.block is not None and shape == (-(-n // self.block[0]), -(-k // self.block[1])):
            return "block"                      # (a weight within one block has a [1, 1] grid: block too)
        if math.prod(shape) == 1 or shape in ((n,), (n, 1)):
            return "channel"
        return None

    def kv_scale(self, name: str) -> Optional[tuple[int, str]]:
        m = KV_SCALE_RE.match(name)
        return (int(m.group(2)), m.group(3) or m.group(4)) if m else None

    # --- the CPU's rule ------------------------------------------------------------------------
    def plan_dequantize(self, index: TensorIndex, name: str, dtype: torch.dtype) -> PlannedTensor:
        base = _base(name)
        scale = scale_name(base, index)
        if scale is None:
            raise ValueError(f"checkpoint tensor {name!r} is FP8 but the checkpoint has no {base}.weight_scale "
                             f"or {base}.weight_scale_inv")
        return PlannedTensor(name, "dequantize", name, scale=scale, dtype=dtype)

    def materialize(self, t: PlannedTensor, get: Getter, device: torch.device) -> torch.Tensor:
        """Ops: ``dequantize`` (``w_fp8 * scale`` in ``t.dtype``, on ``device``), ``block_scale``
        (a block grid, float32), ``scale`` (per tensor / ``[N, 1]`` -> per channel ``[..., N]``),
        ``input_scale`` (float32)."""
        x = get(t.source)
        if t.op == "dequantize":
            s = get(t.scale)
            if s.dtype == torch.uint8:
                raise ValueError(f"checkpoint tensor {t.scale!r}: uint8 (ue8m0) scales are not supported")
            try:
                return dequantize(x.to(device), s, self.block, t.dtype)
            except ValueError as e:
                raise ValueError(f"checkpoint tensor {t.scale!r}: {e}") from None
        if t.op == "scale":
            s = x.float()
            if s.numel() == 1:
                return s.reshape(()).expand(t.rows).contiguous()           # per tensor -> per channel
            if s.shape[-1] == 1 and s.dim() >= 2:
                return s.reshape(s.shape[:-1])                              # [..., N, 1] -> [..., N]
            return s
        if t.op in ("block_scale", "input_scale"):
            return x.float()
        raise ValueError(f"unknown planned op {t.op!r}")

    # --- the GPU's methods ---------------------------------------------------------------------
    def linear_method(self, layer: nn.Module, sources: list[str], index: TensorIndex) -> Optional["Fp8LinearMethod"]:
        """:class:`Fp8LinearMethod` where every source is an FP8 weight with a usable scale of one
        kind and the layer's shapes suit the kernels (:func:`fp8_layout_ok`); else None."""
        kinds = {self.weight_kind(index, s) for s in sources}
        if len(kinds) != 1 or None in kinds:
            return None
        block = self.block if kinds == {"block"} else None
        if not fp8_layout_ok(layer, block):
            return None
        static = block is None and self.static_activations and all(
            input_scale_name(s[: -len(".weight")], index) for s in sources)
        return Fp8LinearMethod(block, static, strict_scales=True)

    def moe_method(self, experts: nn.Module, sources: list[str], index: TensorIndex) -> Optional[FusedMoEMethod]:
        """:class:`~zpp.models.quantization.fp8_moe.Fp8MoEMethod` where every expert tensor is FP8
        with a usable scale of one kind, a fused checkpoint is in HF's layout and the shapes suit
        the kernels (:func:`~zpp.models.quantization.fp8_moe.moe_layout_ok`); else None."""
        from zpp.models.quantization.fp8_moe import MOE_CHECKPOINT_LAYOUTS, Fp8MoEMethod, moe_layout_ok
        kinds = {self.weight_kind(index, s) for s in sources}
        if len(kinds) != 1 or None in kinds:
            return None
        if experts.layout not in MOE_CHECKPOINT_LAYOUTS and any(not s.endswith(".weight") for s in sources):
            return None
        block = self.block if kinds == {"block"} else None
        return Fp8MoEMethod(block) if moe_layout_ok(experts, block) else None

    def kept(self, param: nn.Parameter) -> bool:
        return param.dtype == FP8_DTYPE

    def plan_kept(self, index: TensorIndex, name: str, module: nn.Module) -> list[PlannedTensor]:
        """The canonical ``X.weight_scale`` (a fused expert tensor's: ``X_scale``; and a static
        ``X.input_scale`` where ``module`` takes one)."""
        base = _base(name)
        out = []
        scale = scale_name(base, index)
        if scale is not None:
            op = "block_scale" if self.weight_kind(index, name) == "block" else "scale"
            canonical = f"{base}.weight_scale" if name.endswith(".weight") else f"{base}_scale"
            out.append(PlannedTensor(canonical, op, scale, rows=index[name].shape[-2]))
        inp = input_scale_name(base, index)
        if inp is not None and getattr(module, "input_scale", None) is not None:
            out.append(PlannedTensor(f"{base}.input_scale", "input_scale", inp))
        return out

    def quantize_like_checkpoint(self, model: nn.Module) -> int:
        """``--load-format dummy`` with this config on a GPU with FP8: linear layers
        (:func:`quantize_model_like_checkpoint`) and experts
        (:func:`~zpp.models.quantization.fp8_moe.quantize_experts`) as the checkpoint's. Returns
        the number of layers quantized."""
        from zpp.models.quantization.fp8_moe import quantize_experts
        return quantize_model_like_checkpoint(model, self) + quantize_experts(model, self.block)

    def quantize_module_like_checkpoint(self, name: str, mod: nn.Module) -> bool:
        """One module of :meth:`quantize_like_checkpoint` (the loader's module-by-module dummy
        start, :func:`zpp.models.loader.init_dummy_weights_quantized`): a linear layer ``name``
        (:func:`quantize_linear_fp8` with :attr:`block`) or a
        :class:`~zpp.models.layers.moe.FusedExperts`
        (:func:`~zpp.models.quantization.fp8_moe.quantize_expert_layer`); any other module is left
        as it is. Returns whether it was quantized."""
        from zpp.models.layers.linear import Linear
        from zpp.models.layers.moe import FusedExperts
        from zpp.models.quantization.fp8_moe import quantize_expert_layer
        if isinstance(mod, Linear):
            return quantize_linear_fp8(name, mod, self.block)
        if isinstance(mod, FusedExperts):
            return quantize_expert_layer(mod, self.block)
        return False


def _ct_refuse(what: str) -> ConfigError:
    return ConfigError(f"compressed-tensors checkpoint: {what} is not supported (zpp loads FP8 e4m3, "
                       "format float-quantized, symmetric per-tensor / per-channel / block weight scales; "
                       "int4 pack-quantized)")


def parse_compressed_tensors(q: dict) -> "Fp8Config":
    """compressed-tensors ``float-quantized`` -> :class:`Fp8Config`; ``pack-quantized`` (int4) ->
    :func:`zpp.models.quantization.int4_compressed.parse_pack_quantized`; ConfigError for any other scheme."""
    from zpp.models.quantization.int4_compressed import is_pack_quantized, parse_pack_quantized
    if is_pack_quantized(q):
        return parse_pack_quantized(q)
    fmt = q.get("format")
    groups = q.get("config_groups") or {}
    if not isinstance(groups, dict) or not groups:
        raise _ct_refuse("a quantization_config without config_groups")
    block = None
    static = False
    for name, g in groups.items():
        if not isinstance(g, dict):
            raise _ct_refuse(f"config group {name!r} (not an object)")
        gfmt = g.get("format") or fmt
        if gfmt != "float-quantized":
            raise _ct_refuse(f"format {gfmt!r} (config group {name!r})")
        w = g.get("weights")
        if not isinstance(w, dict):
            raise _ct_refuse(f"config group {name!r} without weights")
        if w.get("type") != "float" or int(w.get("num_bits", 0)) != 8:
            raise _ct_refuse(f"weights of type {w.get('type')!r} with {w.get('num_bits')} bits")
        if w.get("symmetric") is False:
            raise _ct_refuse("asymmetric weights")
        if w.get("dynamic"):
            raise _ct_refuse("dynamic weight scales")
        strategy = w.get("strategy")
        if strategy == "block":
            bs = w.get("block_structure")
            if not (isinstance(bs, (list, tuple)) and len(bs) == 2 and all(int(b) > 0 for b in bs)):
                raise _ct_refuse(f"block strategy with block_structure {bs!r}")
            b = (int(bs[0]), int(bs[1]))
            if block not in (None, b):
                raise _ct_refuse("config groups with different block structures")
            block = b
        elif strategy not in ("tensor", "channel"):
            raise _ct_refuse(f"weight strategy {strategy!r}")
        if g.get("output_activations"):
            raise _ct_refuse("quantized output activations")
        a = g.get("input_activations")
        if a:
            if a.get("type") != "float" or int(a.get("num_bits", 0)) != 8:
                raise _ct_refuse(f"input activations of type {a.get('type')!r} with {a.get('num_bits')} bits")
            if a.get("symmetric") is False:
                raise _ct_refuse("asymmetric input activations")
            if a.get("dynamic") in (True, "local"):
                if a.get("strategy") not in ("token", "tensor", "group", None):
                    raise _ct_refuse(f"dynamic input activation strategy {a.get('strategy')!r}")
            elif a.get("strategy") == "tensor":
                static = True
            else:
                raise _ct_refuse(f"static input activation strategy {a.get('strategy')!r}")
    if static and block is not None:
        raise _ct_refuse("static input scales with block weight scales")
    kv = q.get("kv_cache_scheme")
    if kv:
        if kv.get("type") != "float" or int(kv.get("num_bits", 0)) != 8 or kv.get("strategy") not in ("tensor", None):
            raise _ct_refuse(f"kv_cache_scheme {kv!r}")
    return Fp8Config("compressed-tensors", block, static, bool(kv), tuple(q.get("ignore") or ()))


def parse_fp8(q: dict) -> "Fp8Config":
    """``quant_method: fp8`` (HF ``FineGrainedFP8Config`` / AutoFP8) -> :class:`Fp8Config`."""
    fmt = q.get("fmt", "e4m3")
    if fmt != "e4m3":
        raise ConfigError(f"FP8 checkpoint (quant_method 'fp8'): fmt {fmt!r} is not supported (e4m3 only)")
    scheme = q.get("activation_scheme", "dynamic")
    if scheme not in ("dynamic", "static"):
        raise ConfigError(f"FP8 checkpoint (quant_method 'fp8'): activation_scheme {scheme!r} is not supported")
    bs = q.get("weight_block_size")
    block = None
    if bs is not None:
        if not (isinstance(bs, (list, tuple)) and len(bs) == 2 and all(int(b) > 0 for b in bs)):
            raise ConfigError(f"FP8 checkpoint (quant_method 'fp8'): weight_block_size {bs!r} is not [rows, cols]")
        block = (int(bs[0]), int(bs[1]))
        if scheme == "static":
            raise ConfigError("FP8 checkpoint (quant_method 'fp8'): activation_scheme 'static' with "
                              "weight_block_size is not supported")
    ignore = tuple(q.get("modules_to_not_convert") or q.get("ignored_layers") or ())
    return Fp8Config("fp8", block, scheme == "static", False, ignore)

# --- FP8 linear layers ---------------------------------------------------------------------------
@dataclass
class Fp8Params:
    """What a linear layer with an FP8 weight needs at run time (``Linear.fp8``).

    weight_scale: float32 ``[N]`` (per output channel) or ``[ceil(N/bn), ceil(K/bk)]`` (``block``).
    block: ``(bn, bk)`` or None.
    input_scale: float32 ``[1]``, a static activation scale (the checkpoint's), or None for
        dynamic per-token scales (per token and ``bk``-wide group with ``block``).
    """

    weight_scale: torch.Tensor
    block: Optional[tuple[int, int]] = None
    input_scale: Optional[torch.Tensor] = None


class Fp8LinearMethod(LinearMethod):
    """A linear layer with an e4m3 weight (vLLM's ``Fp8LinearMethod``): ``block`` ``(bn, bk)`` or None
    (per output channel); ``static_input``: the checkpoint's per-tensor ``input_scale``;
    ``strict_scales``: the scales are parameters the strict loader must fill (a checkpoint), else
    buffers (online quantization). The product: :func:`zpp.models.quantization.fp8_linear.fp8_linear`."""

    def __init__(self, block: Optional[tuple[int, int]] = None, static_input: bool = False,
                 strict_scales: bool = True):
        self.block, self.static_input, self.strict_scales = block, static_input, strict_scales

    def create_weights(self, layer: nn.Module) -> None:
        make_fp8_linear(layer, self.block, self.static_input, self.strict_scales)

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        """A merged layer with static input scales uses their largest."""
        p = layer.fp8
        if p is not None and p.input_scale is not None and p.input_scale.numel() > 1:
            p.input_scale = p.input_scale.max().reshape(1)

    def apply(self, layer: nn.Module, x: torch.Tensor, bias: Optional[torch.Tensor]) -> torch.Tensor:
        from zpp.models.quantization.fp8_linear import fp8_linear
        return fp8_linear(x, layer.weight, layer.fp8, bias)


def _shard_sizes(mod) -> tuple[list[int], list[int]]:
    """(local output sizes per shard, full output sizes per shard) of a linear layer."""
    local = list(getattr(mod, "output_sizes", None) or [mod.out_features])
    full = list(getattr(mod, "full_output_sizes", None) or local)
    return local, full


def fp8_layout_ok(mod, block: Optional[tuple[int, int]]) -> bool:
    """Whether a linear layer's FP8 weight suits the GPU kernels: ``torch._scaled_mm`` needs the
    input and output widths to be multiples of 16 (per-channel); block scales need every merged shard
    but the last, and every tensor-parallel slice, to start on a block boundary (so the
    checkpoint's grids concatenate / slice into this rank's grid)."""
    from zpp.models.layers.linear import RowParallelLinear
    if getattr(mod, "transposed", False) or not getattr(mod, "fp8_allowed", True):
        return False
    N, K = mod.out_features, mod.in_features
    if block is None:
        return N % 16 == 0 and K % 16 == 0
    bn, bk = block
    local, _ = _shard_sizes(mod)
    tp = getattr(mod, "tp_size", 1)
    if tp > 1 and not isinstance(mod, RowParallelLinear) and any(n % bn for n in local):
        return False
    if any(n % bn for n in local[:-1]):
        return False
    if isinstance(mod, RowParallelLinear) and tp > 1 and K % bk:
        return False
    return True


def make_fp8_linear(mod, block: Optional[tuple[int, int]], static_input: bool, strict_scales: bool) -> None:
    """Turn a linear layer's weight into an FP8 parameter (same shape, float8_e4m3fn, same loader) and
    give it a ``weight_scale`` (and with ``static_input`` an ``input_scale`` ``[shards]``) with loaders
    that take the checkpoint's (canonical, see :func:`plan_checkpoint`) scales. ``strict_scales``:
    the scales are parameters, so the strict loader names a missing one; else buffers (filled by
    :func:`quantize_model_fp8`)."""
    from zpp.models.layers.linear import MergedLinear, RowParallelLinear, default_weight_loader
    old = mod.weight
    w = nn.Parameter(torch.empty(old.shape, dtype=FP8_DTYPE, device=old.device), requires_grad=False)
    w.weight_loader = getattr(old, "weight_loader", default_weight_loader)
    mod.weight = w
    N, K = mod.out_features, mod.in_features
    shape = (N,) if block is None else (-(-N // block[0]), -(-K // block[1]))
    scale = torch.ones(shape, dtype=torch.float32, device=old.device)
    if isinstance(mod, MergedLinear):
        loader = _merged_scale_loader(mod, block)
    elif isinstance(mod, RowParallelLinear) and block is not None and mod.tp_size > 1:
        loader = _row_parallel_block_scale_loader(mod, block)
    else:
        loader = default_weight_loader
    if strict_scales:
        p = nn.Parameter(scale, requires_grad=False)
        p.weight_loader = loader
        mod.weight_scale = p
    else:
        mod.register_buffer("weight_scale", scale, persistent=False)
    inp = None
    if static_input:
        n = len(_shard_sizes(mod)[0]) if isinstance(mod, MergedLinear) else 1
        inp = nn.Parameter(torch.zeros(n, dtype=torch.float32, device=old.device), requires_grad=False)
        inp.weight_loader = _input_scale_loader
        mod.input_scale = inp
    mod.fp8 = Fp8Params(mod.weight_scale, block, inp)
    mod.quant_method = Fp8LinearMethod(block, static_input, strict_scales)
    del old


def _merged_scale_loader(mod, block):
    """Scales of one shard of a merged (column-parallel) layer: rows (per channel) or block rows of
    this rank's slice, placed at the shard's offset."""
    bn = 1 if block is None else block[0]

    def load(param: nn.Parameter, loaded: torch.Tensor, shard: Optional[int] = None) -> None:
        local, full = _shard_sizes(mod)
        if shard is None:  # a merged checkpoint tensor (all shards)
            if mod.tp_size == 1:
                if tuple(loaded.shape) != tuple(param.shape):
                    raise ValueError(f"shape mismatch: scale {tuple(param.shape)} vs checkpoint {tuple(loaded.shape)}")
                param.data.copy_(loaded)
                return
            parts = loaded.split([-(-n // bn) for n in full], dim=0)
            for i, part in enumerate(parts):
                load(param, part, i)
            return
        rows = -(-local[shard] // bn)
        start = sum(-(-n // bn) for n in local[:shard])
        want = -(-full[shard] // bn)
        if loaded.shape[0] != want or tuple(loaded.shape[1:]) != tuple(param.shape[1:]):
            raise ValueError(f"shape mismatch: scale of shard {shard} {(want,) + tuple(param.shape[1:])} "
                             f"vs checkpoint {tuple(loaded.shape)}")
        src = loaded.narrow(0, mod.tp_rank * rows, rows) if mod.tp_size > 1 else loaded
        param.data.narrow(0, start, rows).copy_(src)
    return load


def _row_parallel_block_scale_loader(mod, block):
    """Block scales of a row-parallel layer: this rank's block columns."""
    def load(param: nn.Parameter, loaded: torch.Tensor) -> None:
        cols = param.shape[1]
        full = (param.shape[0], -(-mod.full_in_features // block[1]))
        if tuple(loaded.shape) != full:
            raise ValueError(f"shape mismatch: scale {full} (before the tensor-parallel split) vs checkpoint "
                             f"{tuple(loaded.shape)}")
        param.data.copy_(loaded.narrow(1, mod.tp_rank * cols, cols))
    return load


def _input_scale_loader(param: nn.Parameter, loaded: torch.Tensor, shard: Optional[int] = None) -> None:
    if loaded.numel() != 1:
        raise ValueError(f"input_scale of shape {tuple(loaded.shape)}: a per-tensor (one-element) scale was expected")
    param.data[0 if shard is None else shard] = loaded.reshape(()).float()


@torch.no_grad()
def quantize_linear_fp8(name: str, mod: nn.Module, block: Optional[tuple[int, int]] = None) -> bool:
    """Quantize one (filled) linear layer ``name`` of the model to e4m3: per output channel (``block``
    None: ``--quantization fp8``, only a bf16/fp16 weight), else in ``block`` tiles (dummy weights
    with a block FP8 checkpoint's config). Layers whose shapes do not suit the kernels
    (:func:`fp8_layout_ok`), transposed (GPT-2 Conv1D) ones, layers already FP8 and weights a
    family reads outside the layer (DeepSeek's ``kv_b_proj``) keep their dtype. Returns whether
    the layer was quantized; its bf16 weight is dropped (freed once no one else holds it)."""
    if mod.fp8 is not None or keeps_dtype(name, mod) or not fp8_layout_ok(mod, block):
        return False
    if block is None and mod.weight.dtype not in (torch.bfloat16, torch.float16):
        return False
    q, s = quantize_per_channel(mod.weight.data) if block is None else quantize_block(mod.weight.data, block)
    make_fp8_linear(mod, block, False, strict_scales=False)
    mod.weight.data.copy_(q)
    mod.weight_scale.copy_(s)
    return True


def quantize_module_fp8(name: str, mod: nn.Module) -> bool:
    """``--quantization fp8`` for one module of the model: a linear layer
    (:func:`quantize_linear_fp8`) or a :class:`~zpp.models.layers.moe.FusedExperts`
    (:func:`~zpp.models.quantization.fp8_moe.quantize_expert_layer`), per output channel; any
    other module is left as it is. Returns whether it was quantized."""
    from zpp.models.layers.linear import Linear
    from zpp.models.layers.moe import FusedExperts
    from zpp.models.quantization.fp8_moe import quantize_expert_layer
    if isinstance(mod, Linear):
        return quantize_linear_fp8(name, mod, None)
    if isinstance(mod, FusedExperts):
        return quantize_expert_layer(mod, None)
    return False


@torch.no_grad()
def quantize_model_fp8(model: nn.Module) -> int:
    """``--quantization fp8``: quantize every linear layer's (loaded) weight to e4m3 per output channel,
    activations per token at run time (:func:`quantize_linear_fp8`: layers whose shapes do not suit
    ``torch._scaled_mm`` -- widths not multiples of 16 --, transposed ones and ``kv_b_proj`` keep
    their dtype). Returns the number of layers quantized."""
    return sum(quantize_linear_fp8(name, mod, None) for name, mod in linear_modules(model))


@torch.no_grad()
def quantize_model_like_checkpoint(model: nn.Module, quant: "Fp8Config") -> int:
    """``--load-format dummy`` with an FP8 checkpoint's config on a GPU with FP8: the random weights
    quantized as the checkpoint's are (``quant.block`` tiles, else per output channel)."""
    return sum(quantize_linear_fp8(name, mod, quant.block) for name, mod in linear_modules(model))
