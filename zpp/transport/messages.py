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
"""
from __future__ import annotations

from typing import Optional, Union

import msgspec

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


class StageCost(msgspec.Struct, tag=True, array_like=True):
    """``--pp-layer-partition auto``: what one stage's forward of a representative micro-batch
    costs on this worker, measured before the stage's weights are loaded
    (``zpp.workers.stage_cost.measure_stage_cost``)."""

    rank: int
    layer_s: float
    """Seconds one decoder layer takes."""
    extra_s: float
    """Seconds of the stage's other work: embedding (first stage); final norm, LM head and
    sampling (last stage); 0 in between."""
    num_tokens: int
    """Tokens of the micro-batch measured (decode tokens, one per sequence)."""


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


class InitKVCache(msgspec.Struct, tag=True, array_like=True):
    num_blocks: int


class CacheReady(msgspec.Struct, tag=True, array_like=True):
    rank: int


class NewRequest(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    """A request the workers have not seen (or see again after preemption: state is replaced)."""

    req_id: str
    token_ids: list[int]
    """Every token known so far (prompt, then outputs when resumed)."""
    num_prompt_tokens: int
    block_ids: list[int]
    sampling: Optional[SamplingParams] = None


class CachedRequest(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    """What changed for a request the workers already hold."""

    req_id: str
    new_token_ids: list[int] = []
    new_block_ids: list[int] = []


class ScheduledChunk(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    """Run tokens ``[start, start + num_tokens)`` of a request in this micro-batch."""

    req_id: str
    start: int
    num_tokens: int
    sample: bool = False
    """Sample the next token after this chunk (the chunk reaches the end of the known tokens)."""
    prompt_logprobs: bool = False
    """Return prompt logprobs for the positions of this chunk."""
    from_prev: bool = False
    """Async scheduling: the chunk is one decode token (``num_tokens`` 1, ``sample`` set) whose
    input, the token at ``start``, is the one this worker sampled for the request in its previous
    micro-batch holding it; the engine does not know it yet (it is not in the worker's token ids).
    The worker takes it from the device."""


class ExecuteBatch(msgspec.Struct, tag=True, array_like=True, omit_defaults=True, gc=False):
    """One micro-batch, decided once by the engine's scheduler and run by every stage in order."""

    batch_id: int
    chunks: list[ScheduledChunk]
    new_reqs: list[NewRequest] = []
    cached_reqs: list[CachedRequest] = []
    finished_req_ids: list[str] = []
    after_idle: bool = False
    """The engine had nothing in flight and nothing to schedule before this micro-batch: the gap
    before it on each stage is a pause in the work, not pipeline idle time (``StepResult.idle_s``)."""
    grammar_rows: list[int] = []
    """Structured outputs: indices into ``chunks`` of the sampling chunks whose next token is
    constrained (the other rows are sampled untouched). Sent to the result rank only (TP rank 0 of
    the last stage): the other stages get the batch without it."""
    grammar_bitmask: bytes = b""
    """The allowed tokens of those rows: ``int32[len(grammar_rows), ceil(vocab_size / 32)]``,
    C order, little-endian; bit ``t % 32`` of word ``t // 32`` set = token ``t`` allowed
    (xgrammar's layout)."""


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


class SampledOutput(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    req_id: str
    token_id: int
    logprobs: Optional[TokenLogprobs] = None


class PromptLogprobsOutput(msgspec.Struct, array_like=True, gc=False):
    req_id: str
    start: int
    """Position of the first token these logprobs are for (position 0 never has one)."""
    entries: list[TokenLogprobs]


class StepResult(msgspec.Struct, tag=True, array_like=True, omit_defaults=True, gc=False):
    """The last stage's answer to one ExecuteBatch."""

    batch_id: int
    sampled: list[SampledOutput]
    prompt_logprobs: list[PromptLogprobsOutput] = []
    busy_s: float = 0.0
    """Seconds the last stage has spent computing so far (cumulative)."""
    idle_s: float = 0.0
    """Seconds the last stage's device has sat idle between micro-batches so far (cumulative; see
    ``ModelRunner.idle_s``)."""


class StageStats(msgspec.Struct, tag=True, array_like=True):
    """Periodic per-stage busy and idle time (every stage, not only the last); cumulative seconds."""

    rank: int
    busy_s: float
    batches: int
    idle_s: float = 0.0


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


ToWorker = Union[InitWorker, AssignLayers, InitKVCache, ExecuteBatch, Shutdown]
FromWorker = Union[Hello, StageCost, WorkerReady, CacheReady, StepResult, StageStats, Heartbeat, WorkerError]

_encoder = msgspec.msgpack.Encoder()
encode = _encoder.encode
to_worker_decoder = msgspec.msgpack.Decoder(ToWorker)
from_worker_decoder = msgspec.msgpack.Decoder(FromWorker)
