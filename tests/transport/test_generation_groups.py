"""The per-generation process groups of ``zpp.transport.p2p`` (gloo, two or four processes on the CPU):
the same code path the stage restarts run under NCCL between GPUs.

- A stage pair formed under ``g1/``, used, left and formed again under ``g2/`` by the same two
  processes; and again under ``g3/`` with one of them replaced by a new process (a restart).
- Abort: a rank blocked receiving from a peer that is alive but silent (its connection stays open,
  so only the abort can release it) returns with a LinkError naming the abort within a second; the
  pair then forms again under a new generation and works. The same for a TP all-reduce.
- Groups of a TP = 2 x PP = 2 world: each rank's TP group and pairs, in one order (no deadlock).
"""
from __future__ import annotations

import multiprocessing as mp
import os
import time
import traceback

import pytest
import torch

pytestmark = pytest.mark.slow


def _store():
    from zpp.transport.p2p import serve_rendezvous_store
    return serve_rendezvous_store("127.0.0.1")


def _run(target, args_of, n: int, timeout: float = 60.0) -> list:
    """Run ``target(rank, queue, *args_of(rank))`` in ``n`` spawned processes; their results by rank."""
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    procs = [ctx.Process(target=_guard, args=(target, r, q, *args_of(r)), daemon=True) for r in range(n)]
    for p in procs:
        p.start()
    got = {}
    try:
        deadline = time.monotonic() + timeout
        while len(got) < n:
            left = deadline - time.monotonic()
            assert left > 0, f"timed out; results so far {got}"
            r, res = q.get(timeout=left)
            assert not (isinstance(res, str) and res.startswith("Traceback")), f"rank {r}:\n{res}"
            got[r] = res
    finally:
        for p in procs:
            p.join(5)
            if p.is_alive():
                p.kill()
    return [got[r] for r in range(n)]


def _guard(target, rank, q, *args):
    try:
        q.put((rank, target(rank, *args)))
    except BaseException:
        q.put((rank, traceback.format_exc()))


def _pair_worker(rank: int, address: str, generations: list[int]) -> list:
    from zpp.transport.p2p import form_links, leave_process_group, make_stage_link
    out = []
    for gen in generations:
        links = form_links(address, rank, 2, 1, torch.device("cpu"), generation=gen)
        link = make_stage_link(links, rank, rank, 2, 1, torch.device("cpu"))
        names = sorted(links.groups)
        if rank == 0:
            for i in range(3):
                link.send(torch.full((2, 3), float(gen * 10 + i)))
            link.flush()
            out.append((gen, names, None))
        else:
            got = [link.recv((2, 3), torch.float32)[0, 0].item() for _ in range(3)]
            out.append((gen, names, got))
        leave_process_group()
    return out


def test_pair_forms_leaves_and_forms_again():
    store, address = _store()
    res = _run(_pair_worker, lambda r: (address, [1, 2]), 2)
    assert res[0] == [(1, ["pair0-1"], None), (2, ["pair0-1"], None)]
    assert res[1] == [(1, ["pair0-1"], [10.0, 11.0, 12.0]), (2, ["pair0-1"], [20.0, 21.0, 22.0])]
    # generation 3 with rank 0 a new process (rank 1 is, too: one spawn per call), same store
    res = _run(_pair_worker, lambda r: (address, [3]), 2)
    assert res[1] == [(3, ["pair0-1"], [30.0, 31.0, 32.0])]


def _abort_worker(rank: int, address: str, what: str) -> dict:
    """Generation 1: rank 1 waits on rank 0 (a receive or an all-reduce) while rank 0 sleeps with
    its connection open; another thread of rank 1 aborts generation 1 after 1 s. Then both form
    generation 2 and do it for real."""
    import threading

    from zpp.transport.p2p import LinkError, abort_links, form_links, leave_process_group, make_stage_link
    from zpp.transport.tensor_parallel import init_tp_group, release_tp_group, tp_all_reduce
    cpu = torch.device("cpu")
    pp, tp = (2, 1) if what == "recv" else (1, 2)
    res = {}
    links = form_links(address, rank, pp, tp, cpu, generation=1)
    link = make_stage_link(links, rank, rank, pp, tp, cpu) if pp > 1 else None
    init_tp_group(links, 0, tp)
    if rank == 0:
        time.sleep(6)  # silent, alive: its sockets stay open
    else:
        threading.Timer(1.0, abort_links, args=(1, "rank 0 lost (test)")).start()
        t0 = time.monotonic()
        try:
            if what == "recv":
                link.recv((4,), torch.float32)
            else:
                tp_all_reduce(torch.ones(4))
            res["error"] = None
        except LinkError as e:
            res["error"], res["peer_gone"] = str(e), e.peer_gone
        res["released_after_s"] = time.monotonic() - t0
        # a later operation of the aborted generation fails at once
        t0 = time.monotonic()
        try:
            link.recv((1,), torch.float32) if link is not None else tp_all_reduce(torch.ones(1))
        except LinkError as e:
            res["later"] = str(e)
        res["later_s"] = time.monotonic() - t0
    if link is not None:
        link.drop()
    release_tp_group()
    leave_process_group()
    links = form_links(address, rank, pp, tp, cpu, generation=2)
    if what == "recv":
        link = make_stage_link(links, rank, rank, pp, tp, cpu)
        if rank == 0:
            link.send(torch.arange(4.0))
            link.flush()
        else:
            res["gen2"] = link.recv((4,), torch.float32).tolist()
    else:
        init_tp_group(links, 0, tp)
        res["gen2"] = tp_all_reduce(torch.full((4,), float(rank + 1))).tolist()
    release_tp_group()
    leave_process_group()
    return res


@pytest.mark.parametrize("what", ["recv", "all_reduce"])
def test_abort_releases_a_wait_on_a_silent_peer(what):
    store, address = _store()
    r0, r1 = _run(_abort_worker, lambda r: (address, what), 2)
    # released by the abort (1 s), long before rank 0 wakes (6 s) and its connection could close
    assert r1["error"] is not None and 0.8 < r1["released_after_s"] < 3.0, r1
    assert "aborted by the engine: rank 0 lost (test)" in r1["error"] and r1["peer_gone"], r1
    assert "aborted by the engine" in r1["later"] and r1["later_s"] < 0.5, r1
    assert r1["gen2"] == ([0.0, 1.0, 2.0, 3.0] if what == "recv" else [3.0] * 4), r1
    if what == "all_reduce":
        assert r0["gen2"] == [3.0] * 4


def _abort_stale_generation(rank: int, address: str) -> dict:
    """An abort of generation 1 that comes once generation 2 is formed changes nothing; an abort of
    generation 2 that comes while it is forming leaves it aborted from the start."""
    from zpp.transport.p2p import LinkError, abort_links, form_links, leave_process_group, make_stage_link
    cpu = torch.device("cpu")
    res = {}
    links = form_links(address, rank, 2, 1, cpu, generation=2)
    res["stale_abort"] = abort_links(1, "old")
    link = make_stage_link(links, rank, rank, 2, 1, cpu)
    if rank == 0:
        link.send(torch.ones(2))
        link.flush()
    else:
        res["got"] = link.recv((2,), torch.float32).tolist()
    leave_process_group()
    abort_links(3, "lost while forming")  # before generation 3 is formed
    links = form_links(address, rank, 2, 1, cpu, generation=3)
    try:
        link = make_stage_link(links, rank, rank, 2, 1, cpu)
        link.send(torch.ones(1)) if rank == 0 else link.recv((1,), torch.float32)
    except LinkError as e:
        res["gen3"] = str(e)
    leave_process_group()
    return res


def test_abort_of_another_generation():
    store, address = _store()
    for r in _run(_abort_stale_generation, lambda r: (address,), 2):
        assert r["stale_abort"] is False and "generation 3 was aborted while forming" in r["gen3"], r
    assert r["got"] == [1.0, 1.0]


def _tp_pp_worker(rank: int, address: str) -> dict:
    from zpp.transport.p2p import form_links, leave_process_group, make_stage_link
    from zpp.transport.tensor_parallel import init_tp_group, release_tp_group, tp_all_reduce
    cpu = torch.device("cpu")
    pp_rank, tp_rank = divmod(rank, 2)
    links = form_links(address, rank, 2, 2, cpu, generation=1)
    link = make_stage_link(links, rank, pp_rank, 2, 2, cpu)
    init_tp_group(links, pp_rank, 2)
    x = tp_all_reduce(torch.full((3,), float(rank)))
    if pp_rank == 0:
        link.send(x * 10 + tp_rank)
        link.flush()
        y = None
    else:
        y = link.recv((3,), torch.float32).tolist()
    res = {"groups": sorted(links.groups), "sum": x.tolist(), "from_prev": y, "prev": link.prev_rank,
           "next": link.next_rank}
    release_tp_group()
    leave_process_group()
    return res


def test_tp_groups_and_pairs_of_a_2x2_world():
    store, address = _store()
    res = _run(_tp_pp_worker, lambda r: (address,), 4, timeout=90)
    assert [r["groups"] for r in res] == [["pair0-2", "tp0"], ["pair1-3", "tp0"], ["pair0-2", "tp1"],
                                          ["pair1-3", "tp1"]]
    assert [r["sum"] for r in res] == [[1.0] * 3, [1.0] * 3, [5.0] * 3, [5.0] * 3]
    assert [r["from_prev"] for r in res] == [None, None, [10.0] * 3, [11.0] * 3]
    assert [(r["prev"], r["next"]) for r in res] == [(None, 2), (None, 3), (0, None), (1, None)]


def test_group_layout_order():
    from zpp.transport.p2p import group_layout
    assert group_layout(3, 1) == [("pair0-1", (0, 1)), ("pair1-2", (1, 2))]
    assert group_layout(2, 2) == [("tp0", (0, 1)), ("pair0-2", (0, 2)), ("pair1-3", (1, 3)), ("tp1", (2, 3))]
    assert group_layout(1, 1) == []
