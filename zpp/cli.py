"""Command line: ``zpp serve``, ``zpp prepare-demo-model``, ``zpp bench {throughput,latency,serve}``."""
from __future__ import annotations

import argparse
import asyncio
import logging
import sys

from zpp.config import (CacheConfig, ConfigError, EngineConfig, ModelConfig, ParallelConfig, SchedulerConfig,
                        parse_size)
from zpp.engine.executor import WorkerDiedError
from zpp.models.partition import parse_partition


def add_engine_args(p: argparse.ArgumentParser, model_optional: bool = True) -> None:
    """Flags shared by ``serve`` and the offline benchmarks (vLLM's names where one exists)."""
    if model_optional:
        p.add_argument("model", nargs="?", default=None,
                       help="model directory (config.json + safetensors + tokenizer); default: the packaged "
                            "SmolLM2-135M-Instruct demo model")
    else:
        p.add_argument("--model", default=None, help="model directory; default: the packaged demo model")
    g = p.add_argument_group("parallelism")
    g.add_argument("--pipeline-parallel-size", "-pp", type=int, default=1, help="pipeline stages (one process each)")
    g.add_argument("--tensor-parallel-size", "-tp", type=int, default=1,
                   help="tensor-parallel ranks (one process / GPU each) per pipeline stage; > 1 for the LLaMA "
                        "family (Llama, Mistral, Qwen2) when it divides the attention and KV heads")
    g.add_argument("--pp-layer-partition", default=None,
                   help="layers per stage, e.g. 10,10,5,5 (default: as even as possible, earlier stages larger)")
    g.add_argument("--pipeline-depth", type=int, default=None,
                   help="micro-batches in flight (default: the pipeline-parallel size)")
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
    g.add_argument("--node-keys-file", default=None,
                   help="multi-host: a 0600 file holding the run's control-plane keys for agents started by "
                        "hand (read if it exists, else written with fresh keys)")
    g = p.add_argument_group("model")
    g.add_argument("--dtype", default="auto", help="auto (float32 on CPU, bfloat16 on CUDA), float32, bfloat16, float16")
    g.add_argument("--max-model-len", type=int, default=None, help="longest sequence (prompt + output) in tokens")
    g.add_argument("--served-model-name", default=None, help="model name in the API (default: directory name)")
    g.add_argument("--tokenizer", default=None, help="tokenizer directory (default: the model directory)")
    g.add_argument("--load-format", choices=["safetensors", "dummy"], default="safetensors",
                   help="dummy = random weights from config.json only")
    g.add_argument("--seed", type=int, default=0)
    g = p.add_argument_group("scheduler and KV cache")
    g.add_argument("--max-num-seqs", type=int, default=256, help="most requests running at once")
    g.add_argument("--max-num-batched-tokens", type=int, default=None, help="token budget of one micro-batch")
    g.add_argument("--enable-chunked-prefill", dest="enable_chunked_prefill", action="store_true", default=True)
    g.add_argument("--no-enable-chunked-prefill", dest="enable_chunked_prefill", action="store_false")
    g.add_argument("--enable-prefix-caching", action="store_true", default=False)
    g.add_argument("--block-size", type=int, default=16, help="tokens per KV block")
    g.add_argument("--num-kv-blocks", type=int, default=None, help="force the number of KV blocks")
    g.add_argument("--kv-cache-memory", default=None, help="KV cache bytes per stage, e.g. 512MiB, 4GiB")
    g.add_argument("--gpu-memory-utilization", type=float, default=0.9,
                   help="CUDA: fraction of GPU memory for weights + activations + KV cache")
    g.add_argument("--enforce-eager", action="store_true", help="CUDA: never use CUDA graphs")
    p.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])


def engine_config_from_args(args) -> EngineConfig:
    """Build and validate the EngineConfig. Raises ConfigError with a one-line message."""
    import torch
    model = args.model
    if model is None:
        from zpp.demo import prepare_demo_model
        model = prepare_demo_model()
    device = args.device
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    nodes = tuple(n for n in (args.nodes or "").split(",") if n)
    return EngineConfig(
        model=ModelConfig(model=model, dtype=args.dtype, max_model_len=args.max_model_len,
                          served_model_name=args.served_model_name, tokenizer=args.tokenizer,
                          load_format=args.load_format, seed=args.seed),
        parallel=ParallelConfig(pipeline_parallel_size=args.pipeline_parallel_size,
                                tensor_parallel_size=args.tensor_parallel_size,
                                pp_layer_partition=parse_partition(args.pp_layer_partition),
                                device=device, nodes=nodes, distributed_host=args.distributed_host,
                                distributed_port=args.distributed_port, node_command=args.node_command,
                                node_launcher=args.node_launcher, node_keys_file=args.node_keys_file),
        cache=CacheConfig(block_size=args.block_size, num_kv_blocks=args.num_kv_blocks,
                          kv_cache_memory=parse_size(args.kv_cache_memory),
                          gpu_memory_utilization=args.gpu_memory_utilization,
                          enable_prefix_caching=args.enable_prefix_caching),
        scheduler=SchedulerConfig(max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
                                  enable_chunked_prefill=args.enable_chunked_prefill,
                                  pipeline_depth=args.pipeline_depth),
        enforce_eager=args.enforce_eager)


def _setup_logging(level: str) -> None:
    logging.basicConfig(level=getattr(logging, level.upper()), format="%(asctime)s %(levelname)s %(name)s: %(message)s")


def cmd_serve(args) -> int:
    from zpp.engine.async_engine import validate_startup
    from zpp.server.openai_server import serve
    config = engine_config_from_args(args)
    validate_startup(config)
    _check_port_free(args.host, args.port)
    return asyncio.run(serve(config, args.host, args.port, args.api_key, args.chat_template))


def _check_port_free(host: str, port: int) -> None:
    """Fail before any weight loads if the HTTP port cannot be bound. Raises ConfigError."""
    import socket
    try:
        with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            s.bind((host, port))
    except OSError as e:
        raise ConfigError(f"--host {host} --port {port}: cannot listen there ({e.strerror})") from None


def cmd_prepare(args) -> int:
    from zpp.demo import prepare_demo_model
    path = prepare_demo_model(args.output)
    print(path)
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="zpp", description="zpp: a pipeline-parallel LLM serving engine")
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("serve", help="serve a model over an OpenAI-compatible HTTP API")
    add_engine_args(p)
    p.add_argument("--host", default="0.0.0.0")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--api-key", default=None, help="require 'Authorization: Bearer KEY' on /v1/*")
    p.add_argument("--chat-template", default=None, help="Jinja chat template file (overrides the tokenizer's)")
    p.set_defaults(func=cmd_serve)

    p = sub.add_parser("prepare-demo-model",
                       help="convert the packaged SmolLM2 GGUF into an HF directory (once) and print its path")
    p.add_argument("--output", default=None, help="target directory (default: $ZPP_CACHE/SmolLM2-135M-Instruct)")
    p.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
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
    except ConfigError as e:
        print(f"zpp: error: {e}", file=sys.stderr)
        return 2
    except WorkerDiedError as e:  # a worker or node could not start
        if args.log_level == "debug":
            raise
        print(f"zpp: error: {str(e).splitlines()[0]}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
