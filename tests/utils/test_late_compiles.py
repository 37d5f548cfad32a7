"""The warning for Triton kernels compiled while serving: once per variant, never for a warm-up,
and the compile still goes ahead (the hook answers False)."""
import logging

import pytest

from zpp.utils import late_compiles


def test_a_late_variant_is_reported_once(caplog):
    late_compiles._reported.clear()
    rep = "_paged_attention_kernel[num_warps=1, num_ctas=1, num_stages=3](Q: *bf16, stride_bt: i32)"
    other = rep.replace("num_warps=1", "num_warps=2")
    with caplog.at_level(logging.WARNING, logger="zpp.utils.late_compiles"):
        assert late_compiles.report_late_compile(repr=rep, key=("k",), fn=None, compile={}) is False
        assert late_compiles.report_late_compile(repr=rep, key=("k",), fn=None, compile={}) is False
        assert late_compiles.report_late_compile(repr=other, is_manual_warmup=True) is False
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 1
    assert "_paged_attention_kernel while serving" in lines[0] and "num_warps=1" in lines[0]


def test_watch_installs_tritons_cache_hook():
    knobs = pytest.importorskip("triton").knobs
    before = knobs.runtime.jit_cache_hook
    try:
        assert late_compiles.watch_late_compiles() is True
        assert knobs.runtime.jit_cache_hook is late_compiles.report_late_compile
    finally:
        knobs.runtime.jit_cache_hook = before
