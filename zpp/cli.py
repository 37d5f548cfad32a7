"""Command line: ``zpp serve``, ``zpp node-keys``, ``zpp prepare-demo-model``, ``zpp bench {throughput,latency,serve}``."""
from __future__ import annotations

import argparse
import asyncio
import logging
import os
import sys
import traceback

from zpp.config import (CacheConfig, ConfigError, EngineConfig, ModelConfig, ParallelConfig, SchedulerConfig,
                        StructuredOutputsConfig,
                        parse_size, resolve_device)
from zpp.models.partition import parse_partition


logger = logging.getLogger("zpp.cli")

# vLLM flags accepted so that vLLM command lines work; they change nothing in zpp.
_NO_EFFECT_FLAGS = {
    "trust_remote_code": "--trust-remote-code: zpp runs no code from model directories (its own model "
                         "classes only); ignored",
}


class _HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Shows each flag's default, unless its help already says it or there is none to show."""

    def _get_help_string(self, action):
        text = action.help or ""
        if ("default" in text or action.default is None or action.default is False or action.default == ""
                or action.default == argparse.SUPPRESS or isinstance(action, argparse._StoreFalseAction)):
            return text
        return super()._get_help_string(action)


class _Parser(argparse.ArgumentParser):
    """Help with defaults; a bad flag is one line ``zpp: error: ...`` (no usage dump)."""

    def __init__(self, *args, **kwargs):
        kwargs.setdefault("formatter_class", _HelpFormatter)
        super().__init__(*args, **kwargs)

    def error(self, message):
        self.exit(2, f"zpp: error: {message} (see: {self.prog} --help)\n")


def _port(value: str) -> int:
    try:
        port = int(value)
    except ValueError:
        port = -1
    if not 0 <= port <= 65535:
        raise argparse.ArgumentTypeError(f"{value} is not a TCP port (0-65535)")
    return port


def add_engine_args(p: argparse.ArgumentParser, model_optional: bool = True) -> None:
    """Flags shared by ``serve`` and the offline benchmarks (vLLM's names where one exists)."""
    if model_optional:
        p.add_argument("model", nargs="?", default=None,
                       help="model directory (config.json + safetensors + tokenizer); default: the packaged "
                            "SmolLM2-135M-Instruct demo model")
        p.add_argument("--model", dest="model_flag", default=None, metavar="MODEL",
                       help="the same as the positional MODEL (vLLM's spelling)")
    else:
        p.add_argument("--model", default=None, help="model directory; default: the packaged demo model")
    g = p.add_argument_group("parallelism")
    g.add_argument("--pipeline-parallel-size", "-pp", type=int, default=1, help="pipeline stages (one process each)")
    g.add_argument("--tensor-parallel-size", "-tp", type=int, default=1,
                   help="tensor-parallel ranks (one process / GPU each) per pipeline stage; > 1 for the LLaMA "
                        "family (Llama, Mistral, Qwen2) when it divides the attention and KV heads")
    g.add_argument("--pp-layer-partition", default=None,
                   help="layers per stage, e.g. 10,10,5,5 (default: as even as possible, earlier stages larger); "
                        "auto: each stage measures a layer's and its embedding / LM head's cost at start-up "
                        "and the split that makes the slowest stage fastest is used")
    g.add_argument("--pipeline-depth", type=int, default=None,
                   help="micro-batches in flight (default: the number of stages; stages + 1 on CUDA)")
    g.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto",
                   help="auto = cuda when available, else cpu")
    g.add_argument("--nodes", default="",
                   help="comma-separated extra hosts (user@host, user@host:N for N ranks there) that run "
                        "stages; zpp-node is started there over SSH ($ZPP_SSH overrides the ssh command)")
    g.add_argument("--distributed-host", default=None,
                   help="multi-host: this host's address that the nodes reach (default: $ZPP_HOST_IP, else the "
                        "address on the route to the first node); never a loopback address")
    g.add_argument("--distributed-port", type=int, default=0,
                   help="multi-host: the control-plane TCP port (default 0: any free port)")
    g.add_argument("--node-command", default="zpp-node",
                   help="the command run on each node over SSH, e.g. /opt/venv/bin/zpp-node (default: zpp-node)")
    g.add_argument("--node-launcher", choices=["ssh", "manual"], default="ssh",
                   help="manual: do not ssh; log the zpp-node command for each node and wait for them "
                        "(needs --node-keys-file)")
    g.add_argument("--worker-heartbeat-timeout", type=float, default=10.0,
                   help="seconds without a worker's heartbeat before the engine fails (a stopped or hung process)")
    g.add_argument("--stage-timeout", type=float, default=60.0,
                   help="seconds a micro-batch may go without any stage finishing it before the engine fails "
                        "(warning at half); raise it for big models on the CPU")
    g.add_argument("--max-stage-restarts", type=int, default=3,
                   help="stage workers that die, go silent or stall are restarted in place (requests resume) at "
                        "most this many times in 10 minutes; 0: fail-stop, every request ends with an error")
    g.add_argument("--node-keys-file", default=None,
                   help="multi-host: a 0600 / 0400 file holding the run's control-plane keys: with --nnodes, the "
                        "same file on every node (made by `zpp node-keys FILE`); with --node-launcher manual, read "
                        "if it exists, else written with fresh keys")
    g = p.add_argument_group("model")
    g.add_argument("--dtype", default="auto", help="auto (float32 on CPU, bfloat16 on CUDA), float32, bfloat16, float16")
    g.add_argument("--max-model-len", type=int, default=None,
                   help="longest sequence (prompt + output) in tokens (default: from the model's config.json)")
    g.add_argument("--served-model-name", default=None, help="model name in the API (default: directory name)")
    g.add_argument("--tokenizer", default=None, help="tokenizer directory (default: the model directory)")
    g.add_argument("--load-format", choices=["safetensors", "dummy"], default="safetensors",
                   help="dummy = random weights from config.json only")
    g.add_argument("--seed", type=int, default=0, help="seed for dummy weights and unseeded sampling")
    g.add_argument("--quantization", "-q", choices=["fp8"], default=None,
                   help="fp8: quantize bf16/fp16 linear weights to FP8 e4m3 at load (per output channel, "
                        "activations per token); CUDA, compute capability >= 8.9. FP8 checkpoints load without it")
    g = p.add_argument_group("scheduler and KV cache")
    g.add_argument("--max-num-seqs", type=int, default=256, help="most requests running at once")
    g.add_argument("--max-num-batched-tokens", type=int, default=None,
                   help="token budget of one micro-batch, decodes first (default with chunked prefill: "
                        "2048 on CUDA; on CPU 32 for `zpp serve`, 2048 for `zpp bench throughput|latency`; "
                        "without: max(--max-model-len, 2048))")
    g.add_argument("--prefill-attention-budget", type=int, default=None, metavar="PAIRS",
                   help="most query-key pairs the prompt chunks of one micro-batch attend, so a chunk "
                        "shrinks at long contexts (default: 65536 for `zpp serve` on CPU, else no limit; "
                        "0 = no limit)")
    g.add_argument("--enable-chunked-prefill", dest="enable_chunked_prefill", action="store_true", default=True,
                   help="split long prompts over several steps so decodes keep going")
    g.add_argument("--no-enable-chunked-prefill", dest="enable_chunked_prefill", action="store_false",
                   help="compute each prompt in one step")
    g.add_argument("--enable-prefix-caching", action="store_true", default=False,
                   help="reuse the KV blocks of shared prompt prefixes")
    g.add_argument("--async-scheduling", dest="async_scheduling", action="store_true", default=None,
                   help="schedule a request's next decode before its sampled token is back; the worker feeds "
                        "the token from the device (default: on for CUDA with PP=1 and TP=1)")
    g.add_argument("--no-async-scheduling", dest="async_scheduling", action="store_false",
                   help="wait for each sampled token before scheduling the request again")
    g.add_argument("--block-size", type=int, default=16, help="tokens per KV block")
    g.add_argument("--kv-cache-dtype", choices=["auto", "fp8", "fp8_e4m3"], default="auto",
                   help="auto: the model's dtype; fp8 (= fp8_e4m3): K/V stored as FP8 e4m3 with per-layer scales "
                        "(the checkpoint's k_scale / v_scale, else 1.0), twice the blocks; CUDA, compute "
                        "capability >= 8.9")
    g.add_argument("--num-kv-blocks", type=int, default=None,
                   help="force the number of KV blocks (default: from the KV cache memory)")
    g.add_argument("--kv-cache-memory", default=None,
                   help="KV cache bytes per worker (each stage, or each TP rank of it), e.g. 512MiB, 4GiB "
                        "(default: 1GiB on CPU; on CUDA what --gpu-memory-utilization leaves)")
    g.add_argument("--gpu-memory-utilization", type=float, default=0.9,
                   help="CUDA: fraction of GPU memory for weights + activations + KV cache")
    g.add_argument("--enforce-eager", action="store_true", help="CUDA: never use CUDA graphs")
    g = p.add_argument_group("structured outputs")
    g.add_argument("--structured-outputs-compile-timeout", type=float, default=10.0,
                   help="seconds a request's grammar (JSON schema, regex, choice, EBNF) may take to compile "
                        "before the request is refused with HTTP 400 (default 10)")
    g.add_argument("--max-structured-outputs-spec-bytes", default="256KiB",
                   help="largest JSON schema / regex / grammar / choice list accepted (default 256KiB; "
                        "larger: HTTP 400)")
    g.add_argument("--max-structured-outputs-grammar-bytes", default="16MiB",
                   help="largest compiled grammar accepted (xgrammar's memory size; default 16MiB; larger: HTTP 400 "
                        "before it is serialized: a small schema can compile to a huge grammar)")
    p.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"],
                   help="debug also prints the traceback of a start-up error")


def engine_config_from_args(args, streaming: bool = True) -> EngineConfig:
    """Build and validate the EngineConfig. Raises ConfigError with a one-line message."""
    model, flag = args.model, getattr(args, "model_flag", None)
    if model and flag and model != flag:
        raise ConfigError(f"two models given: {model!r} and --model {flag!r}")
    model = model or flag
    if model is None:
        from zpp.demo import prepare_demo_model
        model = prepare_demo_model()
    for dest, warning in _NO_EFFECT_FLAGS.items():
        if getattr(args, dest, False):
            logger.warning("%s", warning)
    model_config = ModelConfig(model=model, dtype=args.dtype, max_model_len=args.max_model_len,
                               served_model_name=args.served_model_name, tokenizer=args.tokenizer,
                               load_format=args.load_format, seed=args.seed, quantization=args.quantization)
    device = resolve_device(args.device)
    nodes = tuple(n for n in (args.nodes or "").split(",") if n)
    return EngineConfig(
        model=model_config,
        parallel=ParallelConfig(pipeline_parallel_size=args.pipeline_parallel_size,
                                tensor_parallel_size=args.tensor_parallel_size,
                                pp_layer_partition=parse_partition(args.pp_layer_partition),
                                device=device, nodes=nodes, distributed_host=args.distributed_host,
                                distributed_port=args.distributed_port, node_command=args.node_command,
                                node_launcher=args.node_launcher, node_keys_file=args.node_keys_file,
                                worker_heartbeat_timeout=args.worker_heartbeat_timeout,
                                stage_timeout=args.stage_timeout, max_stage_restarts=args.max_stage_restarts,
                                nnodes=getattr(args, "nnodes", None) or 1, node_rank=getattr(args, "node_rank", None) or 0,
                                master_addr=getattr(args, "master_addr", None),
                                master_port=DEFAULT_MASTER_PORT if getattr(args, "master_port", None) is None
                                else args.master_port,
                                node_join_timeout=getattr(args, "node_join_timeout", 300.0)),
        cache=CacheConfig(block_size=args.block_size, num_kv_blocks=args.num_kv_blocks,
                          kv_cache_memory=parse_size(args.kv_cache_memory),
                          gpu_memory_utilization=args.gpu_memory_utilization,
                          enable_prefix_caching=args.enable_prefix_caching, kv_cache_dtype=args.kv_cache_dtype),
        scheduler=SchedulerConfig(max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
                                  enable_chunked_prefill=args.enable_chunked_prefill,
                                  pipeline_depth=args.pipeline_depth, streaming=streaming,
                                  prefill_attention_budget=args.prefill_attention_budget,
                                  async_scheduling=args.async_scheduling),
        enforce_eager=args.enforce_eager,
        structured_outputs=StructuredOutputsConfig(
            compile_timeout=args.structured_outputs_compile_timeout,
            max_spec_bytes=parse_size(args.max_structured_outputs_spec_bytes, "--max-structured-outputs-spec-bytes"),
            max_grammar_bytes=parse_size(args.max_structured_outputs_grammar_bytes,
                                         "--max-structured-outputs-grammar-bytes")))


def _setup_logging(level: str) -> None:
    logging.basicConfig(level=getattr(logging, level.upper()), format="%(asctime)s %(levelname)s %(name)s: %(message)s")


DEFAULT_MASTER_PORT = 29501
"""vLLM's default ``--master-port``."""


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
    config = engine_config_from_args(args)  # before the heavy imports: a bad flag fails at once
    if config.parallel.nnodes > 1 and config.parallel.node_rank > 0:  # headless: this node's stages only
        from zpp.frontend.async_engine import validate_startup
        from zpp.node.pernode import run_node
        validate_startup(config)
        return run_node(config, args.log_level)
    if args.api_server_count < 1:
        raise ConfigError(f"--api-server-count must be >= 1, got {args.api_server_count}")
    if args.api_server_count > 1:  # before prometheus-client is imported: every front end's counters summed
        import atexit
        import shutil
        import tempfile
        os.environ["PROMETHEUS_MULTIPROC_DIR"] = d = tempfile.mkdtemp(prefix="zpp-metrics-")
        atexit.register(shutil.rmtree, d, True)
    from zpp.frontend.async_engine import validate_startup
    from zpp.server.launch import serve
    validate_startup(config)
    options = _server_options(args)
    _check_port_free(args.host, args.port)
    return asyncio.run(serve(config, args.host, args.port, args.api_key, args.chat_template,
                             log_stats_interval=None if args.disable_log_stats else args.log_stats_interval,
                             api_server_count=args.api_server_count, **options))


def _server_options(args) -> dict:
    """The HTTP server's request limits from the flags. Raises ConfigError."""
    body = parse_size(args.max_request_body_bytes, "--max-request-body-bytes")
    if body is None or body < 1024:
        raise ConfigError(f"--max-request-body-bytes {args.max_request_body_bytes!r}: must be at least 1KiB")
    if args.max_stop_sequences < 0:
        raise ConfigError(f"--max-stop-sequences {args.max_stop_sequences}: must be >= 0")
    if not args.log_stats_interval > 0:
        raise ConfigError(f"--log-stats-interval {args.log_stats_interval}: must be > 0 seconds")
    return {"max_request_body_bytes": body, "max_stop_sequences": args.max_stop_sequences,
            "trust_request_chat_template": args.trust_request_chat_template,
            "log_requests": not args.disable_log_requests}


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


def cmd_prepare(args) -> int:
    from zpp.demo import prepare_demo_model
    path = prepare_demo_model(args.output)
    print(path)
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="zpp", description="zpp: a pipeline-parallel LLM serving engine")
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("serve", help="serve a model over an OpenAI-compatible HTTP API")
    add_engine_args(p)
    p.add_argument("--host", default="0.0.0.0", help="address to listen on")
    p.add_argument("--port", type=_port, default=8000, help="TCP port to listen on")
    g = p.add_argument_group("logging")
    g.add_argument("--disable-log-requests", action="store_true",
                   help="no INFO line per finished request (id, prompt and output tokens, finish reason, time)")
    g.add_argument("--api-server-count", type=int, default=1,
                   help="HTTP front-end processes (tokenization, detokenization, streaming) sharing the port "
                        "(SO_REUSEPORT) and one engine core; more serve more concurrent streams")
    g.add_argument("--disable-log-stats", action="store_true",
                   help="no INFO stats line every 10 s while busy (throughput, queue, KV cache, stage busy)")
    # Seconds between stats lines; hidden (tests shorten it).
    g.add_argument("--log-stats-interval", type=float, default=10.0, help=argparse.SUPPRESS)
    g = p.add_argument_group("accepted for vLLM compatibility (no effect in zpp; a warning says so)")
    g.add_argument("--trust-remote-code", action="store_true", help="zpp runs only its own model code")
    p.add_argument("--api-key", default=None, help="require 'Authorization: Bearer KEY' on /v1/*")
    p.add_argument("--chat-template", default=None, help="Jinja chat template file (overrides the tokenizer's)")
    g = p.add_argument_group("request limits")
    g.add_argument("--max-request-body-bytes", default="8MiB", metavar="SIZE",
                   help="largest request body, after any Content-Encoding is undone (e.g. 8MiB, the default); "
                        "larger ones get HTTP 413")
    g.add_argument("--max-stop-sequences", type=int, default=64, metavar="N",
                   help="most entries `stop` and `stop_token_ids` may each hold (default 64); more get HTTP 400")
    g.add_argument("--trust-request-chat-template", action="store_true",
                   help="accept a `chat_template` in requests (by default they get HTTP 400: a template is a "
                        "program the server would run)")
    g = p.add_argument_group(
        "per-node launch (one zpp serve per host, started by Slurm, a Kubernetes LeaderWorkerSet or any launcher; "
        "vLLM's flags; read from $SLURM_*, $LWS_*, $NNODES/$NODE_RANK/$MASTER_ADDR/$MASTER_PORT when absent)")
    g.add_argument("--nnodes", type=int, default=None,
                   help="hosts in the run, each starting this same command with its own --node-rank (default 1); "
                        "needs --node-keys-file")
    g.add_argument("--node-rank", type=int, default=None,
                   help="this host's index: 0 is the head (engine and API), the others run their stages headless "
                        "(default 0)")
    g.add_argument("--master-addr", default=None,
                   help="node rank 0's address (name or IP) that every node reaches; its control plane listens there")
    g.add_argument("--master-port", type=_port, default=None,
                   help=f"node rank 0's control-plane TCP port (default {DEFAULT_MASTER_PORT})")
    g.add_argument("--node-join-timeout", type=float, default=300.0,
                   help="seconds node rank 0 waits for every node to join (and a node for node rank 0) before "
                        "start-up fails naming the missing node rank")
    g.add_argument("--headless", action="store_true",
                   help="accepted for vLLM command lines: node ranks > 0 are always headless (no HTTP server)")
    p.set_defaults(func=cmd_serve)

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


def main(argv=None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
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
