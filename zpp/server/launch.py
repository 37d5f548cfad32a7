"""Running the server: the engine core and the HTTP front end(s) (``--api-server-count``
replicas sharing one port and one core), signals, the stats logger, and shutdown.
"""
from __future__ import annotations

import asyncio
import logging
import os
import signal
import sys
from typing import Optional

from aiohttp import web

from zpp.errors import ConfigError
from zpp.frontend.async_engine import AsyncEngine
from zpp.server.app import OpenAIServer
from zpp.server.config import ServerConfig
from zpp.server.metrics import DEFAULT_LOG_STATS_INTERVAL_S, StatsLogger
from zpp.utils.process import freeze_gc, main_module_hidden, sigint_blocked, watch_parent

logger = logging.getLogger(__name__)


def load_chat_template(path: Optional[str]) -> Optional[str]:
    """The text of a ``--chat-template`` file (None -> None). Raises ConfigError if unreadable."""
    if not path:
        return None
    try:
        with open(path, encoding="utf-8") as f:
            return f.read()
    except OSError as e:
        raise ConfigError(f"--chat-template {path!r}: {e.strerror or e}") from None


async def serve(config, host: str, port: int, api_key: Optional[str] = None,
                chat_template: Optional[str] = None,
                log_stats_interval: Optional[float] = DEFAULT_LOG_STATS_INTERVAL_S, api_server_count: int = 1,
                **server_options) -> int:
    """Start the engine core and the HTTP front end(s); run until SIGINT/SIGTERM or engine death.

    ``chat_template`` is a file path (read before any worker starts); ``log_stats_interval`` the
    seconds between stats log lines while busy (None: no stats lines, ``--disable-log-stats``);
    ``api_server_count`` the number of front-end processes sharing ``port`` (SO_REUSEPORT) and one
    engine core (vLLM's ``--api-server-count``; this process is the first); ``server_options`` go
    to :class:`OpenAIServer` (request limits, ``trust_request_chat_template``, ``log_requests``).

    On the first SIGINT/SIGTERM, requests in progress are ended at once (streams get an error event
    and ``[DONE]``, others HTTP 503) and the server stops within seconds; a second signal stops it
    immediately. During start-up (the core and workers starting, weights loading) the first
    SIGINT/SIGTERM aborts it: the core and every worker started so far are stopped, one line
    (``zpp: start-up interrupted (SIGINT); ...``) goes to stderr, and then SIGINT returns 130 while
    SIGTERM ends the process by its default action (as an unhandled SIGTERM did before); a second
    signal exits at once (the kernel then kills the core, and the core's death its workers:
    ``PR_SET_PDEATHSIG``).

    Returns the process exit status: 0 after a signal, 1 if the engine (or a front end) died,
    130 after SIGINT during start-up.
    Raises:
        ConfigError: the chat template file cannot be read, or the engine configuration is bad.
        WorkerDiedError: a worker or the engine core failed to start.
    """
    template = load_chat_template(chat_template)
    _generation_defaults(config, server_options)
    loop = asyncio.get_running_loop()
    starting = asyncio.current_task()
    signalled: list[int] = []

    def on_signal_during_start_up(sig: int) -> None:
        if signalled:
            os._exit(128 + signalled[0])
        signalled.append(sig)
        starting.cancel()

    # Until _run_front_end installs its own handlers. Without these, SIGTERM killed this process
    # outright (leaving the core and workers to PR_SET_PDEATHSIG) and SIGINT left it waiting, at
    # exit, for a core that went on loading.
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, on_signal_during_start_up, sig)
    extra: list = []
    try:
        engine = await AsyncEngine.start(config, in_process=False)  # cancelled: core and workers stopped
        freeze_gc()
        try:
            if api_server_count > 1:
                extra = _start_front_ends(config, engine.client.address, api_server_count, host, port, api_key,
                                          template, server_options)
            return await _run_front_end(engine, config, host, port, api_key, template, log_stats_interval,
                                        extra, reuse_port=api_server_count > 1, **server_options)
        finally:
            for p in extra:
                if p.is_alive():
                    p.terminate()
            for p in extra:
                p.join(10)
                if p.is_alive():
                    p.kill()
    except asyncio.CancelledError:
        if not signalled:
            raise
        sig = signalled[0]
        print(f"zpp: start-up interrupted ({signal.Signals(sig).name}); everything it started is stopped",
              file=sys.stderr, flush=True)
        if sig == signal.SIGTERM:  # end by the signal, as before: service managers read that as a clean stop
            loop.remove_signal_handler(sig)
            os.kill(os.getpid(), sig)
        return 128 + sig


def _generation_defaults(config, server_options: dict) -> None:
    """``--generation-config``: replace ``server_options["generation_config"]`` (auto, vllm or a
    directory) by the defaults it gives, logged once. Raises ConfigError."""
    from zpp.generation_config import generation_defaults, log_generation_defaults
    source = server_options.pop("generation_config", "auto")
    defaults = generation_defaults(config.model.model, source)
    log_generation_defaults(defaults, source, config.model.model)
    server_options["generation_defaults"] = defaults


async def _run_front_end(engine: AsyncEngine, config, host: str, port: int, api_key: Optional[str],
                         template: Optional[str], log_stats_interval: Optional[float], extra_front_ends=(),
                         reuse_port: bool = False, owner: bool = True, timeout_keep_alive: float = ServerConfig.timeout_keep_alive,
                         shutdown_timeout: float = 0.0, access_log: bool = False, http_log_level: Optional[str] = None,
                         **server_options) -> int:
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    lost: list[str] = []
    draining: list[bool] = []

    def on_signal() -> None:
        if stop.is_set() and owner:  # a second signal: stop the workers and leave now
            logger.warning("second signal: exiting now")
            for p in extra_front_ends:
                p.kill()
            engine.kill()
            os._exit(1)
        stop.set()

    for sig in ((signal.SIGINT, signal.SIGTERM) if owner else (signal.SIGTERM,)):
        loop.add_signal_handler(sig, on_signal)
    if not owner:  # the first front end decides when to stop (a terminal's Ctrl-C reaches us all)
        signal.signal(signal.SIGINT, signal.SIG_IGN)
    for p in extra_front_ends:
        def gone(p=p):
            loop.remove_reader(p.sentinel)
            if draining:  # it drained and exited, as told
                return
            lost.append(f"front end {p.name} exited (exit code {p.exitcode})")
            stop.set()
        loop.add_reader(p.sentinel, gone)
    server = OpenAIServer(engine, config.model.served_names, api_key, template, **server_options)
    # auto_decompress off: zpp.server.http_body undoes Content-Encoding itself, so that an unknown or
    # unsupported coding and a corrupt body get answers in OpenAI's shape (aiohttp's parser
    # answered br / zstd with plain text before any handler ran, took unknown codings for identity
    # and failed corrupt bodies as a payload error).
    # keepalive_timeout: aiohttp's one timer for a connection without a complete request head,
    # started when it opens and after each response: it sheds idle keep-alive connections and
    # clients that stop sending headers alike (a slow header does not restart it).
    if http_log_level is not None:
        level = logging.DEBUG if http_log_level == "trace" else getattr(logging, http_log_level.upper())
        logging.getLogger("aiohttp").setLevel(level)
    runner = web.AppRunner(server.build_app(), handler_cancellation=True, shutdown_timeout=5.0,
                           access_log=logging.getLogger("aiohttp.access") if access_log else None,
                           keepalive_timeout=timeout_keep_alive, auto_decompress=False)
    status = 0
    stats_task = None
    try:
        await runner.setup()
        site = web.TCPSite(runner, host, port, reuse_port=reuse_port or None, backlog=4096)  # 1000 clients at once
        await site.start()
        if owner:
            logger.info("serving %s on http://%s:%d (pipeline-parallel-size %d, tensor-parallel-size %d, "
                        "%d API server process(es))", ", ".join(config.model.served_names), host, port,
                        config.parallel.pipeline_parallel_size, config.parallel.tensor_parallel_size,
                        1 + len(extra_front_ends))
            # With --api-key, say that /v1/* needs it (a curl without the header gets 401); not the key.
            auth = " (--api-key: /v1/* requests need 'Authorization: Bearer KEY')" if api_key else ""
            print(f"zpp: serving {', '.join(config.model.served_names)} on http://{host}:{port}{auth}", flush=True)
            if log_stats_interval:
                stats = StatsLogger(engine, server.metrics, log_stats_interval, config.cache.enable_prefix_caching)
                stats_task = asyncio.create_task(stats.run())
        while not stop.is_set():
            try:
                await asyncio.wait_for(stop.wait(), timeout=0.5)
            except asyncio.TimeoutError:
                pass
            if engine.dead:
                logger.error("engine died: %s; exiting", engine.dead)
                await asyncio.sleep(1.0)  # let clients see the errors / 503 before we go
                status = 1
                break
        if lost:
            logger.error("%s; stopping", lost[0])
            status = 1
        elif shutdown_timeout > 0 and not engine.dead:
            draining.append(True)
            await _drain(server, site, shutdown_timeout, extra_front_ends, owner)
    finally:
        if owner:
            logger.info("shutting down")
        if stats_task is not None:
            stats_task.cancel()
        engine.abort_all()
        await asyncio.sleep(0.1)  # let the handlers write their error events
        await runner.cleanup()
        await engine.shutdown()
    return status


async def _drain(server: OpenAIServer, site, timeout: float, extra_front_ends, owner: bool) -> None:
    """--shutdown-timeout: stop listening, answer new requests on open connections with 503, and
    wait up to ``timeout`` seconds for the requests in progress (streams included) to finish; the
    caller then ends what is left with an error. The extra front ends are told (SIGTERM) to do the
    same."""
    server.draining = True
    await site.stop()  # the listening socket is closed: new connections are refused
    for p in extra_front_ends:
        if p.is_alive():
            p.terminate()
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    if server.in_flight:
        logger.info("draining: %d request(s) in progress get up to %g s to finish", server.in_flight, timeout)
    while loop.time() < deadline and (server.in_flight or any(p.is_alive() for p in extra_front_ends)):
        await asyncio.sleep(0.05)
    if server.in_flight:
        logger.warning("shutdown timeout (%g s): ending %d request(s) still in progress", timeout, server.in_flight)
    elif owner:
        logger.info("drained: every request in progress finished")


def _start_front_ends(config, core_address: str, count: int, host: str, port: int, api_key: Optional[str],
                      template: Optional[str], server_options: dict) -> list:
    """Spawn front ends 1..count-1 (each: aiohttp on ``port`` with SO_REUSEPORT, joined to the core)."""
    import json
    import multiprocessing as mp

    import msgspec

    ctx = mp.get_context("spawn")
    level = logging.getLogger("zpp").getEffectiveLevel()
    args = json.dumps({"host": host, "port": port, "api_key": api_key, "template": template,
                       "options": server_options, "level": level})
    procs = []
    with main_module_hidden(), sigint_blocked():  # the first front end decides when to stop
        for i in range(1, count):
            # Not daemonic: a daemonic process may not start children, and a front end starts its
            # grammar compile host (structured outputs were unavailable on front ends 1..N-1).
            # serve() stops and joins them; watch_parent() ends them if this process dies.
            p = ctx.Process(target=_front_end_main, name=f"zpp-api-server-{i}", daemon=False,
                            args=(msgspec.msgpack.encode(config), core_address, i, args))
            p.start()
            procs.append(p)
    return procs


def _front_end_main(config_bytes: bytes, core_address: str, index: int, args_json: str) -> None:
    """Entry point of an extra front-end process (``--api-server-count`` > 1)."""
    import json

    import msgspec

    from zpp.config import EngineConfig
    watch_parent()
    from zpp.proctitle import set_process_title
    set_process_title(f"zpp::api{index}")
    a = json.loads(args_json)
    logging.basicConfig(level=a["level"], format=f"%(asctime)s %(levelname)s [api {index}] %(name)s: %(message)s")
    config = msgspec.msgpack.decode(config_bytes, type=EngineConfig)

    async def main() -> int:
        engine = await AsyncEngine.start(config, in_process=False, core_address=core_address, front_end_index=index)
        freeze_gc()
        return await _run_front_end(engine, config, a["host"], a["port"], a["api_key"], a["template"], None,
                                    reuse_port=True, owner=False, **a["options"])
    sys.exit(asyncio.run(main()))
