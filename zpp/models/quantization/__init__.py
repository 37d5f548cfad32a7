"""Quantized weights: one folder, one file per format, one interface.

* :mod:`~zpp.models.quantization.base` -- the interface: a format's
  :class:`~zpp.models.quantization.base.QuantizationConfig` says what the checkpoint holds, how the
  CPU dequantizes it, and which :class:`~zpp.models.quantization.base.LinearMethod` /
  :class:`~zpp.models.quantization.base.FusedMoEMethod` runs it on a GPU (vLLM's split).
* :mod:`~zpp.models.quantization.checkpoint` -- reading any quantized checkpoint (header index,
  per-stage plan, planned loading, KV-cache scales).
* the 4-bit formats, repacked at load into :mod:`~zpp.models.quantization.w4_layout` (what they
  share: :mod:`~zpp.models.quantization.w4_base`): :mod:`~zpp.models.quantization.mxfp4` (gpt-oss),
  :mod:`~zpp.models.quantization.int4_compressed` (compressed-tensors ``pack-quantized``, dispatched
  from :func:`~zpp.models.quantization.fp8.parse_compressed_tensors`),
  :mod:`~zpp.models.quantization.gptq`, :mod:`~zpp.models.quantization.awq`.
* :mod:`~zpp.models.quantization.fp8` -- FP8 e4m3, both layouts (compressed-tensors
  ``float-quantized``; ``quant_method: fp8`` block 128 x 128 / per tensor), its linear method and
  ``--quantization fp8``; :mod:`~zpp.models.quantization.fp8_linear` its linear product,
  :mod:`~zpp.models.quantization.fp8_utils` its numerics in PyTorch,
  :mod:`~zpp.models.quantization.fp8_kernels` its Triton kernels.

A new format is one file (its ``QuantizationConfig`` and methods) plus its kernels, and one entry
in :data:`QUANTIZATION_METHODS`.
"""
from __future__ import annotations

from typing import Any, Callable, Optional

import torch

from zpp.errors import ConfigError
from zpp.models.quantization.base import QuantizationConfig
from zpp.models.quantization.awq import parse_awq
from zpp.models.quantization.fp8 import parse_compressed_tensors, parse_fp8
from zpp.models.quantization.gptq import parse_gptq
from zpp.models.quantization.mxfp4 import parse_mxfp4

QUANTIZATION_METHODS: dict[str, Callable[[dict], QuantizationConfig]] = {
    "compressed-tensors": parse_compressed_tensors,
    "fp8": parse_fp8,
    "mxfp4": parse_mxfp4,
    "gptq": parse_gptq,
    "awq": parse_awq,
}
"""``quantization_config.quant_method`` -> the parser of its scheme (ConfigError for what it refuses)."""

SUPPORTED_QUANTIZATION = tuple(QUANTIZATION_METHODS)
"""``quantization_config.quant_method`` values zpp loads."""


def _method(q: dict) -> str:
    method = q.get("quant_method")
    if not method and (q.get("load_in_4bit") or q.get("load_in_8bit")):
        method = "bitsandbytes"
    return str(method).lower() if method else "unknown"


def parse_quantization_config(cfg: dict[str, Any]) -> Optional[QuantizationConfig]:
    """The checkpoint's quantization scheme, None for an unquantized checkpoint.

    Parsed here rather than with the ``compressed-tensors`` package: importing it pulls in
    transformers and accelerate (about 7 s on the 2-core development VM) in every worker, for a few
    JSON fields; the tests check that the configs this module accepts validate with it.

    Raises:
        ConfigError: one line naming the method or the field zpp does not support (bitsandbytes,
            hqq, ... ; GPTQ act-order or bits != 4; AWQ versions other than gemm; int schemes other
            than 4-bit pack-quantized; asymmetric or group-wise FP8; output activations; e5m2; static
            activations with block scales).
    """
    q = cfg.get("quantization_config")
    if not q:
        return None
    if not isinstance(q, dict):
        raise ConfigError("quantization_config is not a JSON object")
    method = _method(q)
    parse = QUANTIZATION_METHODS.get(method)
    if parse is None:
        raise ConfigError(f"quantized checkpoint (quantization_config.quant_method {method!r}) is not supported: "
                          f"zpp loads {', '.join(SUPPORTED_QUANTIZATION)} checkpoints and unquantized safetensors")
    return parse(q)


def check_quantization(cfg: dict[str, Any]) -> None:
    """Refuse, before any weight loads, a quantized checkpoint zpp cannot load (one-line ConfigError
    naming the method or field; see :func:`parse_quantization_config`)."""
    parse_quantization_config(cfg)


def format_supported(quant: QuantizationConfig, device: torch.device,
                     capability: Optional[tuple[int, int]] = None) -> bool:
    """Whether ``quant``'s GPU methods may run: a CUDA ``device`` (or the planned ``capability``) of
    compute capability >= ``quant.min_capability``."""
    if capability is not None:
        return capability >= quant.min_capability
    return device.type == "cuda" and torch.cuda.get_device_capability(device) >= quant.min_capability


def fp8_supported(device: torch.device) -> bool:
    """Whether FP8 GEMMs run on ``device``: a CUDA GPU of compute capability >= 8.9 (Ada, Hopper)."""
    return device.type == "cuda" and torch.cuda.get_device_capability(device) >= (8, 9)
