"""Which decode steps launch their Triton kernels with programmatic dependent launch: the CUDA-graph
forward of at most ``pdl.PDL_MAX_TOKENS`` rows on one stage rank, and no other (checked on the CPU
by recording the scope the model forward runs in; the launches themselves are GPU tests in
tests/gpu/test_decode_launches.py)."""
from __future__ import annotations

from types import SimpleNamespace

import pytest

from zpp.models.layers import pdl as P
from zpp.workers.cuda_graphs import DecodeGraphs


def _graphs(tp_size: int):
    seen = []
    fake = SimpleNamespace(stage=SimpleNamespace(tp_size=tp_size), _model_forward=lambda bs: seen.append(P._active))
    return fake, seen


@pytest.mark.parametrize("tp_size", [1, 2])
def test_graph_forward_scopes_pdl(tp_size, monkeypatch):
    monkeypatch.setattr(P, "_PDL", True)
    fake, seen = _graphs(tp_size)
    sizes = [1, 2, P.PDL_MAX_TOKENS, P.PDL_MAX_TOKENS + 1, 64]
    for bs in sizes:
        DecodeGraphs._forward(fake, bs)
    assert seen == [tp_size == 1 and bs <= P.PDL_MAX_TOKENS for bs in sizes]
    assert P._active is False  # left as found


def test_pdl_off_switch(monkeypatch):
    monkeypatch.setattr(P, "_PDL", False)  # ZPP_PDL=0
    fake, seen = _graphs(1)
    DecodeGraphs._forward(fake, 1)
    assert seen == [False]


def test_decode_step_restores_scope_on_error(monkeypatch):
    monkeypatch.setattr(P, "_PDL", True)
    with P.decode_step(1):
        with pytest.raises(RuntimeError), P.decode_step(P.PDL_MAX_TOKENS + 1):
            assert P._active is False
            raise RuntimeError
        assert P._active is True
    assert P._active is False
