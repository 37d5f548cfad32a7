"""Model families zpp can split into pipeline stages, resolved from ``config.json``."""
from __future__ import annotations

import importlib
from typing import Any

from zpp.config import ConfigError

# HF ``architectures`` entry -> (module, class). One line per supported architecture.
_MODELS: dict[str, tuple[str, str]] = {
    "LlamaForCausalLM": ("zpp.models.llama", "LlamaForCausalLM"),
    "MistralForCausalLM": ("zpp.models.llama", "LlamaForCausalLM"),
    "Qwen2ForCausalLM": ("zpp.models.llama", "Qwen2ForCausalLM"),
}


def supported_architectures() -> list[str]:
    return sorted(_MODELS)


def resolve_model_class(cfg: dict[str, Any]):
    """The StageModel subclass for an HF config, after checking its options.

    Raises:
        ConfigError: no/unknown ``architectures`` entry, or an option the family does not support
            (one line, listing the supported architectures).
    """
    archs = cfg.get("architectures") or []
    for arch in archs:
        if arch in _MODELS:
            module, name = _MODELS[arch]
            cls = getattr(importlib.import_module(module), name)
            try:
                cls.check_config(cfg)
            except KeyError as e:
                raise ConfigError(f"{arch}: config.json lacks required field {e}") from None
            return cls
    shown = ", ".join(archs) if archs else "(none in config.json)"
    raise ConfigError(f"architecture {shown} is not supported; supported: {', '.join(supported_architectures())}")
