"""Host (CPU) memory for a CPU stage's KV cache.

* :func:`zeroed_tensor`: a zero-filled tensor whose pages the kernel supplies on first touch, so that
  allocating a stage's KV cache costs nothing at start-up. ``torch.zeros`` writes every byte before
  the engine is ready: on the 2-core VM 1 GiB took 0.65-0.8 s for one stage and ~2 s for two stages
  at once (each stage's default cache is 1 GiB), about half of ``LLM(..., pipeline_parallel_size=2)``'s
  start-up. Only the blocks requests really use get memory, as they are first written.
* :func:`available_bytes`: ``MemAvailable`` of ``/proc/meminfo``, lowered by a cgroup v2 memory limit
  (``memory.max - memory.current`` of this process's cgroup or of an ancestor): checked before a KV
  cache is mapped, since a lazily filled mapping that does not fit would otherwise fail only later,
  when the kernel's out-of-memory killer ends the stage mid-request.
"""
from __future__ import annotations

import math
import mmap
import os
from typing import Optional

import torch

from zpp.utils.cpu_threads import cgroup_ancestors


def zeroed_tensor(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """A CPU tensor of ``shape`` and ``dtype`` reading as zeros, backed by a private anonymous
    mapping (``mmap(2)`` with ``MAP_ANONYMOUS``: Linux gives every page zero-filled on first access).

    The tensor keeps the mapping alive; it is unmapped when the last view of it is freed.

    Raises:
        OSError: the kernel refused the mapping (ENOMEM under strict overcommit).
    """
    nbytes = math.prod(shape) * dtype.itemsize
    if nbytes == 0:
        return torch.zeros(shape, dtype=dtype)
    return torch.frombuffer(mmap.mmap(-1, nbytes), dtype=dtype).view(shape)


def available_bytes(meminfo: str = "/proc/meminfo", proc_cgroup: str = "/proc/self/cgroup",
                    root: str = "/sys/fs/cgroup") -> Optional[int]:
    """Bytes this process can still allocate without swapping: ``MemAvailable`` (Linux 3.14+),
    or less where a cgroup v2 ``memory.max`` leaves less above that cgroup's ``memory.current``,
    on this process's cgroup or any of its ancestors (``zpp.utils.cpu_threads.cgroup_ancestors``:
    a container's limit often sits on a parent). None where neither can be read (not Linux).

    Args:
        meminfo: the ``/proc/meminfo`` file to read (tests pass fakes).
        proc_cgroup: the ``/proc/<pid>/cgroup`` file to read; its ``0::PATH`` line (cgroup v2) is used.
        root: where the cgroup v2 file system is mounted.

    Files that are missing or unreadable, and ``memory.max`` of ``max``, count as no limit.
    """
    limits = []
    try:
        with open(meminfo) as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    limits.append(int(line.split()[1]) * 1024)
                    break
    except (OSError, ValueError, IndexError):
        pass
    try:
        with open(proc_cgroup) as f:
            path = next((ln.split(":", 2)[2] for ln in f.read().splitlines() if ln.startswith("0::")), None)
    except (OSError, IndexError):
        path = None
    for d in cgroup_ancestors(root, path) if path is not None else ():
        try:
            with open(os.path.join(d, "memory.max")) as f:
                limit = f.read().strip()
            if limit != "max":
                with open(os.path.join(d, "memory.current")) as f:
                    limits.append(max(0, int(limit) - int(f.read().strip())))
        except (OSError, ValueError):
            pass
    return min(limits) if limits else None
