"""Which linear layers keep their weight in the model dtype under every format (FP8, 4-bit, the
oneDNN CPU packing): a leaf module, imported by :mod:`zpp.models.quantization.base` and
:mod:`zpp.models.layers.cpu_linear` alike."""
from __future__ import annotations

from torch import nn

KEEP_DTYPE_MODULES = ("kv_b_proj",)
"""Linear layers whose weight a family reads outside the layer's forward, so it stays in the model
dtype under every format: DeepSeek's MLA folds ``kv_b_proj``'s key and value parts into the
attention (weight absorption)."""


def keeps_dtype(name: str, mod: nn.Module) -> bool:
    """Whether the linear layer ``name`` keeps its weight in the model dtype under every format
    (``fp8_allowed = False`` on it, or one of :data:`KEEP_DTYPE_MODULES`)."""
    return not getattr(mod, "fp8_allowed", True) or name.rsplit(".", 1)[-1] in KEEP_DTYPE_MODULES
