"""Process groups are values keyed by axis, never ``None`` (docs/architecture.md, groups).

1. An AST scan of ``engine/``: no process-group parameter is ``Optional`` or defaults to
   ``None``, no call passes ``group=None`` / ``*_group=None``, and no ``x if ... else None``
   is bound to a group name. The DeepSpeed edge (``engine/compat/comm.py``, whose
   ``group=None`` means the world as in ``deepspeed.comm``, and ``engine.zero.Init``'s
   ``data_parallel_group``) converts there and is listed below with the reason.
2. :class:`AxisGroup` of size 1 is free: every TP mapping and ``engine.distributed.comm`` op over
   it is the identity without torch.distributed, and asking for its communicator is an
   error that names the fix.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
import torch

from engine.distributed import comm
from engine.distributed.groups import NO_TP, AxisGroup, ParallelGroups
from engine.tensor_parallel import mappings as m
from engine.topology import Axis, Topology

ENGINE = Path(__file__).resolve().parents[2] / "engine"

# (file relative to engine/, function name) -> why a None group is allowed there
DEEPSPEED_EDGE = {
    "compat/comm.py": "mirrors deepspeed.comm: group=None is the world, converted to torch's spelling there",
    "compat/deepspeed/comm/comm.py": "the rest of deepspeed.comm's signatures: group=None is the world, "
                                     "converted by _pg to torch's spelling",
    "zero/init.py:Init.__init__": "DeepSpeed's zero.Init(data_parallel_group=None) is the world: converted by _dp_axis",
    "zero/init.py:_dp_axis": "the conversion of DeepSpeed's data_parallel_group",
}
NOT_GROUPS = {"param_group", "param_groups"}  # optimizer param-group dicts, not process groups


def _is_group_name(name: str, annotation: ast.AST | None = None) -> bool:
    if name in NOT_GROUPS or not (name == "group" or name.endswith("_group")):
        return False
    return annotation is None or "str" not in ast.unparse(annotation)  # not e.g. a W&B run group name


def _mentions_none(node: ast.AST | None) -> bool:
    if node is None:
        return False
    text = ast.unparse(node)
    return "Optional" in text or "None" in text


def _is_none(node: ast.AST | None) -> bool:
    return isinstance(node, ast.Constant) and node.value is None


def _allowed(rel: str, func: str) -> bool:
    return rel in DEEPSPEED_EDGE or f"{rel}:{func}" in DEEPSPEED_EDGE


def _bad_params(node: ast.FunctionDef | ast.AsyncFunctionDef, func: str) -> list[tuple[int, str]]:
    a = node.args
    positional = a.posonlyargs + a.args
    defaults = [None] * (len(positional) - len(a.defaults)) + list(a.defaults)
    out = []
    for arg, default in list(zip(positional, defaults)) + list(zip(a.kwonlyargs, a.kw_defaults)):
        if not _is_group_name(arg.arg, arg.annotation):
            continue
        if _is_none(default):
            out.append((node.lineno, f"{func}({arg.arg}=None)"))
        if _mentions_none(arg.annotation):
            out.append((node.lineno, f"{func}({arg.arg}: {ast.unparse(arg.annotation)})"))
    return out


def _bad_binding(node: ast.Assign | ast.AnnAssign) -> list[tuple[int, str]]:
    targets = node.targets if isinstance(node, ast.Assign) else [node.target]
    names = [t.id if isinstance(t, ast.Name) else t.attr if isinstance(t, ast.Attribute) else "" for t in targets]
    v = node.value
    if isinstance(v, ast.Subscript) and "ProcessGroup" in ast.unparse(v) and _mentions_none(v):  # Optional alias
        return [(node.lineno, f"{names[0]} = {ast.unparse(v)}")]
    if any(_is_group_name(n) for n in names) and isinstance(v, ast.IfExp) and (_is_none(v.body) or _is_none(v.orelse)):
        return [(node.lineno, f"{names[0]} = ... if ... else None")]
    return []


def _violations(path: Path, root: Path = ENGINE) -> list[str]:
    """Each forbidden pattern in ``path`` as ``file:line what``, in line order."""
    rel = path.relative_to(root).as_posix()
    tree = ast.parse(path.read_text(), filename=str(path))
    methods = {child: f"{node.name}.{child.name}" for node in ast.walk(tree) if isinstance(node, ast.ClassDef)
               for child in node.body if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef))}
    found: list[tuple[int, str]] = []
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            func = methods.get(node, node.name)
            if not _allowed(rel, func):
                found += _bad_params(node, func)
        elif _allowed(rel, ""):
            continue
        elif isinstance(node, ast.Call):
            found += [(node.lineno, f"call passes {kw.arg}=None") for kw in node.keywords
                      if kw.arg and _is_group_name(kw.arg) and _is_none(kw.value)]
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            found += _bad_binding(node)
    return [f"{rel}:{line} {what}" for line, what in sorted(found)]


def test_no_process_group_is_none_in_engine():
    found = [v for path in sorted(ENGINE.rglob("*.py")) for v in _violations(path)]
    assert not found, ("process groups passed or defaulted as None (use the axis value: groups[Axis.TP], "
                       "NO_TP / AxisGroup.single for no parallelism, AxisGroup.world() for every rank):\n"
                       + "\n".join(found))


def test_the_scan_catches_each_pattern(tmp_path):
    """The checker has teeth: each forbidden pattern in a planted file is reported."""
    (tmp_path / "planted.py").write_text(
        "from typing import Optional\n"
        "def a(x, tp_group=None): pass\n"
        "def b(x, group: Optional[object] = NO_TP): pass\n"
        "def c(x):\n    f(x, group=None)\n"
        "def d(cfg, groups):\n    tp_group = groups.tp_group if cfg.tp > 1 else None\n"
        "ProcessGroup = Optional[dist.ProcessGroup]\n"
        "def e(x, param_group=None, group=NO_TP, wandb_group: Optional[str] = None): pass\n")
    found = _violations(tmp_path / "planted.py", tmp_path)
    assert [v.split(" ", 1)[1] for v in found] == [
        "a(tp_group=None)", "b(group: Optional[object])", "call passes group=None",
        "tp_group = ... if ... else None", "ProcessGroup = Optional[dist.ProcessGroup]"]


# ---------------------------------------------------------------- the axis value

def test_size_one_axis_is_free_and_every_op_is_the_identity():
    """No torch.distributed anywhere: a size-1 group never reaches it."""
    import torch.distributed as dist

    assert not dist.is_initialized()
    g = AxisGroup.single("tp", global_rank=5)
    assert (g.size, g.rank, g.ranks, g.global_rank, g.handle) == (1, 0, (5,), 5, None)
    assert (NO_TP.size, NO_TP.name) == (1, "tp")
    x = torch.randn(2, 4, 6, requires_grad=True)
    for op in (m.copy_to_tp_region, m.reduce_from_tp_region, m.scatter_to_tp_region, m.gather_from_tp_region,
               m.scatter_to_sequence_parallel_region, m.gather_from_sequence_parallel_region,
               m.reduce_scatter_to_sequence_parallel_region):
        assert op(x, g) is x, op.__name__
    for op in (m.split_along_dim, m.all_gather_along_dim, m.reduce_scatter_along_dim):
        assert op(x, 1, g) is x
    t = torch.arange(6.0)
    assert comm.all_reduce(t, g) is None and torch.equal(t, torch.arange(6.0))
    assert comm.broadcast(t, 5, g) is None
    out = torch.empty(6)
    comm.all_gather(out, t, g)
    assert torch.equal(out, t)
    out.zero_()
    comm.reduce_scatter(out, t, g)
    assert torch.equal(out, t)
    out.zero_()
    comm.all_to_all_single(out, t, [6], [6], g)
    assert torch.equal(out, t)
    comm.check_sequence([g], "nothing to compare", torch.device("cpu"))
    with pytest.raises(RuntimeError, match="size 1 and no communicator"):
        _ = g.process_group
    with pytest.raises(ValueError, match="no communicator"):
        AxisGroup("tp", (0, 1), 0)  # a real group needs its communicator
    with pytest.raises(ValueError, match="outside"):
        AxisGroup("dp", (3, 4), 2)
    with pytest.raises(ValueError, match="outside"):
        g.global_rank_of(1)
    with pytest.raises(RuntimeError, match="init_distributed"):
        AxisGroup.world()


def test_parallel_groups_are_keyed_by_axis():
    """``groups[Axis.TP]`` is the TP value (built directly: no torch.distributed needed for
    size-1 axes); a middle stage has no embedding group and says so."""
    one = {a: AxisGroup.single(a, 4) for a in ("tp", "dp")}
    fake_pp = AxisGroup("pp", (0, 4, 8), 1, handle=object())  # any non-None communicator stands in
    groups = ParallelGroups.from_axes(Topology(dp=4, tp=1, pp=3), 4, {"tp": one["tp"], "dp": one["dp"], "pp": fake_pp}, None)
    assert groups[Axis.TP] is groups.tp_group and groups["pp"] is fake_pp and groups[Axis.DP].size == 1
    assert not groups.in_embedding_group and groups.embedding_ranks == ()
    with pytest.raises(ValueError, match="middle pipeline stage"):
        _ = groups.embedding_group
    assert groups.all_groups() == [fake_pp]
