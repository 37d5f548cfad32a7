"""CPU float32 linear layers through oneDNN with weights packed once at load.

On the CPU, PyTorch's ``F.linear`` of a few rows goes to MKL's ``sgemm``, which for 2-3 rows is
about a matrix-vector product per row. ``scripts/cpu_linear_bench.py`` (one thread, the development
VM's AMD EPYC, SmolLM2-135M's shapes, 15 layers' distinct weights cycled so that they come from
memory, as in a stage at PP=2; load average 0.1): a stage's linear layers took 17.6 ms for 1 row,
27-33 ms for 2-3 rows and 24-28 ms for 4-6; the 49152 x 576 LM head 9.9 ms for 1 row, 22-33 ms for
2-3 and 17-19 ms for 4-6. A speculative verify step computes ``1 + k`` rows per request, so it paid
1.4-1.9x a decode step. oneDNN's inner product with the weight reordered once into its blocked
layout (``torch.ops.mkldnn._reorder_linear_weight`` and ``_linear_pointwise``, the pair PyTorch's
Inductor uses for frozen CPU linears) reads each weight block once for all the rows: 11.7-17.8 ms
for the stage's layers and 5.7-8.7 ms for the LM head at 1 to 6 rows, in the same run.

Numerics: a float32 product still, summed in another order than MKL's (differences up to ~5e-6
on outputs of order 1 at these shapes); in the measurements above, a row's result did not depend on how many rows were in
the call, so a verify row equals the decode row of the same token. Greedy parity with HF
transformers is what the model tests check.

Used by default for float32 weights on the CPU (the CPU path's default dtype), unquantized, when
PyTorch has oneDNN (``torch.backends.mkldnn``); ``ZPP_CPU_ONEDNN_LINEAR=0`` turns it off (MKL's
``F.linear``).

Memory: one copy. Packing replaces a module's dense ``weight`` parameter by a parameter holding the
packed (``torch._mkldnn`` layout) tensor, so the dense copy is freed and a stage holds its linear
weights once, as ``zpp plan`` and the loader's count (``numel x 4`` bytes) say. oneDNN's blocked
layout pads a weight's dims to its blocks (on an AVX-512 Xeon: the output dim to 64, the input dim
to 16); the padding is not counted there and is zero for widths that are multiples of 64 (every
width of SmolLM2 and the Llama shapes); the loader's INFO line gives the packed bytes. The rare code
that needs the dense values gets them back (``to_dense()``): :func:`dense_weight`; ``.to(dtype)``
and the other ``nn.Module._apply`` casts, ``load_state_dict`` and ``load_weights`` unpack the module
first (it then multiplies through ``F.linear``); ``state_dict()`` gives the dense weight. Elementwise
in-place writes (``weight.mul_``) act on the packed values; ops oneDNN tensors lack (indexing,
``copy_`` from a dense tensor, ``torch.equal``) raise. Not packed: a layer whose weight the family
reads outside its ``forward`` (``fp8_allowed = False`` or DeepSeek's ``kv_b_proj``,
:func:`zpp.models.layers.kept_dtype.keeps_dtype`), and quantized layers.
"""
from __future__ import annotations

import logging
from typing import Optional

import torch
from torch import nn

from zpp import envs
from zpp.models.layers.kept_dtype import keeps_dtype

logger = logging.getLogger(__name__)

_ROWS_HINT = 4
"""The batch size oneDNN is told to pack for (1 + k of a verify step); the measured results were
the same for 1 to 512 rows."""


def packable(weight: Optional[torch.Tensor]) -> bool:
    """Whether ``weight`` (``[out, in]``) is one this module packs: a dense 2-D float32 CPU tensor."""
    return (weight is not None and weight.device.type == "cpu" and weight.dtype == torch.float32
            and weight.dim() == 2 and weight.layout == torch.strided)


def pack_weight(weight: torch.Tensor) -> torch.Tensor:
    """``weight [out, in]`` float32 CPU -> an opaque oneDNN (``torch._mkldnn`` layout) tensor for
    :func:`packed_linear`. A copy: later writes to ``weight`` do not reach it."""
    return torch.ops.mkldnn._reorder_linear_weight(weight.detach().contiguous(), _ROWS_HINT)


def packed_linear(x: torch.Tensor, packed: torch.Tensor, bias: Optional[torch.Tensor] = None) -> torch.Tensor:
    """``F.linear(x, weight, bias)`` with ``packed = pack_weight(weight)``: ``x [..., in]`` float32 CPU
    -> ``[..., out]`` float32."""
    return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")


def packed_nbytes(packed: torch.Tensor) -> int:
    """Bytes a packed weight (:func:`pack_weight`) holds, its layout's padding included."""
    return int(torch.ops.mkldnn._nbytes(packed))


class PackableWeight(nn.Module):
    """What a module whose ``weight`` parameter ``[out, in]`` :func:`pack_cpu_linears` may pack
    (:class:`~zpp.models.layers.linear.Linear`, its kinds, and
    :class:`~zpp.models.layers.linear.LMHead`) adds: :attr:`packed_weight`, and the ``nn.Module``
    hooks that give the dense weight back where a packed one cannot serve -- casts and moves
    (``_apply``: ``.to``, ``.bfloat16()``, ``.cuda()``, ...) and ``load_state_dict`` unpack the module
    first; ``state_dict()`` holds the dense weight."""

    @property
    def packed_weight(self) -> Optional[torch.Tensor]:
        """The ``weight`` parameter when it holds the packed (oneDNN) tensor, which ``forward``
        multiplies by; else None."""
        w = self._parameters.get("weight")
        return w if w is not None and w.is_mkldnn else None

    def _apply(self, fn, *args, **kwargs):
        unpack(self)
        return super()._apply(fn, *args, **kwargs)

    def _save_to_state_dict(self, destination, prefix, keep_vars):
        super()._save_to_state_dict(destination, prefix, keep_vars)
        w = destination.get(prefix + "weight")
        if w is not None and w.is_mkldnn:
            destination[prefix + "weight"] = w.to_dense()

    def _load_from_state_dict(self, state_dict, prefix, *args, **kwargs):
        unpack(self)
        return super()._load_from_state_dict(state_dict, prefix, *args, **kwargs)


def _replace_weight(module: nn.Module, new: nn.Parameter) -> None:
    """Make ``new`` the module's ``weight`` parameter, keeping the old one's attributes
    (``weight_loader``, ...); the old parameter is dropped (its memory freed unless something else
    holds it)."""
    new.__dict__.update(module.weight.__dict__)
    module.weight = new


def _return_freed_memory() -> None:
    """Give the dense copies' freed pages back to the OS (glibc's ``malloc_trim(0)``; a CPU worker
    keeps freed memory otherwise, ``zpp.workers.worker.keep_freed_memory``), so that a stage's
    resident memory after packing is its weights once. Nothing where glibc is not the allocator."""
    import ctypes
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


def pack_cpu_linears(model: nn.Module) -> int:
    """Pack the weight of every unquantized float32 CPU :class:`~zpp.models.layers.linear.Linear` (and
    its merged / row-parallel kinds) and :class:`~zpp.models.layers.linear.LMHead` of ``model`` for
    oneDNN: the module's ``weight`` parameter is replaced by one holding the packed tensor (same
    shape and dtype, ``torch._mkldnn`` layout, ``requires_grad=False``) and the dense copy is freed
    (module docstring). Not packed: layers whose weight the family reads outside ``forward``
    (:func:`~zpp.models.layers.kept_dtype.keeps_dtype`). A weight shared by several modules is
    packed once (:func:`unpack` gives each its own dense copy). Call once the weights are loaded. Returns how many modules were packed (0 when
    ``ZPP_CPU_ONEDNN_LINEAR=0`` or PyTorch has no oneDNN)."""
    if not envs.ZPP_CPU_ONEDNN_LINEAR or not torch.backends.mkldnn.is_available():
        return 0
    groups: dict[int, list[nn.Module]] = {}             # by weight object, all alive: ids are unique
    for name, module in model.named_modules():
        if not isinstance(module, PackableWeight) or keeps_dtype(name, module):
            continue
        if getattr(module, "fp8", None) is not None or getattr(module, "quant_method", None) is not None:
            continue
        if packable(module.weight):
            groups.setdefault(id(module.weight), []).append(module)
    n, dense, padded = 0, 0, 0
    for modules in groups.values():
        w = modules[0].weight
        p = nn.Parameter(pack_weight(w), requires_grad=False)
        for module in modules:
            module._dense_requires_grad = w.requires_grad
            _replace_weight(module, p)
        dense += w.numel() * w.element_size()
        padded += packed_nbytes(p)
        n += len(modules)
        del w                                              # the last reference: the dense copy is freed
    if n:
        _return_freed_memory()
        logger.info("%d float32 linear layers packed for oneDNN (%.1f MiB; %.1f MiB dense, freed; "
                    "ZPP_CPU_ONEDNN_LINEAR=0: MKL's F.linear)", n, padded / 2**20, dense / 2**20)
    return n


def unpack(module: nn.Module) -> bool:
    """Give a packed module its dense ``weight`` back (``to_dense()``, a new parameter; the packed one
    is dropped), after which ``forward`` multiplies through ``F.linear``. Returns whether it was
    packed."""
    w = module._parameters.get("weight")
    if w is None or not w.is_mkldnn:
        return False
    _replace_weight(module, nn.Parameter(w.to_dense(), requires_grad=getattr(module, "_dense_requires_grad", True)))
    return True


def unpack_all(model: nn.Module) -> int:
    """:func:`unpack` every packed module of ``model`` (before its weights are loaded again); returns
    how many were packed."""
    return sum(unpack(m) for m in model.modules() if isinstance(m, PackableWeight))


def dense_weight(module: nn.Module) -> torch.Tensor:
    """The module's weight ``[out, in]`` as a dense tensor: ``weight`` itself, or for a packed module a
    dense copy of it (``to_dense()``, ``out x in x 4`` bytes; writes to it do not reach the module)."""
    w = module.weight
    return w.to_dense() if w is not None and w.is_mkldnn else w


def packed_for(module: PackableWeight, x: torch.Tensor) -> Optional[torch.Tensor]:
    """The packed weight of ``module`` (:attr:`PackableWeight.packed_weight`) if it may serve the input ``x`` (a float32 CPU tensor), else
    None: the caller then multiplies by :func:`dense_weight` (``F.linear``)."""
    w = module.packed_weight
    return w if w is not None and x.dtype == torch.float32 and x.device.type == "cpu" else None
