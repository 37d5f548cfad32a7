"""The one in-memory layout of every 4-bit weight (MXFP4, INT4 W4A16: compressed-tensors
``pack-quantized``, GPTQ, AWQ), which the formats repack into at load and the W4A16 kernels read.

A weight ``W [N, K]`` (``N`` output rows, ``K`` input columns; experts add a leading ``E``) is held as:

* ``qweight`` uint8 ``[..., N, K // 2]``: two 4-bit codes a byte, **column ``2j`` in the low nibble,
  column ``2j + 1`` in the high nibble** (the order of the OCP MX spec's e2m1 pairs and of
  gpt-oss's ``*_blocks`` once flattened);
* ``scales`` ``[..., N, K // group_size]``: bf16 / fp16 / fp32 for ``int4``; uint8 E8M0 exponents for
  ``mxfp4`` (scale ``2 ** (s - 127)``, OCP Microscaling Formats v1.0, sect. 5.4);
* ``zeros`` uint8 ``[..., N, K // group_size]`` or None, ``int4`` only: the zero point of each group
  (0..15); None means the symmetric zero point 8.

The value of code ``q`` in group ``g``: ``int4``: ``(q - zero) * scale``; ``mxfp4``:
``E2M1[q] * 2 ** (s - 127)`` with E2M1 the sixteen FP4 values of the MX spec (sign bit 3).
"""
from __future__ import annotations

from typing import Optional

import torch

FORMATS = ("int4", "mxfp4")

E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
"""FP4 e2m1 code -> value (OCP MX v1.0, table 5; the table HF transformers' MXFP4 integration uses)."""


def unpack_codes(qweight: torch.Tensor) -> torch.Tensor:
    """uint8 ``[..., N, K // 2]`` -> the 4-bit codes as uint8 ``[..., N, K]`` (low nibble first)."""
    if qweight.dtype != torch.uint8:
        raise TypeError(f"qweight must be uint8, got {qweight.dtype}")
    lo = qweight & 0x0F
    hi = qweight >> 4
    return torch.stack((lo, hi), dim=-1).flatten(-2)


def pack_codes(codes: torch.Tensor) -> torch.Tensor:
    """The inverse of :func:`unpack_codes`: uint8 codes 0..15 ``[..., N, K]`` (K even) -> ``[..., N, K // 2]``.

    Raises:
        ValueError: ``K`` is odd.
    """
    if codes.shape[-1] % 2:
        raise ValueError(f"a 4-bit weight needs an even number of columns, got {codes.shape[-1]}")
    c = codes.to(torch.uint8)
    return (c[..., 0::2] & 0x0F) | ((c[..., 1::2] & 0x0F) << 4)


def dequantize_w4(qweight: torch.Tensor, scales: torch.Tensor, zeros: Optional[torch.Tensor],
                  group_size: int, fmt: str, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """The weight ``[..., N, K]`` in ``dtype`` (computed in float32): the reference every 4-bit
    format's CPU rule and every W4A16 kernel test compares against.

    Raises:
        ValueError: an unknown ``fmt``, or shapes that do not agree with ``group_size``.
    """
    if fmt not in FORMATS:
        raise ValueError(f"unknown 4-bit format {fmt!r} (one of {', '.join(FORMATS)})")
    codes = unpack_codes(qweight)
    k = codes.shape[-1]
    if k % group_size or scales.shape[-1] != k // group_size or scales.shape[:-1] != codes.shape[:-1]:
        raise ValueError(f"4-bit weight of {k} columns, scales {tuple(scales.shape)}, group size {group_size} "
                         "do not agree")
    if fmt == "mxfp4":
        lut = torch.tensor(E2M1_VALUES, dtype=torch.float32, device=codes.device)
        vals = lut[codes.long()]
        s = torch.exp2(scales.to(torch.float32) - 127.0)
    else:
        z = torch.full_like(scales, 8, dtype=torch.float32) if zeros is None else zeros.to(torch.float32)
        vals = codes.to(torch.float32) - z.repeat_interleave(group_size, dim=-1)
        s = scales.to(torch.float32)
    return (vals * s.repeat_interleave(group_size, dim=-1)).to(dtype)
