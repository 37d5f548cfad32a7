"""``zpp plan``: what fits on which GPUs, per pipeline stage, from ``config.json`` alone, and the fit
check ``zpp serve`` / ``LLM(...)`` run before any worker loads a weight.

One source for the numbers. Each stage's model is built on the ``meta`` device by the loader
itself (:func:`zpp.models.loader.load_stage_model`: the same family class, layer range with
missing-layer placeholders, tensor-parallel slice and FP8 decisions -- taken from the safetensors
headers when present, else as ``--load-format dummy`` takes them -- for the target GPU's compute
capability); its parameters and buffers are summed by dtype. KV bytes per token are
:meth:`zpp.models.base.StageModel.kv_cache_bytes_per_block` (what the model runner sizes its
cache with) over the block size. Nothing is allocated and no tensor is read.

What is estimated: a stage's activation peak (the worker profiles it once its weights are loaded;
here: the largest micro-batch's per-layer intermediates and, on the last stage, its logits), the
CUDA-graph pool (:func:`zpp.workers.cuda_graphs.graph_pool_margin`, the worker's own margin) and
the CUDA context (:data:`zpp.workers.kv_budget.CUDA_CONTEXT_MARGIN`).

A stage *fits* when its weights and margins leave room in its memory (``--gpu-memory`` x
``--gpu-memory-utilization`` on a GPU) for the KV cache of at least one ``--max-model-len``
sequence. On the CPU the stages of one host share its available RAM, and the KV cache
(``--kv-cache-memory``, 1 GiB a stage by default) takes its pages as blocks fill, so a CPU stage
fits when the weights and activations of all stages fit in that RAM.

The splits that weigh memory are :mod:`zpp.plan.split`; reading sizes and printing,
:mod:`zpp.plan.report`.
"""
from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Optional, Sequence

from zpp.errors import ConfigError
from zpp.plan.report import describe_min, fmt_bytes, format_plan, parse_capability, parse_memory_list  # noqa: F401
from zpp.plan.split import AUTO_TIME_SLACK, memory_aware_partition, minmax_partition  # noqa: F401

if TYPE_CHECKING:
    from zpp.config import EngineConfig

DEFAULT_CAPABILITY = (9, 0)


@dataclass
class Target:
    """The devices a plan is made for.

    device: ``cuda`` or ``cpu``. memory: bytes of each stage's device (one entry: every stage), or
    the host's available RAM (``shared``: every stage on it). capability: the GPUs' compute
    capability (decides what stays FP8); None on the CPU."""

    device: str
    memory: tuple[int, ...]
    capability: Optional[tuple[int, int]] = DEFAULT_CAPABILITY
    shared: bool = False
    source: str = ""

    def stage_memory(self, pp: int) -> list[int]:
        if len(self.memory) == 1:
            return [self.memory[0]] * pp
        if len(self.memory) != pp:
            raise ConfigError(f"--gpu-memory gives {len(self.memory)} sizes for --pipeline-parallel-size {pp} "
                              "(give one size, or one per stage)")
        return list(self.memory)


@dataclass
class StagePlan:
    stage: int
    layers: tuple[int, int]
    weight_bytes: int
    weight_bytes_by_dtype: dict[str, int]
    kv_bytes_per_token: int
    kv_tokens: int
    fits: bool
    memory_bytes: int = 0
    """What the stage may use: its device's memory x ``--gpu-memory-utilization`` (GPU); the host's
    available RAM less the other stages' needs (CPU)."""
    activation_bytes: int = 0
    graph_bytes: int = 0
    """CUDA graphs' pool and the CUDA context (0 on the CPU)."""

    @property
    def need_bytes(self) -> int:
        return self.weight_bytes + self.activation_bytes + self.graph_bytes

    def to_json(self) -> dict[str, Any]:
        return {"stage": self.stage, "layers": list(self.layers), "weight_bytes": self.weight_bytes,
                "weight_bytes_by_dtype": dict(self.weight_bytes_by_dtype),
                "kv_bytes_per_token": self.kv_bytes_per_token, "kv_tokens": self.kv_tokens, "fits": self.fits}


@dataclass
class Plan:
    fits: bool
    min_pipeline_parallel_size: Optional[int]
    """The smallest ``-pp`` that fits at this ``-tp`` (each stage on a device of the smallest size
    given), or None when none does (or, on one host's RAM, when even one stage does not)."""
    stages: list[StagePlan]
    target: Target
    tensor_parallel_size: int = 1
    min_tp_pp: Optional[tuple[int, int]] = None
    """The smallest ``(tp, pp)`` (fewest GPUs, then least TP) that fits; None when none does or the
    family has no tensor parallelism."""
    max_model_len: int = 0
    dtype: str = ""

    def to_json(self) -> dict[str, Any]:
        """Exactly the keys of ``zpp plan --json``."""
        return {"fits": self.fits, "min_pipeline_parallel_size": self.min_pipeline_parallel_size,
                "stages": [s.to_json() for s in self.stages]}


# --- what the devices are --------------------------------------------------------------------------
def detect_target(gpu_memory: Optional[Sequence[int]] = None, capability: Optional[tuple[int, int]] = None) -> Target:
    """``--gpu-memory`` (bytes per stage) if given, else the GPUs present (their total memory and the
    first one's capability), else the CPU's available RAM, shared by the stages."""
    if gpu_memory:
        return Target("cuda", tuple(gpu_memory), capability or DEFAULT_CAPABILITY, source="--gpu-memory")
    gpus = _local_gpus()
    if gpus:
        return Target("cuda", tuple(t for t, _ in gpus), capability or gpus[0][1],
                      source=f"{len(gpus)} GPU(s) present")
    from zpp.utils.host_memory import available_bytes
    free = available_bytes() or 0
    return Target("cpu", (free,), None, shared=True, source="this host's available RAM")


def _local_gpus() -> list[tuple[int, tuple[int, int]]]:
    import torch
    if not torch.cuda.is_available():
        return []
    return [(torch.cuda.get_device_properties(i).total_memory, torch.cuda.get_device_capability(i))
            for i in range(torch.cuda.device_count())]


# --- one stage, built on the meta device ---------------------------------------------------------
@dataclass
class _Settings:
    """The settings of an EngineConfig that change memory, with the dtype for the target."""

    model_dir: str
    cfg: dict
    dtype: Any
    kv_dtype: Any
    quantization: Optional[str]
    load_format: str
    max_model_len: int
    max_num_seqs: int
    max_num_batched_tokens: int
    block_size: int
    utilization: float
    kv_cache_memory: Optional[int]
    num_kv_blocks: Optional[int]
    enforce_eager: bool


def _settings(config: "EngineConfig", target: Target) -> _Settings:
    import torch

    from zpp.config import parse_dtype
    dtype = parse_dtype(config.model.dtype, target.device)
    model_dir = config.model.model
    load_format = config.model.load_format
    if load_format == "safetensors" and not any(f.endswith(".safetensors") for f in os.listdir(model_dir)):
        load_format = "dummy"  # config.json alone: the FP8 decisions --load-format dummy takes
    from zpp.spec_config import stage_model_config
    return _Settings(model_dir, stage_model_config(config.model.hf_config, config.speculative_config), dtype,
                     torch.float8_e4m3fn if config.kv_cache_fp8 else dtype, config.model.quantization, load_format,
                     config.max_model_len, config.scheduler.max_num_seqs, config.max_num_batched_tokens,
                     config.cache.block_size, config.cache.gpu_memory_utilization, config.cache.kv_cache_memory,
                     config.cache.num_kv_blocks, config.enforce_eager)


def build_meta_stage(s: _Settings, stage, capability: Optional[tuple[int, int]]):
    """The stage's model as the worker builds it (:func:`zpp.models.loader.load_stage_model`), on
    the ``meta`` device: shapes and dtypes, no storage."""
    import logging

    import torch

    from zpp.models.loader import load_stage_model
    log = logging.getLogger("zpp.models")
    level = log.level
    log.setLevel(logging.WARNING)  # the loader's per-stage FP8 lines are about loading, not planning
    try:
        return load_stage_model(s.model_dir, s.cfg, stage, s.dtype, torch.device("meta"), s.max_model_len,
                                s.load_format, quantization=s.quantization, capability=capability or (0, 0))
    finally:
        log.setLevel(level)


def bytes_by_dtype(model, split_layers: bool = False):
    """``{dtype name: bytes}`` of a module's parameters and buffers (each tensor once). With
    ``split_layers``: ``(per-layer {index: {dtype: bytes}}, the rest {dtype: bytes})``."""
    from zpp.models.base import layer_index
    seen: set[int] = set()
    layers: dict[int, dict[str, int]] = {}
    rest: dict[str, int] = {}
    for name, t in list(model.named_parameters(remove_duplicate=True)) + list(model.named_buffers(remove_duplicate=True)):
        if id(t) in seen:
            continue
        seen.add(id(t))
        key = str(t.dtype).removeprefix("torch.")
        i = layer_index("." + name) if split_layers else None
        d = rest if i is None else layers.setdefault(i, {})
        d[key] = d.get(key, 0) + t.numel() * t.element_size()
    return (layers, rest) if split_layers else rest


def _add(a: dict[str, int], b: dict[str, int]) -> dict[str, int]:
    out = dict(a)
    for k, v in b.items():
        out[k] = out.get(k, 0) + v
    return out


@dataclass
class MemoryModel:
    """Bytes of any contiguous stage ``[a, b)`` at position first / middle / last / only, from four
    meta builds: the whole model (per-layer bytes) and a one-layer stage at each position (the
    bytes outside the layers: embedding, final norm and LM head, shared buffers)."""

    num_layers: int
    layer_bytes: list[dict[str, int]]
    fixed: dict[str, dict[str, int]]
    kv_layer_bytes_per_block: int
    block_size: int
    act_layer_bytes: int
    """Activation peak of a middle stage (bytes), from :func:`activation_bytes`."""
    act_logits_bytes: int
    graph_bytes: dict[str, int]
    _prefix: list[int] = dataclasses.field(default_factory=list, repr=False)

    @staticmethod
    def position(pp_rank: int, pp: int) -> str:
        return "only" if pp == 1 else "first" if pp_rank == 0 else "last" if pp_rank == pp - 1 else "middle"

    def weights(self, pos: str, a: int, b: int) -> dict[str, int]:
        out = dict(self.fixed[pos])
        for i in range(a, b):
            out = _add(out, self.layer_bytes[i])
        return out

    def need(self, pos: str, a: int, b: int) -> int:
        """Weights + activations + graph margin of the stage (bytes)."""
        if not self._prefix:  # running sums of the layers' bytes: the splits' searches call this O(pp x L^2) times
            for d in self.layer_bytes:
                self._prefix.append((self._prefix[-1] if self._prefix else 0) + sum(d.values()))
            self._prefix.insert(0, 0)
        return (sum(self.fixed[pos].values()) + self._prefix[b] - self._prefix[a] + self.activations(pos)
                + self.graph_bytes[pos])

    def activations(self, pos: str) -> int:
        return self.act_layer_bytes + (self.act_logits_bytes if pos in ("last", "only") else 0)

    def kv_per_token(self, a: int, b: int) -> int:
        return self.kv_layer_bytes_per_block * (b - a) // self.block_size


def activation_bytes(cfg: dict, tokens: int, logit_rows: int, dtype_bytes: int, tp: int) -> tuple[int, int]:
    """Estimated peak of a stage's forward beyond its weights, for a micro-batch of ``tokens``
    tokens (the worker's memory profile runs the largest one): ``(layers, logits)``: the stage's
    activations in and out and the widest layer's intermediates (attention projections; the MLP's
    gate-up and activation, ``num_experts_per_tok`` expert MLPs for a mixture of experts) in the
    model's dtype; on the last stage ``logit_rows`` rows of float32 logits, their softmax, log-softmax
    and sort (values and int64 indices)."""
    H = int(cfg.get("hidden_size") or cfg.get("n_embd") or 0)
    heads = int(cfg.get("num_attention_heads") or cfg.get("n_head") or 1)
    kv = int(cfg.get("num_key_value_heads") or heads)
    hd = int(cfg.get("head_dim") or (H // max(1, heads)))
    inter = int(cfg.get("intermediate_size") or cfg.get("n_inner") or 4 * H)
    moe = int(cfg.get("moe_intermediate_size") or 0) * int(cfg.get("num_experts_per_tok") or 0)
    attn = (2 * heads + 2 * kv) * hd // tp
    mlp = 3 * max(inter, moe) // tp
    layer = tokens * dtype_bytes * (4 * H + max(attn, mlp))
    vocab = int(cfg.get("vocab_size") or 0)
    logits = logit_rows * vocab * (4 * 3 + 8)
    return layer, logits


def _with_extra_layers(rest: dict[str, int], layers: dict[int, dict[str, int]], L: int) -> dict[str, int]:
    """``rest`` plus the bytes of layers past the model's ``L`` decoder layers (the last stage's MTP
    layer with MTP speculative decoding: a fixed part of that stage)."""
    for i, d in layers.items():
        if i >= L:
            rest = _add(rest, d)
    return rest


def memory_model(s: _Settings, target: Target, tp: int = 1) -> MemoryModel:
    """:class:`MemoryModel` for ``tp``-way tensor parallelism (rank 0's share) on ``target``."""
    from zpp.models.base import StageInfo
    from zpp.models.registry import resolve_model_class
    cls = resolve_model_class(s.cfg, tp)
    L = cls.num_layers_of(s.cfg)
    whole = build_meta_stage(s, StageInfo(0, 1, 0, L, 0, tp), target.capability)
    per_layer, only = bytes_by_dtype(whole, split_layers=True)
    kv_block = whole.kv_cache_bytes_per_block(s.block_size, s.kv_dtype) // whole.num_local_layers
    fixed = {"only": _with_extra_layers(only, per_layer, L)}
    for pos, info in (("first", StageInfo(0, 3, 0, 1, 0, tp)), ("middle", StageInfo(1, 3, min(1, L - 1), min(2, L), 0, tp)),
                      ("last", StageInfo(2, 3, L - 1, L, 0, tp))):
        layers, rest = bytes_by_dtype(build_meta_stage(s, info, target.capability), split_layers=True)
        fixed[pos] = _with_extra_layers(rest, layers, L)
    dtype_bytes = s.dtype.itemsize
    tokens = s.max_num_batched_tokens
    act, logits = activation_bytes(s.cfg, tokens, min(s.max_num_seqs, tokens), dtype_bytes, tp)
    graphs = {}
    for pos in ("only", "first", "middle", "last"):
        if target.device != "cuda":
            graphs[pos] = 0
            continue
        from zpp.workers.kv_budget import CUDA_CONTEXT_MARGIN
        g = 0
        if not s.enforce_eager:
            from zpp.workers.cuda_graphs import graph_pool_margin
            row = (int(s.cfg.get("vocab_size") or 0) if pos in ("last", "only") else 2 * whole.hidden_size) * dtype_bytes
            g = graph_pool_margin(s.max_num_seqs, row)
        graphs[pos] = g + CUDA_CONTEXT_MARGIN
    return MemoryModel(L, [per_layer.get(i, {}) for i in range(L)], fixed, kv_block, s.block_size, act, logits, graphs)


# --- the plan ------------------------------------------------------------------------------------
def _stage_plans(s: _Settings, mm: MemoryModel, target: Target, ranges: list[tuple[int, int]], tp: int,
                 exact: bool) -> list[StagePlan]:
    """Per stage: ``exact`` builds each stage on the meta device (the reported numbers); else
    :class:`MemoryModel`'s sums (the same bytes, for searching splits)."""
    from zpp.models.base import StageInfo
    pp = len(ranges)
    mem = target.stage_memory(pp)
    out = []
    for r, (a, b) in enumerate(ranges):
        pos = MemoryModel.position(r, pp)
        if exact:
            model = build_meta_stage(s, StageInfo(r, pp, a, b, 0, tp), target.capability)
            by = bytes_by_dtype(model)
            kv = model.kv_cache_bytes_per_block(s.block_size, s.kv_dtype) // s.block_size
            del model
        else:
            by, kv = mm.weights(pos, a, b), mm.kv_per_token(a, b)
        by = {k: v for k, v in sorted(by.items(), key=lambda kv_: -kv_[1]) if v}
        out.append(StagePlan(r, (a, b), sum(by.values()), by, kv, 0, False,
                             activation_bytes=mm.activations(pos), graph_bytes=mm.graph_bytes[pos]))
    if target.shared:  # one host's RAM for every stage; KV pages taken as blocks fill
        total = sum(p.need_bytes for p in out)
        for p in out:
            p.memory_bytes = mem[0] - (total - p.need_bytes)
            p.fits = total <= mem[0]
            kv_mem = s.kv_cache_memory if s.kv_cache_memory is not None else 1 << 30
            blocks = s.num_kv_blocks if s.num_kv_blocks is not None else kv_mem // max(1, p.kv_bytes_per_token * s.block_size)
            p.kv_tokens = int(blocks) * s.block_size
        return out
    for p, m in zip(out, mem):
        p.memory_bytes = int(m * s.utilization)
        per_block = max(1, p.kv_bytes_per_token * s.block_size)
        left = p.memory_bytes - p.need_bytes
        if s.num_kv_blocks is not None:
            blocks, need_kv = s.num_kv_blocks, s.num_kv_blocks * per_block
        elif s.kv_cache_memory is not None:
            blocks, need_kv = s.kv_cache_memory // per_block, s.kv_cache_memory
        else:
            blocks, need_kv = max(0, left) // per_block, -(-s.max_model_len // s.block_size) * per_block
        p.kv_tokens = int(blocks) * s.block_size
        p.fits = left >= need_kv and left > 0
    return out


def _split(s: _Settings, mm: MemoryModel, target: Target, pp: int, partition) -> list[tuple[int, int]]:
    from zpp.models.partition import AUTO, partition_layers
    if partition == AUTO and pp > 1 and target.device == "cuda":
        usable = [int(m * s.utilization) for m in target.stage_memory(pp)]
        sizes = memory_aware_partition(mm, usable, s.max_model_len)
        if sizes is not None:
            return partition_layers(mm.num_layers, pp, sizes)
    return partition_layers(mm.num_layers, pp, partition)


def _search_fits(s: _Settings, mm: MemoryModel, target: Target, pp: int) -> bool:
    """Whether some split over ``pp`` stages of the target's (smallest) memory fits (model sums)."""
    if pp > mm.num_layers:
        return False
    one = Target(target.device, (min(target.memory),), target.capability, target.shared)
    if target.shared:
        ranges = _split(s, mm, one, pp, None)
        return all(p.fits for p in _stage_plans(s, mm, one, ranges, 1, exact=False))
    usable = [int(one.memory[0] * s.utilization)] * pp
    return memory_aware_partition(mm, usable, s.max_model_len) is not None


def make_plan(config: "EngineConfig", target: Target, search: bool = True) -> Plan:
    """The plan for ``config``'s model and settings on ``target`` (see the module docstring).

    ``search``: also find the smallest ``-pp`` (and ``-tp x -pp``) that fits when this one does not.

    Raises:
        ConfigError: unsupported architecture or option, a bad split, ``--gpu-memory`` with a count
            other than one or the stages'.
    """
    from zpp.models.registry import resolve_model_class
    par = config.parallel
    pp, tp = par.pipeline_parallel_size, par.tensor_parallel_size
    s = _settings(config, target)
    resolve_model_class(s.cfg, tp)
    target.stage_memory(pp)  # the count of --gpu-memory
    mm = memory_model(s, target, tp)
    ranges = _split(s, mm, target, pp, par.pp_layer_partition)
    stages = _stage_plans(s, mm, target, ranges, tp, exact=True)
    fits = all(p.fits for p in stages)
    plan = Plan(fits, pp if fits else None, stages, target, tp, (tp, pp) if fits else None, s.max_model_len,
                str(s.dtype).removeprefix("torch."))
    if not search:
        return plan
    if target.shared:  # more stages on one host's RAM do not help
        plan.min_pipeline_parallel_size = 1 if _search_fits(s, mm, target, 1) else None
    else:  # at this -tp; with it fitting, a smaller -pp may too
        plan.min_pipeline_parallel_size = next(
            (n for n in range(1, (pp if fits else mm.num_layers) + 1) if n == pp and fits or _search_fits(s, mm, target, n)),
            None)
    if not fits:
        plan.min_tp_pp = _min_tp_pp(s, config, target, plan.min_pipeline_parallel_size if tp == 1 else None)
    return plan


def _min_tp_pp(s: _Settings, config: "EngineConfig", target: Target, min_pp: Optional[int]) -> Optional[tuple[int, int]]:
    """The fewest GPUs ``tp x pp`` with tensor parallelism (2, 4 or 8, where the family has it and it
    divides the model) that fit (ties: less TP); None when none does within ``min_pp``'s GPU count
    (or 64 GPUs without one)."""
    from zpp.models.registry import resolve_model_class
    if target.shared:
        return None
    best: Optional[tuple[int, int]] = None
    budget = min_pp if min_pp is not None else 64
    for tp in (2, 4, 8):
        try:
            resolve_model_class(s.cfg, tp)
        except ConfigError:
            continue
        mm = memory_model(s, target, tp)
        cap = (best[0] * best[1] if best else max(budget, tp)) // tp
        for pp in range(1, min(cap, mm.num_layers) + 1):
            if _search_fits(s, mm, target, pp):
                if best is None or tp * pp < best[0] * best[1]:
                    best = (tp, pp)
                break
    return best


# --- the fit check at start ------------------------------------------------------------------------
def check_fits_at_start(config: "EngineConfig") -> Optional[Plan]:
    """``zpp serve`` / ``LLM(...)``: before any worker starts, refuse a stage whose weights and
    margins do not fit its device (one-line ConfigError naming the stage, its bytes, the memory it
    has and the smallest split that fits). On the CPU, the stages on this host share its available
    RAM. A stage whose KV cache is smaller than one ``--max-model-len`` sequence is logged, not
    refused (the worker's measured profile decides). Multi-host runs are checked for this host's
    GPUs only when all stages are local; returns the plan, or None when not checked."""
    import logging
    log = logging.getLogger("zpp.plan")
    par = config.parallel
    if par.nodes or par.nnodes > 1:
        return None
    if par.device == "cpu":
        target = detect_target()
        if target.device != "cpu":
            target = _cpu_target()
        if not target.memory[0]:
            return None
    else:
        gpus = _local_gpus()
        if not gpus:
            return None
        if par.share_gpu:  # every stage on GPU 0: each gets its share
            world = par.pipeline_parallel_size * par.tensor_parallel_size
            target = Target("cuda", (gpus[0][0] // world,), gpus[0][1], source="GPU 0 shared by every stage")
        else:
            mem = [gpus[r * par.tensor_parallel_size][0] for r in range(par.pipeline_parallel_size)]
            target = Target("cuda", tuple(mem), gpus[0][1], source="the GPUs present")
    plan = make_plan(config, target, search=False)
    over = [p for p in plan.stages if p.need_bytes > p.memory_bytes]
    if over:
        plan = make_plan(config, target, search=True)
        p = max(over, key=lambda q: q.need_bytes - q.memory_bytes)
        where = "this host's available RAM, shared by every stage" if target.shared else "its GPU's memory x --gpu-memory-utilization"
        raise ConfigError(
            f"stage {p.stage} (layers [{p.layers[0]}, {p.layers[1]})) needs {fmt_bytes(p.need_bytes)} "
            f"({fmt_bytes(p.weight_bytes)} of weights) but has {fmt_bytes(p.memory_bytes)} ({where}); "
            f"smallest split that fits: {describe_min(plan)} (`zpp plan` shows the whole plan)")
    short = [p for p in plan.stages if not p.fits]
    if short and target.device == "cuda":
        log.warning("plan: stage %s may not hold the KV cache of one %d-token sequence (`zpp plan` shows why)",
                    ",".join(str(p.stage) for p in short), plan.max_model_len)
    return plan


def memory_aware_sizes(config: "EngineConfig", memory: Sequence[int], layer_s, extra_s,
                       capability: Optional[tuple[int, int]] = None) -> Optional[tuple[int, ...]]:
    """The engine's ``--pp-layer-partition auto`` on GPUs: :func:`memory_aware_partition` for the
    stages' usable memory (``memory``: bytes each GPU worker reported, CUDA context already left
    out) and their measured seconds (``layer_s[s]``: one layer, or a per-layer list; ``extra_s[s]``:
    the stage's other work). None when no split holds one ``--max-model-len`` sequence's KV cache on
    every stage."""
    import itertools

    from zpp.workers.kv_budget import CUDA_CONTEXT_MARGIN
    target = Target("cuda", tuple(memory), capability or DEFAULT_CAPABILITY)
    s = _settings(config, target)
    mm = memory_model(s, target, config.parallel.tensor_parallel_size)
    prefixes = []
    for c in layer_s:
        per = [c] * mm.num_layers if isinstance(c, (int, float)) else list(c)
        prefixes.append([0.0] + list(itertools.accumulate(per)))

    def stage_time(st: int, a: int, b: int) -> float:
        return prefixes[st][b] - prefixes[st][a] + extra_s[st]
    return memory_aware_partition(mm, [m + CUDA_CONTEXT_MARGIN for m in memory], s.max_model_len, stage_time)


def _cpu_target() -> Target:
    from zpp.utils.host_memory import available_bytes
    return Target("cpu", (available_bytes() or 0,), None, shared=True, source="this host's available RAM")


def plan_config(model: str, **settings: Any) -> "EngineConfig":
    """An EngineConfig for planning only (device ``cpu``, never validated against this machine's
    devices): ``settings`` are EngineConfig's nested fields by name (``pipeline_parallel_size=2``, ...)."""
    from zpp.config import CacheConfig, EngineConfig, ModelConfig, ParallelConfig, SchedulerConfig
    groups = {ModelConfig: {}, ParallelConfig: {}, SchedulerConfig: {}, CacheConfig: {}}
    top = {}
    names = {cls: {f.name for f in dataclasses.fields(cls)} for cls in groups}
    for key, value in settings.items():
        for cls, fields in names.items():
            if key in fields:
                groups[cls][key] = value
                break
        else:
            if key in ("enforce_eager", "speculative_config"):
                top[key] = value
            else:
                raise TypeError(f"unknown setting {key!r}")
    groups[ParallelConfig]["device"] = "cpu"
    config = EngineConfig(model=ModelConfig(model=model, **groups[ModelConfig]),
                          parallel=ParallelConfig(**groups[ParallelConfig]),
                          scheduler=SchedulerConfig(**groups[SchedulerConfig]), cache=CacheConfig(**groups[CacheConfig]),
                          **top)
    config.check_max_model_len()  # as `zpp serve` refuses it
    return config
