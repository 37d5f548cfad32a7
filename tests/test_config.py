"""Settings that depend on the environment: CPU threads per worker, ``device="auto"``."""
from __future__ import annotations

import os

import torch

import zpp.config
from zpp.config import cpu_threads_per_worker, resolve_device


def test_cpu_threads_default_user_torch_and_omp(monkeypatch):
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.setattr(zpp.config, "torch_threads_at_import", torch.get_num_threads())
    cores = os.cpu_count() or 1
    assert cpu_threads_per_worker(2) == max(1, cores // 2)       # default: cores / local workers
    assert cpu_threads_per_worker(4 * cores) == 1
    before = torch.get_num_threads()
    torch.set_num_threads(before + 3)                             # the user's torch.set_num_threads
    try:
        assert cpu_threads_per_worker(2) == before + 3
        monkeypatch.setenv("OMP_NUM_THREADS", "5")                # OMP_NUM_THREADS wins
        assert cpu_threads_per_worker(2) == 5
    finally:
        torch.set_num_threads(before)
    monkeypatch.setenv("OMP_NUM_THREADS", "not-a-number")
    assert cpu_threads_per_worker(2) == max(1, cores // 2)


def test_device_auto():
    assert resolve_device("auto") == ("cuda" if torch.cuda.is_available() else "cpu")
    assert resolve_device("cpu") == "cpu"
