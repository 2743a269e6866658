"""The one integer validator: config keys, topology sizes, schedule arguments, CLI flags.

:func:`check_int` accepts a Python ``int`` (never a ``bool``: ``True == 1`` in Python, and a
``true`` in a JSON config is a slip, not a count), optionally a finite integer-valued float
(JSON writes ``5e8`` as a float), checks the bounds and returns the ``int``. The message
names the value (``name``), what it must be and what it got, then the fix when the caller
gives one:

    pipeline.virtual_stages must be a positive integer (>= 1), got 0: set it to 1 or more

Callers keep their own exception type (``error``; default :class:`ConfigError`) so that a
launch problem stays a ``LaunchError`` and a bad argument to a pure function a
``ValueError``. A leaf module: it imports nothing from the engine but its errors.
"""

from __future__ import annotations

import math
from typing import Any, Optional

from engine.errors import ConfigError

__all__ = ["as_int", "check_int", "int_requirement"]


def as_int(value: Any, allow_float: bool = False) -> Optional[int]:
    """``value`` as an ``int``, or ``None`` when it is not one (a ``bool`` is not; a
    finite integer-valued float is, with ``allow_float``)."""
    if isinstance(value, bool):
        return None
    if isinstance(value, int):
        return value
    if allow_float and isinstance(value, float) and math.isfinite(value) and value.is_integer():
        return int(value)
    return None


def int_requirement(minimum: Optional[int] = None, maximum: Optional[int] = None) -> str:
    """What an integer in ``[minimum, maximum]`` is, in words ("a positive integer (>= 1)")."""
    if minimum is not None and maximum is not None:
        return f"an integer from {minimum} to {maximum}"
    if minimum == 1:
        return "a positive integer (>= 1)"
    if minimum == 0:
        return "a non-negative integer (>= 0)"
    if minimum is not None:
        return f"an integer >= {minimum}"
    if maximum is not None:
        return f"an integer <= {maximum}"
    return "an integer"


def check_int(name: str, value: Any, *, minimum: Optional[int] = None, maximum: Optional[int] = None,
              fix: Optional[str] = None, allow_float: bool = False,
              error: type[Exception] = ConfigError) -> int:
    """``value`` as an ``int`` in ``[minimum, maximum]``, else ``error`` naming ``name``,
    the requirement, the value and ``fix``."""
    v = as_int(value, allow_float)
    if v is None or (minimum is not None and v < minimum) or (maximum is not None and v > maximum):
        msg = f"{name} must be {int_requirement(minimum, maximum)}, got {value!r}"
        raise error(f"{msg}: {fix}" if fix else msg)
    return v
