"""The interface every quantization format implements, and what formats share.

A format is one :class:`QuantizationConfig` subclass (parsed from ``config.json``'s
``quantization_config``) that answers three questions:

1. **What the checkpoint holds** -- which tensors are quantized weights (:meth:`~QuantizationConfig.weight_kind`),
   which only travel with them (scales: :meth:`~QuantizationConfig.is_auxiliary`), which are KV-cache
   scales (:meth:`~QuantizationConfig.kv_scale`).
2. **How the CPU dequantizes it** -- :meth:`~QuantizationConfig.plan_dequantize` /
   :meth:`~QuantizationConfig.materialize`: exactly the format's rule, the reference CI tests against;
   used wherever the format cannot run (CPU, GPUs without the instructions).
3. **Which method runs it on a GPU** -- :meth:`~QuantizationConfig.linear_method` returns a
   :class:`LinearMethod` for a linear layer, :meth:`~QuantizationConfig.moe_method` a
   :class:`FusedMoEMethod` for a :class:`~zpp.models.layers.moe.FusedExperts` (or None: the layer's
   weights are dequantized). A method makes the layer's parameters in the format
   (:meth:`LinearMethod.create_weights`, loaders included), tells the planner which canonical
   tensors they take (:meth:`~QuantizationConfig.plan_kept`) and computes the layer's product.

The split of vLLM's ``QuantizationConfig`` -> ``LinearMethodBase`` / ``FusedMoEMethodBase``
(``vllm/model_executor/layers/quantization/``). The format-independent reading of a checkpoint
(index, plan, loading) is :mod:`zpp.models.quantization.checkpoint`.
"""
from __future__ import annotations

import re
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Callable, Iterator, Optional

import torch
from torch import nn

from zpp.models.layers.kept_dtype import KEEP_DTYPE_MODULES, keeps_dtype  # noqa: F401 (re-exported)


@dataclass
class TensorInfo:
    """One checkpoint tensor, from its safetensors header: file, dtype (safetensors name:
    ``F8_E4M3``, ``BF16``, ...) and shape."""

    path: str
    dtype: str
    shape: tuple[int, ...]


TensorIndex = dict[str, TensorInfo]


@dataclass
class PlannedTensor:
    """One tensor the strict loader will receive: ``name`` (a checkpoint name, or a canonical name a
    method's parameter takes, e.g. ``X.weight_scale``), made from the checkpoint tensor ``source``
    (and ``scale`` for a weight to dequantize) by ``op``: ``copy`` (as stored), ``dequantize`` (to
    ``dtype``), or a format's own op (:meth:`QuantizationConfig.materialize`); ``rows``: the
    weight's output rows, for ops that need them."""

    name: str
    op: str
    source: str
    scale: Optional[str] = None
    dtype: Optional[torch.dtype] = None
    rows: int = 0


Getter = Callable[[str], torch.Tensor]
"""Reads one checkpoint tensor by name (on the CPU)."""


class LinearMethod(ABC):
    """How a linear layer (:class:`zpp.models.layers.linear.Linear` and its merged / row-parallel
    forms) holds and runs a format's weights (vLLM's ``LinearMethodBase``)."""

    @abstractmethod
    def create_weights(self, layer: nn.Module) -> None:
        """Replace the layer's weight by the format's parameters (same loaders; scales with loaders
        that take the canonical tensors :meth:`QuantizationConfig.plan_kept` plans)."""

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        """After the checkpoint loaded (default: nothing)."""

    @abstractmethod
    def apply(self, layer: nn.Module, x: torch.Tensor, bias: Optional[torch.Tensor]) -> torch.Tensor:
        """``x [T, in]`` -> ``[T, out]`` in ``x``'s dtype (+ ``bias``)."""


class FusedMoEMethod(ABC):
    """How a :class:`~zpp.models.layers.moe.FusedExperts` holds and runs a format's expert weights
    (vLLM's ``FusedMoEMethodBase``)."""

    @abstractmethod
    def create_weights(self, experts: nn.Module) -> None:
        """Replace ``gate_up_proj`` / ``down_proj`` by the format's parameters (same loaders)."""

    def process_weights_after_loading(self, experts: nn.Module) -> None:
        """After the checkpoint loaded (default: nothing)."""

    @abstractmethod
    def apply(self, experts: nn.Module, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """``x [T, H]``, routing ``weights [T, k]`` float32, ``ids [T, k]`` int64 -> this rank's
        partial ``[T, H]`` in ``x``'s dtype (no all-reduce)."""


class QuantizationConfig(ABC):
    """A checkpoint's quantization scheme (see the module docstring for the three questions).

    Attributes every format sets: ``method`` (``quant_method``), ``kv_cache_scales`` (the
    checkpoint carries per-layer KV-cache scales), ``ignore`` (layers the config lists as left in
    high precision: informational, what is quantized is read from the tensors).
    """

    method: str
    kv_cache_scales: bool = False
    ignore: tuple[str, ...] = ()
    min_capability: tuple[int, int] = (8, 9)
    """The CUDA compute capability from which a GPU runs the format's methods (below it, and on the
    CPU, every quantized weight is dequantized on load). FP8: 8.9; the 4-bit formats: 8.0."""
    copies_kept_weight: bool = True
    """A kept weight loads as stored (``copy``) besides what :meth:`plan_kept` adds; False for a
    format whose :meth:`plan_kept` plans the weight itself too (the 4-bit formats repack it)."""

    # --- what the checkpoint holds -------------------------------------------------------------
    @abstractmethod
    def is_auxiliary(self, name: str) -> bool:
        """Whether the checkpoint tensor ``name`` only travels with a weight (a scale) and never
        reaches the loader under its own name."""

    @abstractmethod
    def is_quantized(self, info: TensorInfo) -> bool:
        """Whether a (non-auxiliary) tensor is stored quantized: it is either kept by a method or
        dequantized."""

    @abstractmethod
    def weight_kind(self, index: TensorIndex, name: str) -> Optional[str]:
        """How the weight ``name`` is quantized (a format's own label), None if it is not a usable
        quantized weight (no scale, a shape no method takes)."""

    def kv_scale(self, name: str) -> Optional[tuple[int, str]]:
        """``(layer, "k" | "v")`` when ``name`` is a KV-cache scale, else None."""
        return None

    def loaded_name(self, name: str) -> str:
        """The name under which the (non-auxiliary) checkpoint tensor ``name`` reaches the model
        once dequantized: the weight's own name where the format stores it under another one
        (``X.weight_packed`` / ``X.qweight`` -> ``X.weight``, ``X_blocks`` -> ``X``). Default:
        ``name``."""
        return name

    # --- the CPU's rule ------------------------------------------------------------------------
    @abstractmethod
    def plan_dequantize(self, index: TensorIndex, name: str, dtype: torch.dtype) -> PlannedTensor:
        """The planned tensor that dequantizes ``name`` to ``dtype``.

        Raises:
            ValueError: a tensor it needs (its scale) is missing (named).
        """

    @abstractmethod
    def materialize(self, t: PlannedTensor, get: Getter, device: torch.device) -> torch.Tensor:
        """The tensor of a planned op other than ``copy`` (``dequantize`` runs on ``device``)."""

    # --- the GPU's methods ---------------------------------------------------------------------
    @abstractmethod
    def linear_method(self, layer: nn.Module, sources: list[str], index: TensorIndex) -> Optional[LinearMethod]:
        """The method that runs ``layer`` fed by the checkpoint weights ``sources`` (its merged
        shards), or None (dequantized)."""

    def moe_method(self, experts: nn.Module, sources: list[str], index: TensorIndex) -> Optional[FusedMoEMethod]:
        """The method that runs ``experts`` fed by the checkpoint tensors ``sources``, or None
        (default: experts dequantized)."""
        return None

    @abstractmethod
    def kept(self, param: nn.Parameter) -> bool:
        """Whether a parameter holds the format's weights (so the checkpoint tensor is copied as
        stored and its scales planned with :meth:`plan_kept`)."""

    def kept_by(self, module: Optional[nn.Module], param: Optional[nn.Parameter]) -> bool:
        """Whether the weight loading into ``param`` of ``module`` (either may be None: the
        parameter a method replaced) stays in the format. Default: :meth:`kept` of ``param``."""
        return param is not None and self.kept(param)

    @abstractmethod
    def plan_kept(self, index: TensorIndex, name: str, module: nn.Module) -> list[PlannedTensor]:
        """What a kept weight ``name`` brings along for ``module`` (its canonical scales)."""


def linear_modules(model: nn.Module) -> Iterator[tuple[str, nn.Module]]:
    """``(name, module)`` of every :class:`~zpp.models.layers.linear.Linear` of ``model``."""
    from zpp.models.layers.linear import Linear
    for name, mod in model.named_modules():
        if isinstance(mod, Linear):
            yield name, mod


def ignored(name: str, ignore: tuple[str, ...]) -> bool:
    """Whether module ``name`` matches an ``ignore`` entry (a module name, or ``re:`` a regex matched
    from its start, compressed-tensors' rule). Informational: what is quantized is read from the
    checkpoint's tensors."""
    for pat in ignore:
        if pat.startswith("re:"):
            if re.match(pat[3:], name):
                return True
        elif name == pat or name.endswith("." + pat):
            return True
    return False
