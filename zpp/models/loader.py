"""Build one pipeline stage of a model and load only that stage's tensors."""
from __future__ import annotations

import glob
import logging
import os
import zlib
from typing import Any, Iterator

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


def checkpoint_tensor_names(model_dir: str) -> Iterator[str]:
    """Every tensor name of the checkpoint, read from the safetensors headers only (no tensor data).
    Raises FileNotFoundError as :func:`safetensors_files`."""
    from safetensors import safe_open

    for path in safetensors_files(model_dir):
        with safe_open(path, framework="pt", device="cpu") as f:
            yield from f.keys()


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
                     seed: int = 0) -> StageModel:
    """Construct the stage's modules directly on ``device`` in ``dtype`` and fill them; with
    ``stage.tp_size > 1`` only this TP rank's slices of the split weights are allocated and copied.

    The checkpoint's tensor names (safetensors headers) are checked against the stage's parameters
    before any tensor is read: a tensor missing or misnamed is refused before any weight loads.

    Raises:
        ConfigError: unsupported architecture / option (checked again here, before any allocation).
        ValueError: missing or unexpected tensors (named, before any copy), or shape mismatches.
    """
    cls = resolve_model_class(cfg, stage.tp_size, max_positions)
    old = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            model = cls(cfg, stage, max_positions)
    finally:
        torch.set_default_dtype(old)
    if load_format == "dummy":
        init_dummy_weights(model, seed)
    else:
        model.check_weight_names(checkpoint_tensor_names(model_dir))
        model.load_weights(iter_safetensors(model_dir, model))
    return model.eval()
