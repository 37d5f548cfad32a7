"""Reading a quantized checkpoint, whatever its format: which tensors the safetensors files hold
(:func:`read_index`), which layers a format's method keeps quantized
(:func:`prepare_model_for_checkpoint`), the plan of what to read for this stage
(:func:`plan_checkpoint`), the tensors read and (de)quantized as planned (:func:`iter_planned`),
the methods' work after loading (:func:`finish_loading`) and the attention layers' KV-cache scales
(:func:`load_kv_scales`). Every format-specific answer comes from the checkpoint's
:class:`~zpp.models.quantization.base.QuantizationConfig`.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any, Iterator, Optional

import torch
from torch import nn

from zpp.models.quantization.base import (PlannedTensor, QuantizationConfig, TensorIndex, TensorInfo, keeps_dtype,
                                          linear_modules)

logger = logging.getLogger("zpp.models.quantization")


def read_index(files: list[str]) -> TensorIndex:
    """Every tensor's file, dtype (safetensors name: ``F8_E4M3``, ``BF16``, ...) and shape, from the
    safetensors headers only."""
    import json
    import struct
    index: TensorIndex = {}
    for path in files:
        with open(path, "rb") as f:
            n = struct.unpack("<Q", f.read(8))[0]
            header = json.loads(f.read(n))
        for name, meta in header.items():
            if name != "__metadata__":
                index[name] = TensorInfo(path, meta["dtype"], tuple(meta["shape"]))
    return index


@dataclass
class CheckpointPlan:
    tensors: list[PlannedTensor] = field(default_factory=list)
    kv_scales: dict[int, dict[str, str]] = field(default_factory=dict)
    """layer index -> {"k": name, "v": name} of the checkpoint's KV-cache scales."""


def _feeds(model: nn.Module, index: TensorIndex, quant: QuantizationConfig) -> dict[str, list[str]]:
    """parameter name -> the checkpoint weights that load into it (``X.weight`` tensors, and fused
    expert tensors: any non-auxiliary tensor of three or more dimensions; a quantized tensor by the
    name it loads under, :meth:`~zpp.models.quantization.base.QuantizationConfig.loaded_name`)."""
    feeds: dict[str, list[str]] = {}
    for name, info in index.items():
        if quant.is_auxiliary(name):
            continue
        loaded = quant.loaded_name(name) if quant.is_quantized(info) else name
        if loaded.endswith(".weight") or len(info.shape) >= 3:
            for pname, _ in model.map_weight_name(loaded) or ():
                feeds.setdefault(pname, []).append(name)
    return feeds


def prepare_model_for_checkpoint(model: nn.Module, index: TensorIndex, quant: QuantizationConfig,
                                 keep: bool) -> tuple[int, int]:
    """Decide, per linear layer and per :class:`~zpp.models.layers.moe.FusedExperts`, whether its
    weights stay quantized (``keep`` -- a GPU that runs the format -- and ``quant.linear_method`` /
    ``quant.moe_method`` returning a method for the checkpoint tensors feeding it; never for
    :func:`~zpp.models.quantization.base.keeps_dtype` layers), and make those layers so
    (``create_weights``). Returns ``(linear layers, expert layers)`` kept quantized."""
    from zpp.models.layers.moe import FusedExperts
    if not keep:
        return 0, 0
    feeds = _feeds(model, index, quant)
    ne = 0
    for mname, mod in model.named_modules():
        if not isinstance(mod, FusedExperts) or getattr(mod, "quant_method", None) is not None:
            continue
        sources = feeds.get(f"{mname}.gate_up_proj", []) + feeds.get(f"{mname}.down_proj", [])
        method = quant.moe_method(mod, sources, index) if sources else None
        if method is not None:
            method.create_weights(mod)
            ne += 1
    n = 0
    for mname, mod in linear_modules(model):
        sources = feeds.get(f"{mname}.weight" if mname else "weight")
        if not sources or getattr(mod, "quant_method", None) is not None or keeps_dtype(mname, mod):
            continue
        method = quant.linear_method(mod, sources, index)
        if method is None:
            continue
        method.create_weights(mod)
        n += 1
    return n, ne


def plan_checkpoint(model: nn.Module, index: TensorIndex, quant: Optional[QuantizationConfig],
                    dtype: torch.dtype) -> CheckpointPlan:
    """What the strict loader receives for this stage, from the headers alone (no tensor is read):
    every tensor the stage owns, quantized weights either kept (with what ``quant.plan_kept``
    adds: canonical scales, for the parameters a method made) or dequantized to their parameter's
    dtype (else ``dtype``); scales and KV-cache scales never reach it as such.

    Raises:
        ValueError: a quantized weight to dequantize lacks a tensor it needs (named).
    """
    plan = CheckpointPlan()
    params = dict(model.named_parameters())
    for name, info in index.items():
        kv = quant.kv_scale(name) if quant is not None else None
        if kv is not None:
            if model.stage.owns_layer(kv[0]):
                plan.kv_scales.setdefault(kv[0], {})[kv[1]] = name
            continue
        if quant is not None and quant.is_auxiliary(name):
            continue
        quantized = quant is not None and quant.is_quantized(info)
        targets = model.map_weight_name(quant.loaded_name(name) if quantized else name)
        if targets is None:
            continue
        if not quantized:
            plan.tensors.append(PlannedTensor(name, "copy", name))
            continue
        target = params.get(targets[0][0]) if targets else None
        mod = _parent(model, targets[0][0]) if targets else None
        if quant.kept_by(mod, target):
            if quant.copies_kept_weight:
                plan.tensors.append(PlannedTensor(name, "copy", name))
            plan.tensors.extend(quant.plan_kept(index, name, mod))
            continue
        out = target.dtype if target is not None and target.dtype.is_floating_point and target.element_size() > 1 \
            else dtype
        plan.tensors.append(quant.plan_dequantize(index, name, out))
    return plan


def _parent(model: nn.Module, pname: str) -> Optional[nn.Module]:
    """The module holding parameter ``pname`` (also where a method replaced the parameter), or None."""
    try:
        return model.get_submodule(pname.rsplit(".", 1)[0]) if "." in pname else model
    except AttributeError:
        return None


class _Reader:
    """Open safetensors files on demand (a scale may live in another shard than its weight)."""

    def __init__(self, index: TensorIndex):
        self.index = index
        self._open: dict[str, Any] = {}

    def get(self, name: str) -> torch.Tensor:
        from safetensors import safe_open
        path = self.index[name].path
        f = self._open.get(path)
        if f is None:
            f = self._open[path] = safe_open(path, framework="pt", device="cpu").__enter__()
        return f.get_tensor(name)

    def close(self) -> None:
        for f in self._open.values():
            f.__exit__(None, None, None)
        self._open.clear()


def iter_planned(plan: CheckpointPlan, index: TensorIndex, quant: Optional[QuantizationConfig],
                 device: torch.device) -> Iterator[tuple[str, torch.Tensor]]:
    """Read the planned tensors, file by file (each file opened once), and yield ``(name, tensor)``
    for the strict loader. Dequantization runs on ``device``."""
    reader = _Reader(index)
    order = {p: i for i, p in enumerate(dict.fromkeys(info.path for info in index.values()))}
    try:
        for t in sorted(plan.tensors, key=lambda t: order[index[t.source].path]):
            if t.op == "copy":
                yield t.name, reader.get(t.source)
            else:
                yield t.name, quant.materialize(t, reader.get, device)
    finally:
        reader.close()


def finish_loading(model: nn.Module) -> None:
    """After the checkpoint loaded: every quantized layer's
    :meth:`~zpp.models.quantization.base.LinearMethod.process_weights_after_loading`."""
    for mod in model.modules():
        method = getattr(mod, "quant_method", None)
        if method is not None:
            method.process_weights_after_loading(mod)


def load_kv_scales(model: nn.Module, plan: CheckpointPlan, index: TensorIndex) -> int:
    """Give each of this stage's attention layers the checkpoint's ``k_scale`` / ``v_scale``
    (``Attention.k_scale`` / ``v_scale``, floats; used by an FP8 KV cache). Returns how many layers
    got scales."""
    from zpp.models.layers.attention import Attention
    if not plan.kv_scales:
        return 0
    reader = _Reader(index)
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
                    setattr(attn, f"{kind}_scale", float(reader.get(names[kind]).float().reshape(-1)[0]))
            attn.kv_scales_loaded = "k" in names and "v" in names
            n += 1
    finally:
        reader.close()
    return n
