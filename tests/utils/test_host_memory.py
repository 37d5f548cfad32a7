import os

import pytest
import torch

from zpp.utils.host_memory import available_bytes, zeroed_tensor


def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.float8_e4m3fn])
def test_zeroed_tensor_reads_zero_keeps_writes_and_takes_memory_only_where_written(dtype):
    shape = (512, 16, 2, 64, 64)  # 512 blocks of 16 tokens: 64-256 MiB at 1-4 bytes per element
    before = _rss_bytes()
    t = zeroed_tensor(shape, dtype)
    assert t.shape == shape and t.dtype == dtype and t.is_contiguous()
    assert _rss_bytes() - before < 16 << 20  # nothing taken yet
    t[3].fill_(1)
    block = t[3].numel() * t.element_size()
    assert _rss_bytes() - before < block + (16 << 20)  # one block written, one block taken
    raw = t.view(torch.uint8)  # every byte zero is zero in each dtype (read without a float copy)
    assert t[3].float().eq(1).all() and not raw[:3].any() and not raw[4:].any()
    assert zeroed_tensor((0, 4), dtype).shape == (0, 4)


def test_available_bytes_is_meminfo_lowered_by_the_cgroup_limit(tmp_path):
    (tmp_path / "meminfo").write_text("MemTotal:       24000000 kB\nMemAvailable:    2000000 kB\n")
    (tmp_path / "cgroup").write_text("0::/job\n")
    (tmp_path / "job").mkdir()
    args = dict(meminfo=str(tmp_path / "meminfo"), proc_cgroup=str(tmp_path / "cgroup"), root=str(tmp_path))
    (tmp_path / "job" / "memory.max").write_text("max\n")
    assert available_bytes(**args) == 2000000 * 1024
    (tmp_path / "job" / "memory.max").write_text(f"{1 << 30}\n")
    (tmp_path / "job" / "memory.current").write_text(f"{256 << 20}\n")
    assert available_bytes(**args) == (1 << 30) - (256 << 20)
    assert available_bytes(meminfo=str(tmp_path / "none"), proc_cgroup=str(tmp_path / "none")) is None


def test_available_bytes_counts_a_limit_on_a_parent_cgroup(tmp_path):
    """A container's memory.max often sits on a parent of the process's cgroup (the process in
    /pod/ctr, the limit on /pod): the tightest limit on the path counts."""
    (tmp_path / "meminfo").write_text("MemAvailable:    8000000 kB\n")
    (tmp_path / "cgroup").write_text("0::/pod/ctr\n")
    leaf = tmp_path / "pod" / "ctr"
    leaf.mkdir(parents=True)
    (leaf / "memory.max").write_text("max\n")
    (leaf / "memory.current").write_text(f"{100 << 20}\n")
    (tmp_path / "pod" / "memory.max").write_text(f"{2 << 30}\n")
    (tmp_path / "pod" / "memory.current").write_text(f"{512 << 20}\n")
    args = dict(meminfo=str(tmp_path / "meminfo"), proc_cgroup=str(tmp_path / "cgroup"), root=str(tmp_path))
    assert available_bytes(**args) == (2 << 30) - (512 << 20)
    (leaf / "memory.max").write_text(f"{1 << 30}\n")  # now the leaf's is tighter: 1 GiB - 100 MiB
    assert available_bytes(**args) == (1 << 30) - (100 << 20)
    (tmp_path / "pod" / "memory.max").write_text(f"{64 << 20}\n")  # over its limit already: nothing left
    assert available_bytes(**args) == 0
    (tmp_path / "memory.max").write_text("garbage\n")  # an unreadable one at the root counts as none
    assert available_bytes(**args) == 0
