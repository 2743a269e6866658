"""ZeRO-3 parameters used outside their module's forward: DeepSpeed's
``register_external_parameter`` / ``unregister_external_parameter`` and its automatic
detection.

A ZeRO-3 unit (a module owning parameters, :mod:`engine.zero.stage3`) is gathered around its
own forward and backward. A parameter read by another module's forward (a tied
``F.linear(x, self.emb.weight)`` in the parent, ``nn.MultiheadAttention`` passing
``self.out_proj.weight`` to its functional form) would be the empty placeholder there.

- Explicit (DeepSpeed's API, before ``initialize``): ``register_external_parameter(module, p)``
  records ``p`` in ``module._external_params`` (DeepSpeed's attribute: ``{id(p): p}``); the
  ZeRO-3 optimizer then counts ``module`` as an owner of ``p``, so ``module``'s forward and
  backward gather ``p`` too and its gradient is taken per use, as for a weight shared by two
  modules.
- Automatic (as DeepSpeed's ``ZeROOrderedDict``): each module's ``_parameters`` becomes a
  :class:`WatchedParameters` dict; reading a partitioned parameter as a module attribute
  while a forward of the model is running gathers it on the spot. It then stays gathered
  until its gradient has arrived (its owner's release after backward) or the step's backward
  ends; in a forward without backward (evaluation) until the next step's end.
"""

from __future__ import annotations

import weakref
from typing import Any, Optional, Protocol, Set

import torch
import torch.nn as nn

__all__ = ["register_external_parameter", "unregister_external_parameter", "external_parameters",
           "WatchedParameters", "ExternalGatherer", "watch_parameters", "unwatch_parameters"]


def _check_parameter(parameter: Any) -> None:
    if not isinstance(parameter, nn.Parameter):
        raise RuntimeError(f"register_external_parameter needs a torch.nn.Parameter, got {type(parameter).__name__}")


def register_external_parameter(module: nn.Module, parameter: nn.Parameter) -> None:
    """DeepSpeed's: ``module``'s forward (and backward) use ``parameter``, which another module
    owns. Call it before ``initialize`` (typically in ``module.__init__``); afterwards the
    automatic detection covers the use (module docstring)."""
    _check_parameter(parameter)
    ext: Optional[dict[int, nn.Parameter]] = module.__dict__.get("_external_params")
    if ext is None:
        ext = {}
        object.__setattr__(module, "_external_params", ext)  # a plain attribute, as DeepSpeed's
    ext[id(parameter)] = parameter


def unregister_external_parameter(module: nn.Module, parameter: nn.Parameter) -> None:
    """DeepSpeed's: undo :func:`register_external_parameter`."""
    _check_parameter(parameter)
    ext: Optional[dict[int, nn.Parameter]] = module.__dict__.get("_external_params")
    if not ext or id(parameter) not in ext:
        raise RuntimeError("Parameter is not a registered external parameter of module.")
    del ext[id(parameter)]


def external_parameters(module: nn.Module) -> list[nn.Parameter]:
    """The parameters registered as external to ``module`` (registration order)."""
    ext: dict[int, nn.Parameter] = module.__dict__.get("_external_params") or {}
    return list(ext.values())


class ExternalGatherer(Protocol):
    """What :class:`WatchedParameters` calls: the ZeRO-3 optimizer."""

    forward_depth: int

    def gather_external(self, param: torch.Tensor) -> None: ...


class WatchedParameters(dict):
    """A module's ``_parameters`` that gathers a partitioned parameter read during a forward
    (an external use: module docstring). Iteration (``named_parameters``, ``state_dict``) does
    not go through ``__getitem__`` and costs nothing."""

    def __init__(self, params: dict, owner: ExternalGatherer) -> None:
        super().__init__(params)
        self._owner = weakref.ref(owner)

    def __getitem__(self, key: str) -> Any:
        p = super().__getitem__(key)
        if p is not None and p.numel() == 0:
            owner: Optional[ExternalGatherer] = self._owner()
            if owner is not None and owner.forward_depth > 0:
                owner.gather_external(p)
        return p

    def __reduce__(self) -> Any:  # copies and pickles are plain dicts
        return (dict, (dict(self),))

    def __deepcopy__(self, memo: dict) -> dict:
        import copy
        return {k: copy.deepcopy(v, memo) for k, v in self.items()}


def watch_parameters(module: nn.Module, owner: ExternalGatherer, managed: Set[int]) -> list[Any]:
    """Count ``owner.forward_depth`` over every module of ``module`` (hooks returned, to be
    removed with the optimizer's) and watch the ``_parameters`` of each module holding a
    parameter whose id is in ``managed``."""
    hooks: list[Any] = []

    def enter(*_: Any) -> None:
        owner.forward_depth += 1

    def leave(*_: Any) -> None:
        owner.forward_depth -= 1

    for m in module.modules():
        hooks.append(m.register_forward_pre_hook(enter))
        hooks.append(m.register_forward_hook(leave, always_call=True))
        if any(id(p) in managed for p in m._parameters.values() if p is not None):
            m._parameters = WatchedParameters(m._parameters, owner)
    return hooks


def unwatch_parameters(module: nn.Module) -> None:
    """Plain ``_parameters`` dicts again (a destroyed engine leaves no watcher behind)."""
    for m in module.modules():
        if isinstance(m._parameters, WatchedParameters):
            m._parameters = dict(m._parameters)
