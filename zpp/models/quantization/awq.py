"""AWQ (``quantization_config.quant_method: awq``), ``version: gemm``, 4 bits: :class:`AwqConfig`.

The checkpoint (AutoAWQ / llm-awq GEMM), per quantized linear ``X`` with weight ``W [N, K]``:

* ``X.qweight`` int32 ``[K, N / 8]``: packed along ``N``, in AWQ's interleaved order: the nibble
  at bits ``4i`` of word ``[k, j]`` holds column ``8j + AWQ_ORDER[i]``, ``AWQ_ORDER = [0, 2, 4, 6,
  1, 3, 5, 7]`` (AutoAWQ's ``pack``; unpacked with the reverse order ``[0, 4, 1, 5, 2, 6, 3, 7]``);
* ``X.qzeros`` int32 ``[K / G, N / 8]``, the zero points packed the same way;
* ``X.scales`` fp16 ``[K / G, N]``.

The rule (AutoAWQ's ``dequantize_gemm``, vLLM's ``awq_dequantize``): ``w[n, k] = (q[k, n] - z[g, n]) *
scales[g, n]``, ``g = k // G`` (no +1). Repacked: codes and zeros un-interleaved and transposed to
``[N, K]`` / ``[N, K / G]``, ``scales`` transposed.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from zpp.errors import ConfigError
from zpp.models.quantization.base import Getter
from zpp.models.quantization.gptq import unpack_along_n
from zpp.models.quantization.w4_base import Repacked, W4Config, check_group
from zpp.models.quantization.w4_layout import pack_codes

AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)
"""Nibble ``i`` of a packed word holds column ``AWQ_ORDER[i]`` of its eight."""
AWQ_REVERSE_ORDER = (0, 4, 1, 5, 2, 6, 3, 7)
"""Column ``c`` of a word's eight is nibble ``AWQ_REVERSE_ORDER[c]``."""


def unpack_awq(words: torch.Tensor, n: int) -> torch.Tensor:
    """int32 ``[R, N / 8]`` in AWQ's order -> uint8 ``[R, N]`` in column order."""
    nib = unpack_along_n(words, words.shape[-1] * 8)                       # [R, N] in nibble order
    r = nib.reshape(nib.shape[0], -1, 8)[..., list(AWQ_REVERSE_ORDER)]
    return r.reshape(nib.shape[0], -1)[:, :n]


@dataclass
class AwqConfig(W4Config):
    """AWQ GEMM, 4 bits, zero points: ``group_size``, ``ignore`` (``modules_to_not_convert``,
    informational)."""

    method: str = "awq"
    fmt: str = "int4"
    group_size: int = 128
    ignore: tuple[str, ...] = ()
    WEIGHT_SUFFIX = ".qweight"
    AUX_SUFFIXES = (".qzeros", ".scales")

    def aux_names(self, base: str) -> dict[str, str]:
        return {"scales": f"{base}.scales", "zeros": f"{base}.qzeros"}

    @property
    def zero_points(self) -> bool:
        return True

    def repack(self, base: str, get: Getter) -> Repacked:
        qw, qz, s = get(f"{base}.qweight"), get(f"{base}.qzeros"), get(f"{base}.scales")
        if qw.dtype != torch.int32 or qw.dim() != 2 or qz.dtype != torch.int32:
            raise ValueError(f"checkpoint tensor {base}.qweight / .qzeros: int32 [K, N/8] / [K/G, N/8] expected, "
                             f"got {qw.dtype} {tuple(qw.shape)} / {qz.dtype} {tuple(qz.shape)}")
        k, n = qw.shape[0], s.shape[-1]
        check_group(self.method, "group_size", self.group_size, k, f"{base}.qweight")
        g = k // self.group_size
        if tuple(s.shape) != (g, n) or qw.shape[1] != -(-n // 8) or tuple(qz.shape) != (g, qw.shape[1]):
            raise ValueError(f"checkpoint tensors {base}.qweight {tuple(qw.shape)} / .qzeros {tuple(qz.shape)} / "
                             f".scales {tuple(s.shape)} do not agree in groups of {self.group_size}")
        codes = unpack_awq(qw, n).t()                                          # [N, K]
        zeros = unpack_awq(qz, n).t().contiguous()                             # [N, K/G]
        return pack_codes(codes).contiguous(), s.t().contiguous(), zeros


def _refuse(field: str, value) -> ConfigError:
    return ConfigError(f"AWQ checkpoint (quant_method 'awq'): {field} {value!r} is not supported (zpp loads "
                       "bits 4, version gemm, zero_point true)")


def parse_awq(q: dict) -> AwqConfig:
    """``quant_method: awq`` -> :class:`AwqConfig` (AutoAWQ's older names ``w_bit`` /
    ``q_group_size`` too).

    Raises:
        ConfigError: ``bits`` other than 4, a ``version`` other than ``gemm`` (gemv, exllama,
            marlin, ipex), ``zero_point`` false, a bad ``group_size`` (one line naming the field).
    """
    bits = q.get("bits", q.get("w_bit", 4))
    if bits != 4:
        raise _refuse("bits", bits)
    version = str(q.get("version", "gemm")).lower()
    if version != "gemm":
        raise _refuse("version", q.get("version"))
    if q.get("zero_point", True) is False:
        raise _refuse("zero_point", False)
    gs = q.get("group_size", q.get("q_group_size", 128))
    if not isinstance(gs, int) or gs <= 0 or gs % 2:
        raise _refuse("group_size", gs)
    return AwqConfig(group_size=gs, ignore=tuple(q.get("modules_to_not_convert") or ()))
