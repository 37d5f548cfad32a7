"""GPTQ (``quantization_config.quant_method: gptq``), 4 bits, ``desc_act: false``: :class:`GptqConfig`.

The checkpoint (AutoGPTQ / GPTQModel / optimum; Qwen's ``-GPTQ-Int4`` releases), per quantized
linear ``X`` with weight ``W [N, K]``:

* ``X.qweight`` int32 ``[K / 8, N]``: packed along ``K``, row ``8j + i`` of column ``n`` at bits
  ``4i`` of word ``[j, n]``;
* ``X.qzeros`` int32 ``[K / G, N / 8]``: the zero points packed along ``N`` the same way;
* ``X.scales`` fp16 ``[K / G, N]``; ``X.g_idx`` int32 ``[K]`` (the group of each input row; with
  ``desc_act: false`` it is ``k // G``); ``G = K`` for ``group_size: -1``.

The rule (AutoGPTQ's ``QuantLinear`` dequantization, which vLLM's GPTQ / Marlin paths reproduce):
``w[n, k] = scales[g, n] * (q[k, n] - z[g, n])`` with ``g = k // G`` and, for the original
``checkpoint_format: gptq`` ("v1"), ``z = stored zero + 1`` (the quantizer stores ``zero - 1``;
``gptq_v2`` stores ``zero`` itself). Symmetric checkpoints store ``zero - 1 = 7`` (8 after the
rule). Repacked: ``qweight`` is ``X.qweight`` transposed and read as bytes, ``zeros`` the unpacked
zero points (+1 for v1; a v1 stored 15 gives 16, kept as is: uint8) transposed, ``scales``
transposed; a symmetric checkpoint's zeros (all 8) are dropped (``zeros`` None; another value is
refused).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from zpp.errors import ConfigError
from zpp.models.quantization.base import Getter
from zpp.models.quantization.int4_compressed import _as_bytes
from zpp.models.quantization.w4_base import Repacked, W4Config, check_group
from zpp.models.quantization.w4_layout import unpack_codes


def unpack_along_n(words: torch.Tensor, n: int) -> torch.Tensor:
    """int32 ``[R, ceil(N / 8)]`` packed along the columns (value ``i`` of a word at bits ``4i``) ->
    uint8 ``[R, N]``."""
    return unpack_codes(_as_bytes(words))[:, :n]


@dataclass
class GptqConfig(W4Config):
    """GPTQ 4 bits, ``desc_act`` false: ``group_size`` (``-1``: one group over ``K``), ``sym``,
    ``v1`` (``checkpoint_format: gptq``: stored zeros + 1), ``ignore`` (``modules_to_not_convert``,
    informational)."""

    method: str = "gptq"
    fmt: str = "int4"
    group_size: int = 128
    sym: bool = True
    v1: bool = True
    ignore: tuple[str, ...] = ()
    WEIGHT_SUFFIX = ".qweight"
    AUX_SUFFIXES = (".qzeros", ".scales", ".g_idx")

    def aux_names(self, base: str) -> dict[str, str]:
        return {"scales": f"{base}.scales", "zeros": f"{base}.qzeros"}

    @property
    def zero_points(self) -> bool:
        return not self.sym

    def group_of(self, k: int) -> int:
        return k if self.group_size == -1 else self.group_size

    def repack(self, base: str, get: Getter) -> Repacked:
        qw, qz, s = get(f"{base}.qweight"), get(f"{base}.qzeros"), get(f"{base}.scales")
        if qw.dtype != torch.int32 or qw.dim() != 2:
            raise ValueError(f"checkpoint tensor {base}.qweight: int32 [K/8, N] expected, got {qw.dtype} "
                             f"{tuple(qw.shape)}")
        k, n = qw.shape[0] * 8, qw.shape[1]
        G = self.group_of(k)
        check_group(self.method, "group_size", G, k, f"{base}.qweight")
        if tuple(s.shape) != (k // G, n) or tuple(qz.shape) != (k // G, -(-n // 8)) or qz.dtype != torch.int32:
            raise ValueError(f"checkpoint tensors {base}.scales {tuple(s.shape)} / .qzeros {tuple(qz.shape)}: "
                             f"[{k // G}, {n}] / int32 [{k // G}, {-(-n // 8)}] expected for qweight "
                             f"{tuple(qw.shape)} in groups of {G}")
        try:
            self.check_g_idx(base, get, k)
        except KeyError:                                                       # no g_idx: rows in order
            pass
        qweight = _as_bytes(qw.t())                                            # [N, K/2]
        zeros = unpack_along_n(qz, n) + (1 if self.v1 else 0)                  # [K/G, N]
        zeros = zeros.t().contiguous()
        if self.sym:                                                           # the implicit 8
            if not bool((zeros == 8).all()):
                raise ValueError(f"checkpoint tensor {base}.qzeros: zero points other than 8 in a checkpoint whose "
                                 "config says sym: true")
            zeros = None
        return qweight.contiguous(), s.t().contiguous(), zeros

    def check_g_idx(self, base: str, get: Getter, k: int) -> None:
        """Raise ValueError when a ``g_idx`` says the rows are not in group order (act-order)."""
        g = get(f"{base}.g_idx")
        if not torch.equal(g.long(), torch.arange(k) // self.group_of(k)):
            raise ValueError(f"checkpoint tensor {base}.g_idx is not k // group_size: an act-order (desc_act) "
                             "checkpoint, not supported")


def _refuse(field: str, value) -> ConfigError:
    return ConfigError(f"GPTQ checkpoint (quant_method 'gptq'): {field} {value!r} is not supported (zpp loads "
                       "bits 4, desc_act false, checkpoint_format gptq / gptq_v2)")


def parse_gptq(q: dict) -> GptqConfig:
    """``quant_method: gptq`` -> :class:`GptqConfig`.

    Raises:
        ConfigError: ``bits`` other than 4, ``desc_act`` true, a ``group_size`` that is not -1 or
            positive, another ``checkpoint_format`` (one line naming the field).
    """
    bits = q.get("bits", 4)
    if bits != 4:
        raise _refuse("bits", bits)
    if q.get("desc_act"):
        raise _refuse("desc_act", q.get("desc_act"))
    gs = q.get("group_size", 128)
    if not isinstance(gs, int) or (gs != -1 and gs <= 0) or (gs > 0 and gs % 2):
        raise _refuse("group_size", gs)
    cf = q.get("checkpoint_format", "gptq")
    if cf not in ("gptq", "gptq_v2"):
        raise _refuse("checkpoint_format", cf)
    ignore = tuple(q.get("modules_to_not_convert") or ())
    return GptqConfig(group_size=gs, sym=q.get("sym", True) is not False, v1=cf == "gptq", ignore=ignore)
