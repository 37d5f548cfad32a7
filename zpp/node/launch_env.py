"""The per-node launch settings (``--nnodes``, ``--node-rank``, ``--master-addr``, ``--master-port``)
that a cluster launcher already put in the environment, read when the flags are absent.

* **Kubernetes LeaderWorkerSet** (``LWS_LEADER_ADDRESS``, ``LWS_GROUP_SIZE``, ``LWS_WORKER_INDEX``;
  the leader is index 0), as set in every pod of a group
  (https://lws.sigs.k8s.io/docs/reference/labels-annotations-and-environment-variables/).
* **Slurm** (``SLURM_NNODES``, ``SLURM_NODEID``, the first host of the step's node list:
  ``SLURM_STEP_NODELIST``, else ``SLURM_JOB_NODELIST`` / ``SLURM_NODELIST``), as ``srun`` sets them
  in each task; only inside an ``srun`` step (``SLURM_STEP_ID`` set): the batch script itself
  runs on the first node alone. Slurm's compressed host lists (``node[01-03,07]``) are expanded here as ``scontrol
  show hostnames`` does (:func:`expand_hostlist`). One task per node is required: more tasks than
  nodes is refused.
* **torchrun-style** (``NNODES``, ``NODE_RANK``, ``MASTER_ADDR``, ``MASTER_PORT``), as many job
  templates export them.

The first of these whose variables are present is used (in that order); ``MASTER_PORT`` fills the
port for any of them when set. Flags win over the environment field by field.
"""
from __future__ import annotations

import dataclasses
import itertools
import re
from typing import Mapping, Optional

from zpp.errors import ConfigError


@dataclasses.dataclass(frozen=True)
class LaunchEnv:
    """What a launcher's variables say (None: not said)."""

    source: str
    """``Slurm``, ``LeaderWorkerSet`` or ``torchrun-style``."""
    nnodes: Optional[int] = None
    node_rank: Optional[int] = None
    master_addr: Optional[str] = None
    master_port: Optional[int] = None
    read: tuple[tuple[str, str], ...] = ()
    """The variables read, (name, value), for the log."""
    unused: str = ""
    """Why these variables are not a per-node launch (logged), or empty."""

    def describe(self) -> str:
        return f"{self.source}: " + " ".join(f"{k}={v}" for k, v in self.read)


def expand_hostlist(text: str) -> list[str]:
    """Expand a Slurm host list: ``node[01-03,07],gpu-a[1-2]x`` -> ``node01 node02 node03 node07
    gpu-a1x gpu-a2x``. Zero padding follows the range's first bound (``[08-10]`` -> 08 09 10);
    several bracket groups in one name multiply (``r[1-2]n[1-2]`` -> r1n1 r1n2 r2n1 r2n2).

    Raises:
        ConfigError: unbalanced brackets, an empty or reversed range, or an empty list.
    """
    names: list[str] = []
    for item in _split_top_level(text.strip(), text):
        parts: list[list[str]] = []
        for literal, group in re.findall(r"([^\[\]]*)(?:\[([^\[\]]*)\])?", item):
            if literal:
                parts.append([literal])
            if group:
                parts.append(_expand_group(group, text))
        if re.search(r"\[\]", item):
            raise ConfigError(f"host list {text!r}: empty brackets")
        names.extend("".join(p) for p in itertools.product(*parts))
    if not names:
        raise ConfigError(f"host list {text!r} names no host")
    return names


def _split_top_level(text: str, whole: str) -> list[str]:
    items, depth, cur = [], 0, ""
    for ch in text:
        if ch == "[":
            depth += 1
            if depth > 1:
                raise ConfigError(f"host list {whole!r}: nested brackets")
        elif ch == "]":
            depth -= 1
            if depth < 0:
                raise ConfigError(f"host list {whole!r}: ']' without '['")
        if ch == "," and depth == 0:
            items.append(cur)
            cur = ""
        else:
            cur += ch
    if depth:
        raise ConfigError(f"host list {whole!r}: '[' without ']'")
    items.append(cur)
    return [i for i in (s.strip() for s in items) if i]


def _expand_group(group: str, whole: str) -> list[str]:
    out = []
    for piece in group.split(","):
        piece = piece.strip()
        m = re.fullmatch(r"(\d+)(?:-(\d+))?", piece)
        if not m:
            raise ConfigError(f"host list {whole!r}: {piece!r} is not a number or a range a-b")
        lo, hi = m.group(1), m.group(2) if m.group(2) is not None else m.group(1)
        if int(hi) < int(lo):
            raise ConfigError(f"host list {whole!r}: range {piece!r} goes down")
        width = len(lo)
        out.extend(str(i).zfill(width) for i in range(int(lo), int(hi) + 1))
    return out


def _int(env: Mapping[str, str], name: str) -> int:
    try:
        return int(env[name])
    except ValueError:
        raise ConfigError(f"${name}={env[name]!r} is not an integer") from None


def _port(env: Mapping[str, str]) -> tuple[Optional[int], tuple]:
    if "MASTER_PORT" not in env:
        return None, ()
    return _int(env, "MASTER_PORT"), (("MASTER_PORT", env["MASTER_PORT"]),)


def from_lws(env: Mapping[str, str]) -> Optional[LaunchEnv]:
    """LeaderWorkerSet's variables, or None when absent."""
    if "LWS_GROUP_SIZE" not in env and "LWS_LEADER_ADDRESS" not in env:
        return None
    read = tuple((k, env[k]) for k in ("LWS_GROUP_SIZE", "LWS_WORKER_INDEX", "LWS_LEADER_ADDRESS") if k in env)
    port, port_read = _port(env)
    return LaunchEnv("LeaderWorkerSet",
                     nnodes=_int(env, "LWS_GROUP_SIZE") if "LWS_GROUP_SIZE" in env else None,
                     node_rank=_int(env, "LWS_WORKER_INDEX") if "LWS_WORKER_INDEX" in env else None,
                     master_addr=env.get("LWS_LEADER_ADDRESS") or None, master_port=port, read=read + port_read)


def from_slurm(env: Mapping[str, str]) -> Optional[LaunchEnv]:
    """Slurm's variables (one ``srun`` task per node), or None outside a Slurm job.

    Raises:
        ConfigError: more than one task per node, or an unreadable node list.
    """
    if "SLURM_NNODES" not in env and "SLURM_NODEID" not in env:
        return None
    if "SLURM_STEP_ID" not in env and "SLURM_STEPID" not in env:
        # The batch script itself (or salloc's shell) runs on the first node only: node 0 of N
        # there would wait for nodes nobody starts.
        return LaunchEnv("Slurm", read=tuple((k, env[k]) for k in ("SLURM_NNODES", "SLURM_NODEID") if k in env),
                         unused="not an srun task (the batch script or an salloc shell runs on one node): start zpp "
                                "with `srun --ntasks-per-node=1 zpp serve ...` to use every node")
    nodes_var = next((k for k in ("SLURM_STEP_NODELIST", "SLURM_JOB_NODELIST", "SLURM_NODELIST") if env.get(k)), None)
    nnodes_var = "SLURM_STEP_NUM_NODES" if "SLURM_STEP_NUM_NODES" in env else "SLURM_NNODES"
    read = tuple((k, env[k]) for k in (nnodes_var, "SLURM_NODEID", nodes_var) if k and k in env)
    nnodes = _int(env, nnodes_var) if nnodes_var in env else None
    tasks_var = "SLURM_STEP_NUM_TASKS" if "SLURM_STEP_NUM_TASKS" in env else "SLURM_NTASKS"
    if nnodes is not None and tasks_var in env and _int(env, tasks_var) > nnodes:
        raise ConfigError(f"Slurm started {env[tasks_var]} tasks on {nnodes} nodes (${tasks_var}); zpp serve runs "
                          f"once per node: srun --ntasks-per-node=1")
    master = expand_hostlist(env[nodes_var])[0] if nodes_var else None
    port, port_read = _port(env)
    return LaunchEnv("Slurm", nnodes=nnodes,
                     node_rank=_int(env, "SLURM_NODEID") if "SLURM_NODEID" in env else None,
                     master_addr=master, master_port=port, read=read + port_read)


def from_torchrun(env: Mapping[str, str]) -> Optional[LaunchEnv]:
    """``NNODES`` / ``NODE_RANK`` / ``MASTER_ADDR`` / ``MASTER_PORT``, or None when none is set."""
    names = ("NNODES", "NODE_RANK", "MASTER_ADDR", "MASTER_PORT")
    if not any(k in env for k in names[:3]):
        return None
    port, _ = _port(env)
    return LaunchEnv("torchrun-style", nnodes=_int(env, "NNODES") if "NNODES" in env else None,
                     node_rank=_int(env, "NODE_RANK") if "NODE_RANK" in env else None,
                     master_addr=env.get("MASTER_ADDR") or None, master_port=port,
                     read=tuple((k, env[k]) for k in names if k in env))


def launcher_env(env: Mapping[str, str]) -> Optional[LaunchEnv]:
    """The first launcher whose variables are present: LeaderWorkerSet, Slurm, torchrun-style.

    Raises:
        ConfigError: a variable is malformed (one line naming it).
    """
    for read in (from_lws, from_slurm, from_torchrun):
        found = read(env)
        if found is not None:
            return found
    return None
