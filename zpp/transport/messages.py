"""Every message that crosses a process boundary, as tagged msgspec Structs.

Control plane only: ZeroMQ frames carrying msgpack. Tensors between stages go over
torch.distributed (see ``p2p.py``); only sampled token ids and logprobs travel back here.

Handshake (one path for local and remote workers)::

    worker -> engine   Hello(rank, key)                 worker knows only address, rank, keys
    engine -> worker   InitWorker(...)                  model, stage, layer range, rendezvous
    worker -> engine   StageCost(layer_s, extra_s)      only with --pp-layer-partition auto:
    engine -> worker   AssignLayers(start, end)         measured costs, then the balanced range
    worker -> engine   WorkerReady(num_kv_blocks_fit)   weights loaded, process group joined
    engine -> worker   InitKVCache(num_blocks)          the minimum over all stages
    worker -> engine   CacheReady()
    engine -> worker   ExecuteBatch ... (steps)         every stage, same batches, same order
    last   -> engine   StepResult ...                   one per batch, in batch order
    engine -> worker   Shutdown()

Any worker may send WorkerError at any time; the engine treats it as fatal.

Micro-batches are columnar: the per-chunk data of an ExecuteBatch and the sampled tokens of a
StepResult travel as arrays, not as one struct per request: a sequence adds a few bytes to each
column (encoded and decoded as one copy) instead of a struct to build, encode, decode and walk, and
workers read the columns whole with numpy.

* Chunk order: ExecuteBatch's ``B`` chunks are numbered ``0..B-1`` in the order the engine
  scheduled them; every other index in a batch or its result (``StepResult.grammar_stopped``,
  ``StepResult.logprob_chunks``, ``PromptLogprobsOutput.chunk``) is such a chunk index, and
  ``StepResult.tokens`` follows it.
* Columns: a numeric column is a ``bytes`` field holding a C array of fixed type and byte
  order whatever the host's: ``int32`` little-endian (numpy ``'<i4'``; written by
  :func:`pack_int32`, read by :func:`int32s`) or ``uint8`` (``flags``). An empty field is an
  empty array. Each field's docstring gives its type and length. :class:`BatchColumns` reads and
  cross-checks a batch's columns (a malformed one is a ValueError, never a silent misread);
  :class:`BatchBuilder` writes one.
* Slots: hot messages name a request by its *slot*, a small integer the engine assigns when
  the request first reaches the workers (``NewRequest.slot``: the lowest free one, so
  ``0 <= slot < max_num_seqs``) and takes back when the request finishes, is aborted or is
  preempted (``ExecuteBatch.freed_slots``; a preempted request comes back as a NewRequest,
  maybe in another slot). Workers keep per-request state in arrays indexed by slot. Request ids
  travel only in NewRequest (for error messages).
"""
from __future__ import annotations

import struct
from typing import NamedTuple, Optional, Sequence, Union

import msgspec
import numpy as np

from zpp.config import EngineConfig
from zpp.sampling_params import SamplingParams


class Hello(msgspec.Struct, tag=True, array_like=True):
    rank: int
    key: str
    pid: int
    hostname: str
    address: str = ""
    """The worker's address on the route to the engine (multi-host runs; empty over ipc)."""
    interface: str = ""
    """The network interface holding ``address``, which gloo / NCCL use."""


class InitWorker(msgspec.Struct, tag=True, array_like=True):
    """A worker's configuration: the engine's whole config plus what is this rank's own."""

    rank: int
    pp_rank: int
    tp_rank: int
    device_index: int
    layer_start: int
    layer_end: int
    num_layers: int
    dist_store: str
    """``host:port`` of the rendezvous TCPStore the engine hosts (empty when the world is 1)."""
    num_threads: int
    """CPU threads for this worker; 0 = decide on the worker's own host (``OMP_NUM_THREADS``)."""
    eos_token_ids: list[int]
    config: EngineConfig
    """With the model path made absolute by the engine (the same path must hold the model on
    every host)."""
    generation: int = 0
    """The process group's generation: 0 at start-up, one more after each stage restart (the
    rendezvous keys are prefixed with it, so a re-formed group never meets the old one's keys)."""
    num_kv_blocks: int = -1
    """A restarted stage: the KV blocks it must hold (the engine's, fixed at start-up); -1 at start-up."""


class StageCost(msgspec.Struct, tag=True, array_like=True):
    """``--pp-layer-partition auto``: what one stage's forward of a representative micro-batch
    costs on this worker, measured before the stage's weights are loaded
    (``zpp.workers.stage_cost.measure_stage_cost``)."""

    rank: int
    layer_s: list[float]
    """Seconds one decoder layer of each kind takes, kinds in the order of their first appearance
    in the model's ``StageModel.layer_kinds`` (one entry for most families)."""
    extra_s: float
    """Seconds of the stage's other work: embedding (first stage); final norm, LM head and
    sampling (last stage); 0 in between."""
    num_tokens: int
    """Tokens of the micro-batch measured (decode tokens, one per sequence)."""
    memory_bytes: int = 0
    """CUDA: bytes this stage may use on its GPU (total x ``--gpu-memory-utilization``, less what
    other processes and the CUDA context hold), for a split that weighs memory
    (``zpp.plan.memory_aware_partition``); 0: not known (CPU)."""


class AssignLayers(msgspec.Struct, tag=True, array_like=True):
    """``--pp-layer-partition auto``: the engine's answer to StageCost, the stage's layer range
    (replacing InitWorker's provisional even one)."""

    layer_start: int
    layer_end: int


class WorkerReady(msgspec.Struct, tag=True, array_like=True):
    rank: int
    num_kv_blocks_fit: int
    """How many KV blocks this stage can hold within its memory budget."""
    weight_bytes: int
    kv_error: str = ""
    """Why this stage's KV cache cannot be allocated as configured (a one-line message naming the
    setting; the engine stops with it), or empty."""
    weight_bytes_by_dtype: dict[str, int] = {}
    """``weight_bytes`` by dtype name (``fp8``, ``bf16``, ...; :func:`zpp.models.weight_bytes.weight_bytes_by_dtype`)."""


class InitKVCache(msgspec.Struct, tag=True, array_like=True):
    num_blocks: int


class CacheReady(msgspec.Struct, tag=True, array_like=True):
    rank: int


INT32 = np.dtype("<i4")
"""Every int column's element type: 4-byte signed, little-endian."""

# ExecuteBatch.flags bits, one byte per chunk.
SAMPLE = 1
"""Sample the next token after this chunk (it reaches the end of the known tokens, or is FROM_PREV)."""
PROMPT_LOGPROBS = 2
"""Return prompt logprobs for the positions of this chunk."""
FROM_PREV = 4
"""Async scheduling: the chunk is one decode token (``num_tokens`` 1, SAMPLE set) whose input, the
token at ``start``, is the one this worker sampled for the request in its previous micro-batch
holding it; the engine does not know it yet (it is not among the worker's known tokens). The
worker takes it from the device."""
_ALL_FLAGS = SAMPLE | PROMPT_LOGPROBS | FROM_PREV


def pack_int32(values) -> bytes:
    """An int column's bytes (``int32``, little-endian) from a sequence of ints (``struct.pack``:
    twice as fast as numpy from a list; raises ``struct.error`` for a value outside int32) or from an
    integer numpy array (converted with ``astype``: its values must fit)."""
    if isinstance(values, np.ndarray):
        return values.astype(INT32, copy=False).tobytes()
    return struct.pack(f"<{len(values)}i", *values)


def int32s(data: bytes) -> np.ndarray:
    """An int column's values: a read-only ``int32`` view of ``data``. Raises ValueError when its
    length is not a multiple of 4."""
    return np.frombuffer(data, dtype=INT32)


class NewRequest(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    """A request the workers do not hold: sent for the first time, or again after preemption
    (maybe in another slot; whatever the slot held is replaced). Its chunk in the same micro-batch
    has no new tokens or blocks: they are all here."""

    slot: int
    req_id: str
    """For error messages only: the hot messages name the request by ``slot``."""
    token_ids: bytes
    """``int32[n]``: every token known so far (prompt, then outputs when resumed)."""
    num_prompt_tokens: int
    block_ids: bytes
    """``int32[k]``: its KV blocks, in order."""
    sampling: Optional[SamplingParams] = None


class GrammarInit(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    """A constrained request's grammar, for the result rank's matcher of slot ``slot`` (a request
    of the same batch's ``new_reqs``: first sent, or resent after preemption or a stage restart;
    the matcher then accepts the request's output tokens in ``NewRequest.token_ids`` again)."""

    slot: int
    key: str
    """Identifies the compiled grammar (a hash of its specification)."""
    stop_token_ids: list[int]
    """The tokens that end the sequence once the grammar is complete (EOS and the request's
    ``stop_token_ids``)."""
    compiled: str = ""
    """xgrammar's ``CompiledGrammar.serialize_json()`` text; empty when the result rank already
    holds ``key``'s grammar (sent with an earlier request, not evicted since)."""


class ExecuteBatch(msgspec.Struct, tag=True, array_like=True, omit_defaults=True, gc=False):
    """One micro-batch, decided once by the engine's scheduler and run by every stage in order.

    Chunk ``i`` runs tokens ``[starts[i], starts[i] + num_tokens[i])`` of the request in slot
    ``slots[i]``; a request has at most one chunk in a micro-batch. Before running the chunks a
    worker applies ``freed_slots``, then ``new_reqs``, then each chunk's new tokens and blocks. See
    the module docstring for the column encoding (``int32`` little-endian unless said otherwise;
    ``B`` = number of chunks)."""

    batch_id: int
    slots: bytes = b""
    """``int32[B]``: each chunk's request slot."""
    starts: bytes = b""
    """``int32[B]``: the position of each chunk's first token."""
    num_tokens: bytes = b""
    """``int32[B]``: how many tokens each chunk runs (>= 1)."""
    flags: bytes = b""
    """``uint8[B]``: each chunk's bits: SAMPLE, PROMPT_LOGPROBS, FROM_PREV (module constants)."""
    new_token_counts: bytes = b""
    """``int32[B]``, or empty when no chunk has any: how many tokens each chunk's request gained
    since the workers last heard of it (sampled by earlier micro-batches), appended to its known
    tokens before the chunk runs; 0 for a request in ``new_reqs``."""
    new_tokens: bytes = b""
    """``int32[sum(new_token_counts)]``: those tokens, chunk after chunk."""
    new_block_counts: bytes = b""
    """``int32[B]``, or empty when no chunk has any: how many KV blocks each chunk's request
    gained, appended to its block table before the chunk runs."""
    new_blocks: bytes = b""
    """``int32[sum(new_block_counts)]``: those block ids, chunk after chunk."""
    new_reqs: list[NewRequest] = []
    freed_slots: bytes = b""
    """``int32[F]``: slots whose request finished, was aborted or was preempted since the previous
    micro-batch: the workers forget their state (before ``new_reqs``, which may reuse them)."""
    after_idle: bool = False
    """The engine had nothing in flight and nothing to schedule before this micro-batch: the gap
    before it on each stage is a pause in the work, not pipeline idle time (``StepResult.idle_s``)."""
    grammars: list[GrammarInit] = []
    """Structured outputs: the grammars of this batch's ``new_reqs`` that are constrained, to the
    result rank only (TP rank 0 of the last stage, the one that samples: it holds the matchers;
    the other ranks get the batch without them). See :mod:`zpp.workers.grammar`."""
    grammar_tokenizer: str = ""
    """xgrammar's ``TokenizerInfo.serialize_json()`` text, with the first grammar the result rank
    gets (again after a stage restart); empty otherwise."""
    grammar_evict: list[str] = []
    """Grammar keys the result rank forgets after applying ``grammars`` (the engine decides its
    cache of compiled grammars, so ``GrammarInit.compiled`` is sent once per key)."""
    draft_counts: bytes = b""
    """Speculative decoding: ``int32[B]``, or empty when no chunk has any: each chunk's draft tokens
    ``k`` (0 for most). A chunk with drafts is a decode of its request's last known token followed by
    the drafts (``start`` = known tokens - 1, ``num_tokens`` = 1 + k, SAMPLE set): the drafts are its
    input at positions ``start + 1 ..`` but not known tokens (the workers keep them past the known
    ones until the next batch's ``new_tokens`` overwrite them); the last stage verifies them and
    returns 1 to k + 1 tokens for the chunk (``StepResult.token_counts``)."""
    draft_tokens: bytes = b""
    """``int32[sum(draft_counts)]``: those drafts, chunk after chunk."""


class ChunkView(NamedTuple):
    """One chunk of an ExecuteBatch as Python values (:func:`chunks_of`; tests and tools, not the
    hot path)."""

    slot: int
    start: int
    num_tokens: int
    sample: bool
    prompt_logprobs: bool
    from_prev: bool
    new_token_ids: list[int]
    new_block_ids: list[int]
    draft_token_ids: list[int] = []


def _counted(counts: bytes, flat: bytes, size: int, name: str) -> tuple[np.ndarray, np.ndarray]:
    c, v = int32s(counts), int32s(flat)
    if not len(c):
        if len(v):
            raise ValueError(f"ExecuteBatch: {len(v)} {name}s without counts")
        return np.zeros(size, dtype=INT32), v
    if len(c) != size or int(c.min()) < 0 or int(c.sum(dtype=np.int64)) != len(v):
        raise ValueError(f"ExecuteBatch: {name} counts ({len(c)}, sum {int(c.sum(dtype=np.int64))}) do not match "
                         f"{size} chunks and {len(v)} {name}s")
    return c, v


class BatchColumns:
    """An ExecuteBatch's columns as numpy arrays (read-only views of the message's bytes), checked
    against each other. Raises ValueError for a malformed batch: a column's length not a multiple of
    its element size, columns of different lengths, counts that do not add up to their flat array, a
    negative slot or start, an empty chunk, or an unknown flag bit."""

    __slots__ = ("size", "slots", "starts", "num_tokens", "flags", "new_token_counts", "new_tokens",
                 "new_block_counts", "new_blocks", "freed_slots", "draft_counts", "draft_tokens")

    def __init__(self, batch: ExecuteBatch):
        self.slots = int32s(batch.slots)
        self.size = B = len(self.slots)
        self.starts = int32s(batch.starts)
        self.num_tokens = int32s(batch.num_tokens)
        self.flags = np.frombuffer(batch.flags, dtype=np.uint8)
        if not len(self.starts) == len(self.num_tokens) == len(self.flags) == B:
            raise ValueError(f"ExecuteBatch: columns of {B} slots, {len(self.starts)} starts, "
                             f"{len(self.num_tokens)} token counts, {len(self.flags)} flags")
        self.new_token_counts, self.new_tokens = _counted(batch.new_token_counts, batch.new_tokens, B, "new token")
        self.new_block_counts, self.new_blocks = _counted(batch.new_block_counts, batch.new_blocks, B, "new block")
        self.draft_counts, self.draft_tokens = _counted(batch.draft_counts, batch.draft_tokens, B, "draft token")
        self.freed_slots = int32s(batch.freed_slots)
        if len(batch.draft_counts) and ((self.draft_counts > 0) & ((self.num_tokens != self.draft_counts + 1)
                                                                   | ~self.sample | self.from_prev)).any():
            raise ValueError("ExecuteBatch: a chunk with drafts that is not one token + its drafts, sampling")
        if B and (int(self.slots.min()) < 0 or int(self.starts.min()) < 0 or int(self.num_tokens.min()) < 1
                  or int(self.flags.max()) & ~_ALL_FLAGS):
            raise ValueError("ExecuteBatch: a negative slot or start, an empty chunk or an unknown flag bit")
        if len(self.freed_slots) and int(self.freed_slots.min()) < 0:
            raise ValueError("ExecuteBatch: a negative freed slot")

    @property
    def sample(self) -> np.ndarray:
        """``bool[B]``: the chunks with SAMPLE."""
        return (self.flags & SAMPLE) != 0

    @property
    def from_prev(self) -> np.ndarray:
        """``bool[B]``: the chunks with FROM_PREV."""
        return (self.flags & FROM_PREV) != 0

    @property
    def prompt_logprobs(self) -> np.ndarray:
        """``bool[B]``: the chunks with PROMPT_LOGPROBS."""
        return (self.flags & PROMPT_LOGPROBS) != 0


def chunks_of(batch: ExecuteBatch) -> list[ChunkView]:
    """Every chunk of ``batch`` as a :class:`ChunkView`, in chunk order (raises ValueError as
    :class:`BatchColumns` does)."""
    c = BatchColumns(batch)
    tok_end, blk_end = np.cumsum(c.new_token_counts).tolist(), np.cumsum(c.new_block_counts).tolist()
    toks, blks = c.new_tokens.tolist(), c.new_blocks.tolist()
    dr_end, drs = np.cumsum(c.draft_counts).tolist(), c.draft_tokens.tolist()
    out = []
    for i, (slot, start, n, f) in enumerate(zip(c.slots.tolist(), c.starts.tolist(), c.num_tokens.tolist(),
                                                 c.flags.tolist())):
        t0 = tok_end[i - 1] if i else 0
        b0 = blk_end[i - 1] if i else 0
        d0 = dr_end[i - 1] if i else 0
        out.append(ChunkView(slot, start, n, bool(f & SAMPLE), bool(f & PROMPT_LOGPROBS), bool(f & FROM_PREV),
                             toks[t0:tok_end[i]], blks[b0:blk_end[i]], drs[d0:dr_end[i]]))
    return out


class BatchBuilder:
    """Writes an ExecuteBatch chunk by chunk: the scheduler's producer (tests and tools use it too).
    ``add`` one chunk per request, ``new_request`` for a request the workers have not seen (before
    or after its chunk), then ``build``."""

    __slots__ = ("slots", "starts", "num_tokens", "flags", "token_counts", "tokens", "block_counts", "blocks",
                 "new_reqs", "draft_counts", "drafts")

    def __init__(self):
        self.slots: list[int] = []
        self.starts: list[int] = []
        self.num_tokens: list[int] = []
        self.flags: list[int] = []
        self.token_counts: list[int] = []
        self.tokens: list[int] = []
        self.block_counts: list[int] = []
        self.blocks: list[int] = []
        self.new_reqs: list[NewRequest] = []
        self.draft_counts: list[int] = []
        self.drafts: list[int] = []

    def add(self, slot: int, start: int, num_tokens: int, flags: int = 0, new_tokens: Sequence[int] = (),
            new_blocks: Sequence[int] = (), drafts: Sequence[int] = ()) -> None:
        """One chunk: tokens ``[start, start + num_tokens)`` of the request in ``slot``, with the
        tokens and blocks it gained since the workers last heard of it (and, speculative decoding,
        its draft tokens: then ``num_tokens`` is ``1 + len(drafts)``)."""
        self.draft_counts.append(len(drafts))
        if drafts:
            self.drafts.extend(drafts)
        self.slots.append(slot)
        self.starts.append(start)
        self.num_tokens.append(num_tokens)
        self.flags.append(flags)
        self.token_counts.append(len(new_tokens))
        if new_tokens:
            self.tokens.extend(new_tokens)
        self.block_counts.append(len(new_blocks))
        if new_blocks:
            self.blocks.extend(new_blocks)

    def new_request(self, slot: int, req_id: str, token_ids: Sequence[int], num_prompt_tokens: int,
                    block_ids: Sequence[int], sampling: Optional[SamplingParams]) -> None:
        self.new_reqs.append(NewRequest(slot, req_id, pack_int32(token_ids), num_prompt_tokens,
                                        pack_int32(block_ids), sampling))

    def __len__(self) -> int:
        return len(self.slots)

    def build(self, batch_id: int, freed_slots: Sequence[int] = (), after_idle: bool = False) -> ExecuteBatch:
        """The message. Raises ``struct.error`` for a value outside int32 (or a flag outside a byte:
        ValueError)."""
        return ExecuteBatch(batch_id, pack_int32(self.slots), pack_int32(self.starts), pack_int32(self.num_tokens),
                            bytes(self.flags),
                            pack_int32(self.token_counts) if self.tokens else b"", pack_int32(self.tokens),
                            pack_int32(self.block_counts) if self.blocks else b"", pack_int32(self.blocks),
                            self.new_reqs, pack_int32(freed_slots), after_idle,
                            draft_counts=pack_int32(self.draft_counts) if self.drafts else b"",
                            draft_tokens=pack_int32(self.drafts))


class Shutdown(msgspec.Struct, tag=True, array_like=True):
    pass


class TokenLogprobs(msgspec.Struct, array_like=True, gc=False):
    """Log-probabilities at one position: the chosen token's, then the top-k."""

    token_id: int
    logprob: float
    rank: int
    """1-based rank of the chosen token in the distribution."""
    top_ids: list[int]
    top_logprobs: list[float]


class PromptLogprobsOutput(msgspec.Struct, array_like=True, gc=False):
    chunk: int
    """The chunk (index in its ExecuteBatch) that computed them. The engine core hands the struct on
    to the front end as it is; there only ``start`` and ``entries`` mean anything."""
    start: int
    """Position of the first token these logprobs are for (position 0 never has one)."""
    entries: list[TokenLogprobs]


class StepResult(msgspec.Struct, tag=True, array_like=True, omit_defaults=True, gc=False):
    """The last stage's answer to one ExecuteBatch. Indices are chunk indices of that batch."""

    batch_id: int
    tokens: bytes = b""
    """``int32[S]``, little-endian: the token sampled for each chunk with SAMPLE, in chunk order
    (``S`` = the number of such chunks)."""
    logprob_chunks: list[int] = []
    """The sampling chunks whose token comes with logprobs, increasing (empty when none asked)."""
    logprobs: list[TokenLogprobs] = []
    """Their logprobs, one per entry of ``logprob_chunks``."""
    prompt_logprobs: list[PromptLogprobsOutput] = []
    busy_s: float = 0.0
    """Seconds the last stage has spent computing so far (cumulative)."""
    idle_s: float = 0.0
    """Seconds the last stage's device has sat idle between micro-batches so far (cumulative; see
    ``ModelRunner.idle_s``)."""
    grammar_stopped: list[int] = []
    """Structured outputs: the sampling chunks whose grammar accepted their token and is now
    complete (the token is a stop token: the sequence ends, even with ``ignore_eos``), increasing."""
    grammar_refused: list[int] = []
    """The sampling chunks whose token their grammar refused (a dead end: the token is dropped
    and the sequence ends), increasing; also a grammar the result rank could not read."""
    token_counts: bytes = b""
    """Speculative decoding: ``int32[S]``, or empty when the batch had no drafts (one token per
    sampling chunk): how many tokens each sampling chunk returns in ``tokens`` (its accepted drafts,
    then the token the target sampled after them: 1 to k + 1). ``logprob_chunks`` then names a chunk
    once per token that comes with logprobs (non-decreasing), ``logprobs`` following it."""
    draft_tokens: bytes = b""
    """Speculative decoding with MTP: ``int32[S * k]``, the ``k`` drafts the last stage made for each
    sampling chunk's next step (the tokens after the ones returned; -1 where the chain stopped:
    ``zpp.workers.mtp``); empty otherwise."""


class StageStats(msgspec.Struct, tag=True, array_like=True):
    """Periodic per-stage busy and idle time (every stage, the last one too); cumulative seconds.
    With the step times of the micro-batches finished since the last report, for the engine's cost
    model (``zpp.engine.step_cost``; TP rank 0 of each stage only)."""

    rank: int
    busy_s: float
    batches: int
    idle_s: float = 0.0
    step_batches: list[int] = []
    """Batch ids of the micro-batches timed since the last report, in the order run."""
    step_s: list[float] = []
    """Their step times on this stage, seconds (``ModelRunner.step_times``)."""


class Heartbeat(msgspec.Struct, tag=True, array_like=True, gc=False):
    """Sent every second by a worker thread that does not wait on the compute stream or the
    stage-to-stage link: silence means the process is stopped or hung as a whole; its content
    says where a live worker is stuck."""

    rank: int
    last_done: int
    """The last micro-batch this worker finished (-1: none yet)."""
    batch_id: int
    """The micro-batch it is on (-1: none)."""
    waiting: bool
    """Blocked on the previous stage's activations for ``batch_id``."""
    seconds: float
    """How long it has been in that state."""


class WorkerError(msgspec.Struct, tag=True, array_like=True):
    rank: int
    message: str
    traceback: str = ""


class LinkDown(msgspec.Struct, tag=True, array_like=True):
    """A surviving worker's stage-to-stage or tensor-parallel channel failed (a neighbour died):
    it dropped its micro-batches and waits for :class:`Rejoin` (stage restarts), never exiting."""

    rank: int
    message: str


class Rejoin(msgspec.Struct, tag=True, array_like=True):
    """To the surviving workers after a stage restart: forget every request and micro-batch, leave
    the old process groups and form generation ``generation``'s with the restarted ranks; answer
    :class:`Rejoined`."""

    generation: int


class Rejoined(msgspec.Struct, tag=True, array_like=True):
    rank: int
    generation: int


class AbortLinks(msgspec.Struct, tag=True, array_like=True):
    """To a surviving worker's heartbeat socket (read by a thread that never waits on a peer) when
    the engine lost a rank: abort the process groups of generation ``generation`` (and earlier),
    so that a receive or all-reduce blocked on the lost peer returns (the worker then reports
    LinkDown and waits for :class:`Rejoin`). ``reason``: the loss, one line."""

    generation: int
    reason: str


ToWorker = Union[InitWorker, AssignLayers, InitKVCache, ExecuteBatch, Shutdown, Rejoin]
ToHeartbeat = AbortLinks
"""What the engine sends a worker's heartbeat socket (besides empty connection probes)."""
FromWorker = Union[Hello, StageCost, WorkerReady, CacheReady, StepResult, StageStats, Heartbeat, WorkerError,
                   LinkDown, Rejoined]

_encoder = msgspec.msgpack.Encoder()
encode = _encoder.encode
to_worker_decoder = msgspec.msgpack.Decoder(ToWorker)
to_heartbeat_decoder = msgspec.msgpack.Decoder(ToHeartbeat)
from_worker_decoder = msgspec.msgpack.Decoder(FromWorker)
