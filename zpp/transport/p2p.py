"""Stage-to-stage activations over torch.distributed point-to-point (gloo on CPU, NCCL on CUDA),
and the per-generation process groups they (and tensor parallelism) run on.

Invariants (learnt from other engines' bugs):

1. One ordered channel per neighbour pair: sends and receives happen in batch order and tags are
   never relied on (NCCL ignores them). Each pair has its own process group (communicator), so a
   middle stage's send to the next stage and receive from the previous one are not serialized
   with each other or with the tensor-parallel all-reduces (PyTorch runs every unbatched P2P op of
   one NCCL group in order on one stream).
2. A tensor handed to an asynchronous send is kept alive, unmodified, until the send completes:
   ``StageLink`` holds a reference to every pending send and only drops it after ``wait()``; the
   sends of a generation left unfinished (a peer was lost) are parked until they complete.
3. Every group is a standalone backend of just its members, formed per generation under the store
   prefix ``g<generation>/<name>/`` (:class:`Links`): after a stage restart the pairs and TP groups
   are formed again with the new process, and no group spans the world. A lost peer's groups are
   aborted (:func:`abort_links`, from the worker's heartbeat thread) so that nothing waits on it.
"""
from __future__ import annotations

import logging
import os
import queue
import socket
import threading
from collections import deque
from datetime import timedelta
from typing import Optional

import torch
import torch.distributed as dist

logger = logging.getLogger(__name__)

DIST_TIMEOUT = timedelta(minutes=30)
"""Of every process group (world, stage pairs, TP): a stage may wait long for a huge prefill."""


def serve_rendezvous_store(host: str) -> tuple[dist.TCPStore, str]:
    """The engine's side of the workers' rendezvous: a TCPStore listening on ``host`` only (not on
    every interface, which is what a store created from a ``tcp://`` init method does).

    Returns:
        (store, ``host:port`` for :func:`init_process_group`). Keep the store alive for the run.
    """
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, 0))
    sock.listen(128)
    port = sock.getsockname()[1]
    store = dist.TCPStore(host, port, None, True, timeout=DIST_TIMEOUT, wait_for_workers=False,
                          master_listen_fd=sock.detach())
    return store, f"[{host}]:{port}" if family == socket.AF_INET6 else f"{host}:{port}"


class LinkError(RuntimeError):
    """A stage-to-stage or tensor-parallel channel failed: a peer died or left (gloo reports
    "Connection closed by peer"). A surviving worker waits to rejoin instead of exiting.
    ``peer_gone``: the failure is the peer's connection going away (its process died), not an error
    of this worker's own."""

    def __init__(self, what: str, cause: BaseException):
        why, self.peer_gone = _link_failure(cause)
        super().__init__(f"{what}: {why}")


# What gloo / NCCL / the kernel say when the process at the other end died or left.
_PEER_GONE = ("Connection reset by peer", "Connection closed by peer", "Broken pipe", "Connection refused",
              "remote process exited", "Socket closed")


def _link_failure(e: BaseException) -> tuple[str, bool]:
    """(a one-line reason, whether the peer went away) for an exception of a collective or p2p op:
    gloo's multi-line "Read error [...]: Connection reset by peer. This is typically caused by ..."
    becomes "the peer went away (connection reset by peer)"; an abort by the engine
    (:class:`LinksAborted`) "the peer went away (aborted by the engine: <why>)"."""
    if isinstance(e, LinksAborted):
        return f"the peer went away ({str(e).splitlines()[0] if str(e) else 'aborted'})", True
    text = str(e)
    for marker in _PEER_GONE:
        if marker.lower() in text.lower():
            return f"the peer went away ({marker.lower()})", True
    return (text.strip().splitlines() or [type(e).__name__])[0], False


REJOIN_RENDEZVOUS = timedelta(seconds=30)
"""After a stage restart: how long a surviving worker waits for every rank to form the new groups
(if the restarted worker dies meanwhile, the survivor gives up and waits for the next try)."""

RESTART_RENDEZVOUS = timedelta(seconds=120)
"""After a stage restart: the same wait for the restarted worker (longer than the survivors', who
may first have to give up a failed earlier try)."""


class LinksAborted(RuntimeError):
    """The cause of a :class:`LinkError` raised because the engine aborted this generation's
    channels (:func:`abort_links`): a peer was lost, and an operation waiting on it returns."""


def backend_for(device: str, share_gpu: bool = False) -> str:
    """``"nccl"`` between GPUs, else ``"gloo"`` (the CPU, or every stage on one GPU: ``share_gpu``)."""
    return "nccl" if device == "cuda" and not share_gpu else "gloo"


def group_layout(pp_size: int, tp_size: int) -> list[tuple[str, tuple[int, ...]]]:
    """Every process group of a world of ``pp_size`` stages of ``tp_size`` ranks, as (name, global
    ranks), in the one order every rank forms them (the TP group of stage ``s``, then the pairs from
    stage ``s`` to ``s + 1``; then stage ``s + 1``): a group's constructor waits for all its
    members, and forming groups in one global order cannot deadlock (the first unformed group has
    all its members waiting for it). Names: ``tp<stage>``, ``pair<a>-<b>`` (``a < b``, global ranks).
    """
    layout = []
    for s in range(pp_size):
        if tp_size > 1:
            layout.append((f"tp{s}", tuple(range(s * tp_size, (s + 1) * tp_size))))
        if s < pp_size - 1:
            for t in range(tp_size):
                a, b = s * tp_size + t, (s + 1) * tp_size + t
                layout.append((f"pair{a}-{b}", (a, b)))
    return layout


class Links:
    """This worker's process groups of one generation: the stage-to-stage pairs and its TP group,
    each a standalone torch backend (``ProcessGroupGloo`` / ``ProcessGroupNCCL``) of just its
    members, formed from the rendezvous store under the prefix ``g<generation>/<name>/``. Nothing is
    made from a default (world) group: torch.distributed's global state is not used, so a pair can be
    torn down and formed again with a new process while the other groups' members keep theirs.

    Abort (:meth:`abort`, from another thread: the engine lost a rank): every operation waiting on a
    group of this generation returns with a :class:`LinkError` (peer gone), and every later one
    raises at once.

    * gloo: a wait blocked on a peer that does not answer (stopped, or on a hung host: its sockets
      stay open) cannot be interrupted in torch 2.13 (``ProcessGroupGloo.abort()`` returns without
      releasing it, measured), so the calling thread never blocks in gloo: it hands the wait to a
      waiter thread of this generation and sleeps on a lock that the waiter or the abort releases.
      A waiter left blocked by an abort stays so until the dead peer's connection closes.
    * NCCL: ``ProcessGroupNCCL.abort()`` (``ncclCommAbort``, all of this generation's communicators
      in one NCCL group call) ends the kernels waiting on the peer, so a thread blocked in a CUDA
      synchronisation returns; the next operation raises. ``TORCH_NCCL_ASYNC_ERROR_HANDLING`` is
      set to 2 (abort the communicator, keep the process) unless already set. Not yet run on GPUs.
    """

    def __init__(self, store, generation: int, backend: str, device: torch.device):
        self.store = store
        self.generation = generation
        self.backend = backend
        self.device = device
        self.groups: dict[str, "CommGroup"] = {}
        self.aborted: Optional[str] = None
        self._waiting = None  # the lock the calling thread sleeps on (gloo), released by abort()
        self._waiter = _Waiter() if backend == "gloo" else None
        self._abort_lock = threading.Lock()

    def form(self, name: str, ranks: tuple[int, ...], rank: int, rendezvous: timedelta) -> "CommGroup":
        """Form group ``name`` of global ``ranks`` (this worker is ``rank``): every member arrives
        under ``g<generation>/<name>/`` within ``rendezvous``, then the backend connects them.

        Raises:
            LinkError: a member did not arrive within ``rendezvous``, or connecting failed (a member
                died meanwhile).
        """
        prefix = f"g{self.generation}/{name}/"
        store = dist.PrefixStore(prefix, self.store)
        group_rank = ranks.index(rank)
        try:
            # Bound the rendezvous here: the backend's own timeout is also its operations' (a gloo
            # context's timeout is fixed when it is made), which must stay DIST_TIMEOUT.
            store.set(f"arrived/{group_rank}", b"1")
            store.wait([f"arrived/{r}" for r in range(len(ranks))], rendezvous)
            if self.backend == "nccl":
                backend = _nccl_backend(store, group_rank, len(ranks), self.device, name, ranks)
            else:
                backend = dist.ProcessGroupGloo(store, group_rank, len(ranks), DIST_TIMEOUT)
        except Exception as e:
            raise LinkError(f"forming {name} (generation {self.generation}) failed", e) from e
        group = CommGroup(self, name, ranks, group_rank, backend)
        self.groups[name] = group
        return group

    def wait(self, work, what: str) -> None:
        """Wait for ``work`` (a send, receive or all-reduce of one of these groups).

        Raises:
            LinkError: it failed, or the generation was aborted (before or while waiting)."""
        if self.aborted is not None:
            raise LinkError(what, LinksAborted(self.aborted))
        try:
            if self._waiter is None or work.is_completed():
                work.wait()  # NCCL: the current stream waits for the op (the CPU does not)
            else:
                self._wait_in_waiter(work)
        except LinkError:
            raise
        except Exception as e:
            if self.aborted is not None:
                raise LinkError(what, LinksAborted(self.aborted)) from e
            raise LinkError(what, e) from e
        if self.aborted is not None:  # NCCL: the op "completed" because its communicator was aborted
            raise LinkError(what, LinksAborted(self.aborted))

    def _wait_in_waiter(self, work) -> None:
        """gloo: sleep until the waiter thread saw ``work`` complete (re-raising its error) or
        :meth:`abort` released us."""
        lock = threading.Lock()
        lock.acquire()
        self._waiting = lock  # stored before `aborted` is read; abort() sets `aborted`, then reads this
        try:
            if self.aborted is not None:
                return
            box = self._waiter.wait(work, lock)
            lock.acquire()
            if box and self.aborted is None:
                raise box[0]
        finally:
            self._waiting = None

    def abort(self, reason: str) -> None:
        """Abort every group of this generation (any thread; idempotent): see the class."""
        with self._abort_lock:
            if self.aborted is not None:
                return
            self.aborted = reason
            lock = self._waiting
            if lock is not None:
                try:
                    lock.release()
                except RuntimeError:  # the waiter released it first
                    pass
            if self.backend == "nccl":
                _abort_nccl([g.backend for g in self.groups.values()])
            if self._waiter is not None:
                self._waiter.abandon()

    def close(self) -> None:
        """Leave these groups: NCCL communicators are aborted (local and immediate; a destroy could
        wait on a dead peer); gloo's are dropped, which closes their connections once nothing
        waits on them (a neighbour blocked receiving from this worker then fails too)."""
        if self.backend == "nccl" and self.aborted is None:
            self.abort("left")
        if self._waiter is not None:
            self._waiter.abandon()
        self.groups.clear()


class CommGroup:
    """One process group of one generation: ``ranks`` (global), this worker being ``group_rank``."""

    def __init__(self, links: Links, name: str, ranks: tuple[int, ...], group_rank: int, backend):
        self.links = links
        self.name = name
        self.ranks = ranks
        self.group_rank = group_rank
        self.backend = backend

    def isend(self, tensor: torch.Tensor, dst: int):
        """Start sending ``tensor`` to global rank ``dst``; returns the work (wait with :meth:`wait`).
        Raises LinkError (the generation was aborted, or the send could not start)."""
        what = f"send to rank {dst} failed"
        if self.links.aborted is not None:
            raise LinkError(what, LinksAborted(self.links.aborted))
        try:
            return self.backend.send([tensor], self.ranks.index(dst), 0)
        except Exception as e:
            raise LinkError(what, e) from e

    def recv(self, tensor: torch.Tensor, src: int) -> None:
        """Receive into ``tensor`` from global rank ``src``. Raises LinkError."""
        what = f"receive from rank {src} failed"
        if self.links.aborted is not None:
            raise LinkError(what, LinksAborted(self.links.aborted))
        try:
            work = self.backend.recv([tensor], self.ranks.index(src), 0)
        except Exception as e:
            raise LinkError(what, e) from e
        self.links.wait(work, what)

    def all_reduce(self, x: torch.Tensor) -> None:
        """Sum ``x`` over the group in place. Raises LinkError."""
        what = "tensor-parallel all-reduce failed"
        if self.links.aborted is not None:
            raise LinkError(what, LinksAborted(self.links.aborted))
        try:
            work = self.backend.allreduce([x])
        except Exception as e:
            raise LinkError(what, e) from e
        self.links.wait(work, what)

    def wait(self, work, what: str) -> None:
        self.links.wait(work, what)


class _Waiter:
    """A thread that waits on gloo works for the calling thread (see :class:`Links`), started on
    first use. ``abandon()``: it stops after its current wait (which may never end)."""

    def __init__(self):
        self._queue: Optional[queue.SimpleQueue] = None
        self._abandoned = False

    def wait(self, work, lock) -> list:
        """Have the thread wait on ``work`` and release ``lock`` then; returns the list that holds
        its exception, if any, once ``lock`` is released."""
        if self._queue is None:
            self._queue = queue.SimpleQueue()
            threading.Thread(target=self._loop, args=(self._queue,), name="zpp-link-waiter", daemon=True).start()
        box: list = []
        self._queue.put((work, lock, box))
        return box

    def _loop(self, q) -> None:
        while True:
            item = q.get()
            if item is None:
                return
            work, lock, box = item
            try:
                work.wait()
            except BaseException as e:
                box.append(e)
            try:
                lock.release()
            except RuntimeError:  # the abort released it first
                pass
            if self._abandoned:
                return

    def abandon(self) -> None:
        self._abandoned = True
        if self._queue is not None:
            self._queue.put(None)


def _nccl_backend(store, group_rank: int, size: int, device: torch.device, name: str, ranks):
    """A ``ProcessGroupNCCL`` of ``size`` ranks over ``store``, its communicator created now
    (``eager_connect_single_device``). Imported here: CPU builds of torch have no NCCL."""
    os.environ.setdefault("TORCH_NCCL_ASYNC_ERROR_HANDLING", "2")  # read when the backend is made
    from torch.distributed import ProcessGroupNCCL
    options = ProcessGroupNCCL.Options()
    options.is_high_priority_stream = False
    options._timeout = DIST_TIMEOUT
    options.global_ranks_in_group = list(ranks)
    options.group_name = name
    backend = ProcessGroupNCCL(store, group_rank, size, options)
    backend.eager_connect_single_device(device)
    return backend


def _abort_nccl(backends) -> None:
    """``ncclCommAbort`` every backend's communicators inside one NCCL group call (as torch's
    ``_abort_process_group`` does: aborting communicators one at a time can hang while another's
    kernel waits on a dead peer, NVIDIA/nccl#1013)."""
    if not backends:
        return
    first = backends[0]
    grouped = hasattr(first, "_group_start") and hasattr(first, "_group_end")
    if grouped:
        first._group_start()
    try:
        for b in backends:
            try:
                b.abort()
            except Exception as e:  # keep aborting the others
                logger.debug("NCCL abort failed: %s", e)
    finally:
        if grouped:
            first._group_end()


_CURRENT: Optional[Links] = None
_ABORTED_UPTO = -1
_STATE_LOCK = threading.Lock()


def form_links(store_address: str, rank: int, pp_size: int, tp_size: int, device: torch.device,
               share_gpu: bool = False, generation: int = 0,
               rendezvous: Optional[timedelta] = None) -> Optional[Links]:
    """Form this worker's groups of generation ``generation`` (see :class:`Links`): its TP group
    (``tp_size > 1``) and its stage pairs, from the rendezvous store at ``store_address``
    (``host:port``; the engine hosts it and never joins a group). None in a world of one. Those of
    an earlier generation must be left first (:func:`leave_process_group`).

    Raises:
        LinkError: a member did not arrive within ``rendezvous`` (default ``DIST_TIMEOUT``) or
            connecting failed.
    """
    global _CURRENT
    world = pp_size * tp_size
    if world == 1:
        return None
    host, _, port = store_address.rpartition(":")
    timeout = rendezvous or DIST_TIMEOUT
    try:
        store = dist.TCPStore(host.strip("[]"), int(port), world, False, timeout=DIST_TIMEOUT)
    except Exception as e:
        raise LinkError(f"connecting to the rendezvous store {store_address} failed", e) from e
    links = Links(store, generation, backend_for(device.type, share_gpu), device)
    with _STATE_LOCK:
        _CURRENT = links
        if generation <= _ABORTED_UPTO:  # the engine gave up on this generation already
            links.aborted = f"generation {generation} was aborted while forming"
    for name, ranks in group_layout(pp_size, tp_size):
        if rank in ranks:
            links.form(name, ranks, rank, timeout)
    return links


def abort_links(generation: int, reason: str) -> bool:
    """The engine lost a rank at generation ``generation``: abort this worker's groups of that
    generation or an earlier one (any thread; what a group of such a generation formed later starts
    aborted). Returns whether groups were aborted now."""
    global _ABORTED_UPTO
    with _STATE_LOCK:
        _ABORTED_UPTO = max(_ABORTED_UPTO, generation)
        links = _CURRENT
    if links is None or links.generation > generation:
        return False
    links.abort(f"aborted by the engine: {reason}")
    return True


def current_links() -> Optional[Links]:
    """The groups :func:`form_links` formed last and not yet left (None: none)."""
    return _CURRENT


def store_barrier(links: Links, name: str, world: int) -> None:
    """Wait until ``world`` ranks reached barrier ``name`` of ``links``'s generation (over the
    rendezvous store: no process group spans the world)."""
    store = dist.PrefixStore(f"g{links.generation}/barrier/{name}/", links.store)
    if store.add("count", 1) == world:
        store.set("done", b"1")
    store.wait(["done"], DIST_TIMEOUT)


def leave_process_group() -> None:
    """Leave this worker's groups (:meth:`Links.close`). Safe to call when there are none."""
    global _CURRENT
    with _STATE_LOCK:
        links, _CURRENT = _CURRENT, None
    if links is not None:
        links.close()


def make_stage_link(links: Links, rank: int, pp_rank: int, pp_size: int, tp_size: int, device: torch.device,
                    share_gpu: bool = False) -> "StageLink":
    """This worker's StageLink over its pair groups of ``links``. Global ranks are
    ``pp_rank * tp_size + tp_rank``; TP rank ``t`` of stage ``s`` talks to TP rank ``t`` of stages
    ``s - 1`` and ``s + 1``."""
    groups = {}
    for g in links.groups.values():
        if g.name.startswith("pair"):
            a, b = g.ranks
            groups[b if rank == a else a] = g
    prev_rank = rank - tp_size if pp_rank > 0 else None
    next_rank = rank + tp_size if pp_rank < pp_size - 1 else None
    return StageLink(prev_rank, next_rank, device, groups=groups, via_host=share_gpu, links=links)


class StageLink:
    """Sends this stage's activations to the next stage and receives the previous stage's.

    Activations are one contiguous tensor ``[k, num_tokens, hidden_size]`` (k = 2 for models that
    carry a separate residual stream, else 1), so each micro-batch is exactly one send per hop.
    ``groups``: peer global rank -> its pair's :class:`CommGroup` (of ``links``'s generation).
    """

    def __init__(self, prev_rank: Optional[int], next_rank: Optional[int], device: torch.device,
                 max_pending: int = 8, groups: Optional[dict] = None, via_host: bool = False,
                 links: Optional[Links] = None):
        self.prev_rank = prev_rank
        self.next_rank = next_rank
        self._groups = groups or {}
        self.links = links
        self.device = device
        self._pending: deque[tuple[object, torch.Tensor]] = deque()
        self._max_pending = max_pending
        self._via_host = device.type == "cuda" and via_host  # one GPU for all stages (gloo)

    @property
    def groups(self) -> list:
        """This worker's pair groups (one per neighbour)."""
        return list(self._groups.values())

    def send(self, tensor: torch.Tensor) -> None:
        """Start sending ``tensor`` to the next stage; the tensor is kept alive until sent.
        Raises LinkError (the peer went away, or the engine aborted the generation)."""
        assert self.next_rank is not None
        tensor = tensor.contiguous()
        if self._via_host:
            tensor = tensor.cpu()
        work = self._groups[self.next_rank].isend(tensor, self.next_rank)
        self._pending.append((work, tensor))
        self._reap(block=len(self._pending) > self._max_pending)

    def recv(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        """Receive the previous stage's activations for the next batch in order. Raises LinkError."""
        assert self.prev_rank is not None
        buf = torch.empty(shape, dtype=dtype, device="cpu" if self._via_host else self.device)
        self._groups[self.prev_rank].recv(buf, self.prev_rank)
        self._reap(block=False)
        return buf.to(self.device) if self._via_host else buf

    def _reap(self, block: bool) -> None:
        while self._pending:
            work, _ = self._pending[0]
            if block or work.is_completed():
                self._wait(work)
                self._pending.popleft()
                block = len(self._pending) > self._max_pending
            else:
                break

    def _wait(self, work) -> None:
        try:
            self._groups[self.next_rank].wait(work, f"send to rank {self.next_rank} failed")
        except LinkError:
            self.drop()
            raise

    def flush(self) -> None:
        while self._pending:
            self._wait(self._pending[0][0])
            self._pending.popleft()

    def drop(self) -> None:
        """Forget pending sends (their generation is being left after a neighbour's loss). Their
        works and tensors are parked until they complete: a send's buffer must outlive it."""
        _park(self._pending)
        self._pending.clear()


_PARKED: list = []


def _park(pending) -> None:
    """Keep the (work, tensor) pairs of an abandoned generation's unfinished sends alive (gloo
    still reads a pending send's buffer; a send to a stopped peer completes, with an error, only
    when that peer's connection closes); drop those that have completed."""
    _PARKED[:] = [p for p in _PARKED if not p[0].is_completed()] + [p for p in pending if not p[0].is_completed()]
