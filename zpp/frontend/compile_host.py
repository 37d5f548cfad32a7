"""Grammar compiles in processes that can be stopped: a fork server for xgrammar.

xgrammar's compile is C++ that cannot be interrupted, and some small specifications take minutes
(a 17 KB schema of 250 patterned strings: ~41 s and 160 MB). Run in a thread, a compile that timed
out kept a core busy for as long as it liked after its request had been refused (vLLM #14151: a
server at 100% CPU for hours after its clients gave up). So every compile runs in its own process,
killed when its time is up:

* the front end spawns one *compile host* (:func:`host_main`) while the engine starts: a
  single-threaded process that imports xgrammar, loads the tokenizer and builds xgrammar's
  tokenizer info once (a few seconds; the front end itself never imports xgrammar), then forks one
  child per compile. A forked child starts in about a
  millisecond and shares the host's memory (copy on write); it compiles (``COMPILE_THREADS``
  threads, as the in-process compiler had) at a lower CPU priority (``CHILD_NICE``: compiles never
  slow the serving path), sends the serialized grammar back through a pipe and exits;
* the host kills (SIGKILL) a child that has compiled for ``time_limit`` seconds, and one that no
  request waits for any more (its clients timed out or went away): a slow grammar holds a core
  for at most the compile timeout, and not at all once its requests are gone;
* slots: at most ``GENERAL_SLOTS`` young compiles of any size run at once, plus ``SMALL_SLOTS``
  for specifications of at most ``SMALL_SPEC_BYTES`` (a ``choice``, a short regex or schema);
  waiting compiles start smallest first. A compile is young for its first ``YOUNG_S`` seconds;
  then it gives its slot up and runs on at ``OLD_NICE``, so a request that arrives while slow
  grammars compile starts within ``YOUNG_S`` and takes the CPU from them (size does not tell a
  slow grammar: a 117-byte regex schema can take longer than the timeout), up to ``MAX_COMPILES``
  compile processes in all;
* the host dies with the front end (``PR_SET_PDEATHSIG``, and it exits when its pipe closes), and
  every child with the host.

The front end's side is :class:`CompileHost`: ``submit`` returns an ``asyncio`` future resolved
with the serialized grammar or an exception (:class:`CompileFailed`, :class:`CompileTimedOut`,
:class:`CompileHostDied`); ``started_at`` tells when a compile left the queue. Messages are
msgpack lists over a ``multiprocessing`` pipe (no pickle).
"""
from __future__ import annotations

import asyncio
import heapq
import itertools
import logging
import multiprocessing as mp
import os
import re
import selectors
import signal
import threading
import time
from typing import Optional

import msgspec

from zpp.utils.process import main_module_hidden, set_pdeathsig, sigint_blocked

logger = logging.getLogger(__name__)

GENERAL_SLOTS = 2
"""Compiles of any size running at once (a slow one holds its slot until it is killed)."""
SMALL_SLOTS = 1
"""Further compiles running at once for small specifications only."""
SMALL_SPEC_BYTES = 4096
"""Largest specification (UTF-8 bytes) that may use a small slot."""
CHILD_NICE = 10
"""CPU priority of a compile process, below the serving path's: on a CPU-served model, two slow
schemas compiling at the workers' priority slowed a small request's decoding from under 2 s to 7 s
(tests/test_structured_outputs.py); a typical grammar needs milliseconds of CPU, so it still
compiles in time on a busy host."""
YOUNG_S = 1.0
"""Seconds a compile holds its slot; a typical grammar compiles in milliseconds."""
OLD_NICE = 19
"""CPU priority of a compile past ``YOUNG_S``: below every younger compile's ``CHILD_NICE``."""
MAX_COMPILES = 6
"""Compile processes at most, young and old (each may hold --max-structured-outputs-grammar-bytes
and xgrammar's working memory: ~160 MB for the slowest case known)."""
COMPILE_THREADS = 2
"""xgrammar threads per compile (its ``max_threads``: the token masks of a grammar's rules in
parallel), as the in-process compiler had."""

_encode = msgspec.msgpack.encode
_decode = msgspec.msgpack.decode


class CompileFailed(Exception):
    """xgrammar refused the specification (``str``: its message), or the compiled grammar is over
    the size limit (``too_large``: the message is the whole refusal)."""

    def __init__(self, message: str, too_large: bool = False):
        super().__init__(message)
        self.too_large = too_large


class CompileTimedOut(Exception):
    """The compile ran for its whole time limit and was killed."""


class CompileHostDied(Exception):
    """The compile host process is gone (or could not start); ``str`` says why."""


# --- the host process --------------------------------------------------------------------------
_ANY_WS = "[ \\n\\r\\t]*"  # xgrammar's whitespace between JSON tokens, in its EBNF text
_REGEX_RULE = re.compile(r"\broot(_\d+)?\b")


def json_grammar_with_whitespace(xgr, schema: str, strict: bool, pattern: str) -> str:
    """The EBNF of the JSON schema ``schema`` in which every run of whitespace between JSON tokens
    matches the regex ``pattern`` (vLLM's ``whitespace_pattern``; xgrammar has no such option):
    xgrammar's grammar with any whitespace, each ``[ \\n\\r\\t]*`` outside a lookahead replaced
    by the rule ``zpp_ws``, which is xgrammar's grammar of ``pattern`` with its rules renamed.
    (A lookahead keeps any whitespace: it only prunes, and the rule after it still holds.)

    Raises whatever xgrammar raises for a bad schema or regex."""
    base = str(xgr.Grammar.from_json_schema(schema, any_whitespace=True, strict_mode=strict))
    ws = _REGEX_RULE.sub(lambda m: "zpp_ws" + (m.group(1) or ""), str(xgr.Grammar.from_regex(pattern)))
    lines = []
    for line in base.splitlines():
        head, sep, lookahead = line.partition(" (=(")
        lines.append(head.replace(_ANY_WS, "zpp_ws") + sep + lookahead)
    return "\n".join(lines) + "\n" + ws


def _compile(compiler, kind: str, text: str, whitespace, max_grammar_bytes: int) -> list:
    """In a forked child: ``["ok", serialized]``, ``["too_large", message]`` or ``["error", message]``.
    ``whitespace`` (JSON kinds; :meth:`zpp.frontend.grammar.GrammarCompiler.whitespace_of`): False
    compact, True any, an int the most characters of each run, a str the regex each run matches."""
    import json
    if kind in ("json", "json_object"):
        # json_object: any object, not strict, else {"type": "object"} admits only {}
        schema, strict = (text, True) if kind == "json" else ('{"type": "object"}', False)
        if isinstance(whitespace, str):
            import xgrammar as xgr
            g = compiler.compile_grammar(json_grammar_with_whitespace(xgr, schema, strict, whitespace))
        else:
            count = whitespace if isinstance(whitespace, int) and not isinstance(whitespace, bool) else None
            g = compiler.compile_json_schema(schema, any_whitespace=whitespace is not False, strict_mode=strict,
                                             max_whitespace_cnt=count)
    elif kind == "regex":
        g = compiler.compile_regex(text)
    elif kind == "choice":
        g = compiler.compile_grammar("root ::= " + " | ".join(json.dumps(x, ensure_ascii=False) for x in json.loads(text)))
    else:
        g = compiler.compile_grammar(text)
    size = g.memory_size_bytes
    if size > max_grammar_bytes:  # refused before serializing: that takes a few times the size
        return ["too_large", f"the compiled {kind} grammar takes {size / 2**20:.1f} MiB; this server accepts at most "
                             f"{max_grammar_bytes / 2**20:.1f} MiB (--max-structured-outputs-grammar-bytes): simplify it"]
    return ["ok", g.serialize_json()]


def _child(info, w: int, job: list, host: int) -> None:
    """A forked child of the host (pid ``host``): compile ``job`` and write the msgpack result to
    ``w``; never returns."""
    code = 0
    try:
        set_pdeathsig()
        if os.getppid() != host:  # the host died before the line above
            os._exit(1)
        os.nice(CHILD_NICE)
        import xgrammar as xgr
        _, _, kind, text, whitespace, max_bytes, _ = job
        try:
            compiler = xgr.GrammarCompiler(info, max_threads=COMPILE_THREADS, cache_enabled=False)
            out = _compile(compiler, kind, text, whitespace, max_bytes)
        except Exception as e:  # xgrammar's refusal
            out = ["error", str(e) or type(e).__name__]
        data = _encode(out)
        view = memoryview(data)
        while view:
            view = view[os.write(w, view):]
    except BaseException:
        code = 1
    os._exit(code)


class _Running:
    __slots__ = ("job_id", "pid", "fd", "deadline", "chunks", "small", "young_until")

    def __init__(self, job_id, pid, fd, deadline, small, young_until):
        self.job_id, self.pid, self.fd, self.deadline, self.small = job_id, pid, fd, deadline, small
        self.young_until = young_until  # holds a slot until then (None once old)
        self.chunks: list[bytes] = []


def grammar_vocab_size(tokenizer_size: int, model_vocab_size: int, stop_token_ids: list[int]) -> int:
    """The vocabulary xgrammar's ``TokenizerInfo`` is built for: the tokenizer's own tokens (and
    the stop tokens), not the model's padded vocabulary.

    A model's logits often outnumber its tokenizer's tokens (padding for the matrix shapes: Qwen2
    151,936 logits for 151,665 tokens; a benchmark's Llama-3-8B shape with SmolLM2's tokenizer,
    128,256 for 49,152). xgrammar keeps every id past the tokenizer as a special token that no
    grammar allows, and pays for them on every step: with 79,104 such ids its accept took 27.5 us a
    row instead of 2.1 and its bitmask fill 65 us instead of 6 (``scripts/bench_structured.py``'s
    schema, 256 rows, one thread). Built for the tokenizer only, the bitmask has
    ``ceil(result / 32)`` words a row, and the last stage treats every logit past them as
    disallowed (:func:`zpp.workers.sampler.unpack_bitmask`): the same mask, smaller and faster.

    Args:
        tokenizer_size: ``len(tokenizer)`` (its vocabulary with the added tokens).
        model_vocab_size: the model's ``vocab_size`` (logits per row).
        stop_token_ids: ids the grammar must be able to end on (kept inside the result).
    Returns the vocabulary size, at most ``model_vocab_size``."""
    need = max([tokenizer_size] + [t + 1 for t in stop_token_ids])
    return min(model_vocab_size, need)


def host_main(conn, front_end: int, tokenizer_path: str, vocab_size: int, stop_token_ids: list[int],
              general_slots: int, small_slots: int, log_level: int) -> None:
    """The compile host's main loop (a spawned process; see the module docstring).

    From the front end: ``["compile", job_id, kind, text, whitespace, max_grammar_bytes,
    time_limit]``, ``["drop", job_id]`` (nobody waits for it any more: unqueue it, or kill it,
    without a reply), ``["stop"]``.
    To it: ``["ready", tokenizer_info_json]`` (or ``["failed", message]``), then per job
    ``["started", job_id]`` and one of ``["ok", job_id, serialized]``, ``["error", job_id, message]``,
    ``["too_large", job_id, message]``, ``["timeout", job_id]``, ``["died", job_id, message]``.
    """
    set_pdeathsig()
    if os.getppid() != front_end:  # the front end died before the line above
        return
    from zpp.proctitle import set_process_title
    set_process_title("zpp::grammar")  # /proc/PID/cmdline and comm
    logging.basicConfig(level=log_level)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the front end stops us
    try:
        import xgrammar as xgr
        from transformers import AutoTokenizer
        tokenizer = AutoTokenizer.from_pretrained(tokenizer_path)
        info = xgr.TokenizerInfo.from_huggingface(
            tokenizer, vocab_size=grammar_vocab_size(len(tokenizer), vocab_size, stop_token_ids),
            stop_token_ids=stop_token_ids)
        info_json = info.serialize_json()
        del tokenizer
    except Exception as e:
        conn.send_bytes(_encode(["failed", f"xgrammar failed on this tokenizer: {str(e).strip()[:500]}"]))
        return
    conn.send_bytes(_encode(["ready", info_json]))
    del info_json
    sel = selectors.DefaultSelector()
    sel.register(conn.fileno(), selectors.EVENT_READ, None)
    queue: list = []  # heap of (spec bytes, arrival, job)
    order = itertools.count()
    running: dict[int, _Running] = {}  # fd -> compile

    def send(msg: list) -> None:
        conn.send_bytes(_encode(msg))

    def finish(r: _Running, killed: bool, reply: bool = True) -> None:
        sel.unregister(r.fd)
        os.close(r.fd)
        del running[r.fd]
        if killed:
            try:
                os.kill(r.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        _, status = os.waitpid(r.pid, 0)
        if killed:
            if reply:
                send(["timeout", r.job_id])
            return
        try:
            kind, payload = _decode(b"".join(r.chunks))
            send([kind, r.job_id, payload])
        except (msgspec.DecodeError, ValueError, TypeError):
            send(["died", r.job_id, f"the compile process ended with status {status}"])

    def age(now: float) -> None:
        """Young compiles past ``YOUNG_S`` give their slot up and drop to ``OLD_NICE``."""
        for r in running.values():
            if r.young_until is not None and r.young_until <= now:
                r.young_until = None
                try:
                    os.setpriority(os.PRIO_PROCESS, r.pid, OLD_NICE)
                except OSError:  # it has just exited
                    pass

    def start_ready() -> None:
        while queue and len(running) < MAX_COMPILES:
            young = [r for r in running.values() if r.young_until is not None]
            small_running = sum(r.small for r in young)
            size, _, job = queue[0]
            general_free = len(young) - small_running < general_slots
            small_ok = size <= SMALL_SPEC_BYTES and small_running < small_slots
            if not (general_free or small_ok):
                return
            heapq.heappop(queue)
            r, w = os.pipe()
            host = os.getpid()
            pid = os.fork()
            if pid == 0:
                os.close(r)
                _child(info, w, job, host)
            os.close(w)
            os.set_blocking(r, False)
            now = time.monotonic()
            run = _Running(job[1], pid, r, now + float(job[6]), not general_free, now + YOUNG_S)
            running[r] = run
            sel.register(r, selectors.EVENT_READ, run)
            send(["started", job[1]])

    try:
        while True:
            now = time.monotonic()
            for r in [r for r in running.values() if r.deadline <= now]:
                finish(r, killed=True)
            age(now)
            start_ready()
            wake = [r.deadline for r in running.values()] + [r.young_until for r in running.values()
                                                             if r.young_until is not None]
            wait = min(wake, default=now + 60.0) - time.monotonic()
            for key, _ in sel.select(max(0.0, wait)):
                run = key.data
                if run is None:  # a message from the front end
                    try:
                        msg = _decode(conn.recv_bytes())
                    except (EOFError, OSError):
                        return  # the front end is gone
                    if msg[0] == "stop":
                        return
                    if msg[0] == "compile":
                        heapq.heappush(queue, (len(msg[3].encode("utf-8", "surrogatepass")), next(order), msg))
                    elif msg[0] == "drop":  # nobody waits for it any more: unqueue, or kill
                        kept = [q for q in queue if q[2][1] != msg[1]]
                        if len(kept) != len(queue):
                            queue[:] = kept
                            heapq.heapify(queue)
                        for r in [r for r in running.values() if r.job_id == msg[1]]:
                            finish(r, killed=True, reply=False)
                    continue
                if run.fd not in running:
                    continue
                try:
                    data = os.read(run.fd, 1 << 20)
                except BlockingIOError:
                    continue
                if data:
                    run.chunks.append(data)
                else:
                    finish(run, killed=False)
    finally:
        for r in list(running.values()):
            try:
                os.kill(r.pid, signal.SIGKILL)
                os.waitpid(r.pid, 0)
            except (ProcessLookupError, ChildProcessError):
                pass


# --- the front end's side ----------------------------------------------------------------------
class CompileHost:
    """The front end's handle on the compile host (spawned by :meth:`start`).

    Args:
        tokenizer_path: the HF tokenizer's directory (``tokenizer.name_or_path``), loaded by the host.
        vocab_size, stop_token_ids: as xgrammar's ``TokenizerInfo.from_huggingface`` takes them.

    ``start()`` returns the tokenizer info (xgrammar's JSON, which the engine core needs to read the
    grammars). ``submit(job_id, kind, text, whitespace, max_grammar_bytes, time_limit)``
    returns an ``asyncio.Future`` on the calling loop: the serialized grammar, or CompileFailed /
    CompileTimedOut / CompileHostDied. ``started_at(job_id)`` tells when the compile left the host's
    queue; ``drop(job_id)`` unqueues or kills a compile nobody waits for.
    """

    def __init__(self, tokenizer_path: str, vocab_size: int, stop_token_ids: list[int]):
        self._host_args = (tokenizer_path, vocab_size, list(stop_token_ids))
        self._proc: Optional[mp.Process] = None
        self._conn = None
        self._send_lock = threading.Lock()
        self._futures: dict[int, asyncio.Future] = {}
        self._closing = False
        self._started: dict[int, float] = {}  # job id -> when the host reported its start (monotonic s)
        self._ready: Optional[asyncio.Future] = None
        self._dead: Optional[str] = None

    async def start(self) -> str:
        """Spawn the host (once; later calls wait for the same start, or respawn it once it died);
        returns the tokenizer info.

        Raises:
            CompileHostDied: the host could not start (xgrammar failed there), with the reason.
        """
        ready = self._ready
        if ready is None:
            self._dead = None
            self._ready = ready = asyncio.get_running_loop().create_future()
            try:
                self._spawn()
            except Exception as e:
                self._fail(f"the grammar compile process did not start: {e}")  # sets self._ready = None
        return await asyncio.shield(ready)

    def _spawn(self) -> None:
        ctx = mp.get_context("spawn")
        parent, child = ctx.Pipe()
        with main_module_hidden(), sigint_blocked():
            proc = ctx.Process(target=host_main, name="zpp-grammar-host", daemon=True,
                               args=(child, os.getpid(), *self._host_args, GENERAL_SLOTS, SMALL_SLOTS,
                                     logging.getLogger("zpp").getEffectiveLevel()))
            proc.start()
            self._proc = proc  # only once started (close() joins it)
        child.close()
        self._conn = parent
        loop = asyncio.get_running_loop()
        threading.Thread(target=self._read, args=(parent, loop, self._ready), name="zpp-grammar-host-reader",
                         daemon=True).start()

    def _read(self, conn, loop, ready: asyncio.Future) -> None:
        """Reader thread: hands the host's messages to the futures, on the event loop."""
        while True:
            try:
                msg = _decode(conn.recv_bytes())
                call, args, gone = self._on_message, (msg, ready), False
            except (EOFError, OSError, msgspec.DecodeError):
                if self._closing:
                    return
                proc = self._proc
                if proc is not None:
                    proc.join(1.0)
                call, gone = self._fail, True
                code = proc.exitcode if proc is not None else None
                # ended by SIGTERM / SIGINT (a signal to the whole process group, the server's own
                # shutdown on its way): the next compile respawns it; not worth a warning
                args = (f"the grammar compile process exited (code {code})", code in (-signal.SIGTERM, -signal.SIGINT))
            try:
                loop.call_soon_threadsafe(call, *args)
            except RuntimeError:  # the loop is closed: nobody waits any more
                return
            if gone:
                return

    def _on_message(self, msg: list, ready: asyncio.Future) -> None:
        kind = msg[0]
        if kind == "ready":
            if not ready.done():
                ready.set_result(msg[1])
            return
        if kind == "failed":
            self._fail(msg[1])
            return
        job_id = msg[1]
        if kind == "started":
            if job_id in self._futures:
                self._started[job_id] = time.monotonic()
            return
        fut = self._futures.pop(job_id, None)
        self._started.pop(job_id, None)
        if fut is None or fut.done():
            return
        if kind == "ok":
            fut.set_result(msg[2])
        elif kind == "timeout":
            fut.set_exception(CompileTimedOut())
        elif kind in ("error", "too_large"):
            fut.set_exception(CompileFailed(msg[2], too_large=kind == "too_large"))
        else:
            fut.set_exception(CompileHostDied(msg[2]))

    def _fail(self, reason: str, signalled: bool = False) -> None:
        """The host is gone: fail everything waiting; the next ``start`` spawns a new one. Logged as a
        WARNING, at INFO when a termination signal ended it (``signalled``)."""
        if self._dead is not None:
            return
        self._dead = reason
        logger.log(logging.INFO if signalled else logging.WARNING, "structured outputs: %s", reason)
        if self._ready is not None and not self._ready.done():
            self._ready.set_exception(CompileHostDied(reason))
            self._ready.exception()  # retrieved: waiters get it through shield
        self._ready = None
        for fut in self._futures.values():
            if not fut.done():
                fut.set_exception(CompileHostDied(reason))
        self._futures.clear()
        self._started.clear()
        self._close_conn()

    def submit(self, job_id: int, kind: str, text: str, whitespace, max_grammar_bytes: int,
               time_limit: float) -> asyncio.Future:
        fut = self._futures[job_id] = asyncio.get_running_loop().create_future()
        self._send(["compile", job_id, kind, text, whitespace, max_grammar_bytes, time_limit])
        return fut

    def started_at(self, job_id: int) -> Optional[float]:
        """When the compile left the host's queue (``time.monotonic()``), None while it waits."""
        return self._started.get(job_id)

    def drop(self, job_id: int) -> None:
        fut = self._futures.pop(job_id, None)
        if fut is not None and not fut.done():
            fut.cancel()
        self._started.pop(job_id, None)
        self._send(["drop", job_id])

    def _send(self, msg: list) -> None:
        try:
            with self._send_lock:
                if self._conn is None:
                    raise OSError("not running")
                self._conn.send_bytes(_encode(msg))
        except OSError as e:
            self._fail(f"the grammar compile process is gone ({e})")

    @property
    def pid(self) -> Optional[int]:
        return self._proc.pid if self._proc is not None and self._proc.is_alive() else None

    def _close_conn(self) -> None:
        with self._send_lock:
            conn, self._conn = self._conn, None
        if conn is not None:
            try:
                conn.close()
            except OSError:
                pass

    def close(self) -> None:
        """Stop the host (it kills its compiles first); never waits more than a second."""
        proc = self._proc
        if proc is None:
            return
        self._closing = True
        try:
            with self._send_lock:
                if self._conn is not None:
                    self._conn.send_bytes(_encode(["stop"]))  # read once the host is ready
        except OSError:
            pass
        ready = self._ready is not None and self._ready.done()
        proc.join(1.0 if ready else 0.0)  # a host still starting is killed at once
        if proc.is_alive():
            proc.kill()
            proc.join(1.0)
        self._close_conn()
        self._proc = None
