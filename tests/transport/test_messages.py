"""The columnar micro-batch messages: their byte layout, round trips through the typed decoders,
malformed frames refused cleanly, the worker's slot table, and the scheduler's slot numbering."""
from __future__ import annotations

import struct

import msgspec
import numpy as np
import pytest

from zpp.engine.kv_cache_manager import KVCacheManager
from zpp.engine.request import Request
from zpp.engine.scheduler import Scheduler
from zpp.sampling_params import SamplingParams
from zpp.transport import messages as m
from zpp.workers.slots import SlotTable


def _wire(msg):
    return m.to_worker_decoder.decode(m.encode(msg))


def _batch(batch_id=1) -> m.ExecuteBatch:
    """Slot 3: a new request (prompt of 5, two blocks of 4) whose first chunk is [0, 4); slot 0: a
    held request decoding at 7 with one new token and one new block; slot 1: FROM_PREV at 9."""
    b = m.BatchBuilder()
    b.add(0, 7, 1, m.SAMPLE, new_tokens=[42], new_blocks=[11])
    b.add(1, 9, 1, m.SAMPLE | m.FROM_PREV)
    b.new_request(3, "new", [1, 2, 3, 4, 5], 5, [20, 21], SamplingParams(temperature=0))
    b.add(3, 0, 4, m.PROMPT_LOGPROBS)
    return b.build(batch_id, freed_slots=[2], after_idle=True)


def test_batch_layout_and_round_trip():
    batch = _wire(_batch())
    # little-endian int32 columns, one uint8 flag byte per chunk, whatever the host's byte order
    assert batch.slots == b"\x00\x00\x00\x00\x01\x00\x00\x00\x03\x00\x00\x00"
    assert batch.flags == bytes([m.SAMPLE, m.SAMPLE | m.FROM_PREV, m.PROMPT_LOGPROBS])
    assert batch.new_tokens == (42).to_bytes(4, "little") and batch.freed_slots == (2).to_bytes(4, "little")
    assert batch.after_idle and [r.slot for r in batch.new_reqs] == [3]
    assert m.int32s(batch.new_reqs[0].token_ids).tolist() == [1, 2, 3, 4, 5]
    assert m.chunks_of(batch) == [
        m.ChunkView(0, 7, 1, True, False, False, [42], [11]),
        m.ChunkView(1, 9, 1, True, False, True, [], []),
        m.ChunkView(3, 0, 4, False, True, False, [], []),
    ]
    c = m.BatchColumns(batch)
    assert c.size == 3 and c.sample.tolist() == [True, True, False] and c.from_prev.tolist() == [False, True, False]
    assert c.new_token_counts.tolist() == [1, 0, 0] and c.new_block_counts.tolist() == [1, 0, 0]
    empty = m.BatchColumns(_wire(m.ExecuteBatch(5)))
    assert empty.size == 0 and empty.new_token_counts.tolist() == [] and len(empty.freed_slots) == 0
    # no new tokens or blocks at all: both count columns are left empty (read as zeros)
    b = m.BatchBuilder()
    b.add(0, 3, 1, m.SAMPLE)
    one = b.build(2)
    assert one.new_token_counts == one.new_block_counts == b""
    assert m.BatchColumns(one).new_token_counts.tolist() == [0]


def test_step_result_round_trip():
    lp = m.TokenLogprobs(5, -0.5, 1, [5, 6], [-0.5, -1.5])
    res = m.from_worker_decoder.decode(m.encode(m.StepResult(
        3, m.pack_int32([5, 70000, 0]), [2], [lp], [m.PromptLogprobsOutput(1, 1, [lp])], busy_s=1.5)))
    assert m.int32s(res.tokens).tolist() == [5, 70000, 0]
    assert res.logprob_chunks == [2] and res.logprobs == [lp] and res.prompt_logprobs[0].chunk == 1
    assert res.busy_s == 1.5 and m.from_worker_decoder.decode(m.encode(m.StepResult(4))).tokens == b""


@pytest.mark.parametrize("field, value, match", [
    ("starts", m.pack_int32([1, 2]), "columns of 3 slots"),
    ("flags", b"\x01\x01", "columns of 3 slots"),
    ("slots", b"\x00\x00\x00", "multiple of element size"),
    ("new_token_counts", m.pack_int32([2, 0, 0]), "do not match"),
    ("new_token_counts", b"", "without counts"),
    ("new_block_counts", m.pack_int32([1, 0]), "do not match"),
    ("flags", bytes([1, 8, 0]), "unknown flag bit"),
    ("num_tokens", m.pack_int32([1, 0, 4]), "empty chunk"),
    ("slots", m.pack_int32([0, -1, 3]), "negative slot"),
    ("freed_slots", m.pack_int32([-2]), "negative freed slot"),
])
def test_malformed_batch_is_a_value_error(field, value, match):
    bad = msgspec.structs.replace(_batch(), **{field: value})
    with pytest.raises(ValueError, match=match):
        m.BatchColumns(_wire(bad))


def test_mistyped_frame_is_a_validation_error():
    # a list where a column's bytes belong (an old-format or foreign sender): the typed decoder refuses it
    frame = msgspec.msgpack.encode(["ExecuteBatch", 1, [0, 1], b"", b"", b""])
    with pytest.raises(msgspec.ValidationError):
        m.to_worker_decoder.decode(frame)
    with pytest.raises(struct.error):
        m.pack_int32([1 << 31])


def _table_with_batch() -> SlotTable:
    t = SlotTable(4, 16, 4)
    b = m.BatchBuilder()
    b.new_request(0, "held", list(range(100, 107)), 5, [7, 8], None)
    b.new_request(1, "async", list(range(200, 209)), 9, [9, 10, 12], SamplingParams(temperature=0.5))
    b.add(0, 0, 7, m.SAMPLE)
    b.add(1, 0, 9, m.SAMPLE)
    t.apply(_wire(b.build(0)))
    return t


def test_slot_table_applies_a_batch():
    t = _table_with_batch()
    assert t.live.tolist() == [True, True, False, False] and t.plain.tolist() == [True, False, False, False]
    t.apply(_wire(_batch()))  # frees slot 2 (holding nothing: harmless), adds slot 3, appends to slot 0
    assert t.tokens[0, :8].tolist() == list(range(100, 107)) + [42] and t.num_tokens[0] == 8
    assert t.blocks[0, :3].tolist() == [7, 8, 11] and t.num_blocks.tolist() == [3, 3, 0, 2]
    assert t.tokens[3, :5].tolist() == [1, 2, 3, 4, 5] and t.num_prompt[3] == 5 and t.req_ids[3] == "new"
    # block rows are zero past each request's blocks
    assert t.block_rows(np.array([3, 0], dtype=np.int32), 4).tolist() == [[20, 21, 0, 0], [7, 8, 11, 0]]
    s, = t.seq_states(np.array([0]), np.array([8]))
    assert list(s.token_ids) == list(range(100, 107)) + [42] and s.num_output_tokens == 3
    free = m.BatchBuilder().build(2, freed_slots=[0, 3])
    t.apply(_wire(free))
    assert t.live.tolist() == [False, True, False, False] and t.sampling[3] is None
    # slot 0 reused by a request with fewer blocks: nothing of the previous one shows
    b = m.BatchBuilder()
    b.new_request(0, "reuse", [5, 6], 2, [30], None)
    b.add(0, 0, 2, m.SAMPLE)
    t.apply(_wire(b.build(3)))
    assert t.block_rows(np.array([0]), 3).tolist() == [[30, 0, 0]] and t.num_tokens[0] == 2
    # several new tokens for one chunk (async scheduling catching up), none for another, blocks for one
    b = m.BatchBuilder()
    b.add(1, 11, 1, m.SAMPLE, new_tokens=[61, 62, 63])
    b.add(0, 2, 1, m.SAMPLE, new_tokens=[7], new_blocks=[31])
    t.apply(_wire(b.build(4)))
    assert t.tokens[1, 9:12].tolist() == [61, 62, 63] and t.num_tokens[1] == 12 and t.tokens[0, :3].tolist() == [5, 6, 7]
    assert t.blocks[0, :3].tolist() == [30, 31, 0] and t.num_blocks[1] == 3


@pytest.mark.parametrize("chunk, match", [
    ((2, 0, 1, m.SAMPLE), "holds no request"),
    ((9, 0, 1, m.SAMPLE), "out of range"),
    ((0, 6, 2, m.SAMPLE), "chunk \\[6, 8\\) with 7 tokens known"),
    ((1, 8, 1, m.SAMPLE | m.FROM_PREV), "FROM_PREV"),     # FROM_PREV must be past the known tokens
    ((1, 12, 1, m.SAMPLE | m.FROM_PREV), "no KV slots for position 12"),
    ((1, 9, 2, m.SAMPLE | m.FROM_PREV), "FROM_PREV"),     # one token only
])
def test_slot_table_refuses_a_batch_that_does_not_fit(chunk, match):
    t = _table_with_batch()
    b = m.BatchBuilder()
    b.add(*chunk)
    with pytest.raises(ValueError, match=match):
        t.apply(_wire(b.build(1)))


def test_slot_table_refuses_a_request_twice_and_rows_past_max_model_len():
    t = _table_with_batch()
    b = m.BatchBuilder()
    b.add(0, 6, 1, m.SAMPLE)
    b.add(0, 6, 1, m.SAMPLE)
    with pytest.raises(ValueError, match="two chunks"):
        t.apply(_wire(b.build(1)))
    b = m.BatchBuilder()
    b.new_request(2, "long", list(range(17)), 17, [1, 2, 3, 4, 5], None)
    with pytest.raises(ValueError, match="do not fit max_model_len 16"):
        t.apply(_wire(b.build(2)))
    b = m.BatchBuilder()
    b.add(1, 9, 1, m.SAMPLE, new_tokens=list(range(8)))
    with pytest.raises(ValueError, match="new tokens past a row of 16"):
        t.apply(_wire(b.build(3)))
    assert t.blocks.shape[1] == 16  # 4 blocks of 4 tokens, rounded up to TABLE_WIDTH_ALIGN columns
    b = m.BatchBuilder()
    b.add(1, 9, 1, m.SAMPLE, new_blocks=[20, 21])  # a 5th block: past max_model_len, not past the width
    with pytest.raises(ValueError, match="new blocks past a row of 4"):
        t.apply(_wire(b.build(4)))


def test_scheduler_slots_lowest_free_freed_on_finish_and_preemption():
    kv = KVCacheManager(4, 4)
    s = Scheduler(kv, max_num_seqs=3, max_num_batched_tokens=64, max_model_len=64)
    sp = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
    reqs = [Request(r, [1, 2, 3], sp, 1, set(), arrival=float(i)) for i, r in enumerate("abc")]
    for r in reqs[:2]:
        s.add_request(r)
    b0 = s.schedule()
    assert [(c.req_id, c.slot) for c in b0.chunks] == [("a", 0), ("b", 1)]
    out = s.update(b0, m.StepResult(b0.batch.batch_id, m.pack_int32([9, 9])))
    s.release_finished([r for r, _, _ in out])
    assert sorted(s._freed_slots) == [0, 1]
    s.add_request(reqs[2])
    b1 = s.schedule()
    assert m.int32s(b1.batch.freed_slots).tolist() in ([0, 1], [1, 0])
    assert [(c.req_id, c.slot) for c in b1.chunks] == [("c", 0)] and s._freed_slots == []
    # preemption gives the slot back too: the request comes back as a NewRequest
    long_sp = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    kv2 = KVCacheManager(3, 4)
    s2 = Scheduler(kv2, max_num_seqs=2, max_num_batched_tokens=64, max_model_len=64)
    old, new = Request("old", [1] * 4, long_sp, 40, set(), arrival=0.0), Request("new", [2] * 4, long_sp, 40, set(),
                                                                             arrival=1.0)
    s2.add_request(old)
    s2.add_request(new)
    seen_free = []
    for _ in range(12):
        b = s2.schedule()
        if b is None:
            break
        seen_free += m.int32s(b.batch.freed_slots).tolist()
        s2.update(b, m.StepResult(b.batch.batch_id, m.pack_int32([5] * b.num_sampled)))
    assert s2.stats.num_preemptions > 0 and 1 in seen_free, seen_free
