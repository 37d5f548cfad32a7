"""CPU threads of the stage workers: the cores this host really gives zpp, each stage's share, and
the OpenMP environment a stage process must start with.

* :func:`available_cores`: the CPUs this process may run on (``sched_getaffinity``), lowered by a
  cgroup CPU quota (v2 ``cpu.max``, v1 ``cpu.cfs_quota_us`` / ``cpu.cfs_period_us``) on this
  process's cgroup or any of its ancestors.
* :func:`threads_per_stage`: those cores divided among the stage processes on this host.
* :func:`stage_env`: what a CPU stage's environment gets before the process starts. libgomp (the
  OpenMP runtime of PyTorch's CPU builds) reads ``OMP_WAIT_POLICY`` and ``GOMP_SPINCOUNT`` once,
  when it is loaded, so they must be in the child's environment: setting them after ``import
  torch`` changes nothing. A user's own ``OMP_NUM_THREADS``, ``OMP_WAIT_POLICY`` or
  ``GOMP_SPINCOUNT`` is never overridden.
* :func:`environ_for_children`: a context manager that puts such variables in ``os.environ`` only
  while child processes are started (multiprocessing's spawn copies the environment then).
"""
from __future__ import annotations

import contextlib
import math
import os
from typing import Iterator, Mapping, Optional

USER_SETTINGS = ("OMP_NUM_THREADS", "OMP_WAIT_POLICY", "GOMP_SPINCOUNT")
"""Variables a user sets to take the choice into their own hands: zpp never overrides them."""


def affinity_cores() -> int:
    """CPUs this process may run on (``os.sched_getaffinity``; ``os.cpu_count()`` where that is
    missing); at least 1."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except (AttributeError, OSError):
        return max(1, os.cpu_count() or 1)


def cgroup_cpu_limit(proc_cgroup: str = "/proc/self/cgroup", root: str = "/sys/fs/cgroup") -> Optional[float]:
    """The CPU quota of this process's cgroup in cores (``quota / period``), or None without one.

    The smallest quota set on the process's cgroup or any ancestor counts (a container's limit
    often sits on a parent). cgroup v2: ``cpu.max`` (``"max 100000"`` = none, ``"150000 100000"`` =
    1.5 cores); v1: ``cpu.cfs_quota_us`` (-1 = none) over ``cpu.cfs_period_us`` in the ``cpu``
    controller's hierarchy. Files that are missing or unreadable count as no limit.

    Args:
        proc_cgroup: the ``/proc/<pid>/cgroup`` file to read (tests pass a fake one).
        root: where the cgroup file systems are mounted.
    """
    try:
        with open(proc_cgroup) as f:
            lines = f.read().splitlines()
    except OSError:
        return None
    limits = []
    for line in lines:
        parts = line.split(":", 2)
        if len(parts) != 3:
            continue
        _, controllers, path = parts
        if controllers == "":  # v2 (unified): "0::/path"
            for d in cgroup_ancestors(root, path):
                limits.append(_v2_limit(os.path.join(d, "cpu.max")))
        elif "cpu" in controllers.split(","):
            for mount in (controllers, "cpu", "cpu,cpuacct", "cpuacct,cpu"):
                base = os.path.join(root, mount)
                if os.path.isdir(base):
                    for d in cgroup_ancestors(base, path):
                        limits.append(_v1_limit(d))
                    break
    found = [x for x in limits if x is not None]
    return min(found) if found else None


def cgroup_ancestors(base: str, path: str) -> list[str]:
    """``base/path``, then each parent directory of it up to ``base`` itself (those that exist), as
    paths: the cgroup directories whose limits bind a process in cgroup ``path`` (a container's
    limit often sits on a parent). ``path`` is the third field of a ``/proc/<pid>/cgroup`` line;
    ``..`` parts are dropped. In a container the cgroup path may name the host's hierarchy: then
    only the mount's root is there. Used by ``zpp.utils.host_memory`` too."""
    parts = [p for p in path.strip("/").split("/") if p and p != ".."]
    dirs = [os.path.join(base, *parts[:i]) for i in range(len(parts), -1, -1)]
    return [d for d in dirs if os.path.isdir(d)]


def _read(path: str) -> Optional[str]:
    try:
        with open(path) as f:
            return f.read().strip()
    except OSError:
        return None


def _v2_limit(path: str) -> Optional[float]:
    text = _read(path)
    if not text:
        return None
    quota, _, period = text.partition(" ")
    try:
        return int(quota) / int(period or 100000) if quota != "max" else None
    except (ValueError, ZeroDivisionError):
        return None


def _v1_limit(directory: str) -> Optional[float]:
    quota, period = _read(os.path.join(directory, "cpu.cfs_quota_us")), _read(os.path.join(directory, "cpu.cfs_period_us"))
    try:
        q, p = int(quota or "-1"), int(period or "100000")
    except ValueError:
        return None
    return q / p if q > 0 and p > 0 else None


def available_cores(affinity: Optional[int] = None, cgroup_limit: Optional[float] = -1.0) -> int:
    """Whole cores this process may use: the affinity count, lowered to a cgroup CPU quota
    (rounded down; at least 1).

    Args:
        affinity: CPUs in the affinity mask (default: :func:`affinity_cores`).
        cgroup_limit: the quota in cores, None for none (default: read with :func:`cgroup_cpu_limit`).
    """
    cores = affinity_cores() if affinity is None else affinity
    limit = cgroup_cpu_limit() if cgroup_limit == -1.0 else cgroup_limit
    if limit is not None:
        cores = min(cores, math.floor(limit + 1e-9))  # 1.5 cores: 1 thread (2 would be throttled)
    return max(1, cores)


def threads_per_stage(num_local_stages: int, cores: Optional[int] = None) -> int:
    """Intra-op threads for each of ``num_local_stages`` CPU stage processes on this host: the
    available cores divided evenly, rounded down, at least 1.

    Args:
        num_local_stages: stage worker processes on this host (every PP stage x TP rank here).
        cores: the cores to divide (default: :func:`available_cores`).
    """
    cores = available_cores() if cores is None else cores
    return max(1, cores // max(1, num_local_stages))


def stage_env(num_threads: int, environ: Mapping[str, str] = os.environ) -> dict[str, str]:
    """The variables a CPU stage process of ``num_threads`` threads starts with, beyond ``environ``.

    ``OMP_NUM_THREADS`` = ``num_threads``, unless the user set it (then nothing).

    libgomp's spinning is left as it is (300,000 spins at a barrier): shorter spinning cost quiet
    throughput on the 2-core VM without fixing contention (SmolLM2, PP=1, 32 x 64/32:
    ``GOMP_SPINCOUNT=10000`` gave 49.5 / 49.6 / 57.6 out tok/s quiet against 61.1 / 64.6 with
    libgomp's default, and 23.9 with one busy process beside it against 20.2;
    ``OMP_WAIT_POLICY=PASSIVE``: -31% quiet, measured for issue #28). What helps under contention
    is fewer threads: :mod:`zpp.workers.adaptive_threads`.
    """
    return {} if "OMP_NUM_THREADS" in environ else {"OMP_NUM_THREADS": str(max(1, num_threads))}


def describe_choice(num_stages: int, num_threads: int, added: Mapping[str, str],
                    environ: Mapping[str, str] = os.environ) -> str:
    """One line for the log: cores (and why), stages, threads each, and the OpenMP settings (the
    user's, or those zpp adds for the stages)."""
    limit = cgroup_cpu_limit()
    user = [f"{k}={environ[k]} (yours)" for k in USER_SETTINGS if k in environ]
    omp = [f"{k}={v}" for k, v in added.items()] + user
    return (f"CPU stages: {available_cores()} core(s) available (affinity {affinity_cores()}"
            f"{f', cgroup quota {limit:g}' if limit is not None else ''}), {num_stages} stage process(es) here, "
            f"{num_threads} thread(s) each; OpenMP: {', '.join(omp) or 'its defaults'}")


@contextlib.contextmanager
def environ_for_children(extra: Mapping[str, str]) -> Iterator[None]:
    """Put ``extra`` into ``os.environ`` while child processes are started, then restore it.

    multiprocessing's spawn (and ``subprocess`` without ``env=``) hands children the environment
    of the moment; this process's own OpenMP runtime, already loaded, is unaffected.
    """
    saved = {k: os.environ.get(k) for k in extra}
    os.environ.update(extra)
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
