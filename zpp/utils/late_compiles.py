"""Tell when a Triton kernel is compiled while serving.

Start-up builds the kernel variants a run needs (the memory profile's forward pass, the decode CUDA
graphs, the LM head warm-up, the MoE warm-up of :mod:`zpp.models.layers.moe_warmup`). Triton
compiles a new variant for every new class of its arguments
(an integer that is 1, a multiple of 16 or neither, a pointer that is 16-byte aligned or not, the
constexprs and launch options); one that start-up did not build is compiled when a batch first
needs it, and that batch and every one queued behind it wait, 1-2 s on the H200 for the attention
kernel. That happened silently (the block-table widths of eager batches, found only by listing a
fresh Triton cache after a run); :func:`watch_late_compiles`, called once start-up is done, logs
each such variant once, by name and launch options.
"""
from __future__ import annotations

import logging

logger = logging.getLogger(__name__)

_reported: set[str] = set()


def report_late_compile(*, repr: str, is_manual_warmup: bool = False, **_) -> bool:  # noqa: A002 (Triton's name)
    """Triton's ``jit_cache_hook``: log the variant ``repr`` (kernel, launch options, argument
    classes) once at WARNING; returns False, so the compile goes ahead."""
    if not is_manual_warmup and repr not in _reported:
        _reported.add(repr)
        name = repr.split("[", 1)[0]
        logger.warning("Triton compiled a variant of %s while serving (start-up did not build it; the batch "
                       "that needed it waited for the compile): %s", name, repr)
    return False


def watch_late_compiles() -> bool:
    """Install :func:`report_late_compile` as Triton's ``knobs.runtime.jit_cache_hook`` (called on
    every in-memory miss of a kernel's variant cache, before the compile or the load from Triton's
    disk cache). Returns False where this Triton has no such hook (nothing installed)."""
    try:
        from triton import knobs
        runtime = knobs.runtime
    except (ImportError, AttributeError):
        return False
    if not hasattr(runtime, "jit_cache_hook"):
        return False
    runtime.jit_cache_hook = report_late_compile
    return True
