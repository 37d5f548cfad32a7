"""Engine configuration: frozen dataclasses validated at construction.

Each field is a setting, written once: its name, type, default and docstring make the ``zpp
serve`` / ``zpp bench`` flag (the docstring's first paragraph is the ``--help`` line) and the
``LLM(...)`` keyword (``zpp.settings`` describes the scheme, ``zpp.args`` makes the flags).
Every bad setting raises :class:`ConfigError` (a ``ValueError``) whose message is one line naming
the setting, so that ``zpp serve`` can print it and exit before any worker starts or any weight
loads.
"""
from __future__ import annotations

import functools
import json
import os
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Optional, Union

from zpp import envs
from zpp.errors import ConfigError
from zpp.spec_config import SpeculativeConfig, parse_speculative_config  # noqa: F401
from zpp.settings import (parse_human_int, parse_layer_partition, parse_names, parse_nodes, parse_size,  # noqa: F401
                          setting, tcp_port)
from zpp.structured_outputs_config import StructuredOutputsConfig

if TYPE_CHECKING:  # torch is imported where it is needed, so that `zpp --help` and flag errors are quick
    import torch


_DTYPES = {
    "float32": "float32", "fp32": "float32", "float": "float32",
    "float16": "float16", "fp16": "float16", "half": "float16",
    "bfloat16": "bfloat16", "bf16": "bfloat16",
}


def parse_dtype(name: str, device: str) -> "torch.dtype":
    """Map a ``--dtype`` value to a torch dtype. ``auto`` is float32 on CPU, bfloat16 on CUDA.

    Raises:
        ConfigError: unknown dtype name.
    """
    import torch
    if name == "auto":
        return torch.float32 if device == "cpu" else torch.bfloat16
    try:
        return getattr(torch, _DTYPES[name])
    except KeyError:
        raise ConfigError(f"--dtype {name!r} is not one of: auto, {', '.join(sorted(_DTYPES))}") from None


def resolve_device(device: str) -> str:
    """``auto`` -> ``cuda`` when available, else ``cpu``; ``cpu`` and ``cuda`` pass through."""
    if device == "auto":
        return "cuda" if _cuda_available() else "cpu"
    return device


def _cuda_available() -> bool:
    import torch
    return torch.cuda.is_available()


torch_threads_at_import: Optional[int] = None
"""torch's thread count when ``zpp.llm`` was imported (set there): a different count later means
the user called ``torch.set_num_threads`` in this process."""


def cpu_threads_per_worker(num_local_workers: int) -> int:
    """Threads (``torch.set_num_threads``) each CPU worker on this host uses.

    ``OMP_NUM_THREADS`` when the user set it; else the count given to ``torch.set_num_threads`` in
    this process (after importing zpp); else the cores really available to this process (affinity,
    cgroup CPU quota: :func:`zpp.utils.cpu_threads.available_cores`) divided among the local workers
    (at least 1), so that several stages on one machine do not fight over the same cores.
    """
    import torch

    from zpp.utils.cpu_threads import threads_per_stage
    env = os.environ.get("OMP_NUM_THREADS", "").strip()
    if env.isdigit() and int(env) > 0:
        return int(env)
    if torch_threads_at_import is not None and torch.get_num_threads() != torch_threads_at_import:
        return torch.get_num_threads()
    return threads_per_stage(num_local_workers)


@dataclass(frozen=True)
class ModelConfig:
    """What model to serve and how to hold its weights."""

    model: str = setting(flagless=True)
    """Directory with ``config.json`` (and, unless ``load_format='dummy'``, safetensors). The flag is
    written in ``zpp.args`` (a positional MODEL and ``--model``; default: the demo model)."""
    dtype: str = "auto"
    """auto (float32 on CPU, bfloat16 on CUDA), float32, bfloat16, float16"""
    max_model_len: Optional[int] = setting(None, parse=parse_human_int, metavar="N")
    """longest sequence (prompt + output) in tokens, e.g. 4096, 32k (= 32000) or 32K (= 32768)
    (default: from the model's config.json)"""
    served_model_name: Optional[tuple[str, ...]] = setting(None, parse=parse_names, nargs="+", metavar="NAME")
    """model name(s) in the API: requests may name any of them, responses and metrics carry the
    first, /v1/models lists them all (default: the directory's name)

    A tuple once the config is made (``LLM``: a str or a sequence of str)."""
    tokenizer: Optional[str] = None
    """tokenizer directory (default: the model directory)"""
    load_format: str = setting("safetensors", choices=("safetensors", "dummy"))
    """dummy = random weights from config.json only"""
    seed: int = 0
    """seed for dummy weights and unseeded sampling"""
    quantization: Optional[str] = setting(None, aliases=("-q",), choices=("fp8",))
    """fp8: quantize bf16/fp16 linear and MoE expert weights to FP8 e4m3 at load (per output channel,
    activations per token); CUDA, compute capability >= 8.9. FP8 checkpoints load without it

    vLLM's ``--quantization fp8``. None: weights as stored (an FP8 checkpoint is loaded as FP8 where
    the GPU has FP8, else dequantized, with or without this flag)."""

    def __post_init__(self):
        if self.quantization not in (None, "fp8"):
            raise ConfigError(f"--quantization {self.quantization!r} is not supported (fp8 only; FP8 checkpoints "
                              "load without the flag)")
        if self.served_model_name is not None:  # also when made directly with a str
            object.__setattr__(self, "served_model_name", parse_names(self.served_model_name, "--served-model-name"))
        if self.load_format not in ("safetensors", "dummy"):
            raise ConfigError(f"--load-format {self.load_format!r} is not one of: safetensors, dummy")
        if not os.path.isdir(self.model):
            raise ConfigError(f"model {self.model!r}: no such directory; zpp does not download models: "
                              "give a local directory (config.json + safetensors + tokenizer)")
        path = os.path.join(self.model, "config.json")
        if not os.path.isfile(path):
            raise ConfigError(f"model {self.model!r}: no config.json in that directory")
        try:
            with open(path) as f:
                cfg = json.load(f)
        except ValueError as e:
            raise ConfigError(f"{path}: not valid JSON ({e})") from None
        if not isinstance(cfg, dict):
            raise ConfigError(f"{path}: expected a JSON object, got {type(cfg).__name__}")
        if self.max_model_len is not None and self.max_model_len < 1:
            raise ConfigError(f"--max-model-len must be >= 1, got {self.max_model_len}")
        object.__setattr__(self, "_config_json", cfg)  # read once (not a field: not sent to workers)

    @functools.cached_property
    def hf_config(self) -> dict[str, Any]:
        """``config.json``, normalized for its family (``zpp.models.registry.normalize_config``); read
        and normalized once per ModelConfig (the same dict every time: do not modify it)."""
        from zpp.models.registry import normalize_config
        cfg = self.__dict__.get("_config_json")
        if cfg is None:  # made without __post_init__ (decoded by a worker)
            with open(os.path.join(self.model, "config.json")) as f:
                cfg = json.load(f)
        return normalize_config(cfg)

    @property
    def name(self) -> str:
        """The name responses and metrics carry (the first of :attr:`served_names`)."""
        return self.served_names[0]

    @property
    def served_names(self) -> tuple[str, ...]:
        """Every name requests may use for this model (at least one)."""
        return self.served_model_name or (os.path.basename(os.path.normpath(self.model)),)


STAGE_RESTART_WINDOW_S = 600.0
"""The window ``--max-stage-restarts`` counts restarts in (seconds)."""


@dataclass(frozen=True)
class ParallelConfig:
    """How the model is split across processes."""

    pipeline_parallel_size: int = setting(1, aliases=("-pp",))
    """pipeline stages (one process each)"""
    tensor_parallel_size: int = setting(1, aliases=("-tp",))
    """tensor-parallel ranks (one process / GPU each) per pipeline stage; > 1 for the LLaMA family
    (Llama, Mistral, Qwen2) when it divides the attention and KV heads

    Megatron-LM tensor parallelism (``zpp.models.layers.linear``)."""
    pp_layer_partition: Union[tuple[int, ...], str, None] = setting(None, parse=parse_layer_partition)
    """layers per stage, e.g. 10,10,5,5 (default: as even as possible, earlier stages larger); auto:
    each stage measures a layer's and its embedding / LM head's cost at start-up and the split that
    makes the slowest stage fastest is used

    A tuple (``LLM``: any sequence of ints) or ``"auto"`` (``zpp.workers.stage_cost``)."""
    device: str = setting("auto", choices=("auto", "cpu", "cuda"))
    """auto = cuda when available, else cpu

    Resolved when the config is made: the field then holds ``cpu`` or ``cuda``."""
    nodes: tuple[str, ...] = setting((), parse=parse_nodes)
    """comma-separated extra hosts (user@host, user@host:N for N ranks there) that run stages;
    zpp-node is started there over SSH ($ZPP_SSH overrides the ssh command)

    Ranks fill the head first. ``LLM``: a sequence of hosts (or the comma-separated text)."""
    distributed_host: Optional[str] = None
    """multi-host: this host's address that the nodes reach (default: $ZPP_HOST_IP, else the address
    on the route to the first node); never a loopback address

    The control plane and the rendezvous bind to it only."""
    distributed_port: int = 0
    """multi-host: the control-plane TCP port (default 0: any free port)"""
    node_command: str = "zpp-node"
    """the command run on each node over SSH, e.g. /opt/venv/bin/zpp-node (default: zpp-node)"""
    node_launcher: str = setting("ssh", choices=("ssh", "manual"))
    """manual: do not ssh; log the zpp-node command for each node and wait for them (needs
    --node-keys-file)

    ``ssh``: the head starts ``zpp-node`` on each node; ``manual``: something else does."""
    worker_heartbeat_timeout: float = 10.0
    """seconds without a worker's heartbeat before the engine fails (a stopped or hung process)

    Heartbeats are sent every second by a thread of the worker's own."""
    stage_timeout: float = 60.0
    """seconds a micro-batch may go without any stage finishing it before the engine fails (warning
    at half); raise it for big models on the CPU

    On the CPU with the demo model a full 2048-token step takes seconds, more at long contexts
    (about 10 ms per prompt token at context 6000, README; ``--target-inter-token-latency`` cuts
    chunks only while streams decode); for big models on the CPU the longest micro-batch (a full
    prefill chunk on the slowest stage) must stay below it."""
    max_stage_restarts: int = 3
    """stage workers that die, go silent or stall are restarted in place (requests resume) at most
    this many times in 10 minutes; 0: fail-stop, every request ends with an error

    The window is ``STAGE_RESTART_WINDOW_S``. A restarted stage runs where it ran while the other
    stages keep their processes, and every running request is recomputed (clients see a pause, not
    an error). Once spent, or when a restart fails that many times, the engine fails as with 0 (every
    request ends with an error naming the stage)."""
    node_keys_file: Optional[str] = None
    """multi-host: a 0600 / 0400 file holding the run's control-plane keys: with --nnodes, the same
    file on every node (made by `zpp node-keys FILE`); with --node-launcher manual, read if it
    exists, else written with fresh keys"""
    nnodes: int = setting(1, group="per-node", from_launcher=True)
    """hosts in the run, each starting this same command with its own --node-rank; needs
    --node-keys-file

    vLLM's ``--nnodes``; started by Slurm, a Kubernetes LeaderWorkerSet or any launcher
    (``zpp.node.pernode``). 1: this host only (or ``nodes`` over SSH)."""
    node_rank: int = setting(0, group="per-node", from_launcher=True)
    """this host's index: 0 is the head (engine and API), the others run their stages headless"""
    master_addr: Optional[str] = setting(None, group="per-node", from_launcher=True)
    """node rank 0's address (name or IP) that every node reaches; its control plane listens there"""
    master_port: int = setting(29501, type=tcp_port, group="per-node", from_launcher=True)
    """node rank 0's control-plane TCP port

    The default is vLLM's."""
    node_join_timeout: float = setting(300.0, group="per-node")
    """seconds node rank 0 waits for every node to join (and a node for node rank 0) before start-up
    fails naming the missing node rank"""
    share_gpu: bool = setting(default_factory=lambda: envs.ZPP_SHARE_GPU, flagless=True)
    """Testing mode (``ZPP_SHARE_GPU=1`` where the configuration is made): every stage on GPU 0,
    activations over gloo through host memory, so pipeline stages can be tested on one GPU (NCCL
    refuses two ranks on one GPU). Decided once here and sent to every worker with the config."""

    def __post_init__(self):
        object.__setattr__(self, "device", resolve_device(self.device))
        if self.pipeline_parallel_size < 1:
            raise ConfigError(f"--pipeline-parallel-size must be >= 1, got {self.pipeline_parallel_size}")
        if self.tensor_parallel_size < 1:
            raise ConfigError(f"--tensor-parallel-size must be >= 1, got {self.tensor_parallel_size}")
        if self.nodes and self.world_size == 1:
            raise ConfigError("--nodes needs more than one worker (--pipeline-parallel-size or "
                              "--tensor-parallel-size > 1): a single stage runs on this host")
        if self.device not in ("cpu", "cuda"):
            raise ConfigError(f"--device {self.device!r} is not one of: cpu, cuda")
        if self.device == "cuda" and not _cuda_available():
            raise ConfigError("--device cuda: CUDA is not available on this machine")
        if self.node_launcher not in ("ssh", "manual"):
            raise ConfigError(f"--node-launcher {self.node_launcher!r} is not one of: ssh, manual")
        if self.node_launcher == "manual" and not self.node_keys_file:
            raise ConfigError("--node-launcher manual needs --node-keys-file (the agents read the run's keys there)")
        if self.nnodes < 1:
            raise ConfigError(f"--nnodes must be >= 1, got {self.nnodes}")
        if not 0 <= self.node_rank < self.nnodes:
            raise ConfigError(f"--node-rank {self.node_rank} is not in [0, --nnodes {self.nnodes})")
        if self.nnodes > 1:
            if self.nodes:
                raise ConfigError("--nodes (the head starts zpp-node over SSH) and --nnodes (one zpp serve per "
                                  "node) cannot be combined: give one")
            if self.node_launcher != "ssh":
                raise ConfigError(f"--node-launcher {self.node_launcher} is for --nodes; with --nnodes each node "
                                  f"runs zpp serve --node-rank itself")
            if self.nnodes > self.world_size:
                raise ConfigError(f"--nnodes {self.nnodes} but only {self.world_size} workers (--pipeline-parallel-size "
                                  f"x --tensor-parallel-size): every node needs at least one")
            if not self.master_addr:
                raise ConfigError(f"--nnodes {self.nnodes} needs --master-addr: node rank 0's address, which every "
                                  f"node reaches")
            if not self.node_keys_file:
                raise ConfigError(f"--nnodes {self.nnodes} needs --node-keys-file FILE: the control plane's CURVE "
                                  f"keys, the same file on every node (make one with `zpp node-keys FILE`); there "
                                  f"is no unencrypted mode")
        if not 1 <= self.master_port <= 65535:
            raise ConfigError(f"--master-port must be in [1, 65535], got {self.master_port}")
        if not self.node_join_timeout > 0:
            raise ConfigError(f"--node-join-timeout must be > 0, got {self.node_join_timeout}")
        if not self.worker_heartbeat_timeout > 0:
            raise ConfigError(f"--worker-heartbeat-timeout must be > 0, got {self.worker_heartbeat_timeout}")
        if not self.stage_timeout > 0:
            raise ConfigError(f"--stage-timeout must be > 0, got {self.stage_timeout}")
        if self.max_stage_restarts < 0:
            raise ConfigError(f"--max-stage-restarts must be >= 0, got {self.max_stage_restarts}")
        if not 0 <= self.distributed_port <= 65535:
            raise ConfigError(f"--distributed-port must be in [0, 65535], got {self.distributed_port}")
        if self.pp_layer_partition is not None and not isinstance(self.pp_layer_partition, tuple) \
                and self.pp_layer_partition != "auto":
            raise ConfigError(f"--pp-layer-partition {self.pp_layer_partition!r}: layers per stage "
                              "(e.g. 10,10,5,5) or auto")
        if isinstance(self.pp_layer_partition, tuple) and len(self.pp_layer_partition) != self.pipeline_parallel_size:
            raise ConfigError(f"--pp-layer-partition has {len(self.pp_layer_partition)} entries but "
                              f"--pipeline-parallel-size is {self.pipeline_parallel_size}")

    @property
    def world_size(self) -> int:
        return self.pipeline_parallel_size * self.tensor_parallel_size


KV_CACHE_DTYPES = ("auto", "fp8", "fp8_e4m3")


def fp8_device_error(device: str) -> Optional[str]:
    """Why FP8 cannot run on ``device`` (``cpu`` / ``cuda``: the first GPU), or None when it can
    (a CUDA GPU of compute capability >= 8.9: Ada, Hopper, Blackwell)."""
    if device != "cuda":
        return "this run is on the CPU"
    import torch
    cap = torch.cuda.get_device_capability(0)
    if cap < (8, 9):
        return f"this GPU ({torch.cuda.get_device_name(0)}) has compute capability {cap[0]}.{cap[1]}"
    return None


@dataclass(frozen=True)
class CacheConfig:
    """Paged KV cache sizing."""

    block_size: int = 16
    """tokens per KV block"""
    num_kv_blocks: Optional[int] = None
    """force the number of KV blocks (default: from the KV cache memory)

    Overrides the memory-based sizing (tests)."""
    kv_cache_memory: Optional[int] = setting(None, parse=parse_size)
    """KV cache bytes per worker (each stage, or each TP rank of it), e.g. 512MiB, 4GiB (default: 1GiB
    on CPU; on CUDA what --gpu-memory-utilization leaves)

    On CPU it must fit in the host's available memory; its pages are taken as blocks first fill."""
    gpu_memory_utilization: float = 0.9
    """CUDA: fraction of GPU memory for weights + activations + KV cache"""
    enable_prefix_caching: bool = False
    """reuse the KV blocks of shared prompt prefixes

    Full KV blocks only."""
    kv_cache_dtype: str = setting("auto", choices=KV_CACHE_DTYPES)
    """auto: the model's dtype; fp8 (= fp8_e4m3): K/V stored as FP8 e4m3 with per-layer scales (the
    checkpoint's k_scale / v_scale, else 1.0), twice the blocks; CUDA, compute capability >= 8.9

    vLLM's ``--kv-cache-dtype``; K and V are stored as float8_e4m3fn, half the bytes per block."""

    def __post_init__(self):
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ConfigError(f"--kv-cache-dtype {self.kv_cache_dtype!r} is not one of: {', '.join(KV_CACHE_DTYPES)}")
        if self.block_size < 1 or self.block_size & (self.block_size - 1):
            raise ConfigError(f"--block-size must be a power of two, got {self.block_size}")
        if self.num_kv_blocks is not None and self.num_kv_blocks < 1:
            raise ConfigError(f"--num-kv-blocks must be >= 1, got {self.num_kv_blocks}")
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ConfigError(f"--gpu-memory-utilization must be in (0, 1], got {self.gpu_memory_utilization}")


DEFAULT_MAX_NUM_BATCHED_TOKENS = 2048
"""Default token budget per micro-batch with chunked prefill, on CPU and CUDA, for ``zpp serve`` and
offline use alike (vLLM's online-serving value): large steps read the weights less often. While
streams decode, ``--target-inter-token-latency`` cuts the prompt chunks of a step, not this budget
(the CPU ``zpp serve`` default of 32 tokens it replaced starved bursts of short prompts)."""

CPU_TARGET_INTER_TOKEN_LATENCY = 0.7
"""CPU default of ``--target-inter-token-latency`` for ``zpp serve`` (seconds).

The engine aims a stream's mean gap at it; the largest gap of a long prefill is ~1.3 times the mean
on the shared 2-core development VM (demo SmolLM2-135M, PP=2, 8 streams and a 6000-token prompt,
``scripts/bench_long_prompt.py``'s scenario in process: stage steps aimed at 0.4 s gave a median
gap of 0.87 s and a largest of 1.13 s), so 0.7 keeps the largest under the 1 s the issue asks. At
PP=2 a stage-step then takes ~0.3 s; at PP=1 ~0.65 s. Smaller targets cut chunks at long contexts
to a few tokens, where a step's cost hardly shrinks further (one stage, context 6000: 0.40 s with
16 tokens, 0.46 s with 32)."""

CUDA_TARGET_INTER_TOKEN_LATENCY = 0.2
"""CUDA default of ``--target-inter-token-latency`` for ``zpp serve`` (seconds).

Chosen to leave today's GPU throughput alone: a full 2048-token chunk next to 256 decodes of a
Llama-3-8B on one H200 is a step of tens of milliseconds (a 2048-token prefill is ~33 TFLOP), so
the chunk stays capped by ``--max-num-batched-tokens`` as before; the target cuts chunks only
where a step would pass it: very long contexts (attention grows with the context), deep pipelines
(PP=4 has 5 micro-batches in flight: 40 ms per stage-step) or big models per stage."""


@dataclass(frozen=True)
class SchedulerConfig:
    """Continuous-batching scheduler limits."""

    max_num_seqs: int = 256
    """most requests running at once

    The most requests in one micro-batch."""
    max_num_batched_tokens: Optional[int] = setting(None, parse=parse_human_int, metavar="N")
    """token budget of one micro-batch, decodes first, e.g. 2048 or 8k (default: 2048 with chunked
    prefill; without: max(--max-model-len, 2048))

    The running requests' decodes take it first, prompt chunks the rest. ``DEFAULT_MAX_NUM_BATCHED_
    TOKENS`` on CPU and CUDA, serving or offline; while streams decode, ``target_inter_token_latency``
    may cut a step's prompt chunks below what the budget leaves."""
    target_inter_token_latency: Optional[float] = setting(None, metavar="SECONDS")
    """while streams decode, cut prompt chunks so the slowest stage's predicted step keeps a
    stream's gap between tokens near this (default for `zpp serve`: 0.7 on CPU, 0.2 on CUDA; offline:
    none; 0 = none)

    A stream gets a token every ``pipeline_depth`` micro-batches (every one with async scheduling),
    so the step target is this, less the gaps' measured excess over the predicted compute (engine
    round trip, transfers), divided by that. The step's cost comes from a per-stage model fitted
    online to the step times the stages report (``zpp.engine.step_cost``): a chunk is the largest
    that fits (at least ``MIN_PROMPT_CHUNK`` tokens for the oldest prompt; at most the token budget).
    With no stream decoding, prompts take the whole budget; with more requests waiting for a first
    token than streams decoding, the step grows in proportion (a burst). Defaults: ``CPU_TARGET_
    INTER_TOKEN_LATENCY``, ``CUDA_TARGET_INTER_TOKEN_LATENCY`` with ``streaming`` and chunked
    prefill, else none (vLLM has no such setting; its chunk size is the token budget alone)."""
    enable_chunked_prefill: bool = True
    """split long prompts over several steps so decodes keep going

    ``--no-enable-chunked-prefill``: compute each prompt in one step."""
    streaming: bool = setting(True, flagless=True)
    """Clients wait on each token (``zpp serve``). The offline ``LLM`` and ``zpp bench
    throughput|latency`` set False: nobody watches the gaps between tokens, so there is no default
    ``target_inter_token_latency`` (vLLM likewise sizes its offline ``LLM``'s steps for throughput)."""
    pipeline_depth: Optional[int] = setting(None, group="parallelism")
    """micro-batches in flight (default: the number of stages; stages + 1 on CUDA)

    See ``EngineConfig.pipeline_depth``."""
    prefill_attention_budget: Optional[int] = setting(None, metavar="PAIRS")
    """most query-key pairs the prompt chunks of one micro-batch attend while streams decode, so a
    chunk shrinks at long contexts (default: no limit; 0 = no limit)

    A fixed cap, on top of ``target_inter_token_latency`` (whose cost model counts the same pairs,
    measured): the CPU ``zpp serve`` default until issue 28 (65536). The oldest prompt always gets
    at least one token, so every prompt progresses."""
    async_scheduling: Optional[bool] = None
    """schedule a request's next decode before its sampled token is back; the worker feeds the token
    from the device (default: on for CUDA with PP=1 and TP=1)

    vLLM's ``--async-scheduling``. True forces it (also on the CPU), which needs PP=1 and TP=1;
    ``--no-async-scheduling`` (False): wait for each sampled token before scheduling the request
    again. Requests with penalties or structured outputs run synchronously either way."""

    def __post_init__(self):
        if self.max_num_seqs < 1:
            raise ConfigError(f"--max-num-seqs must be >= 1, got {self.max_num_seqs}")
        if self.max_num_batched_tokens is not None and self.max_num_batched_tokens < 1:
            raise ConfigError(f"--max-num-batched-tokens must be >= 1, got {self.max_num_batched_tokens}")
        if self.pipeline_depth is not None and self.pipeline_depth < 1:
            raise ConfigError(f"--pipeline-depth must be >= 1, got {self.pipeline_depth}")
        if self.target_inter_token_latency is not None and not self.target_inter_token_latency >= 0:
            raise ConfigError(f"--target-inter-token-latency must be >= 0 seconds, got {self.target_inter_token_latency}")
        if self.prefill_attention_budget is not None and self.prefill_attention_budget < 0:
            raise ConfigError(f"--prefill-attention-budget must be >= 0, got {self.prefill_attention_budget}")


@dataclass(frozen=True)
class EngineConfig:
    """Everything the engine needs; ``resolve()`` fills defaults that depend on the model."""

    model: ModelConfig
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    cache: CacheConfig = field(default_factory=CacheConfig)
    enforce_eager: bool = False
    """CUDA: never use CUDA graphs"""
    structured_outputs: StructuredOutputsConfig = field(default_factory=StructuredOutputsConfig)
    speculative_config: Optional[SpeculativeConfig] = setting(None, parse=parse_speculative_config, metavar="JSON")
    """speculative decoding, vLLM's JSON, e.g. '{"method": "ngram", "num_speculative_tokens": 3}' (default: off)"""

    @property
    def max_model_len(self) -> int:
        if self.model.max_model_len is not None:
            return self.model.max_model_len
        cfg = self.model.hf_config
        return int(cfg.get("max_position_embeddings") or cfg.get("n_positions") or 2048)

    @property
    def max_num_batched_tokens(self) -> int:
        s = self.scheduler
        if s.max_num_batched_tokens is not None:
            return s.max_num_batched_tokens
        if not s.enable_chunked_prefill:
            return max(self.max_model_len, 2048)
        return DEFAULT_MAX_NUM_BATCHED_TOKENS

    @property
    def prefill_attention_budget(self) -> Optional[int]:
        """Query-key pairs of prompt chunks per micro-batch, or None for no limit (see
        ``SchedulerConfig.prefill_attention_budget``)."""
        return self.scheduler.prefill_attention_budget or None

    @property
    def target_inter_token_latency(self) -> Optional[float]:
        """Seconds between a stream's tokens the prompt chunks are cut for, or None for no target
        (see ``SchedulerConfig.target_inter_token_latency``)."""
        s = self.scheduler
        if s.target_inter_token_latency is not None:
            return s.target_inter_token_latency or None
        if not (s.streaming and s.enable_chunked_prefill):
            return None
        return CUDA_TARGET_INTER_TOKEN_LATENCY if self.parallel.device == "cuda" else CPU_TARGET_INTER_TOKEN_LATENCY

    @property
    def pipeline_depth(self) -> int:
        """Micro-batches in flight. On CUDA, the number of stages + 1: the extra micro-batch covers
        the engine's round trip (apply a result, schedule, the worker's input building) so no GPU
        waits for it (on 2 H200s, PP=2: stage busy 0.69/0.77 at depth 2, 0.84/0.97 at depth 3). On
        CPU, the number of stages: the cores are the bottleneck and smaller micro-batches only cost;
        but 2 with async scheduling (forced on there), which needs a second micro-batch in flight."""
        if self.scheduler.pipeline_depth:
            return self.scheduler.pipeline_depth
        pp = self.parallel.pipeline_parallel_size
        return pp + 1 if self.parallel.device == "cuda" or self.async_scheduling else pp

    @property
    def async_scheduling(self) -> bool:
        """Whether async scheduling is on (see ``SchedulerConfig.async_scheduling``): the stage
        that samples must also embed the next step's tokens, so one stage and one TP rank."""
        a = self.scheduler.async_scheduling
        if a is None:
            a = envs.ZPP_ASYNC_SCHEDULING  # the default's override (testing both ways)
        single = self.parallel.pipeline_parallel_size == 1 and self.parallel.tensor_parallel_size == 1 \
            and self.speculative_config is None  # speculation: the next step needs the accepted tokens
        if a is None:
            return single and self.parallel.device == "cuda"
        return bool(a) and single

    @property
    def torch_dtype(self) -> "torch.dtype":
        return parse_dtype(self.model.dtype, self.parallel.device)

    @property
    def kv_cache_fp8(self) -> bool:
        """Whether the KV cache is stored in FP8 (``--kv-cache-dtype fp8``)."""
        return self.cache.kv_cache_dtype != "auto"

    def check_max_model_len(self) -> None:
        """Raises ConfigError (one line) when ``--max-model-len`` exceeds the model's positions."""
        cfg = self.model.hf_config
        limit = cfg.get("max_position_embeddings") or cfg.get("n_positions")
        if self.model.max_model_len is not None and limit and self.model.max_model_len > limit:
            raise ConfigError(f"--max-model-len {self.model.max_model_len} exceeds the model's max_position_embeddings {limit}")

    def validate(self) -> None:
        """Cross-field checks. Raises ConfigError."""
        dtype = parse_dtype(self.model.dtype, self.parallel.device)
        for flag, on in (("--quantization fp8", self.model.quantization == "fp8"),
                         (f"--kv-cache-dtype {self.cache.kv_cache_dtype}", self.kv_cache_fp8)):
            if not on:
                continue
            why = fp8_device_error(self.parallel.device)
            if why:
                raise ConfigError(f"{flag} needs a CUDA GPU of compute capability >= 8.9 (FP8), but {why}")
            if str(dtype) not in ("torch.bfloat16", "torch.float16"):
                raise ConfigError(f"{flag} needs --dtype bfloat16 or float16, got {self.model.dtype}")
        if self.scheduler.async_scheduling and (self.parallel.pipeline_parallel_size > 1
                                                or self.parallel.tensor_parallel_size > 1 or self.speculative_config):
            raise ConfigError("--async-scheduling needs --pipeline-parallel-size 1, --tensor-parallel-size 1 and no "
                              "--speculative-config (the sampled tokens live on the last stage's first rank)")
        cfg = self.model.hf_config
        self.check_max_model_len()
        if not self.scheduler.enable_chunked_prefill and self.max_num_batched_tokens < self.max_model_len:
            raise ConfigError(f"--max-num-batched-tokens {self.max_num_batched_tokens} is smaller than --max-model-len "
                              f"{self.max_model_len} with chunked prefill off: long prompts could never be scheduled")
        from zpp.spec_config import check_mtp_model
        check_mtp_model(self.speculative_config, cfg, self.model.model, self.model.load_format,
                        self.parallel.tensor_parallel_size)
