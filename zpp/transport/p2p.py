"""Stage-to-stage activations over torch.distributed point-to-point (gloo on CPU, NCCL on CUDA).

Invariants (learnt from other engines' bugs):

1. One ordered channel per neighbour pair: sends and receives happen in batch order and tags are
   never relied on (NCCL ignores them). Each pair has its own process group (communicator), so a
   middle stage's send to the next stage and receive from the previous one are not serialized
   with each other or with the tensor-parallel all-reduces (PyTorch runs every unbatched P2P op of
   one NCCL group in order on one stream).
2. A tensor handed to an asynchronous send is kept alive, unmodified, until the send completes:
   ``StageLink`` holds a reference to every pending send and only drops it after ``wait()``.
"""
from __future__ import annotations

import socket
from collections import deque
from datetime import timedelta
from typing import Optional

import torch
import torch.distributed as dist

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
    becomes "the peer went away (connection reset by peer)"."""
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


def init_process_group(store_address: str, rank: int, world_size: int, device: str, share_gpu: bool = False,
                       generation: int = 0, rendezvous: Optional[timedelta] = None) -> None:
    """Join the workers' process group (not the engine: it never touches tensors; it only hosts
    the rendezvous store at ``store_address``, ``host:port``). ``share_gpu``: every stage on one
    GPU (``ParallelConfig.share_gpu``), so gloo through host memory instead of NCCL.
    ``generation``: after a stage restart every worker forms the group again under a fresh key
    prefix of the same store (``g<generation>/``). ``rendezvous``: give up forming the groups after
    this long (the group's timeout until :func:`settle_timeouts`; default ``DIST_TIMEOUT``).

    Raises:
        torch.distributed.DistStoreError: not every rank arrived within ``rendezvous``.
    """
    backend = "nccl" if device == "cuda" and not share_gpu else "gloo"
    kwargs = {}
    if backend == "nccl":
        kwargs["device_id"] = torch.device("cuda", torch.cuda.current_device())
    host, _, port = store_address.rpartition(":")
    store = dist.TCPStore(host.strip("[]"), int(port), world_size, False, timeout=DIST_TIMEOUT)
    if generation:
        store = dist.PrefixStore(f"g{generation}/", store)
    dist.init_process_group(backend=backend, store=store, rank=rank, world_size=world_size,
                            timeout=rendezvous or DIST_TIMEOUT, **kwargs)


def settle_timeouts(groups) -> None:
    """Give the world's group and ``groups`` (formed with a short rendezvous timeout) the steady
    state's ``DIST_TIMEOUT``: a stage may wait long for a huge prefill."""
    from torch.distributed.distributed_c10d import _set_pg_timeout
    for g in [None, *groups]:
        _set_pg_timeout(DIST_TIMEOUT, g)


def leave_process_group() -> None:
    """Destroy this worker's process groups (the world's and every group made from it), closing
    their connections: a neighbour blocked receiving from this worker gets a :class:`LinkError`
    instead of waiting forever. Safe to call when none exists."""
    if dist.is_initialized():
        try:
            dist.destroy_process_group()
        except Exception:  # a group whose peer is gone may complain while closing
            pass


def make_stage_link(rank: int, pp_rank: int, pp_size: int, tp_size: int, device: torch.device,
                    share_gpu: bool = False, timeout: timedelta = DIST_TIMEOUT) -> "StageLink":
    """This worker's StageLink, over one two-rank process group per neighbour pair.

    Global ranks are ``pp_rank * tp_size + tp_rank``; TP rank ``t`` of stage ``s`` talks to TP rank
    ``t`` of stages ``s - 1`` and ``s + 1``. ``dist.new_group`` is collective over the whole world,
    so every rank creates every pair's group, in the same order.
    """
    groups = {}
    for s in range(pp_size - 1):
        for t in range(tp_size):
            a, b = s * tp_size + t, (s + 1) * tp_size + t
            g = dist.new_group(ranks=[a, b], timeout=timeout)
            if rank in (a, b):
                groups[b if rank == a else a] = g
    prev_rank = rank - tp_size if pp_rank > 0 else None
    next_rank = rank + tp_size if pp_rank < pp_size - 1 else None
    return StageLink(prev_rank, next_rank, device, groups=groups, via_host=share_gpu)


class StageLink:
    """Sends this stage's activations to the next stage and receives the previous stage's.

    Activations are one contiguous tensor ``[k, num_tokens, hidden_size]`` (k = 2 for models that
    carry a separate residual stream, else 1), so each micro-batch is exactly one send per hop.
    """

    def __init__(self, prev_rank: Optional[int], next_rank: Optional[int], device: torch.device,
                 max_pending: int = 8, groups: Optional[dict] = None, via_host: bool = False):
        self.prev_rank = prev_rank
        self.next_rank = next_rank
        self._groups = groups or {}  # peer rank -> its pair's process group (None: the world)
        self.device = device
        self._pending: deque[tuple[dist.Work, torch.Tensor]] = deque()
        self._max_pending = max_pending
        self._via_host = device.type == "cuda" and via_host  # one GPU for all stages (gloo)

    @property
    def groups(self) -> list:
        """This worker's pair groups (one per neighbour)."""
        return list(self._groups.values())

    def send(self, tensor: torch.Tensor) -> None:
        """Start sending ``tensor`` to the next stage; the tensor is kept alive until sent."""
        assert self.next_rank is not None
        tensor = tensor.contiguous()
        if self._via_host:
            tensor = tensor.cpu()
        try:
            work = dist.isend(tensor, dst=self.next_rank, group=self._groups.get(self.next_rank))
        except Exception as e:
            raise LinkError(f"send to rank {self.next_rank} failed", e) from e
        self._pending.append((work, tensor))
        self._reap(block=len(self._pending) > self._max_pending)

    def recv(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        """Receive the previous stage's activations for the next batch in order."""
        assert self.prev_rank is not None
        buf = torch.empty(shape, dtype=dtype, device="cpu" if self._via_host else self.device)
        try:
            dist.recv(buf, src=self.prev_rank, group=self._groups.get(self.prev_rank))
        except Exception as e:
            raise LinkError(f"receive from rank {self.prev_rank} failed", e) from e
        self._reap(block=False)
        return buf.to(self.device) if self._via_host else buf

    def _reap(self, block: bool) -> None:
        while self._pending:
            work, _ = self._pending[0]
            if block or work.is_completed():
                self._pending.popleft()
                self._wait(work)
                block = len(self._pending) > self._max_pending
            else:
                break

    def _wait(self, work) -> None:
        try:
            work.wait()
        except Exception as e:
            self._pending.clear()
            raise LinkError(f"send to rank {self.next_rank} failed", e) from e

    def flush(self) -> None:
        while self._pending:
            self._wait(self._pending.popleft()[0])

    def drop(self) -> None:
        """Forget pending sends (their group is being destroyed after a neighbour's death)."""
        self._pending.clear()
