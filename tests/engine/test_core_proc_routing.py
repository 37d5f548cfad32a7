"""The engine-core process's routing among several API servers (``--api-server-count``), in
process with a stand-in socket and core: a sequence id that arrives while it is live (two API
servers' ids colliding) ends the newcomer at once and keeps the live sequence's tokens going to the
server that sent it. A newcomer once found the core dropping the second request silently and
re-routing the first one's tokens, so one of the two clients waited for ever."""
from __future__ import annotations

import asyncio

from zpp.engine.core_proc import _CoreServer
from zpp.transport import core_messages as cm


class _Socket:
    def __init__(self, inbox):
        self.inbox, self.sent = list(inbox), []

    async def recv(self):
        if not self.inbox:
            raise asyncio.CancelledError
        return self.inbox.pop(0)

    def send(self, ident, msg):
        self.sent.append((ident, msg))

    def broadcast(self, idents, msg):
        for i in idents:
            self.send(i, msg)


class _Core:
    dead = False

    def __init__(self):
        self.added = []

    def add_requests(self, reqs):
        self.added += [r.req_id for r in reqs]

    def stats(self):
        return None


def _req(rid):
    return cm.CoreRequest(rid, [1, 2, 3], None, 4)


def test_a_live_sequence_id_from_another_front_end_is_ended_not_rerouted():
    a, b = b"front-a", b"front-b"
    srv = _CoreServer.__new__(_CoreServer)
    srv.fronts, srv.owner, srv._stats_pending = [a, b], {}, True   # no stats timer in this test
    srv.core = _Core()
    srv.sock = _Socket([(a, cm.AddRequests([_req("x"), _req("y")])), (b, cm.AddRequests([_req("x"), _req("z")]))])
    try:
        asyncio.run(srv._read())
    except asyncio.CancelledError:
        pass
    assert srv.core.added == ["x", "y", "z"]                      # the second "x" never reached the core
    assert srv.owner == {"x": a, "y": a, "z": b}
    ended = [(i, [(d.req_id, d.finish_reason) for d in m.deltas]) for i, m in srv.sock.sent]
    assert ended == [(b, [("x", "abort")])]                        # the newcomer's server hears at once
    srv.sock.sent.clear()
    srv._emit(cm.StepOutputs([cm.SeqDelta("x", 7), cm.SeqDelta("z", 9)], None))
    routed = {i: [d.req_id for d in m.deltas] for i, m in srv.sock.sent}
    assert routed == {a: ["x"], b: ["z"]}                          # x's token still goes to front a
