"""The table of settings: each setting is one field of a config dataclass, written once.

A field's name, type annotation, default and docstring are the whole setting: ``zpp.args`` turns
every field of ``EngineConfig`` (through its sub-configs) into a ``zpp serve`` / ``zpp bench`` flag
and an ``LLM(...)`` keyword argument, and every field of ``ServerConfig`` into a ``zpp serve`` flag.
Adding a setting is adding a field::

    max_foo: int = 8
    \"\"\"most foos per micro-batch

    Further paragraphs are for readers of the code only.\"\"\"

The docstring's first paragraph is the flag's ``--help`` line (argparse adds ``(default: 8)``
unless it says ``default``); the flag is ``--max-foo``, the keyword ``max_foo``. A field whose
flag needs more (an alias, choices, a parser of sizes, a ``--help`` section) says it with
:func:`setting` instead of a bare default. The idea is vLLM's ``EngineArgs``, which derives its
flags from its config classes and their attribute docstrings.

This module imports nothing of zpp at import time: ``zpp.config`` uses it.
"""
from __future__ import annotations

import ast
import dataclasses
import functools
import inspect
import itertools
import json
import re
import textwrap
import typing
from dataclasses import MISSING, dataclass, field
from typing import Any, Callable, Optional, Union


def setting(default: Any = MISSING, *, default_factory: Any = MISSING, flag: Optional[str] = None,
            aliases: tuple[str, ...] = (), choices: Optional[tuple[str, ...]] = None,
            parse: Optional[Callable[[Any, str], Any]] = None, type: Optional[Callable[[str], Any]] = None,
            group: Optional[str] = None, metavar: Optional[str] = None, nargs: Optional[str] = None,
            from_launcher: bool = False, hidden: bool = False, flagless: bool = False) -> Any:
    """A config field with what its flag needs beyond its name, type, default and docstring.

    Args:
        default, default_factory: as ``dataclasses.field``.
        flag: the flag when it is not ``--`` + the field's name with dashes. The setting's name
            (the ``LLM`` keyword, argparse's ``dest``) follows the flag: ``--max-structured-outputs-
            spec-bytes`` is ``max_structured_outputs_spec_bytes``.
        aliases: more spellings of the flag (``-pp``).
        choices: the values the flag accepts.
        parse: ``parse(value, flag) -> value`` for a value given as text (the flag) or as Python
            (an ``LLM`` keyword), e.g. a size such as ``512MiB``; raises ConfigError naming ``flag``.
            The flag then takes text, parsed when the config is made.
        type: argparse's ``type`` when not the annotation's (e.g. a TCP port check).
        group: the key of the ``--help`` section (``zpp.args.GROUPS``) when not the class's.
        metavar: argparse's ``metavar``.
        nargs: argparse's ``nargs`` (``"+"``: one or more values; ``parse`` then gets a list).
        from_launcher: the flag's default is None on the command line, so that ``zpp serve`` can
            fill it from a cluster launcher's environment (``zpp.cli.resolve_per_node``); the
            field's default applies after that.
        hidden: no line in ``--help``.
        flagless: neither a flag nor a keyword: zpp sets it itself (the command, an environment
            variable) or the flag is written by hand (the model).
    """
    meta = {"flag": flag, "aliases": aliases, "choices": choices, "parse": parse, "type": type, "group": group,
            "metavar": metavar, "nargs": nargs, "from_launcher": from_launcher, "hidden": hidden, "flagless": flagless}
    meta = {k: v for k, v in meta.items() if v}  # only what the field says
    return field(default=default, default_factory=default_factory, metadata=meta)


@dataclass(frozen=True)
class Setting:
    """One row of the table: a field of a config dataclass and its flag."""

    name: str
    """The keyword name (``LLM(...)``) and argparse ``dest``: the flag without dashes."""
    flag: str
    path: tuple[str, ...]
    """Attribute path from the root config, e.g. ``("parallel", "nodes")``."""
    owner: type
    """The dataclass that holds the field."""
    field: dataclasses.Field
    type: Any
    """The annotation, evaluated (``Optional[int]``...)."""
    doc: str
    """The field's docstring (empty when it has none)."""

    @property
    def meta(self) -> typing.Mapping[str, Any]:
        return self.field.metadata

    @property
    def default(self) -> Any:
        if self.field.default_factory is not MISSING:
            return self.field.default_factory()
        return self.field.default

    @property
    def help(self) -> str:
        """The docstring's first paragraph on one line (the ``--help`` text)."""
        return " ".join(self.doc.split("\n\n")[0].split())

    @property
    def value_type(self) -> Any:
        """The annotation without ``Optional``: ``int`` for ``Optional[int]``."""
        args = [a for a in typing.get_args(self.type) if a is not type(None)]
        if typing.get_origin(self.type) is Union and len(args) == 1:
            return args[0]
        return self.type

    @property
    def flagless(self) -> bool:
        return bool(self.meta.get("flagless"))


def field_docs(cls: type) -> dict[str, str]:
    """``{field name: its docstring}``: the string literal right after each annotated attribute
    in the class body (the convention of PEP 257 attribute docstrings, which Sphinx reads too)."""
    return dict(_field_docs(cls))


@functools.cache
def _field_docs(cls: type) -> tuple[tuple[str, str], ...]:
    tree = ast.parse(textwrap.dedent(inspect.getsource(cls)))
    body = tree.body[0].body
    docs = []
    for node, after in itertools.pairwise(body):
        if (isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name) and isinstance(after, ast.Expr)
                and isinstance(after.value, ast.Constant) and isinstance(after.value.value, str)):
            docs.append((node.target.id, inspect.cleandoc(after.value.value)))
    return tuple(docs)


@functools.cache
def settings_of(cls: type) -> tuple[Setting, ...]:
    """Every setting of the config dataclass ``cls``, through the dataclass fields it nests
    (``EngineConfig.parallel`` ...), in the order they are written; flagless ones included.

    Raises:
        TypeError: two settings with one name.
    """
    rows: list[Setting] = []
    _collect(cls, (), rows)
    seen: dict[str, Setting] = {}
    for s in rows:
        if not s.flagless and s.name in seen:
            raise TypeError(f"two settings named {s.name!r}: {seen[s.name].path} and {s.path}")
        seen[s.name] = s
    return tuple(rows)


def _collect(cls: type, prefix: tuple[str, ...], rows: list[Setting]) -> None:
    hints = typing.get_type_hints(cls)
    docs = field_docs(cls)
    for f in dataclasses.fields(cls):
        t = hints[f.name]
        if dataclasses.is_dataclass(t):
            _collect(t, prefix + (f.name,), rows)
            continue
        flag = f.metadata.get("flag") or "--" + f.name.replace("_", "-")
        rows.append(Setting(name=flag.lstrip("-").replace("-", "_"), flag=flag, path=prefix + (f.name,), owner=cls,
                            field=f, type=t, doc=docs.get(f.name, "")))


# --- parsers of settings given as text (a flag) or as Python (an LLM keyword) -----------------------

def parse_nodes(value: Any, flag: str) -> tuple[str, ...]:
    """``"user@a,user@b:2"`` or a sequence of hosts -> a tuple of hosts."""
    if value is None or isinstance(value, str):
        return tuple(n for n in (value or "").split(",") if n)
    return tuple(value)


def parse_layer_partition(value: Any, flag: str) -> Union[tuple[int, ...], str, None]:
    """``"10,10,5,5"``, ``"auto"`` or a sequence of ints -> a tuple, ``"auto"`` or None.

    Raises:
        ConfigError: text that is neither.
    """
    if value is None or isinstance(value, str):
        from zpp.models.partition import parse_partition
        return parse_partition(value)
    return tuple(value) or None


def parse_names(value: Any, flag: str) -> Optional[tuple[str, ...]]:
    """One name or several (``--served-model-name a b``: a list; ``LLM``: a str or any sequence of
    str) -> a tuple of names, duplicates dropped (the first kept), or None for None.

    Raises:
        ConfigError: an empty sequence, or a name that is not a non-empty str without surrounding
            whitespace (one line naming ``flag``).
    """
    from zpp.errors import ConfigError
    if value is None:
        return None
    names = (value,) if isinstance(value, str) else tuple(value) if isinstance(value, (list, tuple)) else None
    if not names:
        raise ConfigError(f"{flag}: expected one name or more, got {value!r}")
    for name in names:
        if not isinstance(name, str) or not name.strip() or name != name.strip():
            raise ConfigError(f"{flag} {name!r}: not a name (a non-empty string without surrounding spaces)")
    return tuple(dict.fromkeys(names))


_DECIMAL_SUFFIXES = {"k": 10**3, "m": 10**6, "g": 10**9, "t": 10**12}
_BINARY_SUFFIXES = {"K": 2**10, "M": 2**20, "G": 2**30, "T": 2**40}


def parse_human_int(value: Any, flag: str) -> Optional[int]:
    """A count given as vLLM's human-readable integer (its ``human_readable_int``, used for
    ``--max-model-len``): a lowercase suffix is decimal (``32k`` = 32000, ``1m`` = 1000000,
    ``g``, ``t``; ``25.6k`` = 25600, truncated to an int), an uppercase one binary (``32K`` =
    32768, ``1M`` = 1048576, ``G``, ``T``; whole numbers only), no suffix a plain integer. None
    and an int (an ``LLM`` keyword) pass through.

    Raises:
        ConfigError: anything else (a bool, a float, ``1.5K``, ``32kb``, ``abc``), one line naming ``flag``.
    """
    from zpp.errors import ConfigError
    if value is None or (isinstance(value, int) and not isinstance(value, bool)):
        return value
    bad = ConfigError(f"{flag} {value!r}: not an integer (a number of tokens, e.g. 4096; 32k = 32000, "
                      f"32K = 32768)")
    if not isinstance(value, str):
        raise bad
    m = re.fullmatch(r"([+-]?[0-9]+)|([0-9]+(?:\.[0-9]+)?)([kmgtKMGT])", value.strip())
    if m is None:
        raise bad
    if m.group(1) is not None:  # a plain integer (a sign is the config's to judge)
        return int(m.group(1))
    number, suffix = m.group(2), m.group(3)
    if suffix in _DECIMAL_SUFFIXES:
        return int(float(number) * _DECIMAL_SUFFIXES[suffix])
    if "." in number:
        raise ConfigError(f"{flag} {value!r}: decimals go only with the decimal suffixes k, m, g, t (did you mean "
                          f"{number}{suffix.lower()}?)")
    return int(number) * _BINARY_SUFFIXES[suffix]


def tcp_port(value: str) -> int:
    """argparse ``type`` of a TCP port flag (0-65535)."""
    import argparse
    try:
        port = int(value)
    except ValueError:
        port = -1
    if not 0 <= port <= 65535:
        raise argparse.ArgumentTypeError(f"{value} is not a TCP port (0-65535)")
    return port


def parse_size(value: str | int | float | None, flag: str = "--kv-cache-memory") -> Optional[int]:
    """Parse a byte size such as ``512MiB``, ``2GiB``, ``1.5G`` or ``1000000`` into bytes.
    Raises ConfigError naming ``flag`` for anything else."""
    from zpp.errors import ConfigError
    if value is None or isinstance(value, (int, float)):
        return None if value is None else int(value)
    s = value.strip().lower().removesuffix("b").removesuffix("i")
    mult = {"k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40}
    try:
        if s and s[-1] in mult:
            return int(float(s[:-1]) * mult[s[-1]])
        return int(float(s))
    except ValueError:
        raise ConfigError(f"{flag} {value!r} is not a size (examples: 512MiB, 2GiB)") from None


def parse_json_object(value, flag: str, example: str) -> dict:
    """A flag's JSON-object value (``--speculative-config``, ``--structured-outputs-config``): JSON
    text is parsed, a dict passes through.

    Raises:
        ConfigError: not valid JSON, or not an object (one line naming ``flag``, with ``example``)."""
    from zpp.errors import ConfigError
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except ValueError as e:
            raise ConfigError(f"{flag}: not valid JSON ({e})") from None
    if not isinstance(value, dict):
        raise ConfigError(f"{flag}: expected a JSON object such as {example}, got {value!r}")
    return value
