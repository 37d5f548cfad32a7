"""``--speculative-config``: speculative decoding's settings (a field of
:class:`zpp.config.EngineConfig`, kept in its own module)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

from zpp.errors import ConfigError
from zpp.settings import parse_json_object

SPEC_METHODS = ("ngram", "mtp")
"""``--speculative-config`` methods built (``method``)."""

SPEC_ALIASES = {"deepseek_mtp": "mtp"}
"""Other names of a method (vLLM's)."""

MTP_LAYERS_KEY = "zpp_mtp_layers"
"""The key :func:`stage_model_config` adds to a model's config: how many multi-token-prediction layers
the last stage builds (``zpp.models.deepseek_mtp``)."""

_SPEC_KEYS = ("method", "num_speculative_tokens", "prompt_lookup_max", "prompt_lookup_min", "disable_by_batch_size",
              "min_acceptance_rate")


@dataclass(frozen=True)
class SpeculativeConfig:
    """Speculative decoding (``--speculative-config JSON``, vLLM's flag and keys): each decoding
    request's draft tokens ride in its micro-batch as extra query tokens that every stage computes
    like a short prefill; the last stage verifies them (``zpp.workers.rejection_sampler``) and the
    core rolls back the rejected positions (``zpp.engine.spec_decode``)."""

    method: str = "ngram"
    """``ngram``: prompt lookup (drafts copied from the request's own prompt and output, proposed in
    the engine core; no model). ``mtp`` (alias ``deepseek_mtp``): the checkpoint's multi-token-
    prediction layer runs on the last stage and drafts the next step's tokens (chained ``k`` times;
    :mod:`zpp.workers.mtp`)."""
    num_speculative_tokens: int = 3
    """Draft tokens per request and step (k: a verify chunk is k + 1 query tokens)."""
    prompt_lookup_max: int = 5
    """Longest suffix n-gram looked up (vLLM's default 5; either of the two alone sets both)."""
    prompt_lookup_min: int = 5
    """Shortest suffix n-gram looked up."""
    disable_by_batch_size: Optional[int] = None
    """No drafts in a step whose decoding requests are more than this (None: any batch size)."""
    min_acceptance_rate: float = 0.0
    """zpp's: a request whose recent drafts were accepted at a lower rate than this proposes none for
    a while (``zpp.engine.spec_decode.BACKOFF_STEPS`` steps), then tries again; 0: never."""

    def __post_init__(self):
        if self.method in SPEC_ALIASES:
            object.__setattr__(self, "method", SPEC_ALIASES[self.method])
        if self.method not in SPEC_METHODS:
            raise ConfigError(f"--speculative-config: method {self.method!r} is not supported (zpp has: "
                              f"{', '.join(SPEC_METHODS)}, deepseek_mtp; eagle and draft models are not built)")
        for key in ("num_speculative_tokens", "prompt_lookup_max", "prompt_lookup_min"):
            v = getattr(self, key)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise ConfigError(f"--speculative-config: {key} must be an integer >= 1, got {v!r}")
        if self.prompt_lookup_min > self.prompt_lookup_max:
            raise ConfigError(f"--speculative-config: prompt_lookup_min {self.prompt_lookup_min} is larger than "
                              f"prompt_lookup_max {self.prompt_lookup_max}")
        if self.disable_by_batch_size is not None and (not isinstance(self.disable_by_batch_size, int)
                                                       or self.disable_by_batch_size < 1):
            raise ConfigError(f"--speculative-config: disable_by_batch_size must be an integer >= 1, got "
                              f"{self.disable_by_batch_size!r}")
        if not (isinstance(self.min_acceptance_rate, (int, float)) and 0 <= self.min_acceptance_rate <= 1):
            raise ConfigError(f"--speculative-config: min_acceptance_rate must be in [0, 1], got "
                              f"{self.min_acceptance_rate!r}")

    def describe(self, hf_config: Optional[dict] = None) -> str:
        """The one start-up log line of this configuration, in ``--speculative-config``'s key names:
        the method, ``num_speculative_tokens``, then for ``ngram`` the lookup range
        (``prompt_lookup_min`` / ``max``), for ``mtp`` the MTP layers the last stage builds (from
        ``hf_config``'s ``num_nextn_predict_layers``, :func:`mtp_layers`), and
        ``disable_by_batch_size`` / ``min_acceptance_rate`` where set."""
        parts = [f"method={self.method}", f"num_speculative_tokens={self.num_speculative_tokens}"]
        if self.method == "ngram":
            parts += [f"prompt_lookup_min={self.prompt_lookup_min}", f"prompt_lookup_max={self.prompt_lookup_max}"]
        elif self.method == "mtp":
            parts.append(f"mtp_layers={mtp_layers(hf_config or {})}")
        if self.disable_by_batch_size is not None:
            parts.append(f"disable_by_batch_size={self.disable_by_batch_size}")
        if self.min_acceptance_rate:
            parts.append(f"min_acceptance_rate={self.min_acceptance_rate:g}")
        return "speculative decoding on: " + ", ".join(parts)


def mtp_layers(cfg: dict) -> int:
    """How many multi-token-prediction layers the last stage builds for method ``mtp``: the model
    config's ``num_nextn_predict_layers`` (1 when missing)."""
    return int(cfg.get("num_nextn_predict_layers") or 1)


def parse_speculative_config(value: Any, flag: str) -> Optional[SpeculativeConfig]:
    """``--speculative-config`` as JSON text, or (``LLM(speculative_config=...)``) a dict or a
    :class:`SpeculativeConfig`; None passes through.

    Raises:
        ConfigError: not a JSON object, an unknown key (a draft ``model`` among them: none is
            built), or a bad value (one line naming the flag).
    """
    if value is None or isinstance(value, SpeculativeConfig):
        return value
    value = parse_json_object(value, flag, '{"method": "ngram", "num_speculative_tokens": 3}')
    if "model" in value and value["model"] is not None:
        raise ConfigError(f"{flag}: a draft model ({value['model']!r}) is not supported: only method "
                          f"'ngram' and 'mtp' (the checkpoint's own layers) are built")
    value = {k: v for k, v in value.items() if k != "model"}
    unknown = sorted(set(value) - set(_SPEC_KEYS))
    if unknown:
        raise ConfigError(f"{flag}: unknown key(s) {', '.join(unknown)} (zpp reads: {', '.join(_SPEC_KEYS)})")
    if value.get("method") is None:  # vLLM: "num_speculative_tokens was provided but without speculative model"
        raise ConfigError(f"{flag}: no \"method\" given (zpp builds {', '.join(repr(x) for x in SPEC_METHODS)}, e.g. '{{\"method\": \"ngram\", \"num_speculative_tokens\": 3}}')")
    lo, hi = value.get("prompt_lookup_min"), value.get("prompt_lookup_max")  # vLLM's rule for a missing one
    if lo is None and hi is None:
        lo = hi = 5
    value["prompt_lookup_min"], value["prompt_lookup_max"] = (hi if lo is None else lo), (lo if hi is None else hi)
    return SpeculativeConfig(**{k: v for k, v in value.items() if v is not None or k == "disable_by_batch_size"})



def check_mtp_model(spec: Optional[SpeculativeConfig], hf_config: dict, model_dir: str, load_format: str,
                    tensor_parallel_size: int = 1) -> None:
    """``--speculative-config`` method ``mtp``: the model must be a family with multi-token-prediction
    layers (DeepSeek-V3) whose ``config.json`` has ``num_nextn_predict_layers >= 1`` and whose
    checkpoint holds them (``model.layers.{num_hidden_layers}.*``, read from the safetensors headers
    only; not checked with ``--load-format dummy``). No-op for other methods.

    Raises:
        ConfigError: one line naming the flag and what is missing.
    """
    if spec is None or spec.method != "mtp":
        return
    flag = "--speculative-config: method 'mtp'"
    archs = hf_config.get("architectures") or []
    n = int(hf_config.get("num_nextn_predict_layers") or 0)
    if not any(a in ("DeepseekV3ForCausalLM",) for a in archs):
        raise ConfigError(f"{flag} needs a model with multi-token-prediction layers (DeepSeek-V3 / R1); "
                          f"{', '.join(archs) or 'this model'} has none")
    if n < 1:
        raise ConfigError(f"{flag} needs num_nextn_predict_layers >= 1 in the model's config.json (it is {n})")
    if tensor_parallel_size > 1:
        raise ConfigError(f"{flag} is not built with --tensor-parallel-size {tensor_parallel_size} (only 1)")
    if load_format == "dummy":
        return
    import glob
    import os

    from safetensors import safe_open
    prefix = f"model.layers.{int(hf_config['num_hidden_layers'])}."
    for f in sorted(glob.glob(os.path.join(model_dir, "*.safetensors"))):
        with safe_open(f, "pt") as fh:
            if any(k.startswith(prefix) for k in fh.keys()):
                return
    raise ConfigError(f"{flag}: the checkpoint in {model_dir} holds no multi-token-prediction layer "
                      f"({prefix}* tensors), although config.json says num_nextn_predict_layers={n}")


def stage_model_config(cfg: dict, spec: Optional[SpeculativeConfig]) -> dict:
    """The model config a stage is built from: ``cfg`` itself, or with method ``mtp`` a copy with
    :data:`MTP_LAYERS_KEY` (the last stage then builds and loads the MTP layer(s))."""
    if spec is None or spec.method != "mtp":
        return cfg
    return {**cfg, MTP_LAYERS_KEY: mtp_layers(cfg)}
