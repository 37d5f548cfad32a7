"""A node's watch on its head, in one process (no model, no hosts): zpp.node.head_link.HeadLink sees
the handshake with the head's control plane, then its drop; a link with other keys is refused; a
link with no head never counts as lost."""
from __future__ import annotations

import time

from helpers import free_port


def _head(keys):
    from zpp.transport.channels import EngineSocket
    return EngineSocket(f"tcp://127.0.0.1:{free_port()}", keys)


def test_head_link_sees_the_head_go():
    from zpp.node.head_link import HeadLink
    from zpp.transport.security import new_run_keys
    keys = new_run_keys(True)
    head = _head(keys)
    link = HeadLink(head.address, keys.for_workers(), "node rank 0 at test")
    closed = False
    try:
        assert link.handshake(time.monotonic() + 10) == "ok" and link.connected
        link.watch()
        time.sleep(0.2)
        assert not link.lost.is_set()
        t0 = time.monotonic()
        head.close()  # what the kernel does to a SIGKILLed head's sockets
        closed = True
        assert link.lost.wait(5), "the drop was not seen"
        assert link.lost_at - t0 < 5
    finally:
        link.close()
        if not closed:
            head.close()


def test_head_link_refused_with_other_keys():
    from zpp.node.head_link import HeadLink
    from zpp.transport.security import new_run_keys
    keys = new_run_keys(True)
    head = _head(keys)
    other = new_run_keys(True)
    wrong_client = type(keys)(**{**{f: getattr(keys, f) for f in keys.__struct_fields__},
                                 "client_public": other.client_public, "client_secret": other.client_secret})
    try:
        link = HeadLink(head.address, wrong_client.for_workers(), "test")
        assert link.handshake(time.monotonic() + 10) == "auth"
        link.close()
        link = HeadLink(head.address, other.for_workers(), "test")  # another server key
        assert link.handshake(time.monotonic() + 10) == "protocol"
        link.close()
    finally:
        head.close()


def test_head_link_without_head():
    """No head listening: no handshake, and never 'lost' (a node started first waits for it)."""
    from zpp.node.head_link import HeadLink
    from zpp.transport.security import new_run_keys
    keys = new_run_keys(True)
    link = HeadLink(f"tcp://127.0.0.1:{free_port()}", keys.for_workers(), "test")
    try:
        assert link.handshake(time.monotonic() + 0.5) == "none"
        link.watch()
        assert not link.lost.wait(0.5)
    finally:
        link.close()
