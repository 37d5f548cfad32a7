"""Host-to-GPU copies of a micro-batch's index arrays that never make the worker's host wait.

A ``tensor.to("cuda", non_blocking=True)`` from ordinary (pageable) host memory goes through the
driver's small staging area; once that is full the call blocks until earlier copies have run, and
those copies sit in the stream behind the forward pass already queued. Seen in a ``ZPP_TRACE`` of a
1000 x 256/256 run on one H200: the logits-row index of a 180 ms prefill micro-batch, copied after
its forward was launched, held the worker's host until that forward ended, so the next micro-batch
was launched late and the GPU idled 5-25 ms before every second prefill batch.

:class:`PinnedStaging` packs every array of one upload into a pinned buffer per dtype and issues
one asynchronous copy per dtype (pinned copies are queued without blocking; two copies instead of
one per array), each array at a 128-byte aligned offset. Staging slots rotate; a slot is reused only after the copy that last read it has
run (a CUDA event), so a slot's host memory is never overwritten under a queued copy (invariant 2
of ARCHITECTURE.md, for host buffers). vLLM's GPU model runner keeps pinned CPU mirrors of its input
tensors for the same reason.
"""
from __future__ import annotations

from typing import Optional, Sequence

import numpy as np
import torch


class PinnedStaging:
    """Uploads lists of int32 / int64 numpy arrays to ``device`` through rotating pinned buffers.

    ``upload(arrays)`` returns one device tensor per array, same shape and dtype, in order. On a
    device other than CUDA it copies plainly (no pinned memory there).

    Args:
        device: where the tensors go.
        num_slots: uploads that may be queued at once before the oldest slot is waited for (each
            micro-batch in flight makes one upload).
    """

    def __init__(self, device: torch.device, num_slots: int = 4):
        self.device = device
        self.cuda = device.type == "cuda"
        self._slots: list[dict[np.dtype, torch.Tensor]] = [{} for _ in range(num_slots)]
        self._events: list[Optional[torch.cuda.Event]] = [None] * num_slots
        self._k = 0

    def upload(self, arrays: Sequence[np.ndarray]) -> list[torch.Tensor]:
        """Copy ``arrays`` (each int32 or int64, any shape) to the device; see the class docstring.

        Raises:
            TypeError: an array of another dtype."""
        for a in arrays:
            if a.dtype not in _TORCH:
                raise TypeError(f"PinnedStaging uploads int32 / int64 arrays, got {a.dtype}")
        if not self.cuda:
            return [torch.from_numpy(np.ascontiguousarray(a)).to(self.device) for a in arrays]
        k = self._k = (self._k + 1) % len(self._slots)
        if self._events[k] is not None:
            self._events[k].synchronize()  # the copy that last read this slot has run
        out: list[Optional[torch.Tensor]] = [None] * len(arrays)
        for dt in (np.dtype(np.int64), np.dtype(np.int32)):
            members = [i for i, a in enumerate(arrays) if a.dtype == dt]
            total = sum(aligned_size(arrays[i].size) for i in members)
            if not total:
                for i in members:
                    out[i] = torch.empty(arrays[i].shape, dtype=_TORCH[dt], device=self.device)
                continue
            buf = self._slots[k].get(dt)
            if buf is None or buf.shape[0] < total:
                buf = self._slots[k][dt] = torch.empty(max(total, 4096) * 2, dtype=_TORCH[dt], pin_memory=True)
            host = buf.numpy()
            off = 0
            spans = []
            for i in members:
                n = arrays[i].size
                host[off:off + n] = arrays[i].reshape(-1)
                spans.append((i, off, n))
                off += aligned_size(n)
            dev = buf[:total].to(self.device, non_blocking=True)
            for i, o, n in spans:
                out[i] = dev[o:o + n].view(arrays[i].shape)
        ev = self._events[k] = torch.cuda.Event()
        ev.record()
        return out  # type: ignore[return-value]


_TORCH = {np.dtype(np.int64): torch.int64, np.dtype(np.int32): torch.int32}


def aligned_size(n: int) -> int:
    """Elements an array of ``n`` takes in a packed buffer: a multiple of 32, so every array starts
    128-byte aligned. Triton compiles a kernel variant per pointer alignment (16 bytes or not): with
    arrays packed back to back, each new pattern of offsets compiled new attention variants in the
    middle of a run (0.5-1 s stalls of the first prefill micro-batches on the H200)."""
    return -(-n // 32) * 32
