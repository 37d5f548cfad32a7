"""Build one pipeline stage of a model and load only that stage's tensors."""
from __future__ import annotations

import glob
import logging
import os
import zlib
from typing import Any, Iterator, Optional

import torch

from zpp.models.base import StageInfo, StageModel
from zpp.models.registry import resolve_model_class

logger = logging.getLogger(__name__)


def safetensors_files(model_dir: str) -> list[str]:
    """The checkpoint's ``*.safetensors`` files, sorted.

    Raises:
        FileNotFoundError: the directory holds none.
    """
    files = sorted(glob.glob(os.path.join(model_dir, "*.safetensors")))
    if not files:
        raise FileNotFoundError(f"no *.safetensors files in {model_dir} (use --load-format dummy for random weights)")
    return files


def iter_safetensors(model_dir: str, model: StageModel) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield ``(name, tensor)`` for the checkpoint tensors this stage owns; others are never read.

    Raises:
        FileNotFoundError: the directory holds no ``*.safetensors`` file.
    """
    from safetensors import safe_open

    for path in safetensors_files(model_dir):
        with safe_open(path, framework="pt", device="cpu") as f:
            for name in f.keys():
                if model.map_weight_name(name) is not None:
                    yield name, f.get_tensor(name)


@torch.no_grad()
def init_dummy_weights(model: StageModel, seed: int) -> None:
    """Random weights, N(0, 0.02) (norm weights 1, biases 0), seeded per parameter name so every
    split of the model gets the same values."""
    for name, p in model.named_parameters():
        if name.endswith("bias"):
            p.zero_()
        elif p.dim() == 1:
            p.fill_(1.0)
        else:
            g = torch.Generator(device=p.device).manual_seed(seed ^ zlib.crc32(name.encode()))
            p.normal_(0.0, 0.02, generator=g)


def load_stage_model(model_dir: str, cfg: dict[str, Any], stage: StageInfo, dtype: torch.dtype,
                     device: torch.device, max_positions: int, load_format: str = "safetensors",
                     seed: int = 0, quantization: Optional[str] = None,
                     capability: Optional[tuple[int, int]] = None) -> StageModel:
    """Construct the stage's modules directly on ``device`` in ``dtype`` and fill them; with
    ``stage.tp_size > 1`` only this TP rank's slices of the split weights are allocated and copied.

    FP8 checkpoints (``zpp.models.quantization``): on a GPU with FP8 (compute capability >= 8.9,
    ``dtype`` bf16/fp16) the linear layers whose checkpoint weights are FP8 keep them, with their
    scales; every other FP8 weight (all of them on the CPU) is dequantized to ``dtype`` on load.
    ``quantization="fp8"`` (``--quantization fp8``): the loaded bf16/fp16 linear weights are
    quantized to FP8 per output channel (the caller has checked the GPU).

    4-bit checkpoints (MXFP4, compressed-tensors pack-quantized, GPTQ, AWQ;
    :mod:`zpp.models.quantization.w4_base`): on a GPU of compute capability >= 8.0 (``dtype``
    bf16/fp16) with the W4A16 methods the layers whose checkpoint weights are 4-bit keep them,
    repacked into :mod:`~zpp.models.quantization.w4_layout`; everywhere else (the CPU) they are
    dequantized on load by the format's rule. ``--load-format dummy`` with a 4-bit config quantizes
    the random weights of the layers the release quantizes, where the methods run.

    The names of the tensors the stage receives (from the safetensors headers; for an FP8
    checkpoint, as planned) are checked against its parameters before any tensor is read
    (``StageModel.check_weight_names``): a tensor missing or misnamed is refused before any weight
    loads.

    ``device`` ``meta`` (``zpp plan``, :mod:`zpp.plan`): the same construction and the same FP8
    decisions for a GPU of compute ``capability`` (e.g. ``(9, 0)``), from the safetensors headers when
    ``load_format`` is ``safetensors``; nothing is allocated and no tensor is read.

    Raises:
        ConfigError: unsupported architecture / option (checked again here, before any allocation).
        ValueError: missing or unexpected tensors (an FP8 weight's scale included; named, before any
            copy), or shape mismatches (names given).
    """
    from zpp.models import quantization as q
    from zpp.models.quantization import checkpoint as ck
    from zpp.models.quantization.fp8 import quantize_model_fp8
    from zpp.models.quantization.fp8_moe import quantize_experts
    cls = resolve_model_class(cfg, stage.tp_size)
    quant = q.parse_quantization_config(cfg)
    old = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            model = cls(cfg, stage, max_positions)
    finally:
        torch.set_default_dtype(old)
    meta = torch.device(device).type == "meta"
    fp8_gpu = capability >= (8, 9) if capability is not None else q.fp8_supported(device)
    keep_fp8 = fp8_gpu and dtype in (torch.bfloat16, torch.float16)
    if quant is not None and quant.min_capability != (8, 9):  # a format of its own GPU floor (4-bit: sm80)
        keep_fp8 = q.format_supported(quant, device, capability) and dtype in (torch.bfloat16, torch.float16)
    if load_format == "dummy":
        if not meta:
            init_dummy_weights(model, seed)
        if quant is not None and keep_fp8:
            quant.quantize_like_checkpoint(model)
    elif quant is None:
        model.check_weight_names(ck.read_index(safetensors_files(model_dir)))  # headers only
        if not meta:
            model.load_weights(iter_safetensors(model_dir, model))
    else:
        index = ck.read_index(safetensors_files(model_dir))
        n, ne = ck.prepare_model_for_checkpoint(model, index, quant, keep_fp8)
        plan = ck.plan_checkpoint(model, index, quant, dtype)
        model.check_weight_names(t.name for t in plan.tensors)
        if meta:
            return model.eval()
        model.load_weights(ck.iter_planned(plan, index, quant, device))
        ck.finish_loading(model)
        kv = ck.load_kv_scales(model, plan, index)
        if getattr(quant, "fmt", None) is not None:       # the 4-bit formats
            logger.info("%s checkpoint (%s, group %d): %d linear layers and %d expert layers kept in 4 bits, the "
                        "other 4-bit weights dequantized to %s", quant.method, quant.fmt, quant.group_size, n, ne,
                        str(dtype).removeprefix("torch."))
        else:
            logger.info("FP8 checkpoint (%s%s): %d linear layers and %d expert layers kept in FP8, the other FP8 "
                        "weights dequantized to %s%s",
                        quant.method, f", block {quant.block[0]}x{quant.block[1]}" if quant.block else "", n, ne,
                        str(dtype).removeprefix("torch."), f"; KV-cache scales for {kv} layers" if kv else "")
    if quantization == "fp8" and quant is None:
        n, ne = quantize_model_fp8(model), quantize_experts(model)
        logger.info("--quantization fp8: %d linear layers and %d expert layers quantized to FP8 (e4m3, per output "
                    "channel)", n, ne)
    return model.eval()
