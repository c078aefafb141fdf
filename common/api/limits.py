"""Configuration errors and the limits a request is held to.

Shared by the router's and the engine's configuration, which both refuse a value
that can never work with `ConfigError`.
"""

from __future__ import annotations


class ConfigError(ValueError):
    """A configuration value that can never work; the message names the field."""
