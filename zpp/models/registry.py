"""Model families zpp can split into pipeline stages, resolved from ``config.json``."""
from __future__ import annotations

import importlib
from typing import Any, Optional

from zpp.config import ConfigError

# HF ``architectures`` entry -> (module, class). One line per supported architecture.
_MODELS: dict[str, tuple[str, str]] = {
    "LlamaForCausalLM": ("zpp.models.llama", "LlamaForCausalLM"),
    "MistralForCausalLM": ("zpp.models.llama", "LlamaForCausalLM"),
    "Qwen2ForCausalLM": ("zpp.models.llama", "Qwen2ForCausalLM"),
    "MixtralForCausalLM": ("zpp.models.mixtral", "MixtralForCausalLM"),
    "GPT2LMHeadModel": ("zpp.models.gpt2", "GPT2LMHeadModel"),
    "OPTForCausalLM": ("zpp.models.opt", "OPTForCausalLM"),
    "Phi3ForCausalLM": ("zpp.models.phi3", "Phi3ForCausalLM"),
}

# ``quantization_config.quant_method`` values zpp can load. Empty: zpp reads unquantized safetensors
# only, so a checkpoint with any ``quantization_config`` (mxfp4, gptq, awq, bitsandbytes, fp8,
# compressed-tensors, ...) is refused before any weight loads. A method's loader adds its name here.
SUPPORTED_QUANTIZATION: tuple[str, ...] = ()


def supported_architectures() -> list[str]:
    return sorted(_MODELS)


def tensor_parallel_architectures() -> list[str]:
    """Architectures that support ``--tensor-parallel-size > 1``."""
    return sorted(a for a, (module, name) in _MODELS.items()
                  if getattr(importlib.import_module(module), name).supports_tensor_parallel)


def check_quantization(cfg: dict[str, Any]) -> None:
    """Refuse a quantized checkpoint whose method is not in ``SUPPORTED_QUANTIZATION``, in one line
    naming the method (``quantization_config.quant_method``; ``bitsandbytes`` for old configs that
    carry only ``load_in_4bit`` / ``load_in_8bit``). Raises ConfigError."""
    q = cfg.get("quantization_config")
    if not q:
        return
    method = q.get("quant_method") if isinstance(q, dict) else None
    if not method and isinstance(q, dict) and (q.get("load_in_4bit") or q.get("load_in_8bit")):
        method = "bitsandbytes"
    method = str(method).lower() if method else "unknown"
    if method not in SUPPORTED_QUANTIZATION:
        raise ConfigError(f"quantized checkpoint (quantization_config.quant_method {method!r}) is not supported: "
                          f"zpp loads unquantized safetensors only")


def resolve_model_class(cfg: dict[str, Any], tensor_parallel_size: int = 1, max_model_len: Optional[int] = None):
    """The StageModel subclass for an HF config, after checking its options (nothing is allocated).

    ``max_model_len``: the context length the engine will use, when known (start-up, loading): options
    the family supports only for shorter sequences are checked against it (``check_context``).

    Raises:
        ConfigError: no/unknown ``architectures`` entry, an option the family does not support, or a
            required field missing: one line, naming the architecture and listing the supported ones;
            a quantized checkpoint (:func:`check_quantization`) or an option too short for
            ``max_model_len``: one line naming the architecture.
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
            if max_model_len is not None:
                try:
                    cls.check_context(cfg, max_model_len)
                except ConfigError as e:
                    raise ConfigError(f"{arch}: {e}") from None
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
