"""Programmatic dependent launch (PDL) for zpp's Triton kernels on Hopper and newer GPUs.

A decode step at batch 1 is a few hundred short kernels; between two of them the GPU drains one grid
and ramps the next up. With PDL the next kernel's programs may start while the one before finishes
and wait in-kernel (``griddepcontrol.wait``) for its writes, so those gaps overlap. References: the
CUDA programming guide, "Programmatic Dependent Launch and Synchronization"; PTX ``griddepcontrol``;
Triton's tutorial 11 (``gdc_wait`` / ``gdc_launch_dependents`` and ``launch_pdl``).

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

PDL_MAX_TOKENS = 4
"""Decode steps of at most this many tokens launch with PDL. One H100, Llama-3-8B shape, FP8 weights,
``zpp bench latency`` in CUDA graphs, PDL everywhere against none: batch 1 3.56-3.60 -> 3.38-3.40 ms
per token, batch 8 4.86-4.89 either way, batch 64 5.49 -> 5.54 (the GEMMs there are cuBLAS's,
launched without it). Batches 2 and 4 were not measured apart: they run batch 1's kernels."""
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
    small step, ``USE_PDL=True`` (the kernel starts with :func:`pdl_enter`) and ``launch_pdl=True``
    (Triton launches it with CUDA's programmatic-stream-serialization attribute); else nothing.

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


@triton.jit
def pdl_enter(USE_PDL: tl.constexpr):
    """A kernel's first step under :func:`pdl`: wait for the kernel before it (its writes visible),
    then let the next kernel's programs launch as this one's finish. Where the launch is released
    was measured on an H100 (batch-1 FP8 decode, ms per token): here 3.39, after a GEMV's last weight
    load 3.44. An L2 prefetch of the GEMV's weights before the wait made each placement slower (3.58
    here, 3.66 late, 3.91 released only at exit) and was removed."""
    if USE_PDL:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
