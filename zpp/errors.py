"""Errors a caller of zpp catches. This module imports nothing, so every module can raise them."""
from __future__ import annotations


class ConfigError(ValueError):
    """A setting that cannot work. The message is one line and names the setting (its flag), so
    that ``zpp serve`` can print it and exit before any worker starts or any weight loads."""
