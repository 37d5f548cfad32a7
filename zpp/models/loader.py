"""Build one pipeline stage of a model and load only that stage's tensors."""
from __future__ import annotations

import contextlib
import glob
import logging
import os
import weakref
import zlib
from typing import Any, Callable, Iterator, Optional

import torch
from torch import nn

from zpp.models.base import StageInfo, StageModel
from zpp.models.layers.cpu_linear import pack_cpu_linears
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


def _fill_dummy(name: str, p: torch.Tensor, seed: int) -> None:
    """One parameter's dummy values (see :func:`init_dummy_weights`)."""
    if name.endswith("bias"):
        p.zero_()
    elif p.dim() == 1:
        p.fill_(1.0)
    else:
        g = torch.Generator(device=p.device).manual_seed(seed ^ zlib.crc32(name.encode()))
        p.normal_(0.0, 0.02, generator=g)


@torch.no_grad()
def init_dummy_weights(model: StageModel, seed: int) -> None:
    """Random weights, N(0, 0.02) (norm weights 1, biases 0), seeded per parameter name so every
    split of the model gets the same values."""
    for name, p in model.named_parameters():
        _fill_dummy(name, p, seed)


@contextlib.contextmanager
def parameters_on_meta() -> Iterator[None]:
    """Within it, every parameter a module registers is moved to the ``meta`` device as it is
    registered (its attributes -- ``weight_loader``, ... -- kept); buffers stay where they were made.
    So a model built under ``torch.device(dev)`` inside it holds its computed buffers (rotary
    tables, ...) on ``dev`` and no parameter storage: each tensor ``torch.empty`` made on ``dev``
    is freed at once (accelerate's ``init_empty_weights(include_buffers=False)``).
    :func:`init_dummy_weights_quantized` materializes the parameters module by module."""
    register = nn.Module.register_parameter

    def on_meta(self: nn.Module, name: str, param: Optional[nn.Parameter]) -> None:
        if param is not None and not param.is_meta:
            meta = nn.Parameter(param.data.to("meta"), requires_grad=param.requires_grad)
            meta.__dict__.update(param.__dict__)
            param = meta
        register(self, name, param)

    nn.Module.register_parameter = on_meta
    try:
        yield
    finally:
        nn.Module.register_parameter = register


def _materialize(mod: nn.Module, prefix: str, device: torch.device, seed: int,
                 done: dict[int, tuple[nn.Parameter, weakref.ref]]) -> int:
    """Give ``mod``'s own ``meta`` parameters storage on ``device`` and their dummy values
    (:func:`_fill_dummy`, by full name); a parameter another module shares is filled once (under
    its first name, as ``named_parameters``). Returns the bytes filled; no reference to them is
    kept (so a quantizer that replaces them frees them)."""
    n = 0
    for pname, p in list(mod._parameters.items()):
        if p is None or not p.is_meta:
            continue
        seen = done.get(id(p))
        new = seen[1]() if seen is not None else None
        if new is None:
            new = nn.Parameter(torch.empty(p.shape, dtype=p.dtype, device=device), requires_grad=p.requires_grad)
            new.__dict__.update(p.__dict__)
            _fill_dummy(f"{prefix}{pname}", new.data, seed)
            done[id(p)] = (p, weakref.ref(new))       # (the meta one held: its id stays its own)
            n += new.numel() * new.element_size()
        mod._parameters[pname] = new
    return n


EMPTY_CACHE_BYTES = 64 << 20
"""A quantized module whose float weights took at least this many bytes returns them to the CUDA
driver at once (:func:`init_dummy_weights_quantized`)."""


@torch.no_grad()
def init_dummy_weights_quantized(model: StageModel, seed: int, device: torch.device,
                                 quantize: Callable[[str, nn.Module], bool]) -> int:
    """The dummy weights of a model built under :func:`parameters_on_meta`, quantized module by
    module: each module's own parameters get storage on ``device`` and exactly
    :func:`init_dummy_weights`' values (same per-name seeds: the same tensors, so the quantized
    weights equal those of filling the whole model and quantizing it), then ``quantize(name, mod)``
    replaces what it quantizes (e.g. :meth:`~zpp.models.quantization.fp8.Fp8Config.quantize_module_like_checkpoint`,
    :func:`~zpp.models.quantization.fp8.quantize_module_fp8`) and the module's float weights are
    freed before the next module is made. The peak is the quantized model plus one module's float
    weights and its quantizer's temporaries (one expert's for fused experts), instead of the
    whole model in the float dtype.

    Returns the number of modules ``quantize`` quantized.

    Raises:
        RuntimeError: a parameter is still on ``meta`` afterwards (a module this walk missed).
    """
    done: dict[int, tuple[nn.Parameter, weakref.ref]] = {}
    n = 0
    for name, mod in model.named_modules():
        filled = _materialize(mod, f"{name}." if name else "", device, seed, done)
        if filled and quantize(name, mod):
            n += 1
            if device.type == "cuda" and filled >= EMPTY_CACHE_BYTES:
                # the freed float weights' segments back to the driver, so that the kept weights
                # made next are not carved out of them (the next layer's float weights could then
                # not reuse them, and the cache would grow a layer at a time)
                torch.cuda.empty_cache()
    left = [name for name, p in model.named_parameters() if p.is_meta]
    if left:
        raise RuntimeError(f"dummy weights: parameters left on meta: {', '.join(left[:5])}")
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return n


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
    dequantized on load by the format's rule.

    ``load_format="dummy"``: random weights (:func:`init_dummy_weights`: N(0, 0.02) seeded per
    parameter name, so every split gets the same values), no checkpoint read. With a quantized
    config where its methods run (FP8 on a GPU with FP8; 4-bit where the W4A16 methods run) the
    random weights of the layers the checkpoint would hold quantized are quantized like it (FP8
    block tiles / per channel; the 4-bit format's rounding), and with ``quantization="fp8"`` every
    linear / expert layer per output channel. Those starts build the stage's parameters on
    ``meta`` (:func:`parameters_on_meta`) and make, fill and quantize them module by module
    (:func:`init_dummy_weights_quantized`): the peak is the quantized stage plus one layer's
    weights in ``dtype`` and one module's quantizer temporaries, not the whole stage in ``dtype``
    (gpt-oss-120b MXFP4: about 67 GiB by count instead of 218 GiB), and the weights equal, bit for
    bit, those of filling the whole stage and quantizing it.

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
    from zpp.models.quantization.fp8 import quantize_model_fp8, quantize_module_fp8
    from zpp.models.quantization.fp8_moe import quantize_experts
    cls = resolve_model_class(cfg, stage.tp_size)
    quant = q.parse_quantization_config(cfg)
    device = torch.device(device)
    meta = device.type == "meta"
    fp8_gpu = capability >= (8, 9) if capability is not None else q.fp8_supported(device)
    keep_fp8 = fp8_gpu and dtype in (torch.bfloat16, torch.float16)
    if quant is not None and quant.min_capability != (8, 9):  # a format of its own GPU floor (4-bit: sm80)
        keep_fp8 = q.format_supported(quant, device, capability) and dtype in (torch.bfloat16, torch.float16)
    # dummy weights to quantize: made and quantized module by module, never the whole stage in `dtype`
    streamed = load_format == "dummy" and not meta and (
        (quant is not None and keep_fp8) or (quant is None and quantization == "fp8"))
    old = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device), (parameters_on_meta() if streamed else contextlib.nullcontext()):
            model = cls(cfg, stage, max_positions)
    finally:
        torch.set_default_dtype(old)
    if streamed:
        if device.type == "cuda":
            torch.cuda.empty_cache()                      # the construction's transient parameter tensors
        n = init_dummy_weights_quantized(model, seed, device, quant.quantize_module_like_checkpoint
                                         if quant is not None else quantize_module_fp8)
        what = f"{quant.method} config" if quant is not None else "--quantization fp8"
        logger.info("--load-format dummy with %s: %d layers quantized module by module", what, n)
        return model.eval()
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
    if device.type == "cpu":
        pack_cpu_linears(model)                           # float32 ones only; see zpp.models.layers.cpu_linear
    return model.eval()
