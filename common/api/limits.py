"""Configuration errors and the limits a request is held to.

`RequestLimits` is the one record of what a request may ask for. The router checks
a request against it before any worker sees it, the engine checks again on add, so
the two must agree: `RouterConfig.limits` and `EngineConfig.limits` both build this
record and both validate their fields through `RequestLimits.check` (the flat fields
stay on each config so that existing call sites and CLI flags keep working).
"""

from __future__ import annotations

from dataclasses import dataclass


class ConfigError(ValueError):
    """A configuration value that can never work; the message names the field."""


@dataclass(frozen=True)
class RequestLimits:
    """What one request may ask for."""

    max_model_len: int | None = None  # prompt + max_tokens; None = the model's context
    max_n: int = 16  # parallel samples
    max_logprobs: int = 20  # top logprobs per token

    def __post_init__(self) -> None:
        if self.max_model_len is not None and self.max_model_len < 2:
            raise ConfigError(f"max_model_len must be >= 2, got {self.max_model_len}")
        if self.max_n < 1:
            raise ConfigError(f"max_n must be >= 1, got {self.max_n}")
        if self.max_logprobs < 0:
            raise ConfigError(f"max_logprobs must be >= 0, got {self.max_logprobs}")

    def resolve(self, model_max_len: int) -> RequestLimits:
        """These limits with max_model_len filled in from the model's context."""
        if self.max_model_len is not None:
            return self
        return RequestLimits(model_max_len, self.max_n, self.max_logprobs)
