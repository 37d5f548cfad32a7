"""The model's recommended sampling defaults (``--generation-config``, vLLM's flag of that name).

Model creators ship a ``generation_config.json`` next to the weights (Llama 3: temperature 0.6,
top_p 0.9; Qwen3: temperature 0.6, top_p 0.95, top_k 20; ...). As in vLLM, by default
(``auto``) its sampling fields become the defaults of every request: a request field the client
sends (a value, not null) wins; a field it leaves out or sends as null takes the model's value,
and a field the model does not recommend keeps zpp's built-in default (OpenAI's). ``vllm`` keeps
the built-in defaults; a directory reads that directory's ``generation_config.json`` instead of the
model's.

Fields read (HF ``GenerationConfig`` name -> SamplingParams name): ``temperature``, ``top_p``,
``top_k``, ``min_p``, ``repetition_penalty``, and ``max_new_tokens`` -> ``max_tokens`` (the
default when a request gives no ``max_tokens``: on ``/v1/completions`` instead of OpenAI's 16, on
chat instead of the remaining room; unlike vLLM, which caps every request with it, a request's own
``max_tokens`` wins). Other fields (``do_sample``, ``typical_p``, ...) are ignored, as in vLLM.
Offline, :meth:`zpp.LLM.get_default_sampling_params` is ``SamplingParams()`` with these applied.
"""
from __future__ import annotations

import json
import logging
import os
from typing import Any, Optional

from zpp.config import ConfigError
from zpp.sampling_params import SamplingParams, SamplingParamsError

logger = logging.getLogger(__name__)

GENERATION_CONFIG_CHOICES = ("auto", "vllm")
"""The named values of ``--generation-config``; anything else is a directory."""

_FIELDS = {"temperature": "temperature", "top_p": "top_p", "top_k": "top_k", "min_p": "min_p",
           "repetition_penalty": "repetition_penalty", "max_new_tokens": "max_tokens"}


def generation_defaults(model_dir: str, source: str = "auto") -> dict[str, Any]:
    """The sampling defaults ``--generation-config source`` gives for the model in ``model_dir``.

    Args:
        model_dir: the model directory (read for ``auto``).
        source: ``"auto"`` (the model's ``generation_config.json``; none there: no defaults),
            ``"vllm"`` (none: zpp's built-in defaults) or a directory holding a
            ``generation_config.json``.

    Returns:
        ``{SamplingParams field: value}`` for the fields the file sets (possibly empty):
        ``temperature``/``top_p``/``min_p``/``repetition_penalty`` floats, ``top_k``/``max_tokens`` ints.

    Raises:
        ConfigError: (one line naming ``--generation-config``) the directory has no readable
            ``generation_config.json``, the file is not a JSON object, or a value is out of range.
    """
    if source == "vllm":
        return {}
    directory = model_dir if source == "auto" else source
    path = os.path.join(directory, "generation_config.json")
    if source != "auto" and not os.path.isdir(directory):
        raise ConfigError(f"--generation-config {source!r}: not 'auto', 'vllm' or a directory")
    try:
        with open(path, encoding="utf-8") as f:
            raw = json.load(f)
    except FileNotFoundError:
        if source == "auto":
            return {}
        raise ConfigError(f"--generation-config {source!r}: no generation_config.json in that directory") from None
    except (OSError, ValueError) as e:
        raise ConfigError(f"--generation-config {source}: {path} cannot be read as JSON ({e})") from None
    if not isinstance(raw, dict):
        raise ConfigError(f"--generation-config {source}: {path} is not a JSON object")
    out: dict[str, Any] = {}
    for hf_name, name in _FIELDS.items():
        v = raw.get(hf_name)
        if v is None:
            continue
        whole = name in ("top_k", "max_tokens")
        if isinstance(v, bool) or not isinstance(v, (int, float)) or (whole and float(v) != int(v)):
            raise ConfigError(f"--generation-config {source}: {hf_name} in {path} must be a "
                              f"{'whole ' if whole else ''}number, got {v!r}")
        out[name] = int(v) if whole else float(v)
    try:
        SamplingParams(**out)
    except SamplingParamsError as e:
        raise ConfigError(f"--generation-config {source}: {path}: {e}") from None
    if out.get("top_k") == -1:
        out["top_k"] = 0
    return out


def log_generation_defaults(defaults: dict[str, Any], source: str, model_dir: str) -> None:
    """One INFO line saying which defaults the model's generation config sets (nothing if none)."""
    if not defaults:
        return
    where = model_dir if source == "auto" else source
    logger.info("sampling defaults from %s/generation_config.json: %s (request fields override them; "
                "--generation-config vllm keeps zpp's own defaults)", where.rstrip("/"),
                ", ".join(f"{k}={v}" for k, v in defaults.items()))


def default_sampling_params(defaults: Optional[dict[str, Any]]) -> SamplingParams:
    """``SamplingParams()`` with the model's defaults applied (vLLM's
    ``LLM.get_default_sampling_params``)."""
    return SamplingParams(**(defaults or {}))
