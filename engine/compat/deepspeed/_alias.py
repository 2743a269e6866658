"""``alias()``: this package installed as ``deepspeed`` in ``sys.modules``, so an unmodified
DeepSpeed script (``import deepspeed``, ``from deepspeed.X import Y``, ``import
deepspeed.comm as dist``) and a library that imports DeepSpeed itself get the engine.

How: every module of the package (walked with ``pkgutil``, so a module added later is
included; ``__main__`` excepted) is imported and registered under its ``deepspeed.`` name as
the *same* module object (``deepspeed.comm is engine.compat.deepspeed.comm``). A finder at
the front of ``sys.meta_path`` (:class:`_DeepSpeedFinder`) serves any ``deepspeed.<name>``
imported later the same way, so no second copy of a module is ever loaded under the
other name, and refuses the modules of :data:`~engine.compat.deepspeed._unsupported.UNSUPPORTED_MODULES`
(under both prefixes) with their reason.

With the alias active the same finder also answers ``importlib.metadata`` for the distribution
``deepspeed`` (:class:`EngineDistribution`: name ``deepspeed``, version
``engine.compat.deepspeed.__version__``, e.g. ``0.19.8+engine``), ahead of an installed real
DeepSpeed's: libraries decide whether DeepSpeed is there and which features it has from that
metadata (accelerate's and transformers' ``is_deepspeed_available``, their version gates), so
they work without real DeepSpeed installed and judge the API they actually get.

Real DeepSpeed must not be imported in the same process: if ``deepspeed`` is already in
``sys.modules`` (and is not this package) :func:`alias` raises instead of mixing the two.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import importlib.metadata
import importlib.util
import os
import pkgutil
import re
import sys
from types import ModuleType
from typing import Any, Iterable, Optional, Sequence

from engine.compat.deepspeed._unsupported import UnsupportedModuleError, unsupported_module_reason

__all__ = ["alias", "is_aliased", "install_finder", "EngineDistribution", "PACKAGE", "ALIAS", "REDIRECTS"]

PACKAGE = "engine.compat.deepspeed"
ALIAS = "deepspeed"
_SKIP = ("__main__",)  # the launcher entry point: importing it would run a script
# DeepSpeed modules that are another module of this package under a second name
REDIRECTS = {"runtime.activation_checkpointing.checkpointing": "checkpointing"}


def _relative(fullname: str) -> Optional[str]:
    """``"comm"`` for ``deepspeed.comm`` / ``engine.compat.deepspeed.comm``; ``""`` for the
    package itself; None for a name outside both."""
    for prefix in (ALIAS, PACKAGE):
        if fullname == prefix:
            return ""
        if fullname.startswith(prefix + "."):
            return fullname[len(prefix) + 1:]
    return None


class _AliasLoader(importlib.abc.Loader):
    """Loads ``deepspeed.<rel>`` as the already-importable ``engine.compat.deepspeed.<rel>``."""

    def __init__(self, target: str) -> None:
        self.target = target

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType:
        return importlib.import_module(self.target)

    def exec_module(self, module: ModuleType) -> None:
        pass  # executed once, under its engine name, by create_module's import


class EngineDistribution(importlib.metadata.Distribution):
    """The ``importlib.metadata`` distribution ``deepspeed`` while the alias is active: this
    package under DeepSpeed's name, at the version whose API it mirrors (``+engine``)."""

    def read_text(self, filename: str) -> Optional[str]:
        if filename in ("METADATA", "PKG-INFO"):
            from engine.compat.deepspeed import __version__

            return (f"Metadata-Version: 2.1\nName: {ALIAS}\nVersion: {__version__}\n"
                    f"Summary: this engine installed as deepspeed by {PACKAGE}.alias()\n")
        if filename == "top_level.txt":
            return ALIAS + "\n"
        return None

    def locate_file(self, path: Any) -> Any:
        return os.path.join(os.path.dirname(os.path.abspath(__file__)), str(path))


def _is_deepspeed_name(name: Optional[str]) -> bool:
    return name is not None and re.sub(r"[-_.]+", "-", name).lower() == ALIAS


class _DeepSpeedFinder(importlib.abc.MetaPathFinder):
    """Refuses unsupported DeepSpeed modules with their reason; with the alias active, serves
    ``deepspeed.<rel>`` as ``engine.compat.deepspeed.<rel>``."""

    aliased = False

    def find_spec(self, fullname: str, path: Optional[Sequence[str]] = None,
                  target: Optional[ModuleType] = None) -> Optional[importlib.machinery.ModuleSpec]:
        rel = _relative(fullname)
        if rel is None or (fullname.startswith(ALIAS) and not self.aliased):
            return None
        reason = unsupported_module_reason(rel) if rel else None
        if reason is not None:
            raise UnsupportedModuleError(f"{ALIAS}.{rel} is not supported by this engine: {reason}", name=fullname)
        if rel in REDIRECTS:
            return importlib.machinery.ModuleSpec(fullname, _AliasLoader(f"{PACKAGE}.{REDIRECTS[rel]}"))
        if fullname.startswith(PACKAGE):
            return None  # the ordinary path finder loads the package's own files
        engine_name = PACKAGE + ("." + rel if rel else "")
        if engine_name not in sys.modules and importlib.util.find_spec(engine_name) is None:
            return None  # no such module: the import fails as usual ("No module named ...")
        return importlib.machinery.ModuleSpec(fullname, _AliasLoader(engine_name))

    def find_distributions(self, context: Any = None) -> Iterable[importlib.metadata.Distribution]:
        """``importlib.metadata``'s hook: the engine's ``deepspeed`` distribution, first (this
        finder leads ``sys.meta_path``), when the alias is active and ``deepspeed`` is asked for."""
        if self.aliased and _is_deepspeed_name(getattr(context, "name", None)):
            return [EngineDistribution()]
        return []


_FINDER = _DeepSpeedFinder()


def install_finder() -> None:
    """Put the finder first on ``sys.meta_path`` (once)."""
    if _FINDER not in sys.meta_path:
        sys.meta_path.insert(0, _FINDER)


def is_aliased() -> bool:
    """Whether :func:`alias` has run in this process."""
    return _FINDER.aliased and sys.modules.get(ALIAS) is sys.modules.get(PACKAGE)


def _walk(package: ModuleType) -> list[str]:
    """Every module name of ``package``, parents before children (``__main__`` excepted)."""
    names = []
    for info in pkgutil.walk_packages(package.__path__, prefix=package.__name__ + "."):
        if info.name.rsplit(".", 1)[-1] not in _SKIP:
            names.append(info.name)
    return names


def alias() -> ModuleType:
    """Install this package as ``deepspeed`` (and each of its modules as ``deepspeed.<name>``)
    in ``sys.modules``; returns the package. Idempotent. Raises RuntimeError when real
    DeepSpeed is already imported in this process."""
    package = importlib.import_module(PACKAGE)
    present = sys.modules.get(ALIAS)
    if present is not None and present is not package:
        raise RuntimeError(f"the real DeepSpeed package is already imported in this process "
                           f"({getattr(present, '__file__', present)!r}): call engine.compat.deepspeed.alias() "
                           "(or launch with python -m engine.compat.deepspeed) before anything imports deepspeed")
    install_finder()
    _FINDER.aliased = True
    sys.modules[ALIAS] = package
    for name in _walk(package):
        module = importlib.import_module(name)
        sys.modules[ALIAS + name[len(PACKAGE):]] = module
    return package
