"""A large offline ``generate`` keeps its per-prompt objects out of full garbage collections while it
runs (zpp.llm._frozen_while_running), and still frees the cycles its prompts leave once it ends."""
import gc
import weakref

from zpp.llm import FREEZE_MIN_PROMPTS, _frozen_while_running


class _Node:
    def __init__(self):
        self.me = self  # a reference cycle: only the cyclic collector frees it


def test_objects_alive_at_entry_skip_collections_and_are_freed_at_the_end():
    gc.collect()
    node = _Node()
    ref = weakref.ref(node)
    with _frozen_while_running(FREEZE_MIN_PROMPTS):
        assert gc.get_freeze_count() > 0
        del node  # a prompt finished, leaving a cycle
        gc.collect()
        assert ref() is not None  # frozen: a full collection no longer walks (or frees) it
    assert ref() is None  # collected on the way out
    assert gc.get_freeze_count() > 0  # what was alive is frozen again, as after start-up
    gc.unfreeze()


def test_small_calls_leave_the_collector_alone():
    gc.unfreeze()
    node = _Node()
    ref = weakref.ref(node)
    with _frozen_while_running(FREEZE_MIN_PROMPTS - 1):
        assert gc.get_freeze_count() == 0
        del node
        gc.collect()
        assert ref() is None
