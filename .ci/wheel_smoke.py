"""Checks of an installed (non-editable) engine, run by .ci/wheel_smoke.sh with the fresh
virtual environment's python, from a folder outside the checkout:

    python wheel_smoke.py CHECKOUT

CHECKOUT is only read to compare against: nothing from it may be imported. Exits 1 with
one line per problem.
"""

from __future__ import annotations

import importlib
import os
import pkgutil
import sys
from pathlib import Path


def _inside(path: str | Path, folder: str | Path) -> bool:
    return Path(os.path.realpath(path)).is_relative_to(os.path.realpath(folder))


def main(checkout: Path) -> list[str]:
    problems: list[str] = []
    if sys.prefix == sys.base_prefix:
        problems.append(f"not run in a virtual environment (sys.prefix {sys.prefix})")
    import engine

    pkg = Path(engine.__file__).resolve().parent
    print(f"engine {engine.__version__} from {pkg}")
    if not _inside(pkg, sys.prefix) or _inside(pkg, checkout):
        return problems + [f"engine imported from {pkg}, not from the virtual environment {sys.prefix}"]

    # every module of the checkout is in the installed package (a folder without
    # __init__.py would be missing), and so is py.typed
    shipped = {p.relative_to(checkout / "engine").as_posix() for p in (checkout / "engine").rglob("*.py")
               if "__pycache__" not in p.parts}
    shipped.add("py.typed")
    missing = sorted(rel for rel in shipped if not (pkg / rel).is_file())
    problems += [f"not installed: engine/{rel}" for rel in missing]

    # every module imports (optional third-party dependencies may be absent here)
    names = ["engine"] + [m.name for m in pkgutil.walk_packages(engine.__path__, "engine.")
                          if not m.name.endswith(".__main__")]
    for name in names:
        try:
            module = importlib.import_module(name)
        except ModuleNotFoundError as exc:
            if exc.name is None or exc.name == "engine" or exc.name.startswith("engine."):
                problems.append(f"import {name}: {exc}")
            else:
                print(f"  ({name} needs {exc.name}, not installed here)")
            continue
        if not _inside(module.__file__ or "", pkg):
            problems.append(f"{name} imported from {module.__file__}, outside {pkg}")
    print(f"imported {len(names)} modules")

    # the public entry points
    if not callable(engine.initialize):
        problems.append("engine.initialize is not callable")
    import engine.compat.deepspeed as ds

    if ds.initialize is not engine.initialize:
        problems.append("engine.compat.deepspeed.initialize is not engine.initialize")

    # the fused ops' sources ship in the package, identical to the checkout's csrc/
    from engine.ops.builder import OP_SPECS, OpBuilder, csrc_root

    root = csrc_root()
    if not _inside(root, pkg):
        problems.append(f"csrc_root() is {root}, not inside the installed package")
    for spec in OP_SPECS.values():
        builder = OpBuilder(spec)
        for rel in spec.cpu_sources + spec.cuda_sources + spec.headers:
            if not (root / rel).is_file():
                problems.append(f"op {spec.name}: {rel} is not installed under {root}")
        problem = builder.jit_problem() or ""
        if problem.startswith("sources not found"):
            problems.append(f"op {spec.name}: {problem}")
        elif builder.fingerprint() != OpBuilder(spec, root=checkout / "csrc").fingerprint():
            problems.append(f"op {spec.name}: the installed sources differ from {checkout / 'csrc'}")
    return problems


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit(f"usage: {sys.argv[0]} CHECKOUT")
    found = main(Path(sys.argv[1]).resolve())
    for line in found:
        print(f"wheel smoke: {line}", file=sys.stderr)
    sys.exit(1 if found else 0)
