"""Multi-host support: ``zpp-node`` (the per-host agent) and the head's SSH launcher."""
