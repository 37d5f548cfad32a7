"""ThreadGovernor on fake clocks: a stage keeps its threads while its main thread gets its core,
drops to the cores it really gets under contention, probes its full count later (backing off while
the contention lasts) and goes back up once it is over."""
from __future__ import annotations

from zpp.workers.adaptive_threads import ThreadGovernor

STEP = 0.125  # seconds of wall per step (exact in binary: the windows end where the test says)


class Clocks:
    def __init__(self):
        self.wall = self.cpu = 0.0

    def steps(self, governor, n, cpu_share, wall_s=STEP):
        for _ in range(n):
            governor.begin()
            self.wall += wall_s
            self.cpu += wall_s * cpu_share
            governor.end()


def _governor(max_threads, applied, clocks):
    return ThreadGovernor(max_threads, applied.append, window_s=0.5, min_steps=3, low=0.8, probe_s=2.0,
                          max_probe_s=8.0, wall=lambda: clocks.wall, cpu=lambda: clocks.cpu)


def test_quiet_steps_keep_every_thread():
    clocks, applied = Clocks(), []
    g = _governor(2, applied, clocks)
    clocks.steps(g, 100, 0.97)
    assert g.threads == 2 and applied == []


def test_contention_drops_then_probes_back_off_then_recover():
    clocks, applied = Clocks(), []
    g = _governor(2, applied, clocks)
    clocks.steps(g, 4, 0.67)                # 2 threads + 1 busy process on 2 cores: 2/3 of a core
    assert applied == [1] and g.threads == 1
    clocks.steps(g, 15, 1.0)                # alone on its core now
    assert applied == [1]
    clocks.steps(g, 1, 1.0)                 # 2 s after the drop: it tries 2 threads again
    assert applied == [1, 2]
    clocks.steps(g, 4, 0.67)                # still contended: down again, next probe after 4 s
    assert applied == [1, 2, 1] and g.probe_s == 4.0
    clocks.steps(g, 31, 1.0)
    assert applied == [1, 2, 1]
    clocks.steps(g, 1, 1.0)
    assert applied == [1, 2, 1, 2]
    clocks.steps(g, 40, 0.97)               # the busy process is gone: stays at 2, probe wait reset
    assert applied == [1, 2, 1, 2] and g.threads == 2 and g.probe_s == 2.0


def test_probe_wait_is_capped():
    clocks, applied = Clocks(), []
    g = _governor(2, applied, clocks)
    for _ in range(6):                      # contended every time it probes: 2, 4, 8, 8, 8 s
        clocks.steps(g, 4, 0.6)
        clocks.steps(g, int(g.probe_s / STEP), 1.0)
    assert applied == [1, 2] * 6 and g.probe_s == 8.0


def test_drop_follows_the_share_of_a_core():
    clocks, applied = Clocks(), []
    g = _governor(8, applied, clocks)
    clocks.steps(g, 4, 0.5)                 # 8 threads and 8 more busy ones: about 4 cores for us
    assert applied == [4]


def test_a_window_needs_enough_steps_and_one_thread_is_left_alone():
    clocks, applied = Clocks(), []
    g = _governor(2, applied, clocks)
    clocks.steps(g, 2, 0.5, wall_s=1.0)     # 2 s of wall but only 2 steps: no decision yet
    assert applied == []
    clocks.steps(g, 1, 0.5, wall_s=1.0)
    assert applied == [1]
    single, none = Clocks(), []
    g1 = _governor(1, none, single)
    single.steps(g1, 20, 0.3)
    assert not g1.active and none == []
