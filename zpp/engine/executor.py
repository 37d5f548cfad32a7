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
import contextlib
import dataclasses
import functools
import logging
import multiprocessing as mp
import os
import secrets
import signal
import sys
import threading
import time
from multiprocessing.connection import wait as mp_wait
from typing import Callable, Optional, Protocol

import msgspec

from zpp.config import STAGE_RESTART_WINDOW_S, ConfigError, EngineConfig, cpu_threads_per_worker
from zpp.models.partition import AUTO, balanced_partition, partition_layers, stage_times
from zpp.transport import messages as m
from zpp.transport.channels import EngineSocket, PeerUnreachable, local_ipc_address, tcp_address
from zpp.trace import Trace
from zpp.transport.p2p import serve_rendezvous_store
from zpp.node.placement import describe_stages
from zpp.transport.security import RunKeys, keys_for_run

logger = logging.getLogger(__name__)


_ROOT_CAUSE_GRACE_S = 2.0
"""How long a worker's own error report waits for a process death or a lost node to explain it
(the node agent's report of a remote worker's death took over a second on a loaded 2-core CI VM)."""


_START_ABORT_GRACE_S = 1.0
"""How long workers get to act on Shutdown when start-up fails or is aborted before SIGTERM."""


class WorkerDiedError(RuntimeError):
    """A worker process exited or reported an error; the engine cannot continue."""


class _Marker:
    def __init__(self, name: str):
        self.name = name

    def __repr__(self) -> str:
        return self.name


STAGES_RESTARTING = _Marker("STAGES_RESTARTING")
"""Put in the result stream when a stage is lost and will be restarted: the micro-batches in flight
are void (their results never come); the core requeues every running request and schedules
nothing until :data:`STAGES_RECOVERED`."""

STAGES_RECOVERED = _Marker("STAGES_RECOVERED")
"""The restarted stages and the survivors form one pipeline again: scheduling resumes."""


class _TryFailed(Exception):
    """One restart try failed (a rank died or did not answer in time); the reason is the message."""


class _GiveUp(Exception):
    """A restart cannot succeed whatever the tries left (the message says why): fail-stop now."""


class StageExecutor(Protocol):
    """What the engine core needs from the stages (implemented by :class:`Executor`; a test or
    benchmark can stand in with an object of the same shape, e.g. ``scripts/host_overhead.py``).

    * ``send(batch, grammar_rows, grammar_bitmask)``: one micro-batch to every stage (with
      structured outputs, the constrained rows, and their token bitmask if given, to the sampling
      rank only); raises WorkerDiedError once dead.
    * ``send_grammar_bitmask(batch_id, bitmask)``: the token bitmask of a batch sent with
      ``grammar_rows`` and no bitmask, to the sampling rank (:class:`~zpp.transport.messages.GrammarBitmask`).
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

    def send(self, batch: m.ExecuteBatch, grammar_rows: list[int] = (), grammar_bitmask: bytes = b"") -> None: ...

    def send_grammar_bitmask(self, batch_id: int, bitmask: bytes) -> None: ...

    async def next_result(self) -> Optional[m.StepResult]: ...

    def interrupt(self) -> None: ...

    def shutdown(self) -> None: ...


class Executor:
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
        self.dead: Optional[str] = None
        self.on_stage_stats: Optional[Callable[[], None]] = None
        """Called (on the engine's loop) after a stage's StageStats updated the busy / idle figures."""
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
        ctx = self._ctx = mp.get_context("spawn")
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
        self._spawn_local(local_ranks)
        self._monitor = threading.Thread(target=self._watch_procs, name="zpp-proc-monitor", daemon=True)
        self._loop = asyncio.get_running_loop()
        self._monitor.start()

        self._local_ranks = set(local_ranks)
        cpu_threads = cpu_threads_per_worker(len(local_ranks))
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
        self._cpu_threads = cpu_threads
        for rank in range(self.world):
            self.socket.send(rank, self._init_worker(rank))
        if cfg.parallel.pp_layer_partition == AUTO and self.pp > 1:
            await self._balance_layers()
        ready = await self._expect_all(m.WorkerReady, timeout=1800)
        fit = min(r.num_kv_blocks_fit for r in ready.values())
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
        with _main_module_hidden(), _sigint_blocked():
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
    def send(self, batch: m.ExecuteBatch, grammar_rows: list[int] = (), grammar_bitmask: bytes = b"") -> None:
        """Send one micro-batch to every worker (encoded once). With structured outputs, the
        constrained rows and their token bitmask (see ``ExecuteBatch.grammar_rows``) go to the
        result rank only (TP rank 0 of the last stage, the one that samples); the other ranks get
        the batch without them. Without ``grammar_bitmask`` the result rank waits, when it samples
        the batch, for :meth:`send_grammar_bitmask`."""
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
            if not grammar_rows:
                self.socket.send_bytes(range(self.world), m.encode(batch))
            else:
                result_rank = (self.pp - 1) * self.tp
                others = [r for r in range(self.world) if r != result_rank]
                if others:
                    self.socket.send_bytes(others, m.encode(batch))
                self.socket.send_bytes([result_rank], m.encode(msgspec.structs.replace(
                    batch, grammar_rows=list(grammar_rows), grammar_bitmask=grammar_bitmask)))
        except PeerUnreachable as e:  # it died before the process watcher noticed: name it the same way
            self._lost(e.rank, self._death_of(e.rank))
            if self.dead:
                raise WorkerDiedError(self.dead) from None
            return
        self.trace.mark("sent", batch.batch_id)

    def send_grammar_bitmask(self, batch_id: int, bitmask: bytes) -> None:
        """The token bitmask of micro-batch ``batch_id`` (sent before with ``grammar_rows`` and no
        bitmask) to the result rank. Raises WorkerDiedError once dead; a no-op while a stage
        restart voids the batches in flight."""
        if self.dead:
            raise WorkerDiedError(self.dead)
        if self._recovery is not None:
            return
        rank = (self.pp - 1) * self.tp
        try:
            self.socket.send_bytes([rank], m.encode(m.GrammarBitmask(batch_id, bitmask)))
        except PeerUnreachable as e:
            self._lost(e.rank, self._death_of(e.rank))
            if self.dead:
                raise WorkerDiedError(self.dead) from None
            return
        self.trace.mark("bitmask_sent", batch_id)

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

    # --- stall watchdog ---------------------------------------------------------------------------
    def _heard(self, hb: m.Heartbeat) -> None:
        now = time.monotonic()
        old = self.heartbeats.get(hb.rank)
        if old is not None and hb.last_done > old.last_done:
            self.last_progress = now  # some stage finished a micro-batch
        self.heartbeats[hb.rank] = hb
        self.last_heard[hb.rank] = now

    async def _watchdog(self, tick_s: float = 0.5) -> None:
        """Fail the engine when a worker goes silent (no heartbeat for --worker-heartbeat-timeout:
        stopped or hung process or host) or the pipeline makes no progress for --stage-timeout
        while a micro-batch is in flight (a live worker stuck, e.g. in a wedged gloo/NCCL call);
        warn once at half that limit. Either names the stage and host and what it waits for."""
        par = self.config.parallel
        last_tick = time.monotonic()
        warned: set[int] = set()
        while not self.dead and not self._stopping:
            await asyncio.sleep(tick_s)
            now = time.monotonic()
            if now - last_tick > 4 * tick_s:
                # This loop itself was held up: heartbeats queued meanwhile are not the workers' fault.
                self.last_heard = {r: max(t, now) for r, t in self.last_heard.items()}
                self.last_progress = max(self.last_progress, now)
            last_tick = now
            silent = [(r, t) for r, t in self.last_heard.items()
                      if now - t > par.worker_heartbeat_timeout and r not in self._lost_ranks]
            for rank, t in silent:
                self._lost(rank, f"{self.describe_rank(rank)} sent no heartbeat for {now - t:.0f} s "
                                 f"(--worker-heartbeat-timeout {par.worker_heartbeat_timeout:g}): its process is "
                                 f"stopped or hung", kill=True)
            if self.dead or silent:
                continue
            if self._probed and self._recovery is None:
                # Remote ranks no SSH session watches (per-node launch, --node-launcher manual): a
                # connection that dropped (its process or host died) is seen within a tick, not
                # after --worker-heartbeat-timeout. Only ranks heard from are probed: a worker
                # connects its heartbeat socket once it has its configuration.
                for rank in sorted(self._probed & set(self.heartbeats)):
                    if rank not in self._lost_ranks and not self.socket.connected(rank):
                        self._lost(rank, f"{self.describe_rank(rank)}: its connection to the engine closed (its "
                                         f"process or its host died)")
                        break
                if self.dead:
                    continue
            if not self.inflight or self._recovery is not None:
                continue
            oldest = min(self.inflight)
            stalled = now - self.last_progress
            if stalled > par.stage_timeout:
                rank, doing = self._stuck_rank(oldest)
                self._lost(rank, f"micro-batch {oldest} made no progress for {stalled:.0f} s (--stage-timeout "
                                 f"{par.stage_timeout:g}): {doing}", kill=True)
                continue
            if stalled > par.stage_timeout / 2 and oldest not in warned:
                warned.add(oldest)
                logger.warning("micro-batch %d has made no progress for %.0f s (the engine fails at "
                               "--stage-timeout %g): %s", oldest, stalled, par.stage_timeout, self._stuck_at(oldest))

    def _stuck_at(self, batch_id: int) -> str:
        """The first stage that has not finished ``batch_id``, and what it is doing."""
        return self._stuck_rank(batch_id)[1]

    def _stuck_rank(self, batch_id: int) -> tuple[int, str]:
        """(rank, description) of the first stage that has not finished ``batch_id``: the one to
        restart when the pipeline stalls (the stages after it wait for it)."""
        for rank in range(self.world):
            hb = self.heartbeats.get(rank)
            if hb is not None and hb.last_done >= batch_id:
                continue
            if hb is None or hb.batch_id != batch_id:
                doing = "has not started it (still on an earlier micro-batch, or its message is late)"
            elif hb.waiting:
                doing = f"has waited {hb.seconds:.0f} s for activations from stage {rank // self.tp - 1}"
            else:
                doing = f"has been computing it for {hb.seconds:.0f} s"
            return rank, f"{self.describe_rank(rank)} {doing}"
        last = self.world - self.tp
        return last, f"every stage finished it, but its result has not arrived ({self.describe_rank(last)})"

    def _watch_procs(self) -> None:
        """Thread: report every local worker's death and every node agent's lost session to the
        loop (processes started by a restart are watched from their start; ones the executor killed
        on purpose are not reported)."""
        while not self._stopping:
            procs = [p for p in self.procs if p.pid not in self._reported]
            sentinels = {p.sentinel: p for p in procs}
            ready = mp_wait(list(sentinels), timeout=0.5) if sentinels else time.sleep(0.5) or []
            for s in ready:
                p = sentinels.pop(s)
                self._reported.add(p.pid)
                rank = int(p.name.rsplit("-", 1)[1])
                if self._stopping or p.pid in self._killed:
                    continue
                msg = self._death_of(rank, p)
                if p.exitcode == 1 and not self._restarts_on():
                    # A worker that failed by itself, after its WorkerError: often the echo of a
                    # neighbour's death (a remote stage's, reported by its node agent later), so the
                    # root cause gets the same grace as that WorkerError (the earlier of the two
                    # reasons is the one reported).
                    self._notify(self._loop.call_later, _ROOT_CAUSE_GRACE_S, self._fail, msg)
                else:
                    self._notify(functools.partial(self._lost, rank, msg, pid=p.pid))
            if self.nodes is not None and not self._stopping:
                for host, (err, session) in self.nodes.poll_lost().items():
                    ranks = self.nodes.assignment.get(host, [])
                    self._notify(functools.partial(self._lost, ranks[0] if ranks else 0, err, session=session))

    def _notify(self, fn, *args) -> None:
        """From the watcher thread: run ``fn(*args)`` on the engine's loop; nothing once that loop is
        closed (the engine stopped while a death was being looked into)."""
        try:
            self._loop.call_soon_threadsafe(fn, *args)
        except RuntimeError:  # the loop is closed
            pass

    def _death_of(self, rank: int, proc=None) -> str:
        """Why ``rank`` is gone: its local process's exit (waited for up to 1 s: the sentinel, or a
        dropped connection, comes before the exit code is collected), else its lost connection."""
        for p in ([proc] if proc is not None else self.procs):
            if p.name.rsplit("-", 1)[1] == str(rank):
                p.join(1.0)
                code = p.exitcode
                deadline = time.monotonic() + 1.0
                while code is None and time.monotonic() < deadline:
                    # Another thread may have reaped the process and not yet stored its code
                    # (multiprocessing's poll reads None meanwhile): look again shortly.
                    time.sleep(0.02)
                    code = p.exitcode
                if code is None:
                    return f"{self.describe_rank(rank)}: its worker process (pid {p.pid}) closed its connection to the engine"
                how = f"was killed by {signal.Signals(-code).name}" if code < 0 and -code in signal.valid_signals() \
                    else f"exited with code {code}"
                err = self._last_error.pop(rank, None)
                return f"{self.describe_rank(rank)}: its worker process (pid {p.pid}) {how}" + (f" ({err})" if err else "")
        return f"{self.describe_rank(rank)}: its connection to the engine closed (its process or its host died)"

    def _fail(self, reason: str) -> None:
        if self.dead or self._stopping:
            return
        self.dead = reason
        logger.error("%s", reason)
        if self._recovery is not None and self._recovery is not asyncio.current_task():
            self._recovery.cancel()
        self._results.put_nowait(WorkerDiedError(reason))

    # --- stage supervision ------------------------------------------------------------------------
    def _restarts_on(self) -> bool:
        return self._supervised and self.max_restarts > 0

    def _why_not_restartable(self, rank: int) -> Optional[str]:
        par = self.config.parallel
        if par.device == "cuda" and not par.share_gpu and self.world > 1:
            return "stage restarts need gloo channels (NCCL cannot re-form a communicator with a new process)"
        if self.nodes is not None and rank not in self._local_ranks and par.node_launcher == "manual":
            return "its host's agent was started by hand (--node-launcher manual)"
        if self.nodes is not None and rank not in self._local_ranks and self.nodes.launcher == "pernode":
            return (f"{self.nodes.host_of_rank(rank)} runs its own zpp serve (--nnodes), which the head cannot start "
                    f"again: its launcher restarts the group")
        return None

    def _restart_budget_left(self) -> bool:
        now = time.monotonic()
        self._restart_times = [t for t in self._restart_times if now - t < STAGE_RESTART_WINDOW_S]
        return len(self._restart_times) < self.max_restarts

    def _ranks_of_loss(self, rank: int) -> set[int]:
        """The ranks to start again when ``rank`` is lost: itself on this host; every rank of its
        host elsewhere (its agent stops them all and is started again over SSH)."""
        if self.nodes is None or rank in self._local_ranks:
            return {rank}
        host = self.nodes.host_of_rank(rank)
        return set(self.nodes.assignment.get(host, [rank]))

    @property
    def recovering(self) -> bool:
        """A lost stage is being restarted (the pipeline is paused)."""
        return self._recovery is not None

    def _lost(self, rank: int, reason: str, kill: bool = False, pid: Optional[int] = None,
              session: object = None) -> None:
        """``rank``'s worker (or host) is gone, silent or stuck: restart it in place while the other
        stages keep their processes (see :meth:`_recover`), or fail the engine when restarts are off,
        spent, impossible, or the engine is still starting. ``kill``: the process may still be alive
        (stopped or stuck) and is killed first. ``pid`` / ``session``: the process or node session
        the report is about; a report about one a restart has already replaced is ignored. Runs on
        the engine's loop."""
        if self.dead or self._stopping:
            return
        if pid is not None and not any(p.pid == pid for p in self.procs):
            return  # an earlier incarnation of the rank (killed by a restart), reported late
        if session is not None and (self.nodes is None or not self.nodes.is_current(session)):
            return
        why_not = self._why_not_restartable(rank) if self._restarts_on() else None
        if not self._restarts_on() or why_not:
            self._fail(reason + (f" (not restarted: {why_not})" if why_not else ""))
            return
        ranks = self._ranks_of_loss(rank)
        if self._recovery is None and ranks <= self._lost_ranks:
            return  # already known (several watchers saw the same loss)
        if kill:
            for r in ranks & self._local_ranks:
                self._kill_local(r)
        self._lost_ranks |= ranks
        self._causes.append(" ".join(reason.split("\n", 1)[0].split()))
        self.trace.mark("stage_lost", -1, args={"rank": rank, "reason": reason[:200]})
        if self._recovery is None:
            logger.warning("%s; restarting %s (the other stages keep running; requests resume)", reason,
                           ", ".join(f"stage {r // self.tp}" + (f" rank {r}" if self.tp > 1 else "")
                                     for r in sorted(ranks)))
            self.inflight.clear()
            self._recovery = asyncio.ensure_future(self._recover())
            self._results.put_nowait(STAGES_RESTARTING)
            self._stats_changed()
        else:
            logger.warning("%s (during the restart)", reason)
            self._control.put_nowait((rank, None))

    def _stats_changed(self) -> None:
        if self.on_stage_stats is not None:
            self.on_stage_stats()

    def _kill_local(self, rank: int) -> None:
        for p in self.procs:
            if p.name == f"zpp-worker-{rank}" and p.is_alive():
                self._killed.add(p.pid)
                p.kill()
                p.join(2.0)

    async def _recover(self) -> None:
        """Bring the lost ranks back: each try kills what is left of them, starts them again (this
        host: a new process; another host: a new ``zpp-node`` session), has every rank form process
        group generation ``g + 1`` (survivors: Rejoin; new ranks: InitWorker), loads the new ranks'
        weights and KV cache, and then resumes scheduling (:data:`STAGES_RECOVERED`). Each try
        counts against ``--max-stage-restarts``; when none is left the engine fails with every
        try's cause in one line."""
        t0 = time.monotonic()
        tries = 0
        try:
            while True:
                ranks = set(self._lost_ranks)
                if not self._restart_budget_left():
                    stages = ", ".join(sorted({self.describe_rank(r) for r in ranks}))
                    causes = "; ".join(f"try {i}: {c}" if i else c for i, c in enumerate(self._causes))
                    self._fail(f"{stages}: not restarted, --max-stage-restarts {self.max_restarts} used up within "
                               f"{STAGE_RESTART_WINDOW_S / 60:g} min: {causes}")
                    return
                self._restart_times.append(time.monotonic())
                tries += 1
                for stage in {r // self.tp for r in ranks}:
                    self.stage_restarts[stage] += 1
                try:
                    await self._restart_try(ranks)
                except _TryFailed as e:
                    logger.warning("restart try %d failed: %s", tries, e)
                    if not self._causes or self._causes[-1] != str(e):  # a death is recorded by _lost
                        self._causes.append(str(e))
                    continue
                if self._lost_ranks - ranks:  # another rank was lost meanwhile: restart it too
                    continue
                break
        except asyncio.CancelledError:
            return
        except _GiveUp as e:
            self._fail(str(e))
            return
        except Exception as e:  # a bug in the recovery: fail loudly, never hang
            logger.exception("stage restart failed")
            self._fail(f"stage restart failed: {e!r}")
            return
        took = time.monotonic() - t0
        self.recovery_seconds.append(took)
        logger.info("pipeline formed again in %.1fs (generation %d, %d try/tries); requests resume", took,
                    self.generation, tries)
        self.trace.mark("stages_recovered", -1, args={"seconds": took})
        self._lost_ranks.clear()
        self._causes.clear()
        self._recovery = None
        self.last_progress = time.monotonic()
        self._results.put_nowait(STAGES_RECOVERED)
        self._stats_changed()

    async def _restart_try(self, ranks: set[int]) -> None:
        """One try of :meth:`_recover` for ``ranks``. Raises _TryFailed."""
        while not self._control.empty():  # what came for an earlier try
            self._control.get_nowait()
        for r in ranks & self._local_ranks:
            self._kill_local(r)
        hosts = {self.nodes.host_of_rank(r) for r in ranks - self._local_ranks} if self.nodes else set()
        self.generation += 1
        gen = self.generation
        self._lost_ranks = set(ranks)
        now = time.monotonic()
        for r in ranks:
            self.last_heard.pop(r, None)
            self.heartbeats.pop(r, None)
        survivors = [r for r in range(self.world) if r not in ranks]
        for r in survivors:
            self.last_heard[r] = max(self.last_heard.get(r, now), now)
        logger.info("restarting %s (process group generation %d)", ", ".join(map(self.describe_rank, sorted(ranks))), gen)
        self._spawn_local(sorted(ranks & self._local_ranks))
        for host in hosts:
            await asyncio.get_running_loop().run_in_executor(None, self.nodes.restart, host)

        hello_s = 120.0
        waiting_hello, waiting_ready, waiting_cache = set(ranks), set(ranks), set(ranks)
        waiting_rejoin = set(survivors)
        deadline = time.monotonic() + hello_s
        what = "its Hello"
        while waiting_hello or waiting_ready or waiting_cache or waiting_rejoin:
            left = deadline - time.monotonic()
            if left <= 0:
                late = sorted(waiting_hello or waiting_rejoin or waiting_ready or waiting_cache)
                raise _TryFailed(f"{'; '.join(map(self.describe_rank, late))}: no {what} within {hello_s:.0f} s")
            try:
                rank, msg = await asyncio.wait_for(self._control.get(), timeout=min(left, 1.0))
            except asyncio.TimeoutError:
                continue
            if msg is None:  # a rank died during this try
                raise _TryFailed(self._causes[-1] if self._causes else f"{self.describe_rank(rank)} died")
            if isinstance(msg, m.Hello) and rank in waiting_hello:
                self._check_hello(rank, msg)
                self.placement[rank] = msg
                self.last_heard[rank] = time.monotonic()
                waiting_hello.discard(rank)
                self.socket.send(rank, self._init_worker(rank, self.num_blocks))
                if not waiting_hello:  # every new rank is alive and about to form the groups
                    for r in survivors:
                        self.socket.send(r, m.Rejoin(generation=gen))
                    deadline, what = time.monotonic() + 1800.0, "answer (weights, KV cache, process groups)"
            elif isinstance(msg, m.Rejoined) and msg.generation == gen:
                waiting_rejoin.discard(rank)
            elif isinstance(msg, m.WorkerReady) and rank in waiting_ready:
                waiting_ready.discard(rank)
                if msg.num_kv_blocks_fit < self.num_blocks:
                    raise _GiveUp(f"{self.describe_rank(rank)}: restarted, but it holds only {msg.num_kv_blocks_fit} "
                                  f"KV blocks, not the engine's {self.num_blocks}")
                self.socket.send(rank, m.InitKVCache(num_blocks=self.num_blocks))
            elif isinstance(msg, m.CacheReady) and rank in waiting_cache:
                waiting_cache.discard(rank)
            elif isinstance(msg, m.LinkDown):
                logger.info("%s: %s", self.describe_rank(rank), msg.message)
        for r in sorted(ranks):
            self._log_placement(r, " (restarted)")

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


@contextlib.contextmanager
def _main_module_hidden():
    """Spawn workers without re-running the user's ``__main__`` in them.

    multiprocessing's spawn re-imports the parent's main script in every child, so a script that
    creates an ``LLM`` at top level without an ``if __name__ == "__main__"`` guard would recurse.
    Workers need nothing from ``__main__`` (their target is a zpp function), so hide it while
    starting them.
    """
    main = sys.modules.get("__main__")
    saved = {k: getattr(main, k) for k in ("__file__", "__spec__") if main is not None and hasattr(main, k)}
    try:
        for k in saved:
            if k == "__file__":
                delattr(main, k)
            else:
                setattr(main, k, None)
        yield
    finally:
        for k, v in saved.items():
            setattr(main, k, v)


@contextlib.contextmanager
def _sigint_blocked():
    """Block SIGINT in the calling thread while it spawns child processes.

    Children inherit the signal mask through fork and exec, so a child starts with SIGINT blocked
    and a terminal's Ctrl-C (sent to the whole process group) never reaches it, not even while it
    imports, before it could ignore the signal (it would print a KeyboardInterrupt traceback and
    die, racing the parent's orderly stop). Every zpp child leaves stopping to its parent. A SIGINT
    that arrives here meanwhile stays pending and is handled when the block ends: none is lost.
    """
    # The first spawn starts multiprocessing's resource tracker, and starting it unblocks SIGINT
    # (SIG_UNBLOCK, not a restore): start it before blocking, or the first child would not be.
    from multiprocessing import resource_tracker
    resource_tracker.ensure_running()
    old = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, old)


def _worker_entry(address: str, rank: int, keys: RunKeys, level: int) -> None:
    from zpp.workers.worker import worker_main
    worker_main(address, rank, keys, level)


def _num_layers(config: EngineConfig) -> int:
    from zpp.models.registry import resolve_model_class
    cfg = config.model.hf_config
    return resolve_model_class(cfg).num_layers_of(cfg)
