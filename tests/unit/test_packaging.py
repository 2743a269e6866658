"""What `pip install .` ships and what `ruff check engine` reads: every module under engine/.

A folder under engine/ without ``__init__.py`` is not a package to setuptools, so its modules
are silently left out of a (non-editable) wheel while an editable install, the tests and the
checkout still import them; a folder named like one of ruff's default excludes (build, dist,
...) is silently not linted. Both happened (engine/build, engine/dist, engine/training).
.ci/wheel_smoke.sh installs the wheel itself and uses it from outside the checkout.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

# ruff's default `exclude` folder names (ruff 0.17.6) that could name a subpackage: files
# under such a folder are not linted. Not allowed anywhere under engine/.
RUFF_EXCLUDED_NAMES = {"build", "dist", "_build", "buck-out", "node_modules", "site-packages", "venv",
                       "__pypackages__"}


def _setup_module():
    """setup.py as a module (setup() runs only under __main__): its package selection."""
    spec = importlib.util.spec_from_file_location("engine_setup_py", ROOT / "setup.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def unpackaged_folders(root: Path) -> list[str]:
    """Folders under root/engine holding .py files that setup.py's package selection (run on
    root) leaves out of the distribution, as 'engine/x/y' (sorted; empty when all ship)."""
    packages = set(_setup_module().engine_packages(root))
    left_out = set()
    for path in (root / "engine").rglob("*.py"):
        rel = path.parent.relative_to(root)
        if "__pycache__" in rel.parts:
            continue
        if ".".join(rel.parts) not in packages:
            left_out.add(rel.as_posix())
    return sorted(left_out)


def test_every_module_under_engine_is_in_a_packaged_package():
    assert (ROOT / "engine" / "__init__.py").is_file()
    assert unpackaged_folders(ROOT) == [], "add an __init__.py (setuptools skips folders without one)"


def test_the_package_check_catches_a_folder_without_init(tmp_path):
    (tmp_path / "engine" / "sub" / "newpkg").mkdir(parents=True)
    (tmp_path / "engine" / "__init__.py").write_text("")
    (tmp_path / "engine" / "core.py").write_text("")
    (tmp_path / "engine" / "sub" / "__init__.py").write_text("")
    (tmp_path / "engine" / "sub" / "newpkg" / "mod.py").write_text("X = 1\n")
    assert unpackaged_folders(tmp_path) == ["engine/sub/newpkg"]
    (tmp_path / "engine" / "sub" / "newpkg" / "__init__.py").write_text("")
    assert unpackaged_folders(tmp_path) == []


def test_setup_py_ships_the_op_sources_and_py_typed():
    setup = _setup_module()
    from engine.ops.builder import OP_SPECS

    needed = {rel for spec in OP_SPECS.values() for rel in spec.cpu_sources + spec.cuda_sources + spec.headers}
    assert needed <= set(setup.csrc_sources(ROOT))
    assert setup.CSRC_IN_WHEEL == ("engine", "ops", "csrc")  # where builder.csrc_root() looks first
    assert (ROOT / "engine" / "py.typed").is_file()
    # an sdist (python -m build builds the wheel from it) must carry csrc/ too
    assert "graft csrc" in (ROOT / "MANIFEST.in").read_text().splitlines()


def test_no_folder_under_engine_is_named_like_a_ruff_default_exclude():
    bad = [p.relative_to(ROOT).as_posix() for p in (ROOT / "engine").rglob("*")
           if p.is_dir() and p.name in RUFF_EXCLUDED_NAMES]
    assert bad == [], "ruff (and packagers, .gitignore templates) skip folders with these names"


def _git_py_files() -> set[str]:
    """.py files under engine/ that git tracks or would track (untracked, not ignored)."""
    if shutil.which("git") is None:
        pytest.skip("git is not installed")
    proc = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard", "--", "engine"],
                          cwd=ROOT, capture_output=True, text=True)
    if proc.returncode != 0:
        pytest.skip(f"not a git checkout ({proc.stderr.strip()})")
    return {f for f in proc.stdout.split("\0") if f.endswith(".py") and (ROOT / f).is_file()}


def ruff_read_files(root: Path) -> set[str]:
    """The .py files `ruff check engine` reads when run in root (its --show-files), as
    'engine/...' paths."""
    if importlib.util.find_spec("ruff") is None:
        pytest.skip("ruff is not installed (it is in setup.py's test extra)")
    proc = subprocess.run([sys.executable, "-m", "ruff", "check", "engine", "--show-files", "--no-cache"],
                          cwd=root, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    files = {Path(os.path.relpath(line.strip(), root)).as_posix() for line in proc.stdout.splitlines() if line.strip()}
    return {f for f in files if f.endswith(".py")}


def test_ruff_check_engine_reads_every_python_file():
    expected = _git_py_files()
    assert len(expected) > 100  # sanity: engine/ has well over 100 modules
    read = ruff_read_files(ROOT)
    assert sorted(expected - read) == [], "ruff check engine skips these files"
    assert sorted(read - expected) == []
    assert len(read) == len(expected)


def test_the_ruff_check_catches_a_skipped_folder(tmp_path):
    shutil.copy(ROOT / "ruff.toml", tmp_path / "ruff.toml")
    for rel in ("engine/__init__.py", "engine/ok/__init__.py", "engine/ok/mod.py", "engine/dist/__init__.py",
                "engine/dist/mod.py"):
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text("X = 1\n")
    assert ruff_read_files(tmp_path) == {"engine/__init__.py", "engine/ok/__init__.py", "engine/ok/mod.py"}
