"""The front-end process: the asyncio engine (:mod:`.async_engine`), request intake
(:mod:`.inputs`), output processing and detokenization (:mod:`.output_processor`,
:mod:`.detokenizer`), grammar compilation (:mod:`.grammar`, :mod:`.compile_host`) and the client of
the engine core (:mod:`.core_client`). It runs in ``zpp serve``'s API server process(es) and in the
offline ``LLM``'s; the engine core (:mod:`zpp.engine`) runs beside it or in its own process."""
