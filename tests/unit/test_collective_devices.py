"""Static check: a tensor built inside a function that runs a collective names its device.

NCCL rejects a CPU tensor in a collective - after every timed step of a benchmark has run
(the end-of-run all-reduce of step times in benchmarks/throughput.py and
benchmarks/_compare_common.py did exactly that). gloo accepts it, so no CPU run can catch
it at runtime; this scan catches the pattern: in every function of engine/, benchmarks/ and
launch/ that calls a collective or point-to-point op, each tensor factory call
(torch.tensor / zeros / ones / empty / full / arange / rand*) must pass ``device=``.
"""

import ast
import pathlib

ROOT = pathlib.Path(__file__).resolve().parents[2]
COLLECTIVES = {"all_reduce", "broadcast", "all_gather", "reduce_scatter", "all_gather_into_tensor",
               "reduce_scatter_tensor", "all_gather_single", "reduce_scatter_single", "send", "recv", "isend",
               "irecv", "batch_isend_irecv", "all_to_all_single", "reduce", "gather", "scatter"}
FACTORIES = {"tensor", "zeros", "ones", "empty", "full", "arange", "rand", "randn", "randint"}
COMM_MODULES = {"dist", "comm"}


def _calls(fn: ast.AST):
    for node in ast.walk(fn):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) \
                and isinstance(node.func.value, ast.Name):
            yield node.func.value.id, node.func.attr, node


def violations() -> list[str]:
    found = []
    for sub in ("engine", "benchmarks", "launch"):
        for path in sorted((ROOT / sub).rglob("*.py")):
            tree = ast.parse(path.read_text(), str(path))
            for fn in ast.walk(tree):
                if not isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    continue
                calls = list(_calls(fn))
                if not any(mod in COMM_MODULES and name in COLLECTIVES for mod, name, _ in calls):
                    continue
                for mod, name, node in calls:
                    if mod == "torch" and name in FACTORIES and not any(k.arg == "device" for k in node.keywords):
                        found.append(f"{path.relative_to(ROOT)}:{node.lineno} torch.{name}(...) in {fn.name}() "
                                     f"without device=")
    return found


def test_tensors_built_next_to_a_collective_name_their_device():
    assert violations() == []


def test_the_scan_catches_the_benchmark_bug(tmp_path, monkeypatch):
    """The shape of the original bug is reported (so the scan cannot pass vacuously)."""
    bad = tmp_path / "engine"
    bad.mkdir()
    (bad / "x.py").write_text("import torch\nimport torch.distributed as dist\n"
                              "def f(times):\n    t = torch.tensor(times, dtype=torch.float64)\n"
                              "    dist.all_reduce(t, op=dist.ReduceOp.MAX)\n")
    for sub in ("benchmarks", "launch"):
        (tmp_path / sub).mkdir()
    monkeypatch.setattr(__import__(__name__), "ROOT", tmp_path)
    assert violations() == ["engine/x.py:4 torch.tensor(...) in f() without device="]
