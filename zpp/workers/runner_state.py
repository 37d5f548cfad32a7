"""The model runner's small companions (zpp.workers.model_runner): the row counts the LM head of
an eager step is padded to (:func:`logit_buckets`), a last-stage result whose sampled token ids are
still being copied off the GPU (:class:`PendingResult`), and what a worker is doing for its
heartbeat thread (:class:`Activity`)."""
from __future__ import annotations

import time

import torch

from zpp.transport import messages as m


def logit_buckets(max_rows: int) -> list[int]:
    """Row counts the LM head of an eager step is padded to on CUDA (up to ``max_rows``): 1, 2, 4,
    ..., 64, then multiples of 128 to 1024, then of 1024.

    Why: cuBLAS picks a kernel per matrix shape, and CUDA loads a kernel's module on its first
    launch (lazy loading), which waits for the GPU to drain. Every prefill micro-batch of a run
    samples a different number of rows, so its LM head was a new shape, and the worker's host sat
    until its own forward ended (the next micro-batch was launched late: 5-25 ms GPU gaps before
    every second prefill batch of a 1000 x 256/256 run on the H200; scripts/gpu_host_block_probe.py
    shows 75-180 ms host stalls for new shapes and 0.3 ms for known ones). A fixed set of shapes,
    each run once at start-up (``ModelRunner.warm_up_logits``), never loads a kernel mid-run; the
    padding costs at most 127 rows of LM head (< 0.2 ms at 8B) on a step that takes ~180 ms."""
    out = [b for b in (1, 2, 4, 8, 16, 32, 64) if b < max_rows]
    out += list(range(128, min(max_rows, 1024), 128)) + list(range(1024, max_rows, 1024))
    return sorted(set(out + [max_rows]))


class PendingResult:
    """A last-stage result still on the GPU: token ids copied to pinned memory asynchronously.
    ``finish(runner)`` waits for them and builds the StepResult (structured outputs: after the
    result rank's matchers have accepted them). (On the CPU, where only the
    decode-graph stand-in of the tests makes one, the copy is done at once.)"""

    def __init__(self, batch_id: int, tokens: torch.Tensor, host_buf: torch.Tensor, grammar=None):
        self.batch_id = batch_id
        self.grammar = grammar  # structured outputs: (sampling chunk indices, grammar.sampled_rows) or None
        self.tokens = tokens  # int64[N] on the device (the sampling chunks' tokens), kept alive until the copy is done
        self.host = host_buf[: tokens.shape[0]]
        self.host.copy_(tokens, non_blocking=True)
        self.event = None
        if tokens.is_cuda:
            self.event = torch.cuda.Event()
            self.event.record()

    def done(self) -> bool:
        """Whether the GPU has finished the batch and the copy (never blocks)."""
        return self.event is None or self.event.query()

    def finish(self, runner) -> m.StepResult:
        """Wait for the copy and build the StepResult; ``runner``: the stage's ModelRunner (its busy
        and idle seconds go into the result)."""
        if self.event is not None:
            self.event.synchronize()
        runner.reap_timings()
        tokens = self.host.numpy()
        result = m.StepResult(self.batch_id, m.pack_int32(tokens), busy_s=runner.busy_s, idle_s=runner.idle_s)
        if self.grammar is not None:  # the matchers accept the tokens before the engine sees them
            runner.accept_sampled(result, self.grammar[0], tokens, self.grammar[1])
        return result


class Activity:
    """What a worker is doing, for its heartbeat thread (``zpp.transport.messages.Heartbeat``).

    ``state`` is one tuple (micro-batch id or -1, blocked on activations, since: monotonic s),
    replaced whole so the other thread never sees a mix of two states.
    """

    def __init__(self):
        self.state = (-1, False, time.monotonic())
        self.last_done = -1

    def start(self, batch_id: int) -> None:
        self.state = (batch_id, False, time.monotonic())

    def wait(self, waiting: bool) -> None:
        self.state = (self.state[0], waiting, time.monotonic())

    def done(self, batch_id: int) -> None:
        self.last_done = batch_id
        self.state = (-1, False, time.monotonic())
