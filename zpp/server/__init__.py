"""The OpenAI-compatible HTTP server (the front end's door), one file per job:

- :mod:`.app`: the routes, the middleware (API key, errors in OpenAI's shape), /v1/models,
  /health, /version, /tokenize, /detokenize;
- :mod:`.endpoint`: what every endpoint shares (body reading, the model check, running prompts);
- :mod:`.completions`, :mod:`.chat` (with :mod:`.tools`): the two generation endpoints;
- :mod:`.render`: the bytes of responses (errors, logprobs, usage, the SSE writer);
- :mod:`.protocol`: the request schemas and their SamplingParams; :mod:`.http_body`: decoding bodies;
- :mod:`.metrics`: /metrics and the stats log lines;
- :mod:`.launch`: starting the engine core and the front-end process(es), signals, shutdown.

Every request goes through :meth:`zpp.frontend.async_engine.AsyncEngine.prepare`, as the offline
``LLM``'s do.
"""
