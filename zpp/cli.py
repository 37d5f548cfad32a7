"""Command line: ``zpp serve``, ``zpp plan``, ``zpp node-keys``, ``zpp prepare-demo-model``, ``zpp bench {throughput,latency,serve}``."""
from __future__ import annotations

import argparse
import asyncio
import logging
import os
import sys
import traceback

from zpp.args import add_engine_args, add_serve_args, engine_config_from_args, server_config_from_args
from zpp.config import ConfigError, ParallelConfig

__all__ = ["build_parser", "main", "add_engine_args", "engine_config_from_args", "resolve_per_node"]


logger = logging.getLogger("zpp.cli")


class _HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Shows each flag's default, unless its help already says it or there is none to show."""

    def _get_help_string(self, action):
        text = action.help or ""
        if ("default" in text or action.default is None or action.default is False or action.default == ""
                or action.default == () or action.default == argparse.SUPPRESS
                or isinstance(action, argparse._StoreFalseAction)):
            return text
        return super()._get_help_string(action)


class _Parser(argparse.ArgumentParser):
    """Help with defaults; a bad flag is one line ``zpp: error: ...`` (no usage dump)."""

    def __init__(self, *args, **kwargs):
        kwargs.setdefault("formatter_class", _HelpFormatter)
        super().__init__(*args, **kwargs)

    def error(self, message):
        self.exit(2, f"zpp: error: {message} (see: {self.prog} --help)\n")


def _innermost_parser(parser: argparse.ArgumentParser, argv: list[str]) -> argparse.ArgumentParser:
    """The (sub)command parser ``argv`` names (``zpp bench serve ...`` -> the ``bench serve`` parser),
    so that an unknown flag's hint points to the help that lists the command's flags."""
    while True:
        subs = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
        if not subs:
            return parser
        for i, arg in enumerate(argv):
            if arg in subs[0].choices:
                parser, argv = subs[0].choices[arg], argv[i + 1:]
                break
        else:
            return parser


def expand_config_file(parser: argparse.ArgumentParser, argv: list[str]) -> list[str]:
    """vLLM's ``--config FILE``: a YAML mapping of flag names (``max-num-seqs: 8`` or
    ``max_num_seqs: 8``) to values, read as if those flags came first, so that the command line
    overrides the file. ``true`` gives a switch, ``false`` its ``--no-`` form (or nothing), a list
    its items as separate values for a flag that takes several (``--served-model-name``), else its
    items joined by commas. Returns ``argv`` with ``--config FILE`` replaced by the file's
    flags (unchanged without ``--config``). Raises ConfigError (unreadable file, not a mapping, a
    key that is not a flag of the command)."""
    cmd = _innermost_parser(parser, argv)
    if "--config" not in cmd._option_string_actions:
        return argv
    at = next((i for i, a in enumerate(argv) if a == "--config" or a.startswith("--config=")), None)
    if at is None:
        return argv
    if argv[at] == "--config":
        if at + 1 >= len(argv):
            return argv  # argparse says "expected one argument"
        path, rest = argv[at + 1], argv[:at] + argv[at + 2:]
    else:
        path, rest = argv[at].split("=", 1)[1], argv[:at] + argv[at + 1:]
    import yaml
    try:
        with open(path, encoding="utf-8") as f:
            data = yaml.safe_load(f)
    except OSError as e:
        raise ConfigError(f"--config {path!r}: {e.strerror or e}") from None
    except yaml.YAMLError as e:
        raise ConfigError(f"--config {path!r}: not valid YAML ({str(e).splitlines()[0]})") from None
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise ConfigError(f"--config {path!r}: must hold a mapping of flag names to values, not a {type(data).__name__}")
    flags: list[str] = []
    for key, value in data.items():
        name = "--" + str(key).strip().lstrip("-").replace("_", "-")
        action = cmd._option_string_actions.get(name)
        if action is None or name == "--config":
            raise ConfigError(f"--config {path!r}: {key!r} is not a flag of `{cmd.prog}` (see: {cmd.prog} --help)")
        if action.nargs == 0:  # a switch: true gives it, false its --no- form where there is one
            if not isinstance(value, bool):
                raise ConfigError(f"--config {path!r}: {key!r} is a switch; give true or false, not {value!r}")
            if value:
                flags.append(name)
            elif "--no-" + name[2:] in cmd._option_string_actions:
                flags.append("--no-" + name[2:])
            continue
        if value is None:
            continue
        if isinstance(value, (list, tuple)) and action.nargs in ("+", "*"):  # --served-model-name a b
            flags += [name, *(str(v) for v in value)]
            continue
        if isinstance(value, (list, tuple)):
            value = ",".join(str(v) for v in value)
        elif isinstance(value, bool):
            value = str(value).lower()
        flags += [name, str(value)]
    start = len(argv) - len(_args_after_command(parser, argv))
    start = min(start, at)
    while start < len(rest) and not rest[start].startswith("-"):  # after a leading MODEL: a flag of several
        start += 1  # values (--served-model-name a b) would take it for one more value
    return rest[:start] + flags + rest[start:]


def _args_after_command(parser: argparse.ArgumentParser, argv: list[str]) -> list[str]:
    """The part of ``argv`` after the (sub)command names."""
    while True:
        subs = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
        if not subs:
            return argv
        for i, arg in enumerate(argv):
            if arg in subs[0].choices:
                parser, argv = subs[0].choices[arg], argv[i + 1:]
                break
        else:
            return argv


def _setup_logging(level: str) -> None:
    logging.basicConfig(level=getattr(logging, level.upper()), format="%(asctime)s %(levelname)s %(name)s: %(message)s")


DEFAULT_MASTER_PORT = ParallelConfig.master_port
"""vLLM's default ``--master-port`` (``ParallelConfig.master_port``)."""


def resolve_per_node(args, environ=None) -> None:
    """Fill ``--nnodes``, ``--node-rank``, ``--master-addr``, ``--master-port`` that were not given
    from a cluster launcher's environment (LeaderWorkerSet, Slurm, torchrun-style; see
    ``zpp.node.launch_env``) and log what was read. Ignored, with a log line, when only one worker
    runs (-pp x -tp = 1): a single-stage server inside a multi-node job stays on its host.
    Raises ConfigError (a malformed variable, or more Slurm tasks than nodes)."""
    from zpp.node.launch_env import launcher_env
    fields = ("nnodes", "node_rank", "master_addr", "master_port")
    if all(getattr(args, f) is not None for f in fields):
        return
    found = launcher_env(os.environ if environ is None else environ)
    if found is None:
        return
    if found.unused:
        logger.info("%s: %s", found.describe(), found.unused)
        return
    nnodes = args.nnodes if args.nnodes is not None else found.nnodes
    if not nnodes or nnodes <= 1:
        logger.debug("%s: one node", found.describe())
        return
    if args.pipeline_parallel_size * args.tensor_parallel_size == 1:
        logger.info("%s: not used (one worker: -pp and -tp are 1, so it runs on this host alone)", found.describe())
        return
    taken = []
    for f in fields:
        value = getattr(found, f)
        if getattr(args, f) is None and value is not None:
            setattr(args, f, value)
            taken.append(f"--{f.replace('_', '-')} {value}")
    logger.info("read from %s -> %s", found.describe(), " ".join(taken) or "nothing (the flags say it all)")


def cmd_serve(args) -> int:
    resolve_per_node(args)
    if args.headless and not (args.node_rank or 0) > 0:
        raise ConfigError("--headless is for node ranks > 0 of a per-node launch (--nnodes N --node-rank R); node "
                          "rank 0 serves the API")
    _check_vllm_only_flags(args)
    config = engine_config_from_args(args)  # before the heavy imports: a bad flag fails at once
    if config.parallel.nnodes > 1 and config.parallel.node_rank > 0:  # headless: this node's stages only
        from zpp.frontend.async_engine import validate_startup
        from zpp.node.pernode import run_node
        validate_startup(config)
        return run_node(config, args.log_level)
    server = server_config_from_args(args)
    if server.api_server_count > 1:  # before prometheus-client is imported: every front end's counters summed
        import atexit
        import shutil
        import tempfile
        os.environ["PROMETHEUS_MULTIPROC_DIR"] = d = tempfile.mkdtemp(prefix="zpp-metrics-")
        atexit.register(shutil.rmtree, d, True)
    from zpp.frontend.async_engine import validate_startup
    from zpp.server.launch import serve
    validate_startup(config)
    _check_port_free(server.host, server.port)
    return asyncio.run(serve(config, server.host, server.port, serve_api_key(server), server.chat_template,
                             log_stats_interval=None if server.disable_log_stats else server.log_stats_interval,
                             api_server_count=server.api_server_count, **server.server_options()))


def _check_vllm_only_flags(args) -> None:
    """One warning per vLLM flag that has no effect here; ConfigError for one zpp cannot honour."""
    if args.download_dir is not None or args.revision is not None:
        flag = "--download-dir" if args.download_dir is not None else "--revision"
        raise ConfigError(f"{flag}: zpp does not download models; give a local model directory (config.json + "
                          f"safetensors + tokenizer)")
    if args.tokenizer_mode not in (None, "auto", "hf"):
        raise ConfigError(f"--tokenizer-mode {args.tokenizer_mode}: zpp loads the model directory's Hugging Face "
                          f"tokenizer (auto / hf) only")
    if args.distributed_executor_backend == "ray":
        raise ConfigError("--distributed-executor-backend ray: zpp has no Ray; it starts its workers itself "
                          "(mp, the default; other hosts through --nodes or a per-node launch)")
    if args.distributed_executor_backend is not None:
        logger.warning("--distributed-executor-backend %s: has no effect (zpp always starts its workers with "
                       "multiprocessing)", args.distributed_executor_backend)
    if args.swap_space is not None:
        logger.warning("--swap-space %s: has no effect (zpp recomputes preempted requests; there is no CPU swap "
                       "space)", args.swap_space)


def _check_port_free(host: str, port: int) -> None:
    """Fail before any weight loads if the HTTP port cannot be bound. Raises ConfigError."""
    import socket
    try:
        with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            s.bind((host, port))
    except OSError as e:
        raise ConfigError(f"--host {host} --port {port}: cannot listen there ({e.strerror})") from None


def cmd_node_keys(args) -> int:
    from zpp.transport.security import new_run_keys, write_keys_file
    write_keys_file(args.file, new_run_keys(curve=True), mode=0o400, what="zpp node-keys")
    print(f"zpp: wrote fresh control-plane keys to {args.file} (mode 0400); give every node of the run the same "
          f"file (--node-keys-file), readable only by the user running zpp", file=sys.stderr)
    return 0


def cmd_plan(args) -> int:
    """``zpp plan``: print (or ``--json``) what fits where, from config.json; exit 0 when it fits, 3
    when it does not."""
    import json

    from zpp import plan as zplan
    gpu_memory = zplan.parse_memory_list(args.gpu_memory) if args.gpu_memory else None
    capability = zplan.parse_capability(args.gpu_capability) if args.gpu_capability else None
    args.device = "cpu"  # a plan never touches this machine's devices; its target is --gpu-memory / detected
    config = engine_config_from_args(args, streaming=True)
    config.check_max_model_len()  # refused as `zpp serve` refuses it
    target = zplan.detect_target(gpu_memory, capability)
    plan = zplan.make_plan(config, target)
    if args.json:
        print(json.dumps(plan.to_json()))
    else:
        print(zplan.format_plan(plan, config.model.model))
    return 0 if plan.fits else 3


def cmd_prepare(args) -> int:
    from zpp.demo import prepare_demo_model
    path = prepare_demo_model(args.output)
    print(path)
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="zpp", description="zpp: a pipeline-parallel LLM serving engine")
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("serve", help="serve a model over an OpenAI-compatible HTTP API")
    add_serve_args(p)
    p.set_defaults(func=cmd_serve)

    p = sub.add_parser("plan", help="what fits on which GPUs, per pipeline stage, from config.json alone "
                                    "(no weights load, no GPU needed)")
    add_engine_args(p)
    g = p.add_argument_group("plan")
    g.add_argument("--gpu-memory", default=None, metavar="SIZE[,SIZE...]",
                   help="memory of every stage's GPU (one size) or of each stage's (one per stage: mixed cards), "
                        "e.g. 80GiB or 80GiB,24GiB (a bare number is GiB); default: the GPUs present, else this "
                        "host's available RAM (CPU)")
    g.add_argument("--gpu-capability", default=None, metavar="X.Y",
                   help="the GPUs' compute capability, which decides what stays FP8 (>= 8.9); default: the GPUs "
                        "present, else 9.0")
    g.add_argument("--json", action="store_true",
                   help="print {fits, min_pipeline_parallel_size, stages: [{stage, layers, weight_bytes, "
                        "weight_bytes_by_dtype, kv_bytes_per_token, kv_tokens, fits}]}")
    p.set_defaults(func=cmd_plan)

    p = sub.add_parser("node-keys",
                       help="write fresh control-plane keys (CURVE) for a per-node launch to FILE, mode 0400")
    p.add_argument("file", help="the key file to create (it must not exist); give every node a copy readable only "
                                "by the user running zpp (a Kubernetes secret mounted 0400, the job's shared storage)")
    p.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"],
                   help="log level")
    p.set_defaults(func=cmd_node_keys)

    p = sub.add_parser("prepare-demo-model",
                       help="convert the packaged SmolLM2 GGUF into an HF directory (once) and print its path")
    p.add_argument("--output", default=None, help="target directory (default: $ZPP_CACHE/SmolLM2-135M-Instruct)")
    p.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"],
                   help="log level")
    p.set_defaults(func=cmd_prepare)

    from zpp.bench import add_bench_parser
    add_bench_parser(sub)
    return parser


def serve_api_key(server) -> "str | None":
    """The key ``zpp serve`` requires on ``/v1/*``: ``--api-key``, else ``ZPP_API_KEY`` (as vLLM falls back
    to ``VLLM_API_KEY``), else None (no key)."""
    from zpp import envs
    return server.api_key or envs.ZPP_API_KEY


def main(argv=None) -> int:
    parser = build_parser()
    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        argv = expand_config_file(parser, argv)
    except ConfigError as e:
        print(f"zpp: error: {e}", file=sys.stderr)
        return 2
    args, unknown = parser.parse_known_args(argv)
    if unknown:  # the hint names the command's own help, which lists its flags
        _innermost_parser(parser, argv).error(f"unrecognized arguments: {' '.join(unknown)}")
    _setup_logging(args.log_level)
    try:
        return args.func(args) or 0
    except KeyboardInterrupt:
        return 130
    except Exception as e:  # one line; the traceback only with --log-level debug
        if args.log_level == "debug":
            traceback.print_exc()
        msg = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        from zpp.errors import WorkerDiedError
        if not isinstance(e, (ConfigError, WorkerDiedError)):  # those two say what failed already
            msg = f"{msg} ({type(e).__name__}; --log-level debug shows the traceback)"
        print(f"zpp: error: {msg}", file=sys.stderr)
        return 2 if isinstance(e, ConfigError) else 1


if __name__ == "__main__":
    sys.exit(main())
