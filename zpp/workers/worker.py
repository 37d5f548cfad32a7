"""Worker process main: one pipeline stage (or one tensor-parallel rank of it) on one device.

A worker starts knowing only the engine's address, its rank and a key. Everything else (model,
layer range, dtype, device, rendezvous) arrives over ZeroMQ in ``InitWorker``; the same entry point
serves workers spawned locally and workers started by ``zpp-node`` on another host.

A worker never outlives its engine: it asks the kernel to kill it when its parent dies
(``PR_SET_PDEATHSIG``), a watchdog thread exits when the parent pid changes, and it exits at once
when its parent (the pid the parent recorded, not ``os.getppid()``) died while it was starting
(``zpp.utils.process.watch_parent``).
"""
from __future__ import annotations

import json
import logging
import os
import signal
import socket
import sys
import threading
import time
import traceback

from zpp import envs
from zpp.spec_config import stage_model_config
from zpp.utils.process import freeze_gc, watch_parent
from zpp.workers.kv_budget import cpu_kv_blocks, cuda_kv_blocks, usable_gpu_memory

logger = logging.getLogger("zpp.worker")


def worker_main(engine_address: str, rank: int, keys, log_level: int = logging.INFO) -> None:
    """Entry point of a worker process. Exits with status 0 on Shutdown, 1 on any error.

    Args:
        engine_address: the engine's ZeroMQ endpoint (``ipc://...`` on one host, ``tcp://HOST:PORT``
            in multi-host runs).
        rank: global rank, ``pp_rank * tensor_parallel_size + tp_rank``.
        keys: the run's :class:`~zpp.transport.security.RunKeys` (CURVE keys over TCP).
    """
    watch_parent()
    from zpp.proctitle import set_process_title, stage_title
    set_process_title(f"zpp::worker{rank}")  # its stage is known once the engine's InitWorker comes
    logging.basicConfig(level=log_level, format=f"%(asctime)s %(levelname)s [worker {rank}] %(message)s")
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the engine decides when workers stop
    from zpp.transport import messages as m
    from zpp.transport.addresses import bind_interface_for
    from zpp.transport.channels import WorkerSocket

    address = interface = ""
    if engine_address.startswith("tcp://"):
        # Multi-host: use (and point gloo / NCCL at) the interface that reaches the engine.
        head = engine_address[len("tcp://"):].rsplit(":", 1)[0].strip("[]")
        address, ifname = bind_interface_for(head)
        interface = ifname or ""
    sock = WorkerSocket(engine_address, rank, keys, exit_on_disconnect=bool(address))
    try:
        sock.send(m.Hello(rank=rank, key=keys.key, pid=os.getpid(), hostname=socket.gethostname(),
                          address=address, interface=interface))
        init = sock.recv(timeout_s=120)
        if isinstance(init, m.Shutdown):
            raise _ShutdownDuringSetup("before InitWorker")
        if not isinstance(init, m.InitWorker):
            raise RuntimeError(f"expected InitWorker, got {type(init).__name__}")
        set_process_title(stage_title(init.pp_rank, init.tp_rank, init.config.parallel.tensor_parallel_size))
        from zpp.workers.runner_state import Activity
        activity = Activity()
        _start_heartbeat(engine_address, rank, keys, activity)
        runner = _setup(init, sock)
        runner.activity = activity
        freeze_gc()
        _serve(runner, sock, init)
    except SystemExit:
        raise
    except _ShutdownDuringSetup as e:
        # The engine gave up during start-up (e.g. no room for the KV cache) and reports why
        # itself: an orderly exit, nothing to report here.
        logger.debug("Shutdown during set-up (%s): exiting", e)
    except BaseException as e:  # report, then die: the engine fails every request
        logger.error("worker failed: %s", e)
        try:
            sock.send(m.WorkerError(rank=rank, message=f"{type(e).__name__}: {e}", traceback=traceback.format_exc()))
            time.sleep(0.2)
        except Exception:
            pass
        os._exit(1)
    sock.close()
    os._exit(0)


class _ShutdownDuringSetup(Exception):
    """The engine sent Shutdown while this worker was still setting up (orderly, not a failure)."""


HEARTBEAT_INTERVAL_S = 1.0

STATS_PERIOD_S = 0.25
"""Most seconds between a busy stage's StageStats (busy time and the step times the engine's cost
model learns from: ``zpp.engine.step_cost``); a CPU step of the demo model takes 0.05-0.5 s."""


def _start_heartbeat(engine_address: str, rank: int, keys, activity) -> None:
    """Send a Heartbeat every second from a thread of its own (own ZeroMQ socket): it keeps going
    while the main thread computes or waits on the previous stage, and stops only when the whole
    process does (SIGSTOP, a hung host), which is what the engine's watchdog looks for.

    The same thread takes the engine's AbortLinks (on this socket, since the main thread may be
    blocked in a receive or all-reduce on the lost peer) and has a short-lived thread abort this
    worker's process groups of that generation (``zpp.transport.p2p.abort_links``), which releases
    the main thread with a LinkError; the main thread then reports LinkDown and waits for Rejoin."""
    from zpp.transport import messages as m
    from zpp.transport.channels import WorkerSocket
    from zpp.transport.p2p import abort_links

    def loop():
        sock = WorkerSocket(engine_address, rank, keys, kind="hb")
        next_beat = 0.0
        while True:
            now = time.monotonic()
            if now >= next_beat:
                batch_id, waiting, since = activity.state
                sock.send(m.Heartbeat(rank=rank, last_done=activity.last_done, batch_id=batch_id, waiting=waiting,
                                      seconds=now - since))
                next_beat = now + HEARTBEAT_INTERVAL_S
            if not sock.poll(max(1, int((next_beat - time.monotonic()) * 1000))):
                continue
            frame = sock.sock.recv()
            if not frame:  # the engine's connection probes (empty frames, see EngineSocket.connected)
                continue
            try:
                msg = m.to_heartbeat_decoder.decode(frame)
            except Exception as e:  # malformed: never fatal to this thread
                logger.warning("bad message on the heartbeat socket: %s", e)
                continue
            if isinstance(msg, m.AbortLinks):
                # On a thread of its own: ncclCommAbort may take a while, and heartbeats must go on
                # (a silent survivor would be restarted too).
                threading.Thread(target=abort, args=(msg,), name="zpp-abort-links", daemon=True).start()

    def abort(msg) -> None:
        if abort_links(msg.generation, msg.reason):
            logger.info("the engine lost a rank (%s): aborted this worker's process groups of generation %d",
                        msg.reason, msg.generation)

    threading.Thread(target=loop, name="zpp-heartbeat", daemon=True).start()


def keep_freed_memory() -> bool:
    """CPU stages: have glibc keep freed memory instead of giving it back to the OS at once.

    A CPU forward allocates and frees buffers of megabytes per layer (gathered K/V context,
    attention and MLP outputs). With glibc's defaults such blocks are returned to the OS when
    freed (mmap'd chunks, or trimming the heap top) and the next layer page-faults them in again:
    measured on the 2-core VM, one stage-step of the demo model at context 6000 took 1040 ms with
    the defaults and 590 ms with this (``index_select`` 4.7 -> 1.0 ms, attention 13 -> 7.7 ms,
    matmuls 3.8 -> 2.1 ms per call). Sets ``M_MMAP_THRESHOLD`` to 32 MiB (glibc's maximum; larger
    allocations such as weights and the KV cache are still mapped) and ``M_TRIM_THRESHOLD`` to 1
    GiB via ``mallopt(3)``. Returns False where glibc is not the allocator (nothing changed)."""
    import ctypes
    try:
        libc = ctypes.CDLL("libc.so.6")
        M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3
        return bool(libc.mallopt(M_TRIM_THRESHOLD, 1 << 30)) and bool(libc.mallopt(M_MMAP_THRESHOLD, 32 << 20))
    except (OSError, AttributeError):
        return False


def _setup(init, sock):
    import torch

    from zpp.config import parse_dtype
    from zpp.models.base import StageInfo
    from zpp.models.loader import load_stage_model
    from zpp.models.weight_bytes import format_gib_by_dtype, weight_bytes_by_dtype
    from zpp.models.registry import normalize_config
    from zpp.transport import messages as m
    from zpp.transport.p2p import RESTART_RENDEZVOUS
    from zpp.workers.model_runner import ModelRunner

    from zpp.config import cpu_threads_per_worker
    cfg_all = init.config
    pp_size, tp_size = cfg_all.parallel.pipeline_parallel_size, cfg_all.parallel.tensor_parallel_size
    device_kind, model_dir = cfg_all.parallel.device, cfg_all.model.model
    block_size, max_model_len = cfg_all.cache.block_size, cfg_all.max_model_len
    seed, enforce_eager = cfg_all.model.seed, cfg_all.enforce_eager
    # 0: a worker on another host; its agent set OMP_NUM_THREADS for that host's cores and workers.
    num_threads = init.num_threads if init.num_threads > 0 else cpu_threads_per_worker(1)
    torch.set_num_threads(num_threads)
    if device_kind == "cuda":
        torch.cuda.set_device(init.device_index)
        device = torch.device("cuda", init.device_index)
    else:
        device = torch.device("cpu")
        keep_freed_memory()
    dtype = parse_dtype(cfg_all.model.dtype, device_kind)
    link = _form_groups(init, device, init.generation, RESTART_RENDEZVOUS if init.generation else None)
    with open(os.path.join(model_dir, "config.json")) as f:
        cfg = normalize_config(json.load(f))
    layer_start, layer_end = init.layer_start, init.layer_end
    if cfg_all.parallel.pp_layer_partition == "auto" and pp_size > 1 and init.generation == 0:
        layer_start, layer_end = _measure_and_assign(init, sock, cfg, device, dtype)
    stage = StageInfo(init.pp_rank, pp_size, layer_start, layer_end, init.tp_rank, tp_size)
    _fault_crash_on_restart(init)
    t = time.perf_counter()
    spec = cfg_all.speculative_config
    mtp = spec is not None and spec.method == "mtp"
    model = load_stage_model(model_dir, stage_model_config(cfg, spec), stage, dtype, device, max_model_len,
                             cfg_all.model.load_format, seed, quantization=cfg_all.model.quantization)
    if cfg_all.kv_cache_fp8:
        _warn_kv_scales(model)
    by_dtype = weight_bytes_by_dtype(model)
    weight_bytes = sum(by_dtype.values())
    logger.info("stage %d/%d%s: layers [%d, %d) loaded in %.1fs (%.1f MiB)", init.pp_rank, pp_size,
                f" TP rank {init.tp_rank}/{tp_size}" if tp_size > 1 else "",
                layer_start, layer_end, time.perf_counter() - t, weight_bytes / 2**20)
    runner = ModelRunner(model, device, dtype, block_size, link, set(init.eos_token_ids), seed,
                         trace_name=f"rank{init.rank}-stage{init.pp_rank}",
                         async_scheduling=cfg_all.async_scheduling, max_model_len=max_model_len,
                         max_num_seqs=cfg_all.scheduler.max_num_seqs,
                         kv_cache_dtype=torch.float8_e4m3fn if cfg_all.kv_cache_fp8 else None)
    if mtp and stage.produces_results:
        from zpp.workers.mtp import MTPDrafter
        runner.mtp = MTPDrafter(runner, spec.num_speculative_tokens)
    if runner.trace.enabled and device_kind == "cuda":
        runner.trace.cuda_clock()
    if device_kind == "cpu" and num_threads > 1 and envs.ZPP_CPU_ADAPTIVE_THREADS:
        from zpp.workers.adaptive_threads import ThreadGovernor
        runner.thread_governor = ThreadGovernor(num_threads, torch.set_num_threads)

    per_block = runner.kv_bytes_per_block()
    kv_error = ""
    if device_kind == "cuda":
        fit = cuda_kv_blocks(init, runner, device, per_block)
    else:
        fit, kv_error = cpu_kv_blocks(cfg_all.cache.kv_cache_memory, per_block)
    sock.send(m.WorkerReady(rank=init.rank, num_kv_blocks_fit=max(0, fit), weight_bytes=weight_bytes,
                            kv_error=kv_error, weight_bytes_by_dtype=by_dtype))
    msg = sock.recv(timeout_s=600)
    if isinstance(msg, m.Shutdown):
        raise _ShutdownDuringSetup("before InitKVCache")
    if not isinstance(msg, m.InitKVCache):
        raise RuntimeError(f"expected InitKVCache, got {type(msg).__name__}")
    runner.init_kv_cache(msg.num_blocks)
    logger.info("stage %d/%d%s: weights %s GiB; KV cache %d tokens (%d blocks of %d tokens, %.1f MiB)",
                init.pp_rank, pp_size, f" TP rank {init.tp_rank}/{tp_size}" if tp_size > 1 else "",
                format_gib_by_dtype(by_dtype), msg.num_blocks * block_size, msg.num_blocks, block_size,
                msg.num_blocks * per_block / 2**20)
    from zpp.workers.verify_graphs import set_up_graphs
    set_up_graphs(runner, model, cfg_all, device_kind, enforce_eager, max_model_len, block_size)
    if device_kind == "cuda":
        from zpp.workers.start_up_passes import warm_up_and_watch
        warm_up_and_watch(runner, cfg_all)
    sock.send(m.CacheReady(rank=init.rank))
    return runner


def _warn_kv_scales(model) -> None:
    """--kv-cache-dtype fp8: warn (as vLLM does) when attention layers lack the checkpoint's scales."""
    from zpp.models.layers.attention import Attention
    layers = [m for m in model.modules() if isinstance(m, Attention)]
    missing = sum(not a.kv_scales_loaded for a in layers)
    if missing:
        logger.warning("--kv-cache-dtype fp8: the checkpoint has no k_scale / v_scale for %d of this stage's %d "
                       "attention layers: they use 1.0 (as vLLM does), so K/V values beyond +-448 saturate",
                       missing, len(layers))


def _form_groups(init, device, generation: int, rendezvous=None):
    """Form this worker's process groups of generation ``generation`` (its tensor-parallel group and
    the stage-to-stage pairs, each a standalone group of its members: ``zpp.transport.p2p.Links``)
    and return the StageLink (None with one stage). Each TP rank exchanges activations (whole on
    every TP rank) with the same TP rank of the neighbouring stages. ``rendezvous``: how long to
    wait for every member (a restart's), else ``DIST_TIMEOUT``. Nothing to do in a world of one.

    Raises:
        LinkError: a member did not arrive within ``rendezvous``, or connecting failed.
    """
    from zpp.transport.p2p import form_links, make_stage_link
    from zpp.transport.tensor_parallel import init_tp_group
    c = init.config.parallel
    pp_size, tp_size = c.pipeline_parallel_size, c.tensor_parallel_size
    links = form_links(init.dist_store, init.rank, pp_size, tp_size, device, c.share_gpu, generation, rendezvous)
    if links is None:
        return None
    logger.info("process groups of generation %d (%s): %s", generation, links.backend, ", ".join(sorted(links.groups)))
    init_tp_group(links, init.pp_rank, tp_size)
    return make_stage_link(links, init.rank, init.pp_rank, pp_size, tp_size, device, c.share_gpu) \
        if pp_size > 1 else None


def _measure_and_assign(init, sock, cfg: dict, device, dtype) -> tuple[int, int]:
    """``--pp-layer-partition auto``: measure this stage's costs (``zpp.workers.stage_cost``),
    send StageCost, and return the ``[start, end)`` layer range the engine assigns. Stages take
    turns (a barrier of the process group between turns), so that stages sharing a host's cores
    (CPU) or one GPU (``ZPP_SHARE_GPU``) do not slow down each other's measurement (a barrier over
    the rendezvous store: no process group spans the world)."""
    from zpp.models.base import StageInfo
    from zpp.transport.p2p import current_links, store_barrier
    from zpp.transport import messages as m
    from zpp.workers.stage_cost import measure_stage_cost, representative_batch
    c = init.config
    pp_size, tp_size = c.parallel.pipeline_parallel_size, c.parallel.tensor_parallel_size
    num_seqs, ctx = representative_batch(c.scheduler.max_num_seqs, c.max_num_batched_tokens, c.pipeline_depth,
                                         c.max_model_len)
    stage = StageInfo(init.pp_rank, pp_size, init.layer_start, init.layer_end, init.tp_rank, tp_size)
    t = time.perf_counter()
    for turn in range(pp_size):
        if turn == init.pp_rank:  # every TP rank of the stage together (the layers' all-reduces)
            layer_s, extra_s = measure_stage_cost(c.model.model, cfg, stage, dtype, device, c.max_model_len,
                                                  c.cache.block_size, num_seqs, ctx, c.model.seed)
        store_barrier(current_links(), f"measure{turn}", pp_size * tp_size)
    logger.info("stage %d: a layer takes %s ms, the stage's other work %.3f ms (%d decode tokens at context "
                "%d; measured in %.1fs)", init.pp_rank, " / ".join(f"{x * 1e3:.3f}" for x in layer_s), extra_s * 1e3,
                num_seqs, ctx, time.perf_counter() - t)
    sock.send(m.StageCost(rank=init.rank, layer_s=layer_s, extra_s=extra_s, num_tokens=num_seqs,
                          memory_bytes=usable_gpu_memory(c, device)))
    msg = sock.recv(timeout_s=600)
    if isinstance(msg, m.Shutdown):
        raise _ShutdownDuringSetup("before AssignLayers")
    if not isinstance(msg, m.AssignLayers):
        raise RuntimeError(f"expected AssignLayers, got {type(msg).__name__}")
    return msg.layer_start, msg.layer_end


def _serve(runner, sock, init) -> None:
    """Run micro-batches (:func:`_serve_batches`) until Shutdown. When a neighbour dies (a
    :class:`~zpp.transport.p2p.LinkError` from a stage-to-stage or tensor-parallel channel: its
    connection closed, or the engine aborted the generation because it lost a rank, which is what
    releases a wait on a stopped or unreachable peer) this worker survives: it reports LinkDown,
    drops its micro-batches and waits for the engine's Rejoin (the dead stage restarted) or
    Shutdown (fail-stop)."""
    import torch.distributed as dist

    from zpp.transport import messages as m
    from zpp.transport.p2p import LinkError

    rejoin = None
    while True:
        try:
            if rejoin is not None:
                gen, rejoin = rejoin, None
                _rejoin(runner, sock, init, gen)
            rejoin = _serve_batches(runner, sock, init)
        except (LinkError, dist.DistError) as e:  # DistStoreError: a restarted rank never came
            if getattr(e, "peer_gone", False):  # a neighbour died: the engine reports that death itself
                logger.info("a neighbouring stage went away (%s); waiting for the engine to restart it", e)
            else:
                logger.warning("a stage-to-stage channel failed (%s); waiting for the engine to restart the stage", e)
            sock.send(m.LinkDown(rank=init.rank, message=str(e)))
            rejoin = _await_rejoin(sock)
        if rejoin is None:
            return


def _await_rejoin(sock):
    """After a LinkDown: skip the micro-batches sent before the engine noticed; return Rejoin's
    generation, or None on Shutdown."""
    from zpp.transport import messages as m
    while True:
        msg = sock.recv()
        if isinstance(msg, m.Rejoin):
            return msg.generation
        if isinstance(msg, m.Shutdown):
            return None
        if not isinstance(msg, m.ExecuteBatch):
            raise RuntimeError(f"unexpected message {type(msg).__name__} while waiting to rejoin")


def _rejoin(runner, sock, init, generation: int) -> None:
    """Leave the old process groups (aborted under NCCL; under gloo a neighbour still blocked on this
    worker then fails too, if the engine's abort has not released it already), form generation
    ``generation``'s with the restarted ranks, forget every request, and answer Rejoined. Weights,
    KV cache memory and (without tensor parallelism) CUDA graphs stay."""
    from zpp.transport import messages as m
    import gc

    from zpp.transport.p2p import REJOIN_RENDEZVOUS, leave_process_group
    from zpp.transport.tensor_parallel import release_tp_group
    t = time.perf_counter()
    tp_size = init.config.parallel.tensor_parallel_size
    if runner.link is not None:
        runner.link.drop()
    # Every reference to the old groups must go: only then are gloo's connections closed, which
    # wakes a neighbour still blocked receiving from this worker.
    runner.link = None
    release_tp_group()
    leave_process_group()
    gc.collect()
    runner.link = _form_groups(init, runner.device, generation, REJOIN_RENDEZVOUS)
    runner.forget_requests()
    if runner.graphs is not None and tp_size > 1 and runner.device.type == "cuda":
        # The captured all-reduces name the old communicator: capture again with the new one.
        runner.capture_graphs(init.config.max_model_len, init.config.scheduler.max_num_seqs)
    logger.info("rejoined the pipeline (generation %d) in %.2fs", generation, time.perf_counter() - t)
    sock.send(m.Rejoined(rank=init.rank, generation=generation))


def _serve_batches(runner, sock, init):
    """Run batches in order until Shutdown (returns None) or Rejoin (returns its generation). A last-stage result left on the GPU (PendingResult) is finished only
    after the next batch, if one is already queued, has been launched: the CPU work of batch i+1
    overlaps the GPU work of batch i, and results still go out in batch order.

    With async scheduling the engine sends batch i+1 without waiting for batch i's result, so
    the worker waits for whichever comes first, the next message or batch i's end on the GPU
    (polling both), instead of blocking on batch i: batch i+1 is launched while the GPU still
    runs batch i.

    Structured outputs: before the model runner fills a batch's token bitmask (with its forward
    queued), this rank finishes and sends the result it holds (``before_fill``): the matchers
    accept its tokens as it is finished, and the bitmask depends on them."""
    from zpp.transport import messages as m
    from zpp.workers.runner_state import PendingResult

    last_stats = time.monotonic()
    reported = 0  # batches covered by the last StageStats
    stall_at = _fault_stall_batch(init.rank)
    pending = None

    timed = runner.stage.tp_rank == 0  # one rank per stage reports step times (its ranks run in step)

    def send_stats() -> None:
        nonlocal last_stats, reported
        runner.reap_timings()
        steps = runner.step_times
        ids, secs = ([b for b, _ in steps], [t for _, t in steps]) if timed else ([], [])
        steps.clear()
        sock.send(m.StageStats(rank=init.rank, busy_s=runner.busy_s, batches=runner.num_batches,
                               idle_s=runner.idle_s, step_batches=ids, step_s=secs))
        last_stats, reported = time.monotonic(), runner.num_batches

    spin = runner.async_scheduling
    def before_fill() -> None:
        """Structured outputs (the model runner's ``before_fill``): the result this rank holds goes
        out first; finishing it makes the matchers accept its tokens."""
        nonlocal pending
        if pending is not None:
            _send_result(sock, runner, pending.finish(runner))
            pending = None

    runner.before_fill = before_fill
    try:
        while True:
            if pending is not None and not sock.poll(0):
                if spin and not pending.done():
                    continue
                _send_result(sock, runner, pending.finish(runner))
                pending = None
                continue
            if not sock.poll(250):
                # Idle: stages bring their busy time (and step times) up to date, so figures read
                # after a run are not up to a period stale.
                if runner.num_batches != reported or runner.step_times:
                    send_stats()
                continue
            msg = sock.recv()
            if isinstance(msg, m.ExecuteBatch):
                if stall_at is not None and msg.batch_id >= stall_at:
                    runner.activity.start(msg.batch_id)
                    _stall_forever(msg.batch_id)
                runner.trace.mark("msg", msg.batch_id)
                result = runner.execute(msg)
                runner.activity.done(msg.batch_id)
                runner.trace.mark("launched", msg.batch_id)
                if pending is not None:
                    _send_result(sock, runner, pending.finish(runner))
                    pending = None
                if isinstance(result, PendingResult):
                    pending = result
                elif result is not None:
                    _send_result(sock, runner, result)
                if time.monotonic() - last_stats > STATS_PERIOD_S:
                    send_stats()
            elif isinstance(msg, m.Rejoin):  # another stage died while this one was idle: start afresh
                return msg.generation
            elif isinstance(msg, m.Shutdown):
                if pending is not None:
                    _send_result(sock, runner, pending.finish(runner))
                return _shutdown(runner)
            else:
                raise RuntimeError(f"unexpected message {type(msg).__name__}")
    finally:
        runner.before_fill = None


def _shutdown(runner) -> None:
    """Shutdown: flush the activations link and dump the trace (ZPP_TRACE)."""
    if runner.link is not None:
        runner.link.flush()
    if runner.trace.enabled:
        if runner.device.type == "cuda":
            import torch
            torch.cuda.synchronize()
            st = torch.cuda.memory_stats(runner.device)
            runner.trace.mark("cuda_allocator", -1, args={
                k: st.get(k, 0) for k in ("num_device_alloc", "num_device_free", "num_alloc_retries",
                                          "num_sync_all_streams", "num_ooms")})
        runner.reap_timings()
        runner.trace.dump()


def _fault_stall_batch(rank: int):
    """Fault injection for the watchdog tests: ``ZPP_FAULT_STALL=RANK:BATCH`` makes that rank's
    main thread hang (alive, heartbeats still going) from micro-batch BATCH on, as a wedged
    gloo/NCCL call would. None when unset or for another rank."""
    spec = envs.ZPP_FAULT_STALL
    r, _, b = spec.partition(":")
    return int(b) if r.isdigit() and b.isdigit() and int(r) == rank else None


def _fault_crash_on_restart(init) -> None:
    """Fault injection for the supervision tests: ``ZPP_FAULT_RESTART_CRASH=RANK`` makes that rank
    fail every time it is restarted (generation > 0), while loading its weights: a crash loop."""
    r = envs.ZPP_FAULT_RESTART_CRASH
    if r.isdigit() and int(r) == init.rank and init.generation > 0:
        raise RuntimeError(f"ZPP_FAULT_RESTART_CRASH: rank {init.rank} fails at every restart")


def _stall_forever(batch_id: int) -> None:
    logger.warning("ZPP_FAULT_STALL: hanging before micro-batch %d", batch_id)
    while True:
        time.sleep(3600)


def _send_result(sock, runner, result) -> None:
    runner.trace.mark("result_sent", result.batch_id)
    sock.send(result)


if __name__ == "__main__":  # started by zpp-node: python -m zpp.workers.worker ADDRESS RANK LEVEL (keys on stdin)
    from zpp.transport.security import RunKeys
    _keys = RunKeys.decode(sys.stdin.readline())
    worker_main(sys.argv[1], int(sys.argv[2]), _keys, int(sys.argv[3]) if len(sys.argv) > 3 else logging.INFO)
