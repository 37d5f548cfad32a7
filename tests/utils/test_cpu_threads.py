"""zpp.utils.cpu_threads: the cores a process really has (affinity, cgroup v1 / v2 quotas, on fake
cgroup trees), each stage's share, and the OpenMP variables a stage process starts with (the
user's own settings left alone)."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest

import zpp.config
from zpp.config import cpu_threads_per_worker
from zpp.utils import cpu_threads as ct
from zpp.utils.cpu_threads import (available_cores, cgroup_cpu_limit, environ_for_children,
                                   stage_env, threads_per_stage)


def _write(path, text):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)


def test_cgroup_v2_quota_smallest_on_the_path(tmp_path):
    proc = tmp_path / "cgroup"
    proc.write_text("0::/user.slice/job\n")
    root = tmp_path / "fs"
    _write(root / "user.slice" / "job" / "cpu.max", "max 100000\n")        # no limit on the leaf
    _write(root / "user.slice" / "cpu.max", "250000 100000\n")             # 2.5 cores on the parent
    _write(root / "cpu.max", "max 100000\n")
    assert cgroup_cpu_limit(str(proc), str(root)) == pytest.approx(2.5)
    _write(root / "user.slice" / "job" / "cpu.max", "50000 100000\n")     # 0.5 on the leaf wins
    assert cgroup_cpu_limit(str(proc), str(root)) == pytest.approx(0.5)


def test_cgroup_v2_no_limit_and_missing_files(tmp_path):
    proc = tmp_path / "cgroup"
    proc.write_text("0::/a\n")
    root = tmp_path / "fs"
    _write(root / "a" / "cpu.max", "max 100000\n")
    assert cgroup_cpu_limit(str(proc), str(root)) is None
    assert cgroup_cpu_limit(str(tmp_path / "no-such-file"), str(root)) is None
    assert cgroup_cpu_limit(str(proc), str(tmp_path / "no-such-root")) is None


def test_cgroup_v1_quota_at_the_mount_root_in_a_container(tmp_path):
    """v1 inside a container: /proc/self/cgroup names the host's path, the mount holds only the
    container's own cgroup (its root); -1 means no quota."""
    proc = tmp_path / "cgroup"
    proc.write_text("5:memory:/docker/abc\n4:cpu,cpuacct:/docker/abc\n1:name=systemd:/docker/abc\n")
    root = tmp_path / "fs"
    _write(root / "cpu,cpuacct" / "cpu.cfs_quota_us", "300000\n")
    _write(root / "cpu,cpuacct" / "cpu.cfs_period_us", "100000\n")
    assert cgroup_cpu_limit(str(proc), str(root)) == pytest.approx(3.0)
    _write(root / "cpu,cpuacct" / "cpu.cfs_quota_us", "-1\n")
    assert cgroup_cpu_limit(str(proc), str(root)) is None


def test_available_cores_affinity_lowered_by_quota():
    assert available_cores(affinity=8, cgroup_limit=None) == 8
    assert available_cores(affinity=8, cgroup_limit=2.5) == 2     # 3 threads would be throttled
    assert available_cores(affinity=2, cgroup_limit=16.0) == 2
    assert available_cores(affinity=4, cgroup_limit=0.5) == 1     # at least one
    assert available_cores(affinity=None, cgroup_limit=None) == len(os.sched_getaffinity(0))


def test_threads_per_stage_divides_the_cores():
    assert threads_per_stage(1, cores=2) == 2
    assert threads_per_stage(2, cores=2) == 1
    assert threads_per_stage(3, cores=8) == 2
    assert threads_per_stage(5, cores=2) == 1
    assert threads_per_stage(0, cores=4) == 4


def test_cpu_threads_per_worker_uses_the_available_cores(monkeypatch):
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.setattr(zpp.config, "torch_threads_at_import", None)
    monkeypatch.setattr(ct, "available_cores", lambda: 6)
    assert cpu_threads_per_worker(2) == 3
    assert cpu_threads_per_worker(1) == 6
    monkeypatch.setenv("OMP_NUM_THREADS", "5")                         # the user's choice wins
    assert cpu_threads_per_worker(2) == 5


def test_stage_env_defaults_and_user_settings_win():
    assert stage_env(2, environ={}) == {"OMP_NUM_THREADS": "2"}
    assert stage_env(0, environ={}) == {"OMP_NUM_THREADS": "1"}
    assert stage_env(2, environ={"OMP_NUM_THREADS": "4"}) == {}             # the user's choice wins
    assert stage_env(2, environ={"OMP_WAIT_POLICY": "PASSIVE", "GOMP_SPINCOUNT": "1"}) == {"OMP_NUM_THREADS": "2"}


@pytest.mark.slow
def test_environ_for_children_reaches_a_child_and_is_restored(monkeypatch):
    monkeypatch.setenv("OMP_NUM_THREADS", "7")
    monkeypatch.delenv("GOMP_SPINCOUNT", raising=False)
    code = "import os; print(os.environ.get('OMP_NUM_THREADS'), os.environ.get('GOMP_SPINCOUNT'))"
    with environ_for_children({"OMP_NUM_THREADS": "2", "GOMP_SPINCOUNT": "123"}):
        seen = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert seen.split() == ["2", "123"]
    assert os.environ["OMP_NUM_THREADS"] == "7"
    assert "GOMP_SPINCOUNT" not in os.environ


def test_describe_choice_names_threads_and_settings():
    line = ct.describe_choice(2, 1, {"OMP_NUM_THREADS": "1"}, environ={"OMP_WAIT_POLICY": "PASSIVE"})
    assert "2 stage process(es) here, 1 thread(s) each" in line
    assert "OMP_NUM_THREADS=1" in line and "OMP_WAIT_POLICY=PASSIVE (yours)" in line
