"""The asyncio engine: request intake, the pipeline loop, detokenization and outputs.

One task runs the loop: keep up to ``depth`` micro-batches in flight (schedule, send to every
stage), wait for the oldest to come back from the last stage, apply it (new tokens, stop checks,
incremental detokenization) and publish outputs to the requests' streams. Requests join between
steps (continuous batching).
"""
from __future__ import annotations

import asyncio
import itertools
import json
import logging
import os
import time
from collections import deque
from dataclasses import dataclass, field
from typing import AsyncIterator, Optional, Union

from zpp.config import ConfigError, EngineConfig
from zpp.engine.core_messages import EngineStats
from zpp.engine.detokenizer import IncrementalDetokenizer
from zpp.engine.executor import Executor, WorkerDiedError
from zpp.engine.kv_cache_manager import KVCacheManager
from zpp.engine.request import Request, RequestStatus
from zpp.engine.scheduler import ScheduledBatch, Scheduler
from zpp.models.partition import partition_layers
from zpp.models.registry import resolve_model_class
from zpp.outputs import CompletionOutput, RequestOutput
from zpp.sampling_params import SamplingParams

logger = logging.getLogger(__name__)

PromptType = Union[str, list[int]]


_WAKE = object()  # sentinel on the results queue: new work, not a result


class RequestError(ValueError):
    """A request the engine refuses (HTTP 400). ``param`` names the offending field."""

    def __init__(self, message: str, param: Optional[str] = None):
        super().__init__(message)
        self.param = param


class EngineDeadError(RuntimeError):
    """The engine lost a worker; every request fails and the server reports unhealthy."""


class EngineShutdownError(EngineDeadError):
    """The server is stopping (SIGINT / SIGTERM): requests still running are ended with this."""


@dataclass
class _Seq:
    req: Request
    detok: Optional[IncrementalDetokenizer]
    out: CompletionOutput
    cum_logprob: float = 0.0


@dataclass
class _Group:
    """A user request: one prompt, ``n`` sequences, one output stream."""

    request_id: str
    prompt: Optional[str]
    prompt_token_ids: list[int]
    sampling: SamplingParams
    seqs: list[_Seq]
    queue: asyncio.Queue = field(default_factory=asyncio.Queue)
    prompt_logprobs: Optional[list] = None
    prompt_logprobs_missing: int = 0
    """Prompt positions (after the first) whose logprobs were asked for and are not in yet."""
    arrival: float = field(default_factory=time.monotonic)
    first_token_time: Optional[float] = None
    last_token_time: Optional[float] = None
    stream: bool = True
    """Publish every step (False: only the final output, for offline use)."""
    num_unfinished: int = 0

    def __post_init__(self):
        self.num_unfinished = len(self.seqs)

    @property
    def finished(self) -> bool:
        return self.num_unfinished == 0


class AsyncEngine:
    """Serve requests on a pipeline of stage workers.

    Create with ``await AsyncEngine.start(config)``; call :meth:`generate` per request; call
    :meth:`shutdown` to stop every worker.
    """

    def __init__(self, config: EngineConfig, tokenizer, executor: Executor):
        self.config = config
        self.tokenizer = tokenizer
        self.executor = executor
        self.max_model_len = config.max_model_len
        hf = config.model.hf_config
        self.vocab_size = int(hf["vocab_size"])
        self.eos_token_ids = executor.eos_token_ids
        self.kv = KVCacheManager(executor.num_blocks, config.cache.block_size, config.cache.enable_prefix_caching)
        self.scheduler = Scheduler(self.kv, config.scheduler.max_num_seqs, config.max_num_batched_tokens,
                                   self.max_model_len, config.scheduler.enable_chunked_prefill,
                                   config.pipeline_depth)
        self.depth = config.pipeline_depth
        self.groups: dict[str, _Group] = {}
        self.seq_to_group: dict[str, tuple[_Group, _Seq]] = {}
        self.inflight: deque[ScheduledBatch] = deque()
        self._wake_pending = False
        self._ids = itertools.count()
        self._loop_task: Optional[asyncio.Task] = None
        self.dead: Optional[str] = None
        self.metrics = None  # optional observer with on_* hooks (server/metrics.py)
        executor.on_death = self._on_worker_death

    # --- lifecycle ----------------------------------------------------------------------------
    @classmethod
    async def start(cls, config: EngineConfig) -> "AsyncEngine":
        """Validate the configuration, start the workers and the engine loop.

        Raises:
            ConfigError: bad configuration (before any worker starts or weight loads).
            WorkerDiedError: a worker failed to start.
        """
        validate_startup(config)
        tokenizer = load_tokenizer(config)
        t = time.perf_counter()
        executor = await Executor.start(config, eos_token_ids(config.model.model, config.model.hf_config, tokenizer))
        engine = cls(config, tokenizer, executor)
        logger.info("engine ready in %.1fs: %d stage(s), %d KV blocks of %d tokens, pipeline depth %d, "
                    "%d tokens per micro-batch", time.perf_counter() - t, config.parallel.pipeline_parallel_size,
                    executor.num_blocks, config.cache.block_size, engine.depth, config.max_num_batched_tokens)
        cache_tokens = executor.num_blocks * config.cache.block_size
        if cache_tokens < config.max_model_len:
            logger.warning("the KV cache holds %d tokens, fewer than --max-model-len %d: longer requests "
                           "are refused", cache_tokens, config.max_model_len)
        engine._loop_task = asyncio.create_task(engine._run())
        return engine

    async def shutdown(self) -> None:
        if self._loop_task is not None:
            self._loop_task.cancel()
            try:
                await self._loop_task
            except (asyncio.CancelledError, Exception):
                pass
        self.executor.shutdown()

    def stats(self) -> EngineStats:
        """The scheduler's, KV cache's and stages' counters now (see :class:`EngineStats`)."""
        kv, sch = self.kv, self.scheduler
        return EngineStats(sch.num_running, sch.num_waiting, kv.usage, kv.num_free_blocks, kv.num_blocks,
                           sch.stats.num_preemptions, kv.prefix_queries, kv.prefix_hits,
                           list(self.executor.stage_busy_s))

    @property
    def is_healthy(self) -> bool:
        return self.dead is None

    def _on_worker_death(self, reason: str) -> None:
        self.dead = reason
        self._end_all(EngineDeadError(reason))
        self._wake()

    def abort_all(self, reason: str = "the server is shutting down") -> None:
        """End every request in progress with :class:`EngineShutdownError` (their streams get an
        error event; each request is then aborted by its ``generate`` and its blocks freed)."""
        self._end_all(EngineShutdownError(reason))

    def _end_all(self, error: EngineDeadError) -> None:
        """Hand ``error`` to every request's output queue (its ``generate`` raises it)."""
        for g in list(self.groups.values()):
            g.queue.put_nowait(error)

    # --- requests -----------------------------------------------------------------------------
    def tokenize_prompt(self, prompt: PromptType) -> tuple[Optional[str], list[int]]:
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise RequestError("this model has no tokenizer: send the prompt as token ids", "prompt")
            return prompt, self.tokenizer.encode(prompt)
        return None, list(prompt)

    def validate(self, prompt_token_ids: list[int], sampling: SamplingParams) -> int:
        """Check a request against the limits; return its effective max_tokens.

        Rules: the prompt needs >= 1 token, every id in ``[0, vocab_size)``; ``max_tokens`` omitted
        (None) means the remaining room ``max_model_len - prompt_len``; prompt + max_tokens must not
        exceed ``max_model_len``; ``max_tokens == 0`` returns at once with no output.

        Raises:
            RequestError: naming the numbers.
        """
        n = len(prompt_token_ids)
        if n == 0:
            raise RequestError("the prompt is empty: at least 1 token is needed", "prompt")
        if n >= self.max_model_len:  # before the scan below: a hostile prompt can hold millions of ids
            raise RequestError(
                f"the prompt has {n} tokens, but max_model_len is {self.max_model_len} "
                f"(the prompt must leave room for at least 1 generated token)", "prompt")
        bad = [t for t in prompt_token_ids if not isinstance(t, int) or not 0 <= t < self.vocab_size]
        if bad:
            raise RequestError(f"token id {bad[0]} is outside the vocabulary [0, {self.vocab_size})", "prompt")
        max_tokens = sampling.max_tokens if sampling.max_tokens is not None else self.max_model_len - n
        if n + max_tokens > self.max_model_len:
            raise RequestError(
                f"prompt ({n} tokens) + max_tokens ({max_tokens}) = {n + max_tokens} exceeds "
                f"max_model_len {self.max_model_len}", "max_tokens")
        need = self.kv.blocks_needed(n + max_tokens)
        if need > self.kv.num_blocks:
            raise RequestError(
                f"prompt ({n} tokens) + max_tokens ({max_tokens}) needs {need} KV blocks, but the cache "
                f"holds only {self.kv.num_blocks} blocks of {self.kv.block_size} tokens", "max_tokens")
        return max_tokens

    async def generate(self, prompt: PromptType, sampling: SamplingParams, request_id: Optional[str] = None,
                       stream: bool = True) -> AsyncIterator[RequestOutput]:
        """Submit a request and iterate over its outputs (cumulative; the last has finished=True).
        With ``stream=False`` only the final output is produced (cheaper for offline batches).

        Raises:
            RequestError: the request breaks a limit (before it is queued).
            EngineDeadError: a worker died.
        """
        group = self.add_request(prompt, sampling, request_id, stream)
        try:
            while True:
                item = await group.queue.get()
                while not group.queue.empty() and not isinstance(item, Exception):
                    nxt = group.queue.get_nowait()
                    item = nxt
                if isinstance(item, Exception):
                    raise item
                yield item
                if item.finished:
                    return
        finally:
            if not group.finished:
                self.abort(group.request_id)

    def add_request(self, prompt: PromptType, sampling: SamplingParams,
                    request_id: Optional[str] = None, stream: bool = True) -> _Group:
        if self.dead:
            raise EngineDeadError(self.dead)
        text, ids = self.tokenize_prompt(prompt)
        max_tokens = self.validate(ids, sampling)
        rid = request_id or f"req-{next(self._ids)}"
        if rid in self.groups:
            raise RequestError(f"request id {rid!r} is already in use", "request_id")
        seqs = []
        for i in range(sampling.n):
            sp = sampling
            if sampling.n > 1 and sampling.seed is not None:
                sp = sampling.clone(seed=(sampling.seed + i * 7919) & 0x7FFFFFFFFFFFFFFF)
            req = Request(f"{rid}#{i}" if sampling.n > 1 else rid, ids, sp, max_tokens, self.eos_token_ids)
            detok = None
            if self.tokenizer is not None:
                detok = IncrementalDetokenizer(self.tokenizer, ids, sampling.stop, sampling.skip_special_tokens,
                                               sampling.include_stop_str_in_output, sampling.min_tokens)
            seqs.append(_Seq(req, detok, CompletionOutput(index=i, logprobs=[] if sampling.logprobs is not None else None)))
        group = _Group(rid, text, ids, sampling, seqs, stream=stream)
        if sampling.prompt_logprobs is not None:
            group.prompt_logprobs = [None] * len(ids)
            group.prompt_logprobs_missing = len(ids) - 1
        self.groups[rid] = group
        if max_tokens == 0:
            for s in seqs:
                s.out.finish_reason = "length"
            group.num_unfinished = 0
            self._publish(group)
            return group
        for s in seqs:
            self.seq_to_group[s.req.req_id] = (group, s)
            self.scheduler.add_request(s.req)
        if self.metrics:
            self.metrics.on_request_added(group)
        self._wake()
        return group

    def abort(self, request_id: str) -> None:
        """Abort a request (client went away). Its blocks are freed once no batch in flight
        writes them; results arriving for it are dropped."""
        group = self.groups.pop(request_id, None)
        if group is None:
            return
        for s in group.seqs:
            self.seq_to_group.pop(s.req.req_id, None)
            if s.out.finish_reason is None:
                s.out.finish_reason = "abort"
                self.scheduler.abort(s.req.req_id)
        if self.metrics:
            self.metrics.on_request_finished(group, aborted=True)
        self._wake()

    # --- the loop -----------------------------------------------------------------------------
    async def _run(self) -> None:
        """Keep the pipeline full; then wait on one queue that carries both the workers' results
        (in batch order) and wake-ups from new or aborted requests."""
        results = self.executor.results
        try:
            while True:
                if self.dead:
                    return
                while len(self.inflight) < self.depth:
                    sched = self.scheduler.schedule()
                    if sched is None:
                        break
                    self.executor.send(sched.batch)
                    self.inflight.append(sched)
                item = await results.get()
                if item is _WAKE:
                    self._wake_pending = False
                    continue
                if isinstance(item, Exception):
                    raise item
                sched = self.inflight.popleft()
                if item.batch_id != sched.batch.batch_id:
                    raise RuntimeError(f"result for batch {item.batch_id}, expected {sched.batch.batch_id}")
                self._apply(sched, item)
                self.executor.trace.mark("applied", item.batch_id)
        except asyncio.CancelledError:
            raise
        except WorkerDiedError as e:
            self._on_worker_death(str(e))
        except Exception as e:  # an engine bug: fail loudly, never hang
            logger.exception("engine loop crashed")
            self._on_worker_death(f"engine loop crashed: {e!r}")

    def _wake(self) -> None:
        """Make the loop look at the queues again (a request arrived or was aborted)."""
        if not self._wake_pending:
            self._wake_pending = True
            self.executor.results.put_nowait(_WAKE)

    def _apply(self, sched: ScheduledBatch, result) -> None:
        now = time.monotonic()
        updates = self.scheduler.update(sched, result)
        plp = {p.req_id: p for p in result.prompt_logprobs}
        touched: dict[str, _Group] = {}
        finished_reqs = []
        for req, sampled in updates:
            entry = self.seq_to_group.get(req.req_id)
            if entry is None:
                continue
            group, seq = entry
            if req.req_id in plp and group.prompt_logprobs is not None:
                # Any of the n sequences may deliver them (they share the prompt; whichever is
                # scheduled first computes it); a recompute after preemption gives the same values.
                p = plp[req.req_id]
                for j, e in enumerate(p.entries):
                    group.prompt_logprobs_missing -= group.prompt_logprobs[p.start + j] is None
                    group.prompt_logprobs[p.start + j] = _lp_dict(e)
            if sampled is None:
                touched[group.request_id] = group
                continue
            if group.first_token_time is None:
                group.first_token_time = now
                if self.metrics:
                    self.metrics.on_first_token(group, now)
            elif self.metrics:
                self.metrics.on_token(group, now)
            group.last_token_time = now
            out = seq.out
            out.token_ids.append(sampled.token_id)
            if out.logprobs is not None and sampled.logprobs is not None:
                out.logprobs.append(_lp_dict(sampled.logprobs))
                seq.cum_logprob += sampled.logprobs.logprob
                out.cumulative_logprob = seq.cum_logprob
            if seq.detok is not None:
                # As in vLLM, a token that stopped the sequence (EOS, stop_token_ids) adds no text
                # unless include_stop_str_in_output.
                hide = req.status == RequestStatus.FINISHED_STOPPED and not req.sampling.include_stop_str_in_output
                stop = seq.detok.add_tokens([] if hide else [sampled.token_id])
                if stop is not None:
                    # A stop string outranks a stop token, EOS or length met on the same token.
                    if req.status.finished:
                        req.status = RequestStatus.FINISHED_STOPPED
                    else:
                        self.scheduler.finish(req, RequestStatus.FINISHED_STOPPED)
                    req.stop_reason = stop
            if req.status.finished:
                group.num_unfinished -= 1
                out.finish_reason = req.status.finish_reason
                out.stop_reason = req.stop_reason
                if seq.detok is not None:
                    seq.detok.flush()
                finished_reqs.append(req)
            if seq.detok is not None:
                out.text = seq.detok.stream_text(req.status.finished)
            touched[group.request_id] = group
        self.scheduler.release_finished(finished_reqs)
        for group in touched.values():
            if group.stream or group.num_unfinished == 0:
                self._publish(group)

    def _publish(self, group: _Group) -> None:
        if group.prompt_logprobs is not None and group.prompt_logprobs_missing \
                and any(s.out.token_ids for s in group.seqs):
            # A sampled token means the whole prompt was computed, so every prompt logprob must be
            # in: never answer a value that was asked for with null.
            group.queue.put_nowait(RuntimeError(
                f"request {group.request_id}: {group.prompt_logprobs_missing} prompt logprobs were not "
                "computed (an engine bug)"))
            self.abort(group.request_id)
            return
        finished = group.finished
        outs = [CompletionOutput(index=s.out.index, text=s.out.text, token_ids=list(s.out.token_ids),
                                 finish_reason=s.out.finish_reason, stop_reason=s.out.stop_reason,
                                 logprobs=list(s.out.logprobs) if s.out.logprobs is not None else None,
                                 cumulative_logprob=s.out.cumulative_logprob) for s in group.seqs]
        group.queue.put_nowait(RequestOutput(group.request_id, group.prompt, group.prompt_token_ids, outs,
                                             finished, list(group.prompt_logprobs) if group.prompt_logprobs else None))
        if finished:
            self.groups.pop(group.request_id, None)
            for s in group.seqs:
                self.seq_to_group.pop(s.req.req_id, None)
            if self.metrics:
                self.metrics.on_request_finished(group, aborted=False)


def _lp_dict(lp) -> dict[int, float]:
    d = {lp.token_id: lp.logprob}
    for t, v in zip(lp.top_ids, lp.top_logprobs):
        d.setdefault(t, v)
    return d


# --- start-up helpers -------------------------------------------------------------------------
def validate_startup(config: EngineConfig) -> None:
    """Every check that must fail before any worker starts (one-line ConfigError)."""
    config.validate()
    hf = config.model.hf_config
    cls = resolve_model_class(hf, config.parallel.tensor_parallel_size)
    partition_layers(cls.num_layers_of(hf), config.parallel.pipeline_parallel_size,
                     config.parallel.pp_layer_partition)
    model = config.model.model
    if config.model.load_format == "safetensors" and not any(f.endswith(".safetensors") for f in os.listdir(model)):
        raise ConfigError(f"model {model!r}: no *.safetensors weights in that directory "
                          "(zpp reads safetensors only; --load-format dummy for random weights)")
    if config.parallel.device == "cuda":
        import torch
        n = torch.cuda.device_count()
        from zpp.transport.p2p import shared_gpu
        if shared_gpu() and config.parallel.tensor_parallel_size > 1:
            raise ConfigError("--tensor-parallel-size > 1 needs one GPU per rank (NCCL); ZPP_SHARE_GPU=1 is for PP only")
        if not config.parallel.nodes and config.parallel.world_size > n and not shared_gpu():
            raise ConfigError(f"--pipeline-parallel-size x --tensor-parallel-size = {config.parallel.world_size} "
                              f"GPUs needed, but this host has {n}")


def load_tokenizer(config: EngineConfig):
    """The HF tokenizer of the model (or ``--tokenizer``); None if the directory has none."""
    path = config.model.tokenizer or config.model.model
    if not any(os.path.exists(os.path.join(path, f)) for f in ("tokenizer.json", "tokenizer_config.json",
                                                                "tokenizer.model", "vocab.json")):
        if config.model.tokenizer:
            raise ConfigError(f"--tokenizer {path!r}: no tokenizer files in that directory")
        logger.warning("no tokenizer in %s: prompts must be token ids and outputs have no text", path)
        return None
    from transformers import AutoTokenizer
    return AutoTokenizer.from_pretrained(path)


def eos_token_ids(model_dir: str, hf: dict, tokenizer) -> set[int]:
    ids: set[int] = set()
    sources = [hf]
    try:
        with open(os.path.join(model_dir, "generation_config.json")) as f:
            sources.append(json.load(f))
    except (OSError, ValueError):
        pass
    for src in sources:
        e = src.get("eos_token_id")
        if isinstance(e, int):
            ids.add(e)
        elif isinstance(e, list):
            ids.update(x for x in e if isinstance(x, int))
    if tokenizer is not None and tokenizer.eos_token_id is not None:
        ids.add(tokenizer.eos_token_id)
    return ids
