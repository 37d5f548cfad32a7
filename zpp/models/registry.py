"""Model families zpp can split into pipeline stages, resolved from ``config.json``."""
from __future__ import annotations

import importlib
from typing import Any

from zpp.errors import ConfigError
from zpp.models.quantization import check_quantization

# HF ``architectures`` entry -> (module, class). One line per supported architecture.
_MODELS: dict[str, tuple[str, str]] = {
    "LlamaForCausalLM": ("zpp.models.llama", "LlamaForCausalLM"),
    "MistralForCausalLM": ("zpp.models.llama", "LlamaForCausalLM"),
    "Qwen2ForCausalLM": ("zpp.models.llama", "Qwen2ForCausalLM"),
    "MixtralForCausalLM": ("zpp.models.mixtral", "MixtralForCausalLM"),
    "Qwen3ForCausalLM": ("zpp.models.qwen3", "Qwen3ForCausalLM"),
    "Qwen3MoeForCausalLM": ("zpp.models.qwen3_moe", "Qwen3MoeForCausalLM"),
    "GPT2LMHeadModel": ("zpp.models.gpt2", "GPT2LMHeadModel"),
    "OPTForCausalLM": ("zpp.models.opt", "OPTForCausalLM"),
    "DeepseekV2ForCausalLM": ("zpp.models.deepseek", "DeepseekV2ForCausalLM"),
    "DeepseekV3ForCausalLM": ("zpp.models.deepseek", "DeepseekV3ForCausalLM"),
    "Gemma3ForCausalLM": ("zpp.models.gemma3", "Gemma3ForCausalLM"),
    "Gemma3ForConditionalGeneration": ("zpp.models.gemma3", "Gemma3ForCausalLM"),  # its language model only
    "GptOssForCausalLM": ("zpp.models.gpt_oss", "GptOssForCausalLM"),
    "Phi3ForCausalLM": ("zpp.models.phi3", "Phi3ForCausalLM"),
}


def supported_architectures() -> list[str]:
    return sorted(_MODELS)


def tensor_parallel_architectures() -> list[str]:
    """Architectures that support ``--tensor-parallel-size > 1``."""
    return sorted(a for a, (module, name) in _MODELS.items()
                  if getattr(importlib.import_module(module), name).supports_tensor_parallel)


def normalize_config(cfg: dict[str, Any]) -> dict[str, Any]:
    """``config.json`` of a supported architecture as zpp reads it everywhere (see
    ``StageModel.normalize_config``: e.g. a multimodal Gemma 3 config's ``text_config`` flattened);
    any other config unchanged (it is refused later, by :func:`resolve_model_class`)."""
    for arch in cfg.get("architectures") or []:
        if arch in _MODELS:
            module, name = _MODELS[arch]
            return getattr(importlib.import_module(module), name).normalize_config(cfg)
    return cfg


def resolve_model_class(cfg: dict[str, Any], tensor_parallel_size: int = 1):
    """The StageModel subclass for an HF config, after checking its options (nothing is allocated).

    Raises:
        ConfigError: no/unknown ``architectures`` entry, an option the family does not support, or a
            required field missing; one line, naming the architecture and listing the supported ones;
            a quantized checkpoint zpp cannot load (``zpp.models.quantization.check_quantization``:
            anything but FP8 compressed-tensors / block FP8), one line naming the method.
            With ``tensor_parallel_size > 1``: a family without tensor parallelism, or head / KV-head
            / intermediate sizes it does not divide (one line naming ``--tensor-parallel-size``).
    """
    archs = cfg.get("architectures") or []
    for arch in archs:
        if arch in _MODELS:
            module, name = _MODELS[arch]
            cls = getattr(importlib.import_module(module), name)
            try:
                check_quantization(cfg)
            except ConfigError as e:
                raise ConfigError(f"{arch}: {e}") from None
            try:
                cls.check_config(cfg)
                cls.num_layers_of(cfg)
            except ConfigError as e:
                raise ConfigError(f"{arch}: {e}; {_supported()}") from None
            except KeyError as e:
                raise ConfigError(f"{arch}: config.json lacks required field {e}; {_supported()}") from None
            except (TypeError, ValueError) as e:
                raise ConfigError(f"{arch}: malformed config.json ({e}); {_supported()}") from None
            if tensor_parallel_size > 1:
                if not cls.supports_tensor_parallel:
                    raise ConfigError(
                        f"--tensor-parallel-size > 1 is supported for {', '.join(tensor_parallel_architectures())} "
                        f"only, not {arch} (got --tensor-parallel-size {tensor_parallel_size})")
                try:
                    cls.check_tensor_parallel(cfg, tensor_parallel_size)
                except KeyError as e:
                    raise ConfigError(f"{arch}: config.json lacks required field {e}") from None
            return cls
    shown = ", ".join(archs) if archs else "(none in config.json)"
    raise ConfigError(f"architecture {shown} is not supported; {_supported()}")


def _supported() -> str:
    return f"supported architectures: {', '.join(supported_architectures())}"
