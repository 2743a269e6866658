"""A parameter hook that does not keep its owner alive.

Why: torch keeps a tensor's post-accumulate-grad hooks in C++ (the tensor's autograd
metadata), where the garbage collector cannot see them (a tensor's ``tp_traverse`` visits its
pre-hooks, not these). A bound method registered there makes ``parameter -> hook -> optimizer
-> parameter`` a cycle gc never frees: once a script (HF's ``Trainer``, a DeepSpeed loop) drops
the engine without calling ``destroy()``, the optimizer and every process group it holds live
until interpreter finalisation, where the groups' gloo worker threads can abort the process
("terminate called without an active exception"; docs/launching.md, "Shutdown").
"""

from __future__ import annotations

import weakref
from typing import Any, Callable

__all__ = ["WeakMethodHook"]


class WeakMethodHook:
    """Calls ``method`` while its object is alive; does nothing once it has been collected."""

    __slots__ = ("_method",)

    def __init__(self, method: Callable[..., Any]) -> None:
        self._method = weakref.WeakMethod(method)

    def __call__(self, *args: Any) -> None:
        method = self._method()
        if method is not None:
            method(*args)
