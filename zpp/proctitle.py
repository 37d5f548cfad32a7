"""Process titles: each zpp process shows in ``ps`` / ``top`` by its job (``zpp::core``,
``zpp::stage0``, ``zpp::stage1-tp1``, ``zpp::api1``, ``zpp::grammar``) instead of
``python -c from multiprocessing.spawn ...`` (vLLM does the same: ``VLLM::EngineCore``)."""
from __future__ import annotations


def set_process_title(title: str) -> None:
    """Set this process's title (its ``/proc/PID/cmdline`` and, cut to 15 bytes, ``comm``) with
    the ``setproctitle`` package; does nothing when that package cannot be imported."""
    try:
        import setproctitle
    except ImportError:
        return
    setproctitle.setproctitle(title)


def stage_title(pp_rank: int, tp_rank: int, tp_size: int) -> str:
    """``zpp::stage{pp_rank}``, with ``-tp{tp_rank}`` when a stage has several TP ranks."""
    return f"zpp::stage{pp_rank}" + (f"-tp{tp_rank}" if tp_size > 1 else "")
