"""One table of settings (issue 27): every engine setting is one config field whose name, default
and docstring make the ``zpp serve`` / ``zpp bench`` flag and the ``LLM`` keyword; the server's
settings likewise; every ``ZPP_*`` variable is listed in ``zpp.envs``; no import cycle among the
modules that hold them. No worker starts here (seconds in all)."""
from __future__ import annotations

import os
import argparse
import ast
import builtins
import importlib
import inspect
import pathlib
import re
import sys

import pytest

import zpp.args
from zpp import envs
from zpp.args import (
    engine_config,
    engine_config_from_args,
    engine_settings,
    server_config_from_args,
)
from zpp.cli import build_parser
from zpp.config import (
    CacheConfig,
    ConfigError,
    EngineConfig,
    ModelConfig,
    SchedulerConfig,
)
from zpp.server.config import ServerConfig
from zpp.settings import settings_of

ZPP = pathlib.Path(__file__).resolve().parent.parent / "zpp"


def _subparser(parser: argparse.ArgumentParser, *path: str) -> argparse.ArgumentParser:
    for name in path:
        parser = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction)).choices[name]
    return parser


def _actions(parser: argparse.ArgumentParser) -> dict[str, argparse.Action]:
    return {flag: a for a in parser._actions for flag in a.option_strings}


def _llm_signature() -> inspect.Signature:
    from zpp.llm import LLM
    return inspect.signature(LLM.__init__)


def test_every_engine_field_is_a_flag_and_a_keyword_with_its_default():
    """Every field of EngineConfig (through its sub-configs) but the three zpp sets itself is a
    flag of `zpp serve` and of `zpp bench throughput|latency` (the per-node ones: serve only) and a
    keyword of LLM, all with the field's default, and the --help line is the docstring's."""
    flagless = {s.path for s in settings_of(EngineConfig) if s.flagless}
    assert flagless == {("model", "model"), ("scheduler", "streaming"), ("parallel", "share_gpu")}
    parser = build_parser()
    serve = _actions(_subparser(parser, "serve"))
    benches = [_actions(_subparser(parser, "bench", b)) for b in ("throughput", "latency")]
    params = _llm_signature().parameters
    help_text = "".join(_subparser(parser, "serve").format_help().split())  # argparse wraps at hyphens too
    settings = engine_settings()
    assert len(settings) >= 41
    for s in settings:
        action = serve[s.flag]
        assert action.dest == s.name, s.name
        assert action.default == (None if s.meta.get("from_launcher") else s.default), s.name
        for alias in s.meta.get("aliases", ()):
            assert serve[alias] is action
        for bench in benches:
            assert (s.flag in bench) == (s.meta.get("group") != "per-node"), s.name
            if s.flag in bench:
                assert bench[s.flag].default == s.default, s.name
        assert params[s.name].kind is inspect.Parameter.KEYWORD_ONLY and params[s.name].default == s.default, s.name
        assert s.doc and "".join(s.help.split()) in help_text, f"{s.name}: no docstring, or --help does not show it"
    assert set(params) == {"self", "model"} | {s.name for s in settings}


def test_every_server_field_is_a_serve_flag_with_its_default():
    serve = _actions(_subparser(build_parser(), "serve"))
    fields = settings_of(ServerConfig)
    assert {s.name for s in fields} >= {"host", "port", "api_key", "api_server_count", "max_request_body_bytes"}
    for s in fields:
        assert serve[s.flag].dest == s.name and serve[s.flag].default == s.default, s.name
        assert (serve[s.flag].help == argparse.SUPPRESS) == bool(s.meta.get("hidden")), s.name


def test_no_flags_is_the_dataclass_defaults(demo_model):
    """`zpp serve MODEL` is EngineConfig(ModelConfig(MODEL)) and ServerConfig(); `zpp bench` and
    LLM(MODEL) are the same with streaming off; nothing is defaulted outside the fields."""
    parser = build_parser()
    serve_args = parser.parse_args(["serve", demo_model])
    assert engine_config_from_args(serve_args) == EngineConfig(ModelConfig(demo_model))
    assert server_config_from_args(serve_args) == ServerConfig()
    offline = EngineConfig(ModelConfig(demo_model), scheduler=SchedulerConfig(streaming=False))
    for bench in ("throughput", "latency"):
        args = parser.parse_args(["bench", bench, "--model", demo_model])
        assert engine_config_from_args(args, streaming=False) == offline
    assert engine_config(demo_model, streaming=False) == offline


def test_flags_and_keywords_give_the_same_config(demo_model):
    """Text on the command line and Python values as LLM keywords: the same config, every value
    where it belongs (sizes, hosts, layer splits, booleans both ways, aliases, renamed flags)."""
    argv = ["serve", demo_model, "-pp", "2", "--pp-layer-partition", "20,10", "--nodes", "a@h1,b@h2:1",
            "--kv-cache-memory", "512MiB", "--max-structured-outputs-spec-bytes", "1KiB",
            "--structured-outputs-compile-timeout", "3", "--no-enable-chunked-prefill", "--max-num-batched-tokens",
            "8192", "--enable-prefix-caching", "--no-async-scheduling", "--served-model-name", "m",
            "--device", "cpu", "--node-launcher", "manual", "--node-keys-file", "/k"]
    cli = engine_config_from_args(build_parser().parse_args(argv), streaming=False)
    kw = engine_config(demo_model, streaming=False, pipeline_parallel_size=2, pp_layer_partition=[20, 10],
                       nodes=["a@h1", "b@h2:1"], kv_cache_memory=512 << 20, max_structured_outputs_spec_bytes="1KiB",
                       structured_outputs_compile_timeout=3.0, enable_chunked_prefill=False,
                       max_num_batched_tokens=8192, enable_prefix_caching=True, async_scheduling=False,
                       served_model_name="m", device="cpu", node_launcher="manual", node_keys_file="/k")
    assert cli == kw
    assert kw.parallel.pp_layer_partition == (20, 10) and kw.parallel.nodes == ("a@h1", "b@h2:1")
    assert kw.cache == CacheConfig(kv_cache_memory=512 << 20, enable_prefix_caching=True)
    assert kw.structured_outputs.max_spec_bytes == 1024 and kw.structured_outputs.compile_timeout == 3.0
    assert kw.scheduler.async_scheduling is False and not kw.scheduler.enable_chunked_prefill
    assert kw.model.name == "m" and kw.parallel.node_launcher == "manual"


def test_bad_values_name_their_flag(demo_model):
    with pytest.raises(ConfigError, match=r"^--kv-cache-memory 'lots' is not a size"):
        engine_config(demo_model, streaming=False, kv_cache_memory="lots")
    with pytest.raises(ConfigError, match=r"^--max-structured-outputs-grammar-bytes 'x' is not a size"):
        engine_config(demo_model, streaming=False, max_structured_outputs_grammar_bytes="x")
    with pytest.raises(ConfigError, match=r"^--max-request-body-bytes 10: must be at least 1KiB"):
        ServerConfig(max_request_body_bytes=10)


@pytest.mark.parametrize("text, value", [
    ("4096", 4096), (" 2048 ", 2048), ("32k", 32_000), ("1m", 1_000_000), ("2g", 2 * 10**9), ("1t", 10**12),
    ("25.6k", 25_600), ("1.5m", 1_500_000), ("32K", 32_768), ("1M", 1 << 20), ("2G", 2 << 30), ("1T", 1 << 40),
])
def test_human_readable_ints_as_vllm(text, value):
    """vLLM's human_readable_int: lowercase k/m/g/t decimal (decimals allowed, truncated), uppercase
    K/M/G/T binary (whole numbers only)."""
    from zpp.settings import parse_human_int
    assert parse_human_int(text, "--max-model-len") == value
    assert parse_human_int(value, "--max-model-len") == value and parse_human_int(None, "--x") is None


@pytest.mark.parametrize("bad", ["1.5K", "32kb", "32 k", "k", "", "abc", "1e3", "1.5", "0x10", "\u0661\u0662", True, 1.5])
def test_human_readable_int_errors_are_one_line_naming_the_flag(bad):
    from zpp.settings import parse_human_int
    with pytest.raises(ConfigError) as e:
        parse_human_int(bad, "--max-num-batched-tokens")
    msg = str(e.value)
    assert msg.startswith(f"--max-num-batched-tokens {bad!r}: ") and "\n" not in msg
    if bad == "1.5K":
        assert "did you mean 1.5k?" in msg


def test_max_model_len_and_token_budget_take_human_readable_ints(demo_model):
    """``--max-model-len 2k`` / ``1K`` and ``--max-num-batched-tokens 4k`` on the command line and as
    LLM keywords; a bad one is a ConfigError naming the flag (``zpp serve`` prints it as one line)."""
    parser = build_parser()
    for text, value in (("2k", 2000), ("1K", 1024)):
        args = parser.parse_args(["serve", demo_model, "--max-model-len", text, "--max-num-batched-tokens", "4k"])
        cfg = engine_config_from_args(args, streaming=False)
        assert cfg.model.max_model_len == value and cfg.scheduler.max_num_batched_tokens == 4000
        assert engine_config(demo_model, streaming=False, max_model_len=text).model.max_model_len == value
    assert engine_config(demo_model, streaming=False, max_model_len=512).model.max_model_len == 512
    with pytest.raises(ConfigError, match=r"^--max-model-len '32kk': not an integer"):
        engine_config_from_args(parser.parse_args(["serve", demo_model, "--max-model-len", "32kk"]))
    with pytest.raises(ConfigError, match=r"^--max-model-len must be >= 1, got 0"):
        engine_config(demo_model, streaming=False, max_model_len="0k")


@pytest.mark.parametrize("flags, on", [
    ([], True), (["--disable-log-requests"], False), (["--enable-log-requests"], True),
    (["--no-enable-log-requests"], False), (["--no-enable-log-requests", "--disable-log-requests"], False),
])
def test_enable_and_disable_log_requests(flags, on):
    """vLLM's newer --enable-log-requests / --no-enable-log-requests and its older
    --disable-log-requests decide the per-request log lines (zpp's default: on); the two that
    contradict each other are a ConfigError."""
    server = server_config_from_args(build_parser().parse_args(["serve", *flags]))
    assert server.log_requests is on and server.server_options()["log_requests"] is on
    with pytest.raises(ConfigError, match=r"^--enable-log-requests and --disable-log-requests contradict"):
        server_config_from_args(build_parser().parse_args(["serve", "--enable-log-requests", "--disable-log-requests"]))


def test_served_model_name_takes_several_names(demo_model, tmp_path):
    """vLLM's ``--served-model-name NAME [NAME ...]``: a tuple of names (the first is ``name``),
    from the command line (MODEL before or after, or --model), a ``--config`` YAML list, or an LLM
    keyword given as a str or a sequence; the model directory's name without it."""
    from zpp.cli import expand_config_file
    parser = build_parser()
    for argv in (["serve", demo_model, "--served-model-name", "a", "b"], ["serve", "--model", demo_model,
                 "--served-model-name", "a", "b", "a"], ["serve", "--served-model-name", "a", "b", "--", demo_model]):
        cfg = engine_config_from_args(parser.parse_args(argv), streaming=False)
        assert cfg.model.served_model_name == ("a", "b") and cfg.model.name == "a", argv
        assert cfg.model.served_names == ("a", "b")
    # MODEL after the names is swallowed by nargs="+": refused, not served as the demo model under 3 names
    with pytest.raises(ConfigError, match=r"^--served-model-name took the model directory .* put MODEL before"):
        engine_config_from_args(parser.parse_args(["serve", "--served-model-name", "a", "b", demo_model]))
    yaml = tmp_path / "serve.yaml"
    yaml.write_text("served-model-name: [x, y]\n")
    args = parser.parse_args(expand_config_file(parser, ["serve", demo_model, "--config", str(yaml)]))
    assert args.model == demo_model and args.served_model_name == ["x", "y"]
    for value in ("m", ["m"], ("m",)):
        assert engine_config(demo_model, streaming=False, served_model_name=value).model.served_model_name == ("m",)
    assert ModelConfig(demo_model, served_model_name="smol").name == "smol"  # a str made directly: one name
    plain = engine_config(demo_model, streaming=False).model
    assert plain.served_model_name is None and plain.served_names == (os.path.basename(demo_model),)
    for bad, msg in (([], "expected one name or more"), ("", "not a name"), (["a", " b"], "not a name"),
                     (["a", 3], "not a name")):
        with pytest.raises(ConfigError, match=r"^--served-model-name.*" + msg):
            engine_config(demo_model, streaming=False, served_model_name=bad)


def test_unknown_llm_keyword_is_a_type_error_naming_it(demo_model):
    from zpp.llm import LLM
    with pytest.raises(TypeError, match=r"'max_num_seq'.*did you mean 'max_num_seqs'"):
        LLM(demo_model, max_num_seq=4)
    with pytest.raises(TypeError, match=r"'no_such_setting': not an engine setting"):
        LLM(demo_model, no_such_setting=1)
    with pytest.raises(TypeError, match="'streaming'"):  # set by zpp (LLM: off), not a keyword
        LLM(demo_model, streaming=True)
    with pytest.raises(ConfigError, match="node_rank=1"):
        LLM(demo_model, node_rank=1)
    with pytest.raises(TypeError, match=r"max_num_seqs='4': expected int \(--max-num-seqs\)"):
        LLM(demo_model, max_num_seqs="4")
    with pytest.raises(TypeError, match=r"async_scheduling=1: expected bool or None"):
        LLM(demo_model, async_scheduling=1)
    assert engine_config(demo_model, streaming=False, stage_timeout=5).parallel.stage_timeout == 5  # int for float


def test_a_new_field_is_a_new_flag(tmp_path, monkeypatch):
    """The table is read from the fields alone: a dataclass written like the configs gets its
    flags, their defaults and help from its fields, nothing else."""
    src = tmp_path / "newconf.py"
    src.write_text('from dataclasses import dataclass\nfrom typing import Optional\n'
                   'from zpp.settings import setting\n\n\n@dataclass(frozen=True)\nclass NewConfig:\n'
                   '    max_foo: int = 8\n    """most foos per micro-batch\n\n    Not in --help."""\n'
                   '    bar_mode: Optional[str] = setting(None, aliases=("-b",), choices=("x", "y"))\n'
                   '    """how bars run"""\n')
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "newconf", raising=False)
    mod = importlib.import_module("newconf")
    monkeypatch.setitem(zpp.args.CLASS_GROUPS, "NewConfig", None)
    p = argparse.ArgumentParser()
    zpp.args.add_settings(p, settings_of(mod.NewConfig))
    assert vars(p.parse_args([])) == {"max_foo": 8, "bar_mode": None}
    assert vars(p.parse_args(["--max-foo", "3", "-b", "y"])) == {"max_foo": 3, "bar_mode": "y"}
    text = " ".join(p.format_help().split())
    assert "--max-foo MAX_FOO most foos per micro-batch" in text and "Not in --help" not in text


def test_hf_config_reads_config_json_once(demo_model, monkeypatch):
    opened = []
    real_open = builtins.open

    def counting_open(path, *a, **kw):
        if str(path).endswith("config.json"):
            opened.append(path)
        return real_open(path, *a, **kw)

    monkeypatch.setattr(builtins, "open", counting_open)
    config = EngineConfig(ModelConfig(demo_model))
    for _ in range(3):
        assert config.model.hf_config["vocab_size"] == 49152
        config.validate()
        _ = config.max_model_len
    assert len(opened) == 1, opened


# --- ZPP_* environment variables -----------------------------------------------------------------

def _sources():
    for path in sorted(ZPP.rglob("*.py")):
        if path.name != "envs.py" or path.parent != ZPP:
            yield path, path.read_text()


def test_every_zpp_variable_read_is_listed_in_envs():
    """Every ZPP_* name in zpp/ is in zpp.envs.VARIABLES (with a type and a docstring), every
    listed one is used, and no module reads one from os.environ itself."""
    named, direct = set(), []
    for path, text in _sources():
        named |= set(re.findall(r"\bZPP_[A-Z0-9_]+", text))
        for n, line in enumerate(text.splitlines(), 1):
            if re.search(r"(environ|getenv)\b.*['\"]ZPP_", line):
                direct.append(f"{path.relative_to(ZPP.parent)}:{n}: {line.strip()}")
    assert not direct, "read ZPP_* through zpp.envs:\n" + "\n".join(direct)
    assert named - set(envs.VARIABLES) == set(), "add these to zpp/envs.py"
    used = {name for name in envs.VARIABLES
            if any(re.search(rf"envs\.{name}\b|VARIABLES\[\"{name}\"\]", text) for _, text in _sources())}
    assert used == set(envs.VARIABLES), f"listed but never read: {set(envs.VARIABLES) - used}"
    for var in envs.VARIABLES.values():
        assert var.doc and var.type


def test_envs_read_at_access(monkeypatch):
    monkeypatch.delenv("ZPP_TRACE", raising=False)
    assert envs.ZPP_TRACE is None
    monkeypatch.setenv("ZPP_TRACE", "/tmp/t")
    assert envs.ZPP_TRACE == "/tmp/t"
    monkeypatch.setenv("ZPP_ASYNC_SCHEDULING", "0")
    assert envs.ZPP_ASYNC_SCHEDULING is False
    monkeypatch.setenv("ZPP_ASYNC_SCHEDULING", "yes")
    assert envs.ZPP_ASYNC_SCHEDULING is None
    with pytest.raises(AttributeError, match="ZPP_NOPE"):
        _ = envs.ZPP_NOPE


# --- import cycles ---------------------------------------------------------------------------------

def _import_graph() -> dict[str, set[str]]:
    """Module -> the zpp modules it imports, at any depth of its code (function bodies included)."""
    mods = {}
    for path in ZPP.rglob("*.py"):
        parts = path.relative_to(ZPP.parent).with_suffix("").parts
        mods[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    graph: dict[str, set[str]] = {m: set() for m in mods}
    for name, path in mods.items():
        pkg = name if path.name == "__init__.py" else name.rpartition(".")[0]
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    base = ".".join(pkg.split(".")[:len(pkg.split(".")) - node.level + 1] + ([base] if base else []))
                targets = [f"{base}.{a.name}" for a in node.names] + [base]
            else:
                continue
            for t in targets:
                while t and t not in mods:
                    t = t.rpartition(".")[0]
                if t and t not in (name, "zpp"):
                    graph[name].add(t)
    return graph


def _cycles(graph: dict[str, set[str]]) -> list[set[str]]:
    """The strongly connected components of more than one module (Tarjan)."""
    index, low, stack, on, out = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = set()
            while True:
                w = stack.pop()
                on.discard(w)
                comp.add(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(comp)

    for v in graph:
        if v not in index:
            visit(v)
    return out


def test_no_import_cycle_through_the_settings_modules():
    """cli, bench, args, config, settings, envs, errors, the server config and llm are in no cycle
    (cli <-> bench was one: each imported the other for the engine flags)."""
    graph = _import_graph()
    assert "zpp.bench.latency" in graph["zpp.bench"] and "zpp.args" in graph["zpp.cli"]
    mine = {"zpp.cli", "zpp.args", "zpp.config", "zpp.settings", "zpp.envs", "zpp.errors", "zpp.server.config",
            "zpp.llm"} | {m for m in graph if m.startswith("zpp.bench")}
    bad = [c for c in _cycles(graph) if c & mine]
    assert not bad, bad
    assert _cycles({"a": {"b"}, "b": {"a"}, "c": set()}) == [{"a", "b"}]  # the check can fail


def test_flags_page_lists_every_flag():
    """Every option string the real `zpp serve` parser accepts (``--x`` and ``--no-x``, aliases,
    hand-written and vLLM-compatibility flags, those hidden from --help) and MODEL has a row in the
    generated page, and every setting's row carries its field's docstring."""
    from zpp.args import flags_markdown, server_settings
    page = flags_markdown()
    serve = _subparser(build_parser(), "serve")
    strings = [f for a in serve._actions for f in a.option_strings]
    assert {"--model", "--config", "--log-level", "--trust-remote-code", "--headless", "--download-dir", "--revision",
            "--swap-space", "--distributed-executor-backend", "--no-enable-chunked-prefill", "-pp", "-h",
            "--enable-log-requests", "--log-stats-interval"} <= set(strings)
    rows = [line for line in page.splitlines() if line.startswith("| `")]
    listed = [f for row in rows for f in re.findall(r"`([^`]+)`", row.split(" | ")[0])]
    missing = [f for f in strings if f not in listed]
    assert not missing, missing
    assert len(listed) == len(set(listed)), "a flag listed twice"
    assert listed[0] == "MODEL" and set(listed) == set(strings) | {"MODEL"}
    for s in engine_settings() + server_settings():
        row = next(r for r in rows if r.startswith(f"| `{s.flag}`"))
        assert " ".join(s.help.split()).replace("``", "`") in row.replace("\\|", "|"), s.name


def test_docs_flags_page_is_the_generated_one():
    """docs/flags.md is `python -m zpp.args`'s output, whole (regenerate it after adding a flag or
    a setting): the flags' documentation has one source, the parser and its fields."""
    from zpp.args import flags_markdown
    with open(os.path.join(os.path.dirname(__file__), "..", "docs", "flags.md")) as f:
        page = f.read()
    assert page == flags_markdown() + "\n", "docs/flags.md is stale: python -m zpp.args > docs/flags.md"


def test_bool_flags_take_vllms_no_form(demo_model):
    """vLLM command lines switch bools off with ``--no-X`` (``--no-enable-prefix-caching``): each
    bool setting has both forms, the last one given wins; ``--disable-X`` flags stay plain."""
    parser = build_parser()
    for argv, on in ((["--enable-prefix-caching"], True), (["--no-enable-prefix-caching"], False),
                     (["--enable-prefix-caching", "--no-enable-prefix-caching"], False), ([], False)):
        cfg = engine_config_from_args(parser.parse_args(["serve", demo_model, *argv]), streaming=False)
        assert cfg.cache.enable_prefix_caching is on, argv
    assert parser.parse_args(["serve", "--no-enforce-eager"]).enforce_eager is False
    with pytest.raises(SystemExit):
        parser.parse_args(["serve", "--no-disable-log-stats"])
