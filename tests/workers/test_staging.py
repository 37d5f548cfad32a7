"""PinnedStaging (zpp/workers/staging.py): a micro-batch's index arrays reach the device intact,
in order, with their shapes and dtypes; on CUDA through rotating pinned slots whose host memory is
not rewritten under a copy still queued behind GPU work."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from zpp.workers.staging import PinnedStaging, aligned_size


def _arrays(rng, n):
    return [rng.integers(-2**40, 2**40, size=n, dtype=np.int64),
            rng.integers(-2**30, 2**30, size=(3, n // 3 + 1), dtype=np.int32),
            np.zeros(0, dtype=np.int64),
            rng.integers(0, 9, size=1, dtype=np.int32)]


def test_upload_keeps_values_shapes_and_dtypes_on_cpu():
    rng = np.random.default_rng(0)
    staging = PinnedStaging(torch.device("cpu"))
    arrays = _arrays(rng, 77)
    out = staging.upload(arrays)
    for a, t in zip(arrays, out):
        assert t.dtype == {np.int64: torch.int64, np.int32: torch.int32}[a.dtype.type]
        assert t.shape == a.shape and np.array_equal(t.numpy(), a)


def test_other_dtypes_are_refused():
    with pytest.raises(TypeError, match="float64"):
        PinnedStaging(torch.device("cpu")).upload([np.zeros(3)])


def test_packed_offsets_are_128_byte_aligned():
    assert [aligned_size(n) for n in (0, 1, 31, 32, 33)] == [0, 32, 32, 32, 64]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (pinned memory)")
def test_uploads_queued_behind_gpu_work_all_arrive_intact():
    rng = np.random.default_rng(1)
    staging = PinnedStaging(torch.device("cuda"), num_slots=2)
    x = torch.randn(4096, 4096, device="cuda")
    for _ in range(20):  # keep the stream busy so the copies queue behind it
        x = x @ x / 64
    sent, got = [], []
    for i in range(9):  # more uploads than slots: a slot is reused only after its copy ran
        arrays = _arrays(rng, 1000 + 50 * i)
        sent.append(arrays)
        got.append(staging.upload(arrays))
        assert all(t.data_ptr() % 128 == 0 for t in got[-1] if t.numel())
    torch.cuda.synchronize()
    for arrays, tensors in zip(sent, got):
        for a, t in zip(arrays, tensors):
            assert np.array_equal(t.cpu().numpy(), a)


def test_logit_buckets_cover_every_row_count_with_little_padding():
    """The LM head's padded row counts (zpp.workers.runner_state.logit_buckets): a short fixed list
    that covers 1..max_rows, each count up to 1024 padded by less than 128 rows, larger ones (prompt
    logprobs) by less than 1024, none more than doubled."""
    from zpp.workers.runner_state import logit_buckets
    for max_rows in (1, 5, 100, 256, 1000, 1024, 8192):
        b = logit_buckets(max_rows)
        assert b == sorted(set(b)) and b[0] == 1 and b[-1] == max_rows and len(b) <= 24
        for n in range(1, max_rows + 1):
            padded = next(x for x in b if x >= n)
            assert padded - n < (128 if n <= 1024 else 1024) and padded <= 2 * n
