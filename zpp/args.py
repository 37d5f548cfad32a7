"""Flags and keyword arguments made from the table of settings (``zpp.settings``).

``add_engine_args`` gives ``zpp serve`` and ``zpp bench throughput|latency`` one flag per field of
``EngineConfig`` (through its sub-configs), ``add_server_args`` gives ``zpp serve`` one per field
of ``ServerConfig``; ``engine_config`` builds the config from settings given by name (``LLM(...)``
keywords), ``engine_config_from_args`` from parsed flags. A flag's name, default and help are
never written here: they are the field's (vLLM's ``EngineArgs`` idea; zpp keeps the fields in the
config classes themselves).

``zpp.cli`` and ``zpp.bench`` both import this module (neither imports the other for it).
"""
from __future__ import annotations

import argparse
import dataclasses
import difflib
import logging
import os
import typing
from typing import Any, Iterable, Optional

from zpp.config import ConfigError, EngineConfig
from zpp.server.config import ServerConfig
from zpp.settings import Setting, settings_of

logger = logging.getLogger("zpp.cli")

GROUPS = {
    "parallelism": "parallelism",
    "model": "model",
    "scheduler": "scheduler and KV cache",
    "structured-outputs": "structured outputs",
    "per-node": "per-node launch (one zpp serve per host, started by Slurm, a Kubernetes LeaderWorkerSet or any "
                "launcher; vLLM's flags; read from $SLURM_*, $LWS_*, $NNODES/$NODE_RANK/$MASTER_ADDR/$MASTER_PORT "
                "when absent)",
    "logging": "logging",
    "compat": "accepted for vLLM compatibility (no effect in zpp and a warning says so, or refused with a "
              "one-line error where zpp cannot do what it asks)",
    "limits": "request limits",
    "sampling": "sampling defaults, tool calls and reasoning",
    "http": "HTTP server",
}
"""``--help`` sections, in their order: a setting's ``group`` (``zpp.settings.setting``), else its
class's (``CLASS_GROUPS``); None: the parser's own options."""

CLASS_GROUPS = {"ParallelConfig": "parallelism", "ModelConfig": "model", "SchedulerConfig": "scheduler",
                "CacheConfig": "scheduler", "EngineConfig": "scheduler",
                "StructuredOutputsConfig": "structured-outputs", "ServerConfig": None}

NO_EFFECT_FLAGS = {
    "trust_remote_code": "--trust-remote-code: zpp runs no code from model directories (its own model "
                         "classes only); ignored",
}
"""vLLM flags accepted so that vLLM command lines work; they change nothing in zpp."""


def engine_settings() -> list[Setting]:
    """The engine settings that are flags and ``LLM`` keywords, in table order."""
    return [s for s in settings_of(EngineConfig) if not s.flagless]


def server_settings() -> list[Setting]:
    """``zpp serve``'s HTTP front-end settings (flags only)."""
    return [s for s in settings_of(ServerConfig) if not s.flagless]


def format_size(n: int) -> str:
    """Bytes as the largest whole binary unit: ``262144`` -> ``256KiB``."""
    for unit, shift in (("TiB", 40), ("GiB", 30), ("MiB", 20), ("KiB", 10)):
        if n and n % (1 << shift) == 0:
            return f"{n >> shift}{unit}"
    return str(n)


def _help(s: Setting) -> str:
    if s.meta.get("hidden"):
        return argparse.SUPPRESS
    text = s.help.replace("%", "%%")
    if "default" not in text and not any(s.default is v for v in (None, False)) and s.default not in ("", ()):
        if s.meta.get("from_launcher"):  # argparse's default is None, so the formatter would not say it
            text += f" (default: {s.default})"
        elif s.meta.get("parse") and isinstance(s.default, int) and not isinstance(s.default, bool):
            text += f" (default: {format_size(s.default)})"
    return text


def _add(group, s: Setting) -> None:
    """One flag for ``s``: ``--x`` / ``--no-x`` for a bool (as vLLM's, e.g. ``--no-enable-prefix-caching``;
    store_true for a ``--disable-...`` one that defaults to False), else a value of the annotation's
    type (text when the setting has a ``parse``)."""
    meta = s.meta
    kwargs: dict[str, Any] = {"dest": s.name, "help": _help(s),
                              "default": None if meta.get("from_launcher") else s.default}
    if s.value_type is bool:
        negative = s.default is False and s.flag.startswith("--disable-")
        kwargs["action"] = "store_true" if negative else argparse.BooleanOptionalAction
    else:
        kind = meta.get("type") or (str if meta.get("parse") else s.value_type)
        if kind not in (int, float, str) and not meta.get("type"):
            raise TypeError(f"setting {s.name}: a {s.type} needs a parse= (zpp.settings.setting)")
        kwargs["type"] = kind
        for key in ("choices", "metavar", "nargs"):
            if meta.get(key):
                kwargs[key] = list(meta[key]) if key == "choices" else meta[key]
    group.add_argument(s.flag, *meta.get("aliases", ()), **kwargs)


def add_settings(p: argparse.ArgumentParser, settings: Iterable[Setting], extra_groups=()) -> dict:
    """Add a flag per setting, in ``GROUPS`` order (the parser's own options first). Returns the
    argparse groups made, by key: those in ``extra_groups`` are made even without settings."""
    by_group: dict[Optional[str], list[Setting]] = {}
    for s in settings:
        by_group.setdefault(s.meta.get("group", CLASS_GROUPS.get(s.owner.__name__)), []).append(s)
    for s in by_group.pop(None, []):
        _add(p, s)
    unknown = set(by_group) - set(GROUPS)
    if unknown:
        raise TypeError(f"settings in unknown --help groups {sorted(unknown)}: add them to zpp.args.GROUPS")
    made = {}
    for key, title in GROUPS.items():
        if key in by_group or key in extra_groups:
            made[key] = g = p.add_argument_group(title)
            for s in by_group.get(key, ()):
                _add(g, s)
    return made


def add_engine_args(p: argparse.ArgumentParser, model_optional: bool = True) -> None:
    """The engine's flags (``zpp serve`` and the offline benchmarks; vLLM's names where one exists).

    Args:
        model_optional: MODEL positional and ``--model`` (``zpp serve``); else ``--model`` only.

    The per-node launch settings (``--nnodes`` ...) are ``add_per_node_args``'s.
    """
    if model_optional:
        p.add_argument("model", nargs="?", default=None,
                       help="model directory (config.json + safetensors + tokenizer); default: the packaged "
                            "SmolLM2-135M-Instruct demo model")
        p.add_argument("--model", dest="model_flag", default=None, metavar="MODEL",
                       help="the same as the positional MODEL (vLLM's spelling)")
    else:
        p.add_argument("--model", default=None, help="model directory; default: the packaged demo model")
    add_settings(p, [s for s in engine_settings() if s.meta.get("group") != "per-node"])
    p.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"],
                   help="debug also prints the traceback of a start-up error")


def add_per_node_args(p: argparse.ArgumentParser) -> argparse._ArgumentGroup:
    """``zpp serve``'s per-node launch flags (``--nnodes``, ``--node-rank`` ...). Returns their group."""
    return add_settings(p, [s for s in engine_settings() if s.meta.get("group") == "per-node"])["per-node"]


def add_server_args(p: argparse.ArgumentParser) -> None:
    """``zpp serve``'s HTTP front-end flags (``ServerConfig``) and the vLLM flags it only accepts."""
    p.add_argument("--config", default=None, metavar="FILE",
                   help="a YAML file of flags (vLLM's: `max-num-seqs: 8` per line); the command line overrides it")
    groups = add_settings(p, server_settings(), extra_groups=("compat",))
    g = groups["compat"]
    g.add_argument("--trust-remote-code", action="store_true", help="zpp runs only its own model code")
    g.add_argument("--swap-space", type=float, default=None, metavar="GIB",
                   help="vLLM's CPU swap space per GPU; zpp recomputes preempted requests instead of swapping")
    g.add_argument("--distributed-executor-backend", choices=["mp", "ray", "uni", "external_launcher"],
                   default=None, help="zpp starts its workers with multiprocessing (mp) always; ray is refused")
    g.add_argument("--enable-request-id-headers", action="store_true",
                   help="accepted: every zpp response carries X-Request-Id (the request's, else its id)")
    g.add_argument("--tokenizer-mode", choices=["auto", "hf", "slow", "mistral", "custom"], default=None,
                   help="auto and hf: what zpp does (the model directory's Hugging Face tokenizer); the others "
                        "are refused")
    g.add_argument("--download-dir", default=None, help="refused: zpp does not download models")
    g.add_argument("--revision", default=None, help="refused: zpp does not download models")


def add_serve_args(p: argparse.ArgumentParser) -> None:
    """Every flag of ``zpp serve`` (``zpp.cli.build_parser`` and :func:`flags_markdown` both call
    this): the engine's, the HTTP front end's, the vLLM ones it only accepts, the per-node launch's
    and ``--headless``."""
    add_engine_args(p)
    add_server_args(p)
    add_per_node_args(p).add_argument(
        "--headless", action="store_true",
        help="accepted for vLLM command lines: node ranks > 0 are always headless (no HTTP server)")


def engine_config(model: Optional[str] = None, *, streaming: bool, **values: Any) -> EngineConfig:
    """The EngineConfig of ``model`` (default: the demo model) with ``values``: engine settings by
    name (``engine_settings()``; a missing one, or a per-node one given as None, takes its default),
    each given as its type or as a flag's text where the setting parses (sizes, hosts, layers).

    Raises:
        TypeError: a name that is no engine setting (named, with the nearest one).
        ConfigError: a bad value (one line naming the flag).
    """
    table = {s.name: s for s in engine_settings()}
    for name in values:
        if name not in table:
            near = difflib.get_close_matches(name, table, n=1)
            raise TypeError(f"unexpected keyword argument {name!r}: not an engine setting"
                            + (f" (did you mean {near[0]!r}?)" if near else "")
                            + "; the settings are the engine flags of `zpp serve --help`, with underscores")
    if model is None:
        from zpp.demo import prepare_demo_model
        model = prepare_demo_model()
    by_path = {s.path: s for s in settings_of(EngineConfig)}

    def build(cls, prefix):  # each class parsed and made in field order, so the first bad one is reported
        kwargs = {}
        for f in dataclasses.fields(cls):
            path = prefix + (f.name,)
            s = by_path.get(path)
            if s is None:
                kwargs[f.name] = build(typing.get_type_hints(cls)[f.name], path)
            elif path == ("model", "model"):
                kwargs[f.name] = model
            elif path == ("scheduler", "streaming"):
                kwargs[f.name] = streaming
            elif s.name in values and not s.flagless and not (values[s.name] is None and s.meta.get("from_launcher")):
                v = values[s.name]
                kwargs[f.name] = s.meta["parse"](v, s.flag) if s.meta.get("parse") else _checked(s, v)
        return cls(**kwargs)

    return build(EngineConfig, ())


def _checked(s: Setting, value: Any) -> Any:
    """``value`` if it is of the setting's type (an int where a float goes; None where the
    annotation is Optional). Raises TypeError naming the setting."""
    optional = type(None) in typing.get_args(s.type)
    kind = s.value_type
    if value is None and optional:
        return value
    ok = {bool: lambda v: isinstance(v, bool), int: lambda v: isinstance(v, int) and not isinstance(v, bool),
          float: lambda v: isinstance(v, (int, float)) and not isinstance(v, bool),
          str: lambda v: isinstance(v, str)}.get(kind, lambda v: True)
    if not ok(value):
        want = getattr(kind, "__name__", str(kind)) + (" or None" if optional else "")
        raise TypeError(f"{s.name}={value!r}: expected {want} ({s.flag})")
    return value


def engine_config_from_args(args: argparse.Namespace, streaming: bool = True) -> EngineConfig:
    """Build the EngineConfig from parsed flags (those this parser lacks take their defaults).
    Raises ConfigError with a one-line message."""
    model, flag = args.model, getattr(args, "model_flag", None)
    if model and flag and model != flag:
        raise ConfigError(f"two models given: {model!r} and --model {flag!r}")
    if not (model or flag):  # `--served-model-name a b DIR` takes DIR for a third name (nargs="+")
        for name in getattr(args, "served_model_name", None) or ():
            if os.path.isfile(os.path.join(name, "config.json")):
                raise ConfigError(f"--served-model-name took the model directory {name!r} for a served name, and "
                                  f"no MODEL was given: put MODEL before the flag (zpp serve MODEL "
                                  f"--served-model-name NAME ...) or pass --model MODEL")
    for dest, warning in NO_EFFECT_FLAGS.items():
        if getattr(args, dest, False):
            logger.warning("%s", warning)
    values = {s.name: getattr(args, s.name) for s in engine_settings() if hasattr(args, s.name)}
    return engine_config(model or flag, streaming=streaming, **values)


def server_config_from_args(args: argparse.Namespace) -> ServerConfig:
    """Build the ServerConfig from ``zpp serve``'s flags. Raises ConfigError."""
    values = {}
    for s in server_settings():
        v = getattr(args, s.name)
        values[s.path[-1]] = s.meta["parse"](v, s.flag) if s.meta.get("parse") else v
    return ServerConfig(**values)


def flags_markdown() -> str:
    """``zpp serve``'s flags as Markdown, made from the parser itself (:func:`add_serve_args`), one
    table per ``--help`` section in its order: every option string (``--x`` and ``--no-x`` alike,
    aliases, the positional MODEL, ``--help``, flags hidden from ``--help``), the default and the
    meaning. A setting's row takes its default and its whole docstring (the ``--help`` line, then
    the notes) from its field; a hand-written flag's (MODEL, ``--model``, ``--log-level``, the vLLM
    ones zpp only accepts) from its ``add_argument``. ``python -m zpp.args > docs/flags.md`` writes
    the flags page."""
    parser = argparse.ArgumentParser(prog="zpp serve")
    add_serve_args(parser)
    by_dest = {s.name: s for s in engine_settings() + server_settings()}
    out = ["# `zpp serve` flags", "",
           ("Generated from `zpp serve`'s own argument parser and the config fields behind it (`python -m zpp.args > "
            "docs/flags.md`; a test checks that every flag the parser accepts is here). `LLM(...)` takes every "
            "engine flag as a keyword of the same name with underscores. `zpp plan` takes the engine flags too and "
            "prints what fits on which GPUs before anything loads: [How many GPUs?](how-many-gpus.md)."), ""]
    for group in parser._action_groups:
        actions = [a for a in group._group_actions]
        if not actions:
            continue
        title = {"positional arguments": "model", "options": "general",
                 "optional arguments": "general"}.get(group.title, group.title)
        if group.title == "positional arguments":
            continue  # MODEL goes first in the general table
        if title == "general":
            actions = [a for a in parser._actions if not a.option_strings] + actions
        out += [f"## {title}", "", "| flag | default | meaning |", "| --- | --- | --- |"]
        for a in actions:
            out.append(_flag_row(a, by_dest.get(a.dest)))
        out.append("")
    return "\n".join(out)


def _flag_row(action: argparse.Action, s: Optional[Setting]) -> str:
    """One Markdown table row of :func:`flags_markdown`."""
    def cell(text: str) -> str:
        return " ".join(text.replace("``", "`").replace("|", "\\|").split())

    flags = ", ".join(f"`{f}`" for f in action.option_strings) or f"`{action.metavar or action.dest.upper()}`"
    if s is not None:
        default = s.default
        if s.meta.get("parse") and isinstance(default, int) and not isinstance(default, bool):
            default = format_size(default)
        paragraphs = s.doc.split("\n\n")
    else:
        default = action.default
        paragraphs = [(action.help or "").replace("%%", "%")]
    meaning = "<br>".join(cell(p) for p in paragraphs)
    if action.help == argparse.SUPPRESS:
        meaning += " (not listed by `--help`)"
    if action.choices and not isinstance(action, argparse._SubParsersAction):
        meaning += "<br>One of: " + ", ".join(f"`{c}`" for c in action.choices) + "."
    if isinstance(default, tuple):
        default = ",".join(map(str, default))
    shown = "" if default == argparse.SUPPRESS else f"`{default}`" if default != "" else '`""`'
    return f"| {flags} | {shown} | {meaning} |"


if __name__ == "__main__":
    print(flags_markdown())
