"""``StructuredOutputsConfig``: the engine's settings of structured-output grammars (compile limits,
the JSON whitespace rule of ``--structured-outputs-config``), one flag per field (``zpp.settings``).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

from zpp.errors import ConfigError
from zpp.settings import parse_json_object, parse_size, setting


DEFAULT_MAX_WHITESPACE_CNT = 16
"""Characters each run of whitespace between JSON tokens may have by default (xgrammar's
``max_whitespace_cnt``): pretty-printed JSON up to a newline and 15 spaces of indent (indent 4 to
depth 3, indent 2 to depth 7) stays legal, while SmolLM2-135M's runaway newlines end (measured:
docs/structured-outputs.md, *Whitespace*)."""


@dataclass(frozen=True)
class JsonWhitespace:
    """The server-wide whitespace rule of JSON grammars (``--structured-outputs-config``).

    Attributes:
        disable_any_whitespace: compact JSON in every JSON grammar (vLLM's key).
        max_whitespace_cnt: most characters of each run of whitespace between JSON tokens
            otherwise; None: unbounded (vLLM's and xgrammar's default).
    """

    disable_any_whitespace: bool = False
    max_whitespace_cnt: Optional[int] = DEFAULT_MAX_WHITESPACE_CNT


_SO_CONFIG_NO_EFFECT = ("disable_fallback", "disable_additional_properties", "enable_in_reasoning")


def parse_structured_outputs_config(value: Any, flag: str) -> Optional[JsonWhitespace]:
    """vLLM's ``--structured-outputs-config``: a JSON object (text, or a dict / JsonWhitespace as an
    ``LLM`` keyword) with ``disable_any_whitespace`` (bool), zpp's ``max_whitespace_cnt`` (an int
    >= 1, or null: unbounded), ``backend`` (``"auto"`` or ``"xgrammar"``: zpp's only backend) and
    vLLM's ``disable_fallback`` / ``disable_additional_properties`` / ``enable_in_reasoning``
    (accepted, no effect: xgrammar has no fallback and its schemas are strict). None -> None.

    Raises:
        ConfigError: not a JSON object, an unknown key, or a value of the wrong type (one line
            naming ``flag`` and the key)."""
    if value is None or isinstance(value, JsonWhitespace):
        return value
    value = parse_json_object(value, flag, '{"disable_any_whitespace": true}')
    out = {}
    for key, v in value.items():
        if key == "disable_any_whitespace" or key in _SO_CONFIG_NO_EFFECT:
            if not isinstance(v, bool):
                raise ConfigError(f"{flag}: {key} must be true or false, got {v!r}")
            if key == "disable_any_whitespace":
                out[key] = v
        elif key == "max_whitespace_cnt":
            if v is not None and (isinstance(v, bool) or not isinstance(v, int) or v < 1):
                raise ConfigError(f"{flag}: max_whitespace_cnt must be an integer >= 1 or null (unbounded), got {v!r}")
            out[key] = v
        elif key == "backend":
            if v not in ("auto", "xgrammar"):
                raise ConfigError(f"{flag}: backend {str(v)[:30]!r}: zpp's only structured-outputs backend is "
                                  "xgrammar (give \"auto\" or \"xgrammar\")")
        else:
            raise ConfigError(f"{flag}: unknown key {str(key)[:40]!r} (zpp takes disable_any_whitespace, "
                              "max_whitespace_cnt, backend, disable_fallback, disable_additional_properties, "
                              "enable_in_reasoning)")
    return JsonWhitespace(**out)


@dataclass(frozen=True)
class StructuredOutputsConfig:
    """Limits on the grammars of structured-output requests (JSON schema, regex, choice, EBNF)."""

    compile_timeout: float = setting(10.0, flag="--structured-outputs-compile-timeout")
    """seconds a request's grammar (JSON schema, regex, choice, EBNF) may take to compile before the
    request is refused with HTTP 400

    Waiting for a compile slot included; a compile still running then is killed."""
    max_spec_bytes: int = setting(256 << 10, flag="--max-structured-outputs-spec-bytes", parse=parse_size)
    """largest JSON schema / regex / grammar / choice list accepted (larger: HTTP 400)

    In bytes: the JSON schema as JSON text, the regex, the EBNF or the choices together; refused
    before compiling."""
    max_grammar_bytes: int = setting(16 << 20, flag="--max-structured-outputs-grammar-bytes", parse=parse_size)
    """largest compiled grammar accepted (xgrammar's memory size; larger: HTTP 400 before it is
    serialized: a small schema can compile to a huge grammar)

    xgrammar's ``memory_size_bytes``, refused before it is serialized for the engine core: 200
    properties with one bounded-repetition pattern each compiled to ~100 MB, whose serialization
    took tens of GB, so the specification's size alone bounds nothing."""
    structured_outputs_config: Optional[JsonWhitespace] = setting(
        None, flag="--structured-outputs-config", parse=parse_structured_outputs_config, metavar="JSON")
    """vLLM's JSON of structured-output settings: {"disable_any_whitespace": true} makes every JSON
    grammar compact; {"max_whitespace_cnt": N} bounds each run of whitespace between JSON tokens
    (default 16; null: unbounded)

    Keys: ``disable_any_whitespace`` (vLLM's), ``max_whitespace_cnt`` (zpp's, xgrammar's name),
    ``backend`` (``auto`` / ``xgrammar``), and vLLM's ``disable_fallback``,
    ``disable_additional_properties``, ``enable_in_reasoning`` (accepted, no effect). A request's
    ``structured_outputs.disable_any_whitespace`` / ``whitespace_pattern`` apply on top."""

    @property
    def json_whitespace(self) -> JsonWhitespace:
        """The server-wide JSON whitespace rule (``--structured-outputs-config``, else the default)."""
        return self.structured_outputs_config or JsonWhitespace()

    def __post_init__(self):
        if not self.compile_timeout > 0:
            raise ConfigError(f"--structured-outputs-compile-timeout must be > 0 seconds, got {self.compile_timeout}")
        if self.max_spec_bytes < 1:
            raise ConfigError(f"--max-structured-outputs-spec-bytes must be >= 1, got {self.max_spec_bytes}")
        if self.max_grammar_bytes < 1:
            raise ConfigError(f"--max-structured-outputs-grammar-bytes must be >= 1, got {self.max_grammar_bytes}")
