"""The error type of the data pipeline."""

from __future__ import annotations

from engine.errors import ConfigError

__all__ = ["DataError"]


class DataError(ConfigError):
    """Bad data input: a missing, unreadable or empty file, a tokenizer that does not fit
    the model, a corrupt cache. The message names the file (or setting) and the fix.

    A subclass of ``ConfigError`` (itself a ``ValueError``), so a caller that reports
    configuration problems reports these the same way.
    """
