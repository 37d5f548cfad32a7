"""Reading an FP8 checkpoint: which tensors the safetensors files hold (:func:`read_index`), which
linear layers become FP8 (:func:`prepare_model_for_checkpoint`), the plan of what to read for
this stage (:func:`plan_checkpoint`), the tensors read and (de)quantized as planned
(:func:`iter_planned`), and the attention layers' KV-cache scales (:func:`load_kv_scales`).
The checkpoint's ``quantization_config`` and the FP8 layers are :mod:`zpp.models.quantization`.
"""
from __future__ import annotations

import logging
import math
from dataclasses import dataclass, field
from typing import Any, Iterator, Optional

import torch
from torch import nn

from zpp.models.layers.fp8 import FP8_DTYPE, dequantize
from zpp.models.quantization import (_KV_SCALE_RE, _SCALE_SUFFIXES, CheckpointQuant, _keep_dtype,
                                     _linear_modules, fp8_layout_ok, make_fp8_linear)

logger = logging.getLogger("zpp.models.quantization")


@dataclass
class TensorInfo:
    path: str
    dtype: str
    shape: tuple[int, ...]


def read_index(files: list[str]) -> dict[str, TensorInfo]:
    """Every tensor's file, dtype (safetensors name: ``F8_E4M3``, ``BF16``, ...) and shape, from the
    safetensors headers only."""
    import json
    import struct
    index: dict[str, TensorInfo] = {}
    for path in files:
        with open(path, "rb") as f:
            n = struct.unpack("<Q", f.read(8))[0]
            header = json.loads(f.read(n))
        for name, meta in header.items():
            if name != "__metadata__":
                index[name] = TensorInfo(path, meta["dtype"], tuple(meta["shape"]))
    return index


def _scale_name(base: str, index: dict[str, TensorInfo]) -> Optional[str]:
    for suffix in (".weight_scale_inv", ".weight_scale"):
        if base + suffix in index:
            return base + suffix
    return None


def _input_scale_name(base: str, index: dict[str, TensorInfo]) -> Optional[str]:
    for suffix in (".input_scale", ".activation_scale"):
        if base + suffix in index:
            return base + suffix
    return None


@dataclass
class PlannedTensor:
    """One tensor the strict loader will receive: ``name`` (a checkpoint name, or ``X.weight_scale`` /
    ``X.input_scale`` in zpp's canonical form), made from ``source`` (and ``scale`` for a weight) by
    ``op``: ``copy`` (as stored), ``dequantize`` (to ``dtype``), ``scale`` (canonical weight scale of
    ``rows`` output rows), ``input_scale``."""

    name: str
    op: str
    source: str
    scale: Optional[str] = None
    dtype: Optional[torch.dtype] = None
    rows: int = 0


@dataclass
class CheckpointPlan:
    tensors: list[PlannedTensor] = field(default_factory=list)
    kv_scales: dict[int, dict[str, str]] = field(default_factory=dict)
    """layer index -> {"k": name, "v": name} of the checkpoint's KV-cache scales."""


def _fp8_kind(index: dict[str, TensorInfo], name: str, block: Optional[tuple[int, int]]) -> Optional[str]:
    """``channel`` (per-tensor or per-channel scale), ``block``, or None (not a usable FP8 weight)."""
    info = index[name]
    if info.dtype != "F8_E4M3" or len(info.shape) != 2:
        return None
    s = _scale_name(name[: -len(".weight")], index)
    if s is None:
        return None
    shape = index[s].shape
    n, k = info.shape
    if block is not None and shape == (-(-n // block[0]), -(-k // block[1])):
        return "block"                          # (a weight within one block has a [1, 1] grid: block too)
    if math.prod(shape) == 1 or shape in ((n,), (n, 1)):
        return "channel"
    return None


def prepare_model_for_checkpoint(model: nn.Module, index: dict[str, TensorInfo], quant: CheckpointQuant,
                                 keep_fp8: bool) -> int:
    """Decide, per linear layer, whether its weight stays FP8 (``keep_fp8`` -- a GPU with FP8 -- and
    every checkpoint tensor feeding it an FP8 weight with a usable scale of one kind, shapes the
    kernels take: :func:`fp8_layout_ok`), and make those layers FP8 (:func:`make_fp8_linear`).
    Returns the number of FP8 layers."""
    if not keep_fp8:
        return 0
    feeds: dict[str, list[str]] = {}
    for name in index:
        if not name.endswith(".weight"):
            continue
        for pname, _ in model.map_weight_name(name) or ():
            feeds.setdefault(pname, []).append(name)
    n = 0
    for mname, mod in _linear_modules(model):
        sources = feeds.get(f"{mname}.weight" if mname else "weight")
        if not sources or mod.fp8 is not None or _keep_dtype(mname, mod):
            continue
        kinds = {_fp8_kind(index, s, quant.block) for s in sources}
        if len(kinds) != 1 or None in kinds:
            continue
        block = quant.block if kinds == {"block"} else None
        if not fp8_layout_ok(mod, block):
            continue
        static = block is None and quant.static_activations and all(
            _input_scale_name(s[: -len(".weight")], index) for s in sources)
        make_fp8_linear(mod, block, static, strict_scales=True)
        n += 1
    return n


def plan_checkpoint(model: nn.Module, index: dict[str, TensorInfo], quant: Optional[CheckpointQuant],
                    dtype: torch.dtype) -> CheckpointPlan:
    """What the strict loader receives for this stage, from the headers alone (no tensor is read):
    every tensor the stage owns, FP8 weights either kept (with their canonical scales, for layers
    :func:`prepare_model_for_checkpoint` made FP8) or dequantized to their parameter's dtype (else
    ``dtype``); scales and KV-cache scales never reach it as such.

    Raises:
        ValueError: an FP8 weight to dequantize has no scale (named).
    """
    plan = CheckpointPlan()
    params = dict(model.named_parameters())
    for name, info in index.items():
        kv = _KV_SCALE_RE.match(name)
        if kv:
            layer = int(kv.group(2))
            if model.stage.owns_layer(layer):
                plan.kv_scales.setdefault(layer, {})[kv.group(3) or kv.group(4)] = name
            continue
        if name.endswith(_SCALE_SUFFIXES):
            continue
        targets = model.map_weight_name(name)
        if targets is None:
            continue
        if info.dtype not in ("F8_E4M3", "F8_E5M2") or quant is None:
            plan.tensors.append(PlannedTensor(name, "copy", name))
            continue
        base = name[: -len(".weight")] if name.endswith(".weight") else name
        scale = _scale_name(base, index)
        target = params.get(targets[0][0]) if targets else None
        if target is not None and target.dtype == FP8_DTYPE:
            plan.tensors.append(PlannedTensor(name, "copy", name))
            if scale is not None:
                op = "block_scale" if _fp8_kind(index, name, quant.block) == "block" else "scale"
                plan.tensors.append(PlannedTensor(f"{base}.weight_scale", op, scale, rows=info.shape[0]))
            inp = _input_scale_name(base, index)
            mod = model.get_submodule(targets[0][0].rsplit(".", 1)[0])
            if inp is not None and getattr(mod, "input_scale", None) is not None:
                plan.tensors.append(PlannedTensor(f"{base}.input_scale", "input_scale", inp))
            continue
        if scale is None:
            raise ValueError(f"checkpoint tensor {name!r} is FP8 but the checkpoint has no {base}.weight_scale "
                             f"or {base}.weight_scale_inv")
        out = target.dtype if target is not None and target.dtype.is_floating_point and target.element_size() > 1 \
            else dtype
        plan.tensors.append(PlannedTensor(name, "dequantize", name, scale=scale, dtype=out))
    return plan


class _Reader:
    """Open safetensors files on demand (a scale may live in another shard than its weight)."""

    def __init__(self):
        self._open: dict[str, Any] = {}

    def get(self, index: dict[str, TensorInfo], name: str) -> torch.Tensor:
        from safetensors import safe_open
        path = index[name].path
        f = self._open.get(path)
        if f is None:
            f = self._open[path] = safe_open(path, framework="pt", device="cpu").__enter__()
        return f.get_tensor(name)

    def close(self) -> None:
        for f in self._open.values():
            f.__exit__(None, None, None)
        self._open.clear()


def iter_planned(plan: CheckpointPlan, index: dict[str, TensorInfo], quant: Optional[CheckpointQuant],
                 device: torch.device) -> Iterator[tuple[str, torch.Tensor]]:
    """Read the planned tensors, file by file (each file opened once), and yield ``(name, tensor)``
    for the strict loader. Dequantization runs on ``device``."""
    reader = _Reader()
    block = quant.block if quant is not None else None
    order = {p: i for i, p in enumerate(dict.fromkeys(info.path for info in index.values()))}
    try:
        for t in sorted(plan.tensors, key=lambda t: order[index[t.source].path]):
            x = reader.get(index, t.source)
            if t.op == "copy":
                yield t.name, x
            elif t.op == "dequantize":
                s = reader.get(index, t.scale)
                if s.dtype == torch.uint8:
                    raise ValueError(f"checkpoint tensor {t.scale!r}: uint8 (ue8m0) scales are not supported")
                try:
                    w = dequantize(x.to(device), s, block, t.dtype)
                except ValueError as e:
                    raise ValueError(f"checkpoint tensor {t.scale!r}: {e}") from None
                yield t.name, w
            elif t.op == "block_scale":
                yield t.name, x.float()
            elif t.op == "scale":
                s = x.float()
                if s.numel() == 1:
                    s = s.reshape(()).expand(t.rows).contiguous()           # per tensor -> per channel
                elif s.dim() == 2 and s.shape[1] == 1:
                    s = s.reshape(-1)                                      # [N, 1] -> [N]
                yield t.name, s
            elif t.op == "input_scale":
                yield t.name, x.float()
    finally:
        reader.close()


def load_kv_scales(model: nn.Module, plan: CheckpointPlan, index: dict[str, TensorInfo]) -> int:
    """Give each of this stage's attention layers the checkpoint's ``k_scale`` / ``v_scale``
    (``Attention.k_scale`` / ``v_scale``, floats; used by an FP8 KV cache). Returns how many layers
    got scales."""
    from zpp.models.layers.attention import Attention
    if not plan.kv_scales:
        return 0
    reader = _Reader()
    n = 0
    try:
        layers = model.model.layers if hasattr(model, "model") else None
        for i, names in plan.kv_scales.items():
            layer = layers[i] if layers is not None else None
            attn = next((m for m in layer.modules() if isinstance(m, Attention)), None) if layer is not None else None
            if attn is None:
                continue
            for kind in ("k", "v"):
                if kind in names:
                    setattr(attn, f"{kind}_scale", float(reader.get(index, names[kind]).float().reshape(-1)[0]))
            attn.kv_scales_loaded = "k" in names and "v" in names
            n += 1
    finally:
        reader.close()
    return n
