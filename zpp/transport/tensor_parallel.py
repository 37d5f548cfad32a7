"""The tensor-parallel (TP) process group of this worker and the all-reduce its layers use.

Ranks are laid out stage-major: global rank ``pp_rank * tp_size + tp_rank``, so the TP group of a
stage is the ``tp_size`` consecutive ranks ``[pp_rank * tp_size, (pp_rank + 1) * tp_size)``. The
group (``tp<stage>``) is one of the worker's per-generation groups (:class:`zpp.transport.p2p.Links`:
NCCL between GPUs, gloo on the CPU or one shared GPU), formed again after a stage restart; the
engine aborting the generation releases an all-reduce waiting on a lost rank. With ``tp_size == 1`` no group is made
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

from zpp.transport.p2p import CommGroup, Links

_GROUP: Optional[CommGroup] = None


def init_tp_group(links: Optional[Links], pp_rank: int, tp_size: int) -> Optional[CommGroup]:
    """Make stage ``pp_rank``'s TP group of ``links`` (formed by :func:`zpp.transport.p2p.form_links`)
    the one :func:`tp_all_reduce` uses, and return it. No-op (None) when ``tp_size == 1``."""
    global _GROUP
    _GROUP = None
    if tp_size == 1 or links is None:
        return None
    _GROUP = links.groups[f"tp{pp_rank}"]
    return _GROUP


def release_tp_group() -> None:
    """Drop this module's reference to the TP group (before the groups are left and formed
    again after a stage restart)."""
    global _GROUP
    _GROUP = None


def tp_all_reduce(x: torch.Tensor) -> torch.Tensor:
    """Sum ``x`` (any shape and dtype, on the group's device) over the TP group, in place; returns it.

    On CUDA with NCCL this may run inside a CUDA-graph capture (PyTorch supports capturing NCCL
    collectives once the communicator exists: it is created when the group is formed); a graph
    that captured it names that generation's communicator and is captured again after a restart.

    Raises:
        RuntimeError: no TP group was initialised (``init_tp_group`` with ``tp_size > 1``).
        LinkError: the all-reduce failed (a rank of the group died), or the engine aborted the
            generation (a rank was lost).
    """
    if _GROUP is None:
        raise RuntimeError("tp_all_reduce called without a tensor-parallel group (init_tp_group not called)")
    _GROUP.all_reduce(x)
    return x
