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
    "MixtralForCausalLM": ("zpp.models.mixtral", "MixtralForCausalLM"),
    "GPT2LMHeadModel": ("zpp.models.gpt2", "GPT2LMHeadModel"),
    "OPTForCausalLM": ("zpp.models.opt", "OPTForCausalLM"),
}


def supported_architectures() -> list[str]:
    return sorted(_MODELS)


def resolve_model_class(cfg: dict[str, Any]):
    """The StageModel subclass for an HF config, after checking its options (nothing is allocated).

    Raises:
        ConfigError: no/unknown ``architectures`` entry, an option the family does not support, or a
            required field missing; one line, naming the architecture and listing the supported ones.
    """
    archs = cfg.get("architectures") or []
    for arch in archs:
        if arch in _MODELS:
            module, name = _MODELS[arch]
            cls = getattr(importlib.import_module(module), name)
            try:
                cls.check_config(cfg)
                cls.num_layers_of(cfg)
            except ConfigError as e:
                raise ConfigError(f"{arch}: {e}; {_supported()}") from None
            except KeyError as e:
                raise ConfigError(f"{arch}: config.json lacks required field {e}; {_supported()}") from None
            except (TypeError, ValueError) as e:
                raise ConfigError(f"{arch}: malformed config.json ({e}); {_supported()}") from None
            return cls
    shown = ", ".join(archs) if archs else "(none in config.json)"
    raise ConfigError(f"architecture {shown} is not supported; {_supported()}")


def _supported() -> str:
    return f"supported architectures: {', '.join(supported_architectures())}"
