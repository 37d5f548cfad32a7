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

Used only for float32 weights on the CPU (the CPU path's default dtype), unquantized, when
PyTorch has oneDNN (``torch.backends.mkldnn``); ``ZPP_CPU_ONEDNN_LINEAR=0`` turns it off. The
packed copy is held next to the dense ``weight`` (which stays, for code that reads it), so a
packed layer's weight takes twice its memory on the CPU.
"""
from __future__ import annotations

import logging
from typing import Optional

import torch
from torch import nn

from zpp import envs

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


def pack_cpu_linears(model: nn.Module) -> int:
    """Give every unquantized float32 CPU :class:`~zpp.models.layers.linear.Linear` (and its merged /
    row-parallel kinds) and :class:`~zpp.models.layers.linear.LMHead` of ``model`` a packed copy of its
    weight (``module.packed_weight``), which their ``forward`` then uses. Call once the weights are
    loaded. Returns how many modules were packed (0 when ``ZPP_CPU_ONEDNN_LINEAR=0`` or PyTorch has no
    oneDNN)."""
    if not envs.ZPP_CPU_ONEDNN_LINEAR or not torch.backends.mkldnn.is_available():
        return 0
    n = 0
    for module in model.modules():
        if getattr(type(module), "packed_weight", False) is not None:  # Linear, its kinds and LMHead say None
            continue
        if getattr(module, "fp8", None) is not None or getattr(module, "quant_method", None) is not None:
            continue
        if not packable(module.weight):
            continue
        module.packed_weight = pack_weight(module.weight)
        module._packed_of = (module.weight.data_ptr(), module.weight._version)
        n += 1
    if n:
        logger.debug("%d float32 linear layers packed for oneDNN", n)
    return n


def packed_for(module: nn.Module, x: torch.Tensor) -> Optional[torch.Tensor]:
    """``module.packed_weight`` if it may serve the input ``x``: a float32 CPU ``x``, and the weight
    still the float32 tensor it was packed from, unchanged (same storage, no in-place write since --
writes through ``.data`` are not seen:
    a model cast to another dtype, or weights loaded again or edited, fall back to ``F.linear``
    on ``weight``); else None."""
    packed = module.packed_weight
    if packed is None or x.dtype != torch.float32 or x.device.type != "cpu":
        return None
    w = module.weight
    if w.dtype != torch.float32 or (w.data_ptr(), w._version) != getattr(module, "_packed_of", None):
        return None
    return packed
