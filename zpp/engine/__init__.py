"""The engine process: scheduler, KV block manager, detokenizer, executor, asyncio loop."""
