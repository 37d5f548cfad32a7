"""The tensor-parallel (TP) process group of this worker and the all-reduce its layers use.

Ranks are laid out stage-major: global rank ``pp_rank * tp_size + tp_rank``, so the TP group of a
stage is the ``tp_size`` consecutive ranks ``[pp_rank * tp_size, (pp_rank + 1) * tp_size)``. The
group uses the world's backend (NCCL on CUDA, gloo on CPU). With ``tp_size == 1`` no group is made
and :func:`tp_all_reduce` is never called (the row-parallel layers skip it), so the TP = 1 path is
exactly the code that ran before tensor parallelism existed.

Megatron-LM (Shoeybi et al. 2019, "Megatron-LM: Training Multi-Billion Parameter Language Models
Using Model Parallelism") needs exactly one all-reduce after each row-parallel matmul in the
forward pass: two per transformer layer (after the attention output projection and after the MLP
down projection).
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist

from zpp.transport.p2p import DIST_TIMEOUT, LinkError

_GROUP: Optional[dist.ProcessGroup] = None


def init_tp_group(rank: int, pp_size: int, tp_size: int, timeout=DIST_TIMEOUT) -> Optional[dist.ProcessGroup]:
    """Create one TP group per pipeline stage and keep this rank's.

    Every rank of the world must call this with the same ``pp_size`` / ``tp_size`` after
    ``torch.distributed.init_process_group`` (``dist.new_group`` is collective over the whole world
    and must be called for every group, in the same order, even by ranks outside it).
    No-op when ``tp_size == 1``. Returns this rank's group (None without TP).
    """
    global _GROUP
    _GROUP = None
    if tp_size == 1:
        return None
    for pp_rank in range(pp_size):
        ranks = list(range(pp_rank * tp_size, (pp_rank + 1) * tp_size))
        group = dist.new_group(ranks=ranks, timeout=timeout)
        if rank in ranks:
            _GROUP = group
    return _GROUP


def release_tp_group() -> None:
    """Drop this module's reference to the TP group (before the groups are destroyed and formed
    again after a stage restart)."""
    global _GROUP
    _GROUP = None


def tp_all_reduce(x: torch.Tensor) -> torch.Tensor:
    """Sum ``x`` (any shape and dtype, on the group's device) over the TP group, in place; returns it.

    On CUDA with NCCL this may run inside a CUDA-graph capture (PyTorch supports capturing NCCL
    collectives once the communicator exists; the warm-up forwards before capture create it).

    Raises:
        RuntimeError: no TP group was initialised (``init_tp_group`` with ``tp_size > 1``).
        LinkError: the all-reduce failed (a rank of the group died).
    """
    if _GROUP is None:
        raise RuntimeError("tp_all_reduce called without a tensor-parallel group (init_tp_group not called)")
    try:
        dist.all_reduce(x, group=_GROUP)
    except Exception as e:
        raise LinkError("tensor-parallel all-reduce failed", e) from e
    return x
