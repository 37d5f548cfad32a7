"""Programmatic dependent launch (PDL) for zpp's Triton kernels on Hopper and newer GPUs.

A decode step at batch 1 is a few hundred short kernels; between two of them the GPU drains one grid
and ramps the next up. With PDL the next kernel's programs may start while the one before finishes
and wait in-kernel (``griddepcontrol.wait``) for its writes, so those gaps overlap; the GEMVs also
ask L2 for their weight rows (never written by anyone) before the wait. References: the CUDA
programming guide, "Programmatic Dependent Launch and Synchronization"; PTX ``griddepcontrol``;
Triton's tutorial 11 (``gdc_wait`` / ``gdc_launch_dependents`` and ``launch_pdl``); CUTLASS's
example 63 (weight prefetch before the dependency wait).

Never on the CPU path, and off under ``TRITON_INTERPRET=1`` (CPU tensors get no keywords).
"""
from __future__ import annotations

import contextlib
import functools
from typing import Iterator

import torch
import triton
import triton.language as tl

from zpp import envs

_PDL = envs.ZPP_PDL
_PREFETCH = envs.ZPP_GEMV_PREFETCH
_TRIGGER = envs.ZPP_PDL_TRIGGER
if _TRIGGER not in ("entry", "late", "exit"):
    raise ValueError(f"ZPP_PDL_TRIGGER must be entry, late or exit, got {_TRIGGER!r}")
# read by the jitted helpers below as compile-time constants
_TRIGGER_AT_ENTRY = tl.constexpr(_TRIGGER == "entry")
_TRIGGER_LATE = tl.constexpr(_TRIGGER == "late")

PDL_MAX_TOKENS = 4
"""Decode steps of at most this many tokens launch with PDL. One H100, Llama-3-8B shape, FP8 weights,
``zpp bench latency`` in CUDA graphs: batch 1 3.56 -> 3.40 ms per token, batch 8 4.87 either way,
batch 64 5.49 -> 5.54 (the GEMMs there are cuBLAS's, launched without it)."""
_active = False  # inside decode_step() for a step of <= PDL_MAX_TOKENS tokens


@contextlib.contextmanager
def decode_step(num_tokens: int) -> Iterator[None]:
    """The kernels launched inside (a decode step of ``num_tokens`` tokens, run or captured into a
    CUDA graph) use PDL if ``num_tokens <= PDL_MAX_TOKENS`` and ``ZPP_PDL`` is not ``0``; outside
    any such scope none does."""
    global _active
    before, _active = _active, _PDL and num_tokens <= PDL_MAX_TOKENS
    try:
        yield
    finally:
        _active = before


@functools.lru_cache(maxsize=None)
def _pdl_capable(index: int) -> bool:
    # Triton 3.3 brought gdc_wait and launch_pdl; torch >= 2.4 may come with an older one
    from triton.language.extra import cuda
    return torch.cuda.get_device_capability(index)[0] >= 9 and hasattr(cuda, "gdc_wait")


def pdl(t: torch.Tensor) -> dict:
    """Launch keywords for a zpp Triton kernel whose operands live on ``t``'s device: on a CUDA
    device of compute capability 9.0 or newer (Hopper, Blackwell), inside :func:`decode_step` for a
    small step, ``USE_PDL=True`` (the kernel starts with :func:`pdl_enter`) and ``launch_pdl=True`` (Triton
    launches it with CUDA's programmatic-stream-serialization attribute); else nothing.

    Programmatic dependent launch (CUDA programming guide, "Programmatic Dependent Launch and
    Synchronization"; Triton's tutorial 11): the GPU may start a kernel's programs while the kernel
    before it on the stream is still finishing, and each program waits (``griddepcontrol.wait``)
    until that kernel has completed and its writes are visible before it reads or writes anything
    the kernels before it touch. A batch-1 decode step is ~300 short kernels whose start-up and tail
    gaps add up to a tenth of the step; the waits keep every read after its producer, so results do
    not change. CUDA graphs keep the attribute (stream capture turns it into programmatic edges)."""
    if not (_active and t.is_cuda):
        return {}
    index = t.device.index if t.device.index is not None else torch.cuda.current_device()
    return dict(USE_PDL=True, launch_pdl=True) if _pdl_capable(index) else {}


def gemv_pdl(w: torch.Tensor) -> dict:
    """:func:`pdl`'s keywords for a GEMV over the ``[N, K]`` weight ``w`` (unit stride in a row),
    with its rows' L2 prefetch (:func:`prefetch_rows_l2`) under ``ZPP_GEMV_PREFETCH=1``."""
    kw = pdl(w)
    if kw and _PREFETCH:
        per_line = 128 // w.element_size()
        kw.update(PREFETCH=True, PF_LINES=triton.next_power_of_2(triton.cdiv(w.shape[1], per_line)))
    return kw


@triton.jit
def pdl_enter(USE_PDL: tl.constexpr, MULTI_WAVE: tl.constexpr = False):
    """A kernel's first step under :func:`pdl`: wait for the kernel before it (its writes visible),
    then let the next kernel's programs launch as this one's finish (``ZPP_PDL_TRIGGER=entry``; with
    ``late`` only a kernel that is not ``MULTI_WAVE``: those call :func:`pdl_trigger` after their main
    loop, so the next kernel's waiting programs do not take SM slots from this one's later waves)."""
    if USE_PDL:
        tl.extra.cuda.gdc_wait()
        if _TRIGGER_AT_ENTRY or (_TRIGGER_LATE and not MULTI_WAVE):
            tl.extra.cuda.gdc_launch_dependents()


@triton.jit
def pdl_trigger(USE_PDL: tl.constexpr):
    """A ``MULTI_WAVE`` kernel's launch of the next one under ``ZPP_PDL_TRIGGER=late``, called once its
    last loads are issued; nothing otherwise."""
    if USE_PDL:
        if _TRIGGER_LATE:
            tl.extra.cuda.gdc_launch_dependents()


@triton.jit
def prefetch_rows_l2(W, n, N, stride_wn, K, LINES: tl.constexpr, ELEMS_PER_LINE: tl.constexpr):
    """Ask L2 for rows ``n`` (``[BLOCK_N]``, clamped to ``N - 1``) of the ``[N, K]`` matrix ``W``, one
    ``prefetch.global.L2`` per 128-byte line (``LINES`` >= ``ceil(K / ELEMS_PER_LINE)``, a power of
    two). Before :func:`pdl_enter`: weights are never written by the kernel before, so their reads may
    start while it finishes."""
    rows = tl.minimum(n, N - 1)
    cols = tl.minimum(tl.arange(0, LINES) * ELEMS_PER_LINE, K - 1)
    addr = (W + rows[:, None] * stride_wn + cols[None, :]).to(tl.uint64, bitcast=True)
    tl.inline_asm_elementwise("prefetch.global.L2 [$1]; // $0", "=r,l", [addr], dtype=tl.int32, is_pure=False,
                              pack=1)
