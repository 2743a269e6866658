"""The layering of engine/, checked on the source with ``ast`` (no imports, no processes).

Three rules (issue 18, "one owner per concept at the seams"):

(a) an import never points upward in ``LAYERS`` (module-level or inside a function:
    a lazy import is still a dependency); imports within one layer are free;
(b) no parameter is annotated ``engine: Any`` (take the typed value you need instead);
(c) no process-group parameter defaults to ``None`` (``None`` meant WORLD in one module
    and "no parallelism" in another: pass the group).

``ALLOWED`` (violations tolerated for now) is empty and must stay so: the test fails on any
violation not listed, and on a listed entry that no longer occurs. ``LAYERS`` names the
modules as they are: a prefix that matches no module fails the test too.
"""

from __future__ import annotations

import ast
from pathlib import Path
from typing import Iterator, Optional

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "engine"

# Lowest first. A module belongs to the layer of the longest prefix listed here (a prefix
# matches itself and its submodules); the package root ``engine`` (the lazy facade in
# engine/__init__.py) is matched exactly and sits on top. A module that matches nothing
# fails the test: place a new package here, in the layer its imports put it.
LAYERS: list[tuple[str, tuple[str, ...]]] = [
    # pure values and helpers with no engine dependencies
    ("foundation", ("engine.errors", "engine.topology", "engine.metrics", "engine.validate", "engine.timers",
                    "engine.version", "engine.placement", "engine.torch_api")),
    # process groups, collectives, launch/spawn, the failure watch
    ("distributed", ("engine.distributed",)),
    # typed configuration (the model's config dataclass and the AutoTP rule grammar are
    # parsed by the config loader), data, monitors, op builders
    ("config", ("engine.config", "engine.models.config", "engine.tensor_parallel.auto_rules", "engine.data",
                "engine.monitor", "engine.ops", "engine.moe.config", "engine.moe.context")),
    # layers: precision (FP8, loss scaling, the split-backward phase flag), TP, models
    ("layers", ("engine.precision", "engine.tensor_parallel", "engine.context_parallel", "engine.models",
                "engine.moe")),
    # ZeRO (step arithmetic included) and the pipeline (stage chunks, runner, parameter
    # names); the optimizers (Muon reads ZeRO's shard view); the values the engine is
    # assembled from and exports
    ("parallel", ("engine.zero", "engine.pipeline", "engine.optim", "engine.parts", "engine.training_state")),
    ("checkpoint", ("engine.checkpoint", "engine.weights16")),
    ("engine", ("engine.engine", "engine.ds_queries", "engine.pipe")),
    # assembly, the training loop, entry points and adapters on top
    ("entry", ("engine.assembly", "engine.training", "engine.generate", "engine.compat", "engine.planner", "engine.plot",
               "engine")),
]

# Rule (c) does not apply here: engine.compat mirrors deepspeed.comm / torch.distributed,
# whose documented signatures take ``group=None`` for the default (world) group.
GROUP_NONE_EXEMPT = ("engine.compat",)

# Rule (c) does not apply to these public signatures either: "<module> <function>(<param>)".
# engine.zero.Init mirrors deepspeed.zero.Init(data_parallel_group=None), where None means the
# world group (DeepSpeed's documented default); changing it would break users' scripts.
GROUP_NONE_EXEMPT_PARAMS = frozenset({"engine.zero.init Init.__init__(data_parallel_group)"})

# Violations tolerated for now. MUST STAY EMPTY: fix a violation rather than list it (the
# test fails on a listed entry that no longer occurs, so the list cannot go stale).
ALLOWED: frozenset[str] = frozenset()


def _module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _sources() -> list[Path]:
    return sorted(PACKAGE.rglob("*.py"))


def _known_modules() -> set[str]:
    return {_module_name(p) for p in _sources()}


def layer_of(module: str) -> Optional[int]:
    """Index in LAYERS of ``module`` (longest matching prefix), None when nothing matches."""
    best, best_len = None, -1
    for index, (_, prefixes) in enumerate(LAYERS):
        for prefix in prefixes:
            if prefix == "engine":
                hit = module == "engine"
            else:
                hit = module == prefix or module.startswith(prefix + ".")
            if hit and len(prefix) > best_len:
                best, best_len = index, len(prefix)
    return best


def _imported_modules(node: ast.AST, package: str, known: set[str]) -> Iterator[str]:
    """Engine modules one import statement depends on (``from engine import pipe`` -> engine.pipe)."""
    if isinstance(node, ast.Import):
        yield from (a.name for a in node.names if a.name == "engine" or a.name.startswith("engine."))
    elif isinstance(node, ast.ImportFrom):
        if node.level:  # relative: resolve against this module's package
            base = package.split(".")[: len(package.split(".")) - node.level + 1]
            module = ".".join(base + ([node.module] if node.module else []))
        else:
            module = node.module or ""
        if module != "engine" and not module.startswith("engine."):
            return
        for a in node.names:
            sub = f"{module}.{a.name}"
            yield sub if sub in known else module


def _is_any(annotation: Optional[ast.expr]) -> bool:
    if isinstance(annotation, ast.Constant) and isinstance(annotation.value, str):
        return annotation.value in ("Any", "typing.Any")
    if isinstance(annotation, ast.Name):
        return annotation.id == "Any"
    return isinstance(annotation, ast.Attribute) and annotation.attr == "Any"


def _is_group_param(arg: ast.arg) -> bool:
    name = arg.arg
    if name in ("group", "pg", "process_group") or name.endswith("_group") or name.endswith("_pg"):
        return not name.startswith("param_group")
    return arg.annotation is not None and "ProcessGroup" in ast.unparse(arg.annotation)


def _functions(node: ast.AST, prefix: str = "") -> Iterator[tuple[str, ast.FunctionDef | ast.AsyncFunctionDef]]:
    """Every function with its qualified name (``Class.method``, ``outer.inner``)."""
    for child in ast.iter_child_nodes(node):
        if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):
            yield prefix + child.name, child
            yield from _functions(child, prefix + child.name + ".")
        elif isinstance(child, ast.ClassDef):
            yield from _functions(child, prefix + child.name + ".")
        else:
            yield from _functions(child, prefix)


def _defaults(fn: ast.FunctionDef | ast.AsyncFunctionDef) -> Iterator[tuple[ast.arg, Optional[ast.expr]]]:
    positional = fn.args.posonlyargs + fn.args.args
    padded: list[Optional[ast.expr]] = [None] * (len(positional) - len(fn.args.defaults))
    yield from zip(positional, padded + list(fn.args.defaults))
    yield from zip(fn.args.kwonlyargs, fn.args.kw_defaults)


def violations() -> set[str]:
    known = _known_modules()
    found: set[str] = set()
    for path in _sources():
        rel = path.relative_to(ROOT).as_posix()
        module = _module_name(path)
        package = module if path.name == "__init__.py" else module.rpartition(".")[0]
        here = layer_of(module)
        assert here is not None, f"{rel}: module {module} is in no layer; add it to LAYERS in {__file__}"
        tree = ast.parse(path.read_text(), filename=rel)
        for node in ast.walk(tree):
            for target in _imported_modules(node, package, known):
                there = layer_of(target)
                assert there is not None, f"{rel} imports {target}, which is in no layer; add it to LAYERS"
                if there > here:
                    found.add(f"{rel} imports {target} ({LAYERS[here][0]} -> {LAYERS[there][0]})")
        group_rule = not any(module == m or module.startswith(m + ".") for m in GROUP_NONE_EXEMPT)
        for name, fn in _functions(tree):
            for arg, default in _defaults(fn):
                if arg.arg == "engine" and _is_any(arg.annotation):
                    found.add(f"{rel} {name}(engine: Any)")
                if group_rule and isinstance(default, ast.Constant) and default.value is None and _is_group_param(arg):
                    if f"{module} {name}({arg.arg})" not in GROUP_NONE_EXEMPT_PARAMS:
                        found.add(f"{rel} {name}({arg.arg}=None)")
    return found


def test_every_module_has_a_layer_and_the_layers_are_disjoint():
    prefixes = [p for _, ps in LAYERS for p in ps]
    assert len(prefixes) == len(set(prefixes)), "a prefix is listed in two layers"
    known = _known_modules()
    for module in known:
        assert layer_of(module) is not None, f"{module} is in no layer"
    stale = [p for p in prefixes if not any(m == p or m.startswith(p + ".") for m in known)]
    assert not stale, f"LAYERS names modules that do not exist (moved or removed?): {stale}"


def test_no_new_layering_violation_and_the_allowlist_is_current():
    found = violations()
    new = sorted(found - ALLOWED)
    assert not new, ("new layering violations (fix them; do not add them to ALLOWED):\n  " + "\n  ".join(new))
    gone = sorted(ALLOWED - found)
    assert not gone, ("fixed, so delete these entries from ALLOWED in tests/unit/test_layering.py:\n  "
                      + "\n  ".join(gone))


def test_the_checker_sees_each_kind_of_violation(tmp_path):
    """The three detectors on a planted module (so an empty ALLOWED proves something)."""
    src = ("def f(engine: Any, tp_group=None, *, pg: 'ProcessGroup' = None, param_group=None):\n"
           "    from engine.assembly.initialize import initialize\n")
    tree = ast.parse(src)
    fn = tree.body[0]
    assert isinstance(fn, ast.FunctionDef)
    flagged = [a.arg for a, d in _defaults(fn)
               if isinstance(d, ast.Constant) and d.value is None and _is_group_param(a)]
    assert flagged == ["tp_group", "pg"]
    assert _is_any(fn.args.args[0].annotation)
    targets = [t for node in ast.walk(tree) for t in _imported_modules(node, "engine.zero", _known_modules())]
    assert targets == ["engine.assembly.initialize"]
    assert layer_of("engine.assembly.initialize") > layer_of("engine.zero.base")
    assert layer_of("engine.zero.base") == layer_of("engine.zero")
    assert layer_of("engine.parts") < layer_of("engine.assembly.initialize")
    # the exemption is by exact name: the same parameter elsewhere is still flagged
    assert "engine.zero.base Init.__init__(data_parallel_group)" not in GROUP_NONE_EXEMPT_PARAMS
