"""MXFP4 (``quantization_config.quant_method: mxfp4``) as gpt-oss ships it: :class:`Mxfp4Config`.

The checkpoint (openai/gpt-oss-20b / -120b): every MoE layer's experts as
``mlp.experts.gate_up_proj_blocks`` uint8 ``[E, 2I, H / 32, 16]`` with ``gate_up_proj_scales`` uint8
``[E, 2I, H / 32]``, and ``mlp.experts.down_proj_blocks`` ``[E, H, I / 32, 16]`` with
``down_proj_scales`` ``[E, H, I / 32]``: each weight row ``[N, K]`` cut into blocks of 32 columns, a
block's 32 FP4 (e2m1) codes in 16 bytes (column ``2j`` in the low nibble) and one E8M0 exponent (the
block's scale ``2 ** (s - 127)``; OCP Microscaling Formats v1.0). ``gate_up`` rows are gpt-oss's
interleaved gate (even) / up (odd). Everything else -- attention, routers, embeddings, LM head
(``modules_to_not_convert``), the experts' biases -- is bf16.

Dequantized (CPU; GPUs without the W4A16 methods), each weight is exactly HF transformers'
``convert_moe_packed_tensors`` (``transformers/integrations/mxfp4.py``: ``E2M1[code] * 2 ** (s - 127)``
then ``[E, N, K] -> [E, K, N]``), i.e. the bf16 checkpoint's ``gate_up_proj [E, H, 2I]`` /
``down_proj [E, I, H]``, which the gpt-oss family loads as usual. Kept on a GPU, ``qweight`` is the
blocks flattened to ``[E, N, K / 2]`` (already the w4_layout's nibble order) and ``scales`` the E8M0
bytes ``[E, N, K / 32]``.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from zpp.errors import ConfigError
from zpp.models.quantization.base import Getter
from zpp.models.quantization.w4_base import Repacked, W4Config

BLOCK = 32
"""Columns per E8M0 scale (the MX block)."""


@dataclass
class Mxfp4Config(W4Config):
    """gpt-oss's MXFP4 experts; ``ignore``: ``modules_to_not_convert`` (informational)."""

    method: str = "mxfp4"
    fmt: str = "mxfp4"
    group_size: int = BLOCK
    ignore: tuple[str, ...] = ()
    WEIGHT_SUFFIX = "_blocks"
    LOADED_SUFFIX = ""
    AUX_SUFFIXES = ("_scales",)
    STORED_DTYPES = ("U8",)

    def aux_names(self, base: str) -> dict[str, str]:
        return {"scales": base + "_scales"}

    @property
    def zero_points(self) -> bool:
        return False

    def dummy_target(self, name: str, experts: bool) -> bool:
        """gpt-oss's release quantizes the experts only."""
        return experts

    def repack(self, base: str, get: Getter) -> Repacked:
        blocks, scales = get(base + "_blocks"), get(base + "_scales")
        if blocks.dtype != torch.uint8 or scales.dtype != torch.uint8:
            raise ValueError(f"checkpoint tensor {base}_blocks / _scales: uint8 expected, got {blocks.dtype} / "
                             f"{scales.dtype}")
        if blocks.dim() < 3 or blocks.shape[-1] != BLOCK // 2 or tuple(blocks.shape[:-1]) != tuple(scales.shape):
            raise ValueError(f"checkpoint tensor {base}_blocks {tuple(blocks.shape)} and {base}_scales "
                             f"{tuple(scales.shape)}: MXFP4 blocks [..., N, K/32, 16] with scales [..., N, K/32] "
                             "expected")
        return blocks.reshape(*blocks.shape[:-2], -1).contiguous(), scales.contiguous(), None

    def to_loaded_layout(self, w: torch.Tensor) -> torch.Tensor:
        """``[E, N, K] -> [E, K, N]``: the bf16 checkpoint's layout (HF's ``out.transpose(1, 2)``)."""
        return w.transpose(-1, -2).contiguous()


def parse_mxfp4(q: dict) -> Mxfp4Config:
    """``quant_method: mxfp4`` -> :class:`Mxfp4Config`.

    Raises:
        ConfigError: a field gpt-oss's release does not have with another value (named).
    """
    bs = q.get("block_size", q.get("group_size", BLOCK))
    if bs != BLOCK:
        raise ConfigError(f"MXFP4 checkpoint (quant_method 'mxfp4'): block size {bs!r} is not supported (32 only)")
    return Mxfp4Config(ignore=tuple(q.get("modules_to_not_convert") or ()))
