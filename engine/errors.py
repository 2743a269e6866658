"""Exception types shared across the package."""

__all__ = ["ConfigError"]


class ConfigError(ValueError):
    """A configuration problem. The message names the offending key and the fix."""
