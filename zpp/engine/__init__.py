"""The engine core: scheduler, KV block manager, executor (the stage workers' owner), the core's
half of structured outputs, and the core process's entry point (:mod:`.core_proc`)."""
