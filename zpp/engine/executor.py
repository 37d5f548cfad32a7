"""Starts the stage workers, hands them their configuration and talks to them over ZeroMQ.

Workers on this host are spawned with multiprocessing (spawn); workers on other hosts are started
by ``zpp-node`` agents (see ``zpp/node``). Either way they connect back, say Hello with the key,
and receive the same InitWorker message. The executor watches every local worker's process
sentinel and every agent's connection: a death fails the engine (never a hang). Workers on hosts
whose agent no SSH session watches (``--nnodes`` per-node launch, ``--node-launcher manual``) have
their connection probed each watchdog tick (:meth:`EngineSocket.connected`).
"""
from __future__ import annotations

import asyncio
import dataclasses
import logging
import multiprocessing as mp
import os
import secrets
import threading
import time
from typing import Callable, Optional, Protocol

import msgspec

from zpp.config import EngineConfig, cpu_threads_per_worker
from zpp.errors import ConfigError, WorkerDiedError
from zpp.models.partition import AUTO, balanced_partition, partition_layers, stage_times
from zpp.transport import messages as m
from zpp.transport.channels import EngineSocket, PeerUnreachable, local_ipc_address, tcp_address
from zpp.trace import Trace
from zpp.transport.p2p import serve_rendezvous_store
from zpp.node.placement import describe_stages
from zpp.transport.security import RunKeys, keys_for_run
from zpp.utils.cpu_threads import describe_choice, environ_for_children, stage_env
from zpp.utils.process import main_module_hidden, sigint_blocked
from zpp.engine.stage_restarts import StageRestarts
from zpp.engine.watchdog import _ROOT_CAUSE_GRACE_S, StallWatchdog

logger = logging.getLogger(__name__)


_START_ABORT_GRACE_S = 1.0
"""How long workers get to act on Shutdown when start-up fails or is aborted before SIGTERM."""


class StageExecutor(Protocol):
    """What the engine core needs from the stages (implemented by :class:`Executor`; a test or
    benchmark can stand in with an object of the same shape, e.g. ``scripts/host_overhead.py``).

    * ``send(batch, result_fields)``: one micro-batch to every stage (with structured outputs,
      ``result_fields``: the batch's grammar fields, to the sampling rank only); raises
      WorkerDiedError once dead.
    * ``await next_result()``: the next StepResult, in the order the batches were sent, or None
      once after ``interrupt()`` (the caller has new work to look at). The one death channel:
      raises WorkerDiedError (with the reason) when a worker or node died or the stall watchdog
      fired, and on every call after that. With stage restarts (:class:`Executor`), a lost stage
      gives :data:`STAGES_RESTARTING` instead, then :data:`STAGES_RECOVERED` once it is back (or
      WorkerDiedError if it cannot be brought back).
    * ``interrupt()``: make a waiting (or the next) ``next_result()`` return None; safe to call
      many times before it is consumed (one wake-up).
    * ``shutdown()``: stop every worker (idempotent).
    * ``num_blocks`` (KV blocks per stage), ``eos_token_ids``, ``stage_busy_s`` / ``stage_idle_s``
      (seconds each stage computed / waited between micro-batches, for metrics), ``trace``
      (ZPP_TRACE timeline).
    """

    num_blocks: int
    eos_token_ids: set[int]
    stage_busy_s: list[float]
    stage_idle_s: list[float]
    trace: Trace

    def send(self, batch: m.ExecuteBatch, result_fields: Optional[dict] = None) -> None: ...

    async def next_result(self) -> Optional[m.StepResult]: ...

    def interrupt(self) -> None: ...

    def shutdown(self) -> None: ...


class Executor(StallWatchdog, StageRestarts):
    """Owns the workers of one engine.

    Use ``await Executor.start(config)``; then the :class:`StageExecutor` interface: ``send(batch)``
    for each micro-batch, ``await next_result()`` for the StepResults in batch order (or None after
    ``interrupt()``; WorkerDiedError on a death).
    """

    def __init__(self, config: EngineConfig, eos_token_ids: set[int]):
        self.config = config
        self.eos_token_ids = eos_token_ids
        self.pp = config.parallel.pipeline_parallel_size
        self.tp = config.parallel.tensor_parallel_size
        self.world = self.pp * self.tp
        self.keys: Optional[RunKeys] = None
        self.socket: Optional[EngineSocket] = None
        self._store = None  # the workers' rendezvous TCPStore (kept alive for the run)
        self.dist_store = ""
        self.placement: dict[int, m.Hello] = {}
        # Stall watchdog state (see _watchdog).
        self.heartbeats: dict[int, m.Heartbeat] = {}
        self.last_heard: dict[int, float] = {}
        self.inflight: dict[int, float] = {}  # batch id -> when it was sent
        self.last_progress = time.monotonic()
        self._watchdog_task: Optional[asyncio.Task] = None
        self.procs: list[mp.Process] = []
        self._results: asyncio.Queue = asyncio.Queue()  # StepResult | None (interrupt) | WorkerDiedError
        self._interrupt_pending = False
        self.stage_busy_s = [0.0] * self.pp
        self.stage_batches = [0] * self.pp
        self.stage_idle_s = [0.0] * self.pp
        self.stage_weight_bytes: list[dict[str, int]] = [{} for _ in range(self.pp)]
        """Per stage, its weights' bytes by dtype (the WorkerReady of its TP ranks, summed)."""
        self.dead: Optional[str] = None
        self.on_stage_stats: Optional[Callable[[], None]] = None
        """Called (on the engine's loop) after a stage's StageStats updated the busy / idle figures."""
        self.on_step_times: Optional[Callable[[int, list[int], list[float]], None]] = None
        """Called (on the engine's loop) with ``(stage, batch ids, seconds)``: a stage's times of the
        micro-batches it finished (``StageStats.step_batches``), for the scheduler's cost model."""
        self.num_blocks = 0
        self.layer_ranges = partition_layers(
            _num_layers(config), self.pp, config.parallel.pp_layer_partition)
        self._reader: Optional[asyncio.Task] = None
        self._monitor: Optional[threading.Thread] = None
        self._stopping = False
        self.nodes = None
        self.trace = Trace("engine")
        # Stage supervision (see _lost / _recover).
        self.max_restarts = config.parallel.max_stage_restarts
        self.stage_restarts = [0] * self.pp
        """Restarts of each stage so far (``zpp:stage_restarts_total``)."""
        self.recovery_seconds: list[float] = []
        """How long each finished recovery took, death to pipeline formed again."""
        self.generation = 0
        self._supervised = False  # set once start-up is done: a death during start-up is fail-stop
        self._recovery: Optional[asyncio.Task] = None
        self._lost_ranks: set[int] = set()
        self._control: asyncio.Queue = asyncio.Queue()  # (rank, message) during a recovery
        self._restart_times: list[float] = []
        self._causes: list[str] = []
        self._killed: set[int] = set()  # pids this executor killed on purpose (not reported as deaths)
        self._reported: set[int] = set()  # pids whose death was reported
        self._last_error: dict[int, str] = {}  # rank -> its last WorkerError (the cause of its exit)
        self._probed: set[int] = set()  # remote ranks whose connection the watchdog probes
        self._local_ranks: set[int] = set(range(self.world))
        self._cpu_threads = 0  # torch threads of each local CPU worker (set in _start)
        self._child_env: dict[str, str] = {}  # what local CPU workers' environment gets (zpp.utils.cpu_threads)

    @classmethod
    async def start(cls, config: EngineConfig, eos_token_ids: set[int]) -> "Executor":
        ex = cls(config, eos_token_ids)
        try:
            await ex._start()
        except BaseException:  # a failure, or cancelled (Ctrl-C): workers still importing or loading
            ex.shutdown(timeout_s=_START_ABORT_GRACE_S)  # would not read Shutdown for a while
            raise
        return ex

    def _open_control_plane(self) -> None:
        """Bind the control plane (and the rendezvous store): ipc on one host; on several, TCP with
        CURVE on the one address the nodes reach (see ``zpp.transport.addresses``)."""
        par = self.config.parallel
        if par.nnodes > 1:  # per-node launch: node rank 0 listens at --master-addr:--master-port
            from zpp.node.pernode import head_bind_address
            from zpp.transport.security import read_node_keys
            host = head_bind_address(par.master_addr, par.distributed_host)
            self.keys = read_node_keys(par.node_keys_file, head=True)
            try:
                self.socket = EngineSocket(tcp_address(host, par.master_port), self.keys)
            except Exception as e:  # zmq.ZMQError: the port is taken, or the address is not this host's
                raise ConfigError(f"--master-addr / --master-port: cannot listen on {tcp_address(host, par.master_port)} "
                                  f"({e})") from None
            logger.info("control plane on %s for %d nodes (ZeroMQ CURVE with the keys of %s: encrypted, only "
                        "holders of that file admitted)", self.socket.address, par.nnodes, par.node_keys_file)
        elif par.nodes:
            from zpp.transport.addresses import choose_head_address
            host = choose_head_address(par.nodes, par.distributed_host)
            self.keys = keys_for_run(True, par.node_keys_file)
            self.socket = EngineSocket(tcp_address(host, par.distributed_port), self.keys)
            logger.info("control plane on %s (ZeroMQ CURVE: encrypted, only this run's keys admitted)",
                        self.socket.address)
        else:
            host = "127.0.0.1"
            self.keys = keys_for_run(False, None)
            self.socket = EngineSocket(local_ipc_address())
        if self.world > 1:
            self._store, self.dist_store = serve_rendezvous_store(host)

    async def _start(self) -> None:
        cfg = self.config
        self._open_control_plane()
        for r, (a, b) in enumerate(self.layer_ranges):
            logger.info("stage %d: layers [%d, %d) (%d layers)%s%s", r, a, b, b - a,
                        " + embedding" * (r == 0) + " + norm, lm_head, sampler" * (r == self.pp - 1),
                        ", until measured (--pp-layer-partition auto)"
                        * (cfg.parallel.pp_layer_partition == AUTO and self.pp > 1))
        self._ctx = mp.get_context("spawn")
        level = self._level = logging.getLogger("zpp").getEffectiveLevel()
        local_ranks = list(range(self.world))
        par = cfg.parallel
        if par.nodes or par.nnodes > 1:
            from zpp.node.ssh import PER_NODE, NodeLauncher, per_node_name
            per_node = par.nnodes > 1
            self.nodes = NodeLauncher(tuple(map(per_node_name, range(1, par.nnodes))) if per_node else par.nodes,
                                      self.socket.address, self.keys, node_command=par.node_command,
                                      launcher=PER_NODE if per_node else par.node_launcher,
                                      keys_file=par.node_keys_file,
                                      log_level=logging.getLevelName(level).lower(), tp_size=self.tp)
            local_ranks = self.nodes.assign(self.world)
            self.nodes.start()
        self._local_ranks = set(local_ranks)
        self._cpu_threads = cpu_threads = cpu_threads_per_worker(len(local_ranks))
        self._child_env = {}
        if cfg.parallel.device == "cpu" and local_ranks:  # OpenMP reads these when the child loads it
            self._child_env = stage_env(cpu_threads)
            logger.info(describe_choice(len(local_ranks), cpu_threads, self._child_env))
        self._spawn_local(local_ranks)
        self._monitor = threading.Thread(target=self._watch_procs, name="zpp-proc-monitor", daemon=True)
        self._loop = asyncio.get_running_loop()
        self._monitor.start()

        hello_timeout = 600 if cfg.parallel.node_launcher == "manual" else 120
        if par.nnodes > 1:
            hello_timeout = par.node_join_timeout
        self.placement = await self._expect_all(m.Hello, timeout=hello_timeout, check=self._check_hello,
                                                on_timeout=self._not_joined if par.nnodes > 1 else None)
        self._log_placement()
        if par.nnodes > 1:
            self._log_nodes_joined()
        # Remote ranks without an SSH session to watch: their connections are probed (see _watchdog).
        self._probed = ({r for r in range(self.world) if r not in local_ranks}
                        if self.nodes is not None and self.nodes.launcher != "ssh" else set())
        now = time.monotonic()
        self.last_heard = {r: now for r in range(self.world)}
        self._watchdog_task = asyncio.create_task(self._watchdog())
        self._worker_config = dataclasses.replace(
            cfg, model=dataclasses.replace(cfg.model, model=os.path.abspath(cfg.model.model)))
        for rank in range(self.world):
            self.socket.send(rank, self._init_worker(rank))
        if cfg.parallel.pp_layer_partition == AUTO and self.pp > 1:
            await self._balance_layers()
        ready = await self._expect_all(m.WorkerReady, timeout=1800)
        refused = [r.kv_error for r in ready.values() if r.kv_error]
        if refused:
            raise ConfigError(refused[0])
        fit = min(r.num_kv_blocks_fit for r in ready.values())
        for rank, r in ready.items():
            per = self.stage_weight_bytes[rank // self.tp]
            for k, v in r.weight_bytes_by_dtype.items():
                per[k] = per.get(k, 0) + v
        num_blocks = cfg.cache.num_kv_blocks if cfg.cache.num_kv_blocks is not None else fit
        if num_blocks > fit:
            raise ConfigError(f"--num-kv-blocks {num_blocks} does not fit: a stage can hold only {fit} blocks")
        if num_blocks < 1:  # the workers measured it: a setting error found once they have loaded
            raise ConfigError("no memory left for the KV cache (not one block fits): raise --kv-cache-memory / "
                              "--gpu-memory-utilization")
        self.num_blocks = num_blocks
        for rank in range(self.world):
            self.socket.send(rank, m.InitKVCache(num_blocks=num_blocks))
        await self._expect_all(m.CacheReady, timeout=1800)
        self._reader = asyncio.create_task(self._read_loop())
        self._supervised = True

    def _init_worker(self, rank: int, num_kv_blocks: int = -1) -> m.InitWorker:
        """``rank``'s InitWorker (at start-up, or for a restarted rank: the current generation and
        the engine's KV blocks)."""
        pp_rank, tp_rank = divmod(rank, self.tp)
        a, b = self.layer_ranges[pp_rank]
        return m.InitWorker(
            rank=rank, pp_rank=pp_rank, tp_rank=tp_rank, device_index=self._device_index(rank),
            layer_start=a, layer_end=b, num_layers=_num_layers(self.config), dist_store=self.dist_store,
            num_threads=self._cpu_threads if rank in self._local_ranks else 0,
            eos_token_ids=sorted(self.eos_token_ids), config=self._worker_config, generation=self.generation,
            num_kv_blocks=num_kv_blocks)

    def _spawn_local(self, ranks) -> None:
        """Start a worker process for each of ``ranks`` on this host (replacing a dead one's entry)."""
        with main_module_hidden(), sigint_blocked(), environ_for_children(self._child_env):
            for rank in ranks:
                p = self._ctx.Process(target=_worker_entry, args=(self.socket.address, rank, self.keys, self._level),
                                      name=f"zpp-worker-{rank}", daemon=True)
                p.start()
                self.procs = [q for q in self.procs if q.name != p.name] + [p]

    async def _balance_layers(self) -> None:
        """``--pp-layer-partition auto``: every worker measured its stage's costs before loading
        weights (StageCost); choose the split that makes the slowest stage fastest, log it with the
        costs in one line, and send every rank its stage's layer range (AssignLayers)."""
        from zpp.models.registry import resolve_model_class
        from zpp.workers.stage_cost import distinct_kinds
        costs = await self._expect_all(m.StageCost, timeout=1800)
        cfg = self.config.model.hf_config
        kinds = resolve_model_class(cfg).layer_kinds(cfg)
        names = distinct_kinds(kinds)
        # A stage is as slow as its slowest TP rank; kind_s[s][j]: a layer of kind names[j] on stage s.
        kind_s = [[max(costs[r].layer_s[j] for r in range(s * self.tp, (s + 1) * self.tp)) for j in range(len(names))]
                  for s in range(self.pp)]
        extra_s = [max(costs[r].extra_s for r in range(s * self.tp, (s + 1) * self.tp)) for s in range(self.pp)]
        if len(names) == 1:
            layer_s = [ks[0] for ks in kind_s]
        else:  # per stage, the cost of every global layer by its kind
            index = [names.index(k) for k in kinds]
            layer_s = [[ks[j] for j in index] for ks in kind_s]
        even = [b - a for a, b in self.layer_ranges]
        sizes = balanced_partition(len(kinds), layer_s, extra_s)
        memory = [min(costs[r].memory_bytes for r in range(s * self.tp, (s + 1) * self.tp)) for s in range(self.pp)]
        if all(memory):  # GPUs: a stage must hold its share and a KV cache; a smaller card gets fewer layers
            weighed = self._memory_aware_sizes(memory, layer_s, extra_s)
            if weighed is not None:
                sizes = weighed
        self.layer_ranges = partition_layers(len(kinds), self.pp, sizes)

        def ms(xs) -> str:
            return ",".join(f"{x * 1e3:.3f}" for x in xs)
        per_kind = ms(k[0] for k in kind_s) if len(names) == 1 else "; ".join(
            f"{name} {ms(k[j] for k in kind_s)}" for j, name in enumerate(names))
        logger.info("pp layer partition auto: %s (even %s); per stage, for a micro-batch of %d decode tokens: "
                    "layer ms %s, embedding / LM head + sampling ms %s; slowest stage %.2f ms (even split %.2f ms)",
                    ",".join(map(str, sizes)), ",".join(map(str, even)), costs[0].num_tokens, per_kind,
                    ms(extra_s), max(stage_times(sizes, layer_s, extra_s)) * 1e3,
                    max(stage_times(even, layer_s, extra_s)) * 1e3)
        for rank in range(self.world):
            a, b = self.layer_ranges[rank // self.tp]
            self.socket.send(rank, m.AssignLayers(layer_start=a, layer_end=b))

    def _memory_aware_sizes(self, memory: list[int], layer_s, extra_s) -> Optional[tuple[int, ...]]:
        """:func:`zpp.plan.memory_aware_sizes` for the stages' usable GPU memory (bytes, from their
        StageCost), logged; None: the time-only split stands."""
        import torch

        from zpp import plan as zplan
        cap = torch.cuda.get_device_capability(0) if torch.cuda.is_available() else None
        sizes = zplan.memory_aware_sizes(self.config, memory, layer_s, extra_s, cap)
        shown = ", ".join(zplan.fmt_bytes(m) for m in memory)
        if sizes is None:
            logger.warning("pp layer partition auto: no split holds the KV cache of one %d-token sequence on every "
                           "stage (GPU memory %s usable); splitting on time alone", self.config.max_model_len, shown)
        else:
            logger.info("pp layer partition auto: weighing each stage's memory (%s usable)", shown)
        return sizes

    def _device_index(self, rank: int) -> int:
        if self.config.parallel.device != "cuda" or self.config.parallel.share_gpu:
            return 0
        if self.nodes is not None:
            return self.nodes.local_index(rank)
        return rank

    def _check_hello(self, rank: int, msg: m.Hello) -> None:
        if not secrets.compare_digest(msg.key, self.keys.key):
            raise WorkerDiedError(f"worker rank {rank} presented a wrong key")

    def _log_placement(self, only: Optional[int] = None, note: str = "") -> None:
        """One line per rank (or for rank ``only``): host, address and interface, device, pid."""
        for rank in range(self.world) if only is None else [only]:
            h = self.placement[rank]
            pp_rank, tp_rank = divmod(rank, self.tp)
            where = f"{h.hostname}" + (f" ({h.address} on {h.interface or '?'})" if h.address else "")
            device = self.config.parallel.device + (f":{self._device_index(rank)}"
                                                    if self.config.parallel.device == "cuda" else "")
            logger.info("placement: rank %d = stage %d%s on %s, %s, pid %d%s", rank, pp_rank,
                        f" TP rank {tp_rank}" if self.tp > 1 else "", where, device, h.pid, note)

    def describe_rank(self, rank: int) -> str:
        """``stage S (rank R) on HOST`` for error messages (``on node rank N (HOSTNAME)`` in a
        per-node launch)."""
        h = self.placement.get(rank)
        host = (self.nodes.host_of_rank(rank) if self.nodes else None) or (h.hostname if h else "this host")
        if self.nodes is not None and self.nodes.launcher == "pernode" and h is not None and rank not in self._local_ranks:
            host += f" ({h.hostname})"
        return f"stage {rank // self.tp} (rank {rank}) on {host}"

    def _not_joined(self, missing: list[int], timeout: float) -> str:
        """Per-node launch: the one line for nodes whose workers did not all say Hello in time."""
        par = self.config.parallel
        parts = []
        for host, ranks in self.nodes.assignment.items():
            late = [r for r in ranks if r in missing]
            if late and len(late) == len(ranks):
                parts.append(f"{host} did not join ({self.nodes.stages_of(host)})")
            elif late:
                parts.append(f"{host}: rank{'s' * (len(late) > 1)} {', '.join(map(str, late))} did not say Hello")
        late_here = [r for r in missing if r in self._local_ranks]
        if late_here:
            parts.append(f"this host: rank{'s' * (len(late_here) > 1)} {', '.join(map(str, late_here))} did not say Hello")
        refused = self.socket.refused
        hint = (f"; {refused} control-plane connection{'s were' if refused > 1 else ' was'} refused meanwhile (a "
                f"node with another --node-keys-file?)" if refused else "")
        return (f"{'; '.join(parts)} within {timeout:.0f} s (--node-join-timeout){hint}: start `zpp serve` there "
                f"with --nnodes {par.nnodes}, its --node-rank, --master-addr {par.master_addr}, --master-port "
                f"{par.master_port} and the same --node-keys-file")

    def _log_nodes_joined(self) -> None:
        """Per-node launch: one line once every node has joined: each node rank's host and stages."""
        head = self.placement[min(self._local_ranks)].hostname if self._local_ranks else "?"
        where = [f"node rank 0 = {head} ({describe_stages(sorted(self._local_ranks), self.tp)})"]
        for host, ranks in self.nodes.assignment.items():
            h = self.placement[ranks[0]]
            where.append(f"{host} = {h.hostname} {h.address} ({describe_stages(ranks, self.tp)})")
        logger.info("all %d nodes joined: %s", self.config.parallel.nnodes, "; ".join(where))

    async def _expect_all(self, kind, timeout: float, check=None, on_timeout=None) -> dict[int, object]:
        """One ``kind`` message from every rank within ``timeout`` seconds. Raises WorkerDiedError
        (``on_timeout(missing ranks)`` gives its message when given)."""
        got: dict[int, object] = {}
        deadline = time.monotonic() + timeout
        while len(got) < self.world:
            if self.dead:
                raise WorkerDiedError(self.dead)
            left = deadline - time.monotonic()
            if left <= 0:
                missing = sorted(set(range(self.world)) - set(got))
                if on_timeout is not None:
                    raise WorkerDiedError(on_timeout(missing, timeout))
                raise WorkerDiedError(f"{'; '.join(map(self.describe_rank, missing))}: no {kind.__name__} "
                                      f"within {timeout:.0f}s")
            try:
                rank, msg = await self.socket.recv(timeout_s=min(left, 0.5))
            except TimeoutError:
                continue
            if isinstance(msg, m.Heartbeat):
                self._heard(msg)
                continue
            if isinstance(msg, m.WorkerError):
                raise WorkerDiedError(f"{self.describe_rank(rank)} failed during start-up: {msg.message}")
            if not isinstance(msg, kind):
                raise WorkerDiedError(f"worker {rank}: expected {kind.__name__}, got {type(msg).__name__}")
            if check:
                check(rank, msg)
            got[rank] = msg
        return got

    # --- steady state -------------------------------------------------------------------------
    def send(self, batch: m.ExecuteBatch, result_fields: Optional[dict] = None) -> None:
        """Send one micro-batch to every worker (encoded once). With structured outputs,
        ``result_fields`` (``ExecuteBatch.grammars`` and the fields that go with it) go to the
        result rank only (TP rank 0 of the last stage, the one that samples and holds the
        matchers); the other ranks get the batch without them."""
        if self.dead:
            raise WorkerDiedError(self.dead)
        if self._recovery is not None:  # void: STAGES_RESTARTING is queued, the core requeues it
            return
        if self.trace.enabled:
            self.trace.mark("send", batch.batch_id, args={"tokens": int(m.int32s(batch.num_tokens).sum()),
                                                          "seqs": len(batch.slots) // 4, "after_idle": batch.after_idle})
        now = time.monotonic()
        if not self.inflight:  # the pipeline was idle: the stall clock starts now
            self.last_progress = now
        self.inflight[batch.batch_id] = now
        try:
            if not result_fields:
                self.socket.send_bytes(range(self.world), m.encode(batch))
            else:
                result_rank = (self.pp - 1) * self.tp
                others = [r for r in range(self.world) if r != result_rank]
                if others:
                    self.socket.send_bytes(others, m.encode(batch))
                self.socket.send_bytes([result_rank], m.encode(msgspec.structs.replace(batch, **result_fields)))
        except PeerUnreachable as e:  # it died before the process watcher noticed: name it the same way
            self._lost(e.rank, self._death_of(e.rank))
            if self.dead:
                raise WorkerDiedError(self.dead) from None
            return
        self.trace.mark("sent", batch.batch_id)

    async def next_result(self) -> Optional[m.StepResult]:
        """The next StepResult (batches return in the order sent), or None once after
        :meth:`interrupt`. Raises WorkerDiedError, now and on every later call, once a worker died."""
        item = await self._results.get()
        if item is None:
            self._interrupt_pending = False
        elif isinstance(item, Exception):
            self._results.put_nowait(item)
            raise item
        return item

    def interrupt(self) -> None:
        """Make a waiting (or the next) :meth:`next_result` return None: the caller has new work."""
        if not self._interrupt_pending:
            self._interrupt_pending = True
            self._results.put_nowait(None)

    async def _read_loop(self) -> None:
        try:
            while True:
                rank, msg = await self.socket.recv()
                if self._recovery is not None and not isinstance(msg, (m.Heartbeat, m.StageStats)):
                    # A restart is under way: results of void micro-batches are dropped; the rest
                    # (Hello, WorkerReady, CacheReady, Rejoined, LinkDown, WorkerError) is its handshake.
                    if isinstance(msg, m.WorkerError):
                        self._last_error[rank] = msg.message
                        logger.warning("%s failed: %s", self.describe_rank(rank), msg.message)
                    elif not isinstance(msg, m.StepResult):
                        self._control.put_nowait((rank, msg))
                    continue
                if isinstance(msg, m.LinkDown):  # a survivor of a death not seen yet: the watchers will tell
                    logger.info("%s: %s", self.describe_rank(rank), msg.message)
                    continue
                if isinstance(msg, m.StepResult):
                    self.trace.mark("result", msg.batch_id)
                    self.stage_busy_s[-1] = msg.busy_s
                    self.stage_idle_s[-1] = msg.idle_s
                    self.stage_batches[-1] += 1
                    self.inflight.pop(msg.batch_id, None)
                    self.last_progress = time.monotonic()
                    self._results.put_nowait(msg)
                elif isinstance(msg, m.Heartbeat):
                    self._heard(msg)
                elif isinstance(msg, m.StageStats):
                    stage = rank // self.tp
                    self.stage_busy_s[stage] = msg.busy_s
                    self.stage_idle_s[stage] = msg.idle_s
                    self.stage_batches[stage] = msg.batches
                    if msg.step_batches and self.on_step_times is not None:
                        self.on_step_times(stage, msg.step_batches, msg.step_s)
                    if self.on_stage_stats is not None:
                        self.on_stage_stats()
                elif isinstance(msg, m.WorkerError):
                    # Often the echo of another failure (gloo: "connection closed by peer" when the
                    # next stage died): give the process / node monitor a moment to report the
                    # root cause first; whichever reason arrives first is the one reported.
                    reason = f"{self.describe_rank(rank)} failed: {msg.message}\n{msg.traceback}"
                    if not self._restarts_on():
                        asyncio.get_running_loop().call_later(_ROOT_CAUSE_GRACE_S, self._fail, reason)
                        return
                    # Supervised: the worker exits next and its death restarts it (the error is its cause).
                    self._last_error[rank] = msg.message
                    logger.error("%s", reason)
        except asyncio.CancelledError:
            pass
        except Exception as e:  # malformed frame etc.
            self._fail(f"bad message from a worker: {e!r}")

    def shutdown(self, timeout_s: float = 5.0) -> None:
        """Stop every worker: Shutdown message, then SIGTERM, then SIGKILL. Idempotent. After a
        failure (``dead``) the workers get at most 1 s to act on the message: a stopped or hung one
        never will, and the others may be blocked receiving from it."""
        if self._stopping:
            return
        self._stopping = True
        if self._recovery is not None:
            self._recovery.cancel()
        if self._reader is not None:
            self._reader.cancel()
        if self._watchdog_task is not None:
            self._watchdog_task.cancel()
        if self.dead:  # a worker died or went silent: the others may be stuck waiting on it
            timeout_s = min(timeout_s, 1.0)
        payload = m.encode(m.Shutdown())
        for rank in range(self.world):
            try:
                self.socket.send_bytes([rank], payload)
            except Exception:  # that worker is already gone (or the socket never opened)
                pass
        deadline = time.monotonic() + timeout_s
        for p in self.procs:
            p.join(max(0.0, deadline - time.monotonic()))
        for p in self.procs:
            if p.is_alive():
                # A stopped process (SIGSTOP) acts on SIGTERM only once continued: kill it now
                # rather than wait the 2 s below for nothing.
                if _stopped(p.pid):
                    p.kill()
                else:
                    p.terminate()
        for p in self.procs:
            p.join(2.0)
            if p.is_alive():
                p.kill()
                p.join(1.0)
        if self.nodes is not None:
            self.nodes.stop()
        if self.socket is not None:
            self.socket.close()
        self._store = None
        self.trace.dump()


def _stopped(pid: Optional[int]) -> bool:
    """Is the process stopped (state T: SIGSTOP, or traced)?"""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] in ("T", "t")
    except (OSError, IndexError):
        return False


def _worker_entry(address: str, rank: int, keys: RunKeys, level: int) -> None:
    from zpp.workers.worker import worker_main
    worker_main(address, rank, keys, level)


def _num_layers(config: EngineConfig) -> int:
    from zpp.models.registry import resolve_model_class
    cfg = config.model.hf_config
    return resolve_model_class(cfg).num_layers_of(cfg)
