"""``zpp plan``'s sizes and text: reading ``--gpu-memory`` / ``--gpu-capability``, printing a plan."""
from __future__ import annotations

import re
from typing import Any

from zpp.errors import ConfigError


# --- sizes -------------------------------------------------------------------------------------
_UNITS = {"": 1, "b": 1, "k": 10**3, "kb": 10**3, "m": 10**6, "mb": 10**6, "g": 10**9, "gb": 10**9,
          "t": 10**12, "tb": 10**12, "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}


def parse_memory_list(text: str, flag: str = "--gpu-memory") -> tuple[int, ...]:
    """``80GiB,24GiB`` -> bytes per entry. A bare number is GiB (``80`` = 80 GiB; GPUs are sold so);
    units: B, KB/MB/GB/TB (powers of 10), KiB/MiB/GiB/TiB (powers of 2).

    Raises:
        ConfigError: one line naming ``flag`` and the entry it cannot read.
    """
    out = []
    for part in str(text).split(","):
        m = re.fullmatch(r"\s*([0-9]+(?:\.[0-9]+)?)\s*([A-Za-z]*)\s*", part)
        unit = m.group(2).lower() if m else ""
        if not m or unit not in _UNITS or float(m.group(1)) <= 0:
            raise ConfigError(f"{flag} {text!r}: cannot read {part.strip()!r} as a size (e.g. 80GiB, 24GiB, 80)")
        out.append(int(float(m.group(1)) * (_UNITS[unit] if unit else 2**30)))
    return tuple(out)


def parse_capability(text: str) -> tuple[int, int]:
    """``9.0`` -> ``(9, 0)``. Raises ConfigError (one line) on anything else."""
    try:
        major, minor = str(text).strip().split(".")
        return int(major), int(minor)
    except ValueError:
        raise ConfigError(f"--gpu-capability {text!r}: expected MAJOR.MINOR, e.g. 9.0 (H100), 8.9 (L40S), 8.0 (A100)") \
            from None


def fmt_bytes(n: float) -> str:
    n = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1024
    return f"{n:.2f} TiB"


# --- printing ----------------------------------------------------------------------------------
def format_plan(plan: Any, model: str) -> str:
    """The plan as ``zpp plan`` prints it: a line of context, a table (one row per stage), the verdict."""
    t = plan.target
    dev = (f"GPU (compute capability {t.capability[0]}.{t.capability[1]}), memory "
           f"{','.join(fmt_bytes(m) for m in t.memory)} ({t.source})" if t.device == "cuda"
           else f"CPU, {fmt_bytes(t.memory[0])} RAM available for every stage ({t.source})")
    lines = [f"{model}: {len(plan.stages)} stage(s) x TP {plan.tensor_parallel_size}, dtype {plan.dtype}, "
             f"max-model-len {plan.max_model_len}; {dev}", ""]
    head = ("stage", "layers", "weights", "by dtype", "act+graphs", "KV/token", "KV tokens", "memory", "fits")
    rows = []
    for p in plan.stages:
        rows.append((str(p.stage), f"[{p.layers[0]}, {p.layers[1]})", fmt_bytes(p.weight_bytes),
                     " ".join(f"{k} {fmt_bytes(v)}" for k, v in p.weight_bytes_by_dtype.items()),
                     fmt_bytes(p.activation_bytes + p.graph_bytes), fmt_bytes(p.kv_bytes_per_token),
                     f"{p.kv_tokens:,}", fmt_bytes(p.memory_bytes), "yes" if p.fits else "NO"))
    widths = [max(len(r[i]) for r in rows + [head]) for i in range(len(head))]
    lines.append("  ".join(h.ljust(w) for h, w in zip(head, widths)).rstrip())
    for r in rows:
        lines.append("  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip())
    lines.append("")
    total = sum(p.weight_bytes for p in plan.stages)
    if plan.fits:
        lines.append(f"fits: yes ({fmt_bytes(total)} of weights; KV cache for "
                     f"{min(p.kv_tokens for p in plan.stages):,} tokens, the smallest stage's)")
    else:
        short = [p for p in plan.stages if not p.fits]
        bad = ", ".join(str(p.stage) for p in short)
        if all(p.need_bytes <= p.memory_bytes and p.kv_tokens > 0 for p in short):
            # The weights fit; what falls short is the KV cache of one --max-model-len sequence.
            room = min(p.kv_tokens for p in short)
            lines.append(f"fits: NO (stage {bad}: its KV cache holds {room:,} tokens, less than one "
                         f"--max-model-len {plan.max_model_len:,} sequence; {fmt_bytes(total)} of weights)")
            lines.append(f"--max-model-len {room:,} or less fits as it is; or a split that fits the whole length: "
                         f"{describe_min(plan)}")
        else:
            lines.append(f"fits: NO (stage {bad}; {fmt_bytes(total)} of weights)")
            lines.append(f"smallest split that fits: {describe_min(plan)}")
    return "\n".join(lines)


def describe_min(plan: Any) -> str:
    parts = []
    if plan.min_pipeline_parallel_size is not None:
        tp = plan.tensor_parallel_size
        parts.append(f"-tp {tp} -pp {plan.min_pipeline_parallel_size}" if tp > 1 else f"-pp {plan.min_pipeline_parallel_size}")
    if plan.min_tp_pp is not None and plan.min_tp_pp[0] > 1:
        parts.append(f"-tp {plan.min_tp_pp[0]} -pp {plan.min_tp_pp[1]}")
    if not parts:
        return ("none on this host's RAM (add hosts, or a smaller dtype)" if plan.target.shared
                else "none on devices of this size")
    return " or ".join(parts) + " (each stage on its own device of this size)"
