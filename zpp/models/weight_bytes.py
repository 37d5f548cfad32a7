"""What a stage holds, by dtype: the one count the loader's log, ``/metrics`` and the memory planner
share (it only reads ``numel`` and ``dtype``, so it works on the meta device too)."""
from __future__ import annotations

import torch
from torch import nn

DTYPE_NAMES = {torch.float8_e4m3fn: "fp8", torch.float8_e5m2: "fp8_e5m2", torch.bfloat16: "bf16",
               torch.float16: "fp16", torch.float32: "fp32", torch.int64: "int64", torch.int32: "int32",
               torch.uint8: "uint8", torch.int8: "int8"}
"""Short dtype names (vLLM's ``--dtype`` / ``--quantization`` spelling where there is one)."""


def dtype_name(dtype: torch.dtype) -> str:
    """``torch.float8_e4m3fn`` -> ``fp8``, ``torch.bfloat16`` -> ``bf16``, others ``str(dtype)`` without ``torch.``."""
    return DTYPE_NAMES.get(dtype, str(dtype).removeprefix("torch."))


def weight_bytes_by_dtype(module: nn.Module) -> dict[str, int]:
    """Bytes of ``module``'s weights by dtype name (:func:`dtype_name`), largest first: every
    parameter, plus the buffers holding weight scales (names ending in ``_scale``: the scales
    ``--quantization fp8`` keeps as buffers). Tensors shared by several modules count once."""
    out: dict[str, int] = {}
    seen: set[int] = set()
    tensors = list(module.named_parameters()) + [(n, b) for n, b in module.named_buffers() if n.endswith("_scale")]
    for _, t in tensors:
        if id(t) in seen:
            continue
        seen.add(id(t))
        key = dtype_name(t.dtype)
        out[key] = out.get(key, 0) + t.numel() * t.element_size()
    return dict(sorted(out.items(), key=lambda kv: -kv[1]))


def format_gib_by_dtype(by_dtype: dict[str, int]) -> str:
    """``{"fp8": 31.2e9, "bf16": 1.4e9}`` -> ``"fp8 29.1, bf16 1.3"`` (GiB, one decimal)."""
    return ", ".join(f"{k} {v / 2**30:.1f}" for k, v in by_dtype.items()) or "none"
