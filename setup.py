"""Package `engine`: a 3D-parallel (DP x TP x PP) training engine on PyTorch.

Fused ops in csrc/ are JIT-built on first use by default. Set ENGINE_BUILD_OPS=1 to
build them ahead of time here (see engine/ops/). A wheel also carries csrc/'s sources as
engine/ops/csrc/, so an installed (non-editable) engine can JIT-build them too.

`engine_packages()` and `csrc_sources()` are what setup() packages; tests/unit/test_packaging.py
imports this file (setup() runs only when it is executed, as pip and `python setup.py` do).
"""

import os
from pathlib import Path

from setuptools import find_packages, setup
from setuptools.command.build_py import build_py

HERE = Path(__file__).resolve().parent

# Ranges that torch 2.13.0 (installed first, see .ci/run) satisfies, so pip never pulls
# another torch build. torch >= 2.11: the oldest torch the engine is tested on (the GPU
# image's; engine/torch_api.py holds the fallbacks for newer-only APIs and
# tests/distributed/test_older_torch.py runs a smoke subset with those APIs removed).
INSTALL_REQUIRES = ["torch>=2.11", "numpy", "sentencepiece", "tqdm", "safetensors"]
EXTRAS = {
    # accelerate: Hugging Face's Trainer runs DeepSpeed through it (tests/distributed/test_hf_trainer_ds.py);
    # >= 1.1 is what transformers 5 requires, < 2 the major release it was tested with (1.15)
    # pytest-xdist: pytest.ini runs the files on parallel workers (-n auto --dist loadfile)
    "test": ["pytest>=7", "pytest-timeout", "pytest-xdist>=3.2", "ninja", "transformers", "accelerate>=1.1.0,<2",
             "tensorboard", "ruff==0.17.6", "mypy==2.4.1"],
    "deepspeed": ["deepspeed"],
}

# What the distribution holds: every package under engine/ (a folder without __init__.py is
# NOT one, and its modules are silently left out of the wheel: the package test catches it).
PACKAGE_INCLUDE = ("engine", "engine.*")
# The fused ops' sources (relative to csrc/), copied into the wheel under CSRC_IN_WHEEL.
CSRC_SUFFIXES = (".cpp", ".cu", ".cuh", ".h")
CSRC_IN_WHEEL = ("engine", "ops", "csrc")  # engine/ops/builder.py:csrc_root() looks there first


def engine_packages(root: "str | os.PathLike[str]" = HERE) -> list:
    """The packages setup() installs, found under `root` (a checkout)."""
    return find_packages(where=str(root), include=list(PACKAGE_INCLUDE))


def csrc_sources(root: "str | os.PathLike[str]" = HERE) -> list:
    """csrc/'s kernel sources and headers, as paths relative to csrc/ (sorted)."""
    csrc = Path(root) / "csrc"
    return sorted(p.relative_to(csrc).as_posix() for p in csrc.rglob("*")
                  if p.is_file() and p.suffix in CSRC_SUFFIXES)


class BuildPyWithCsrc(build_py):
    """build_py that also copies csrc/'s sources into the package (engine/ops/csrc/): csrc/ lies
    outside engine/, so a wheel would otherwise have no sources to JIT-build the fused ops
    from. An editable install skips the copy (csrc_root() finds the checkout's csrc/)."""

    def run(self) -> None:
        super().run()
        if getattr(self, "editable_mode", False):
            return
        for rel in csrc_sources():
            target = os.path.join(self.build_lib, *CSRC_IN_WHEEL, *rel.split("/"))
            self.mkpath(os.path.dirname(target))
            self.copy_file(str(HERE / "csrc" / rel), target)


def _ext_modules_and_cmdclass():
    try:
        from engine.ops.builder import ahead_of_time_extensions  # type: ignore
    except Exception:  # noqa: BLE001 - the op builder is optional at install time
        return [], {}
    return ahead_of_time_extensions()


def main() -> None:
    ext_modules, cmdclass = _ext_modules_and_cmdclass()
    setup(
        name="engine",
        version="0.1.0",
        description="3D-parallel (DP x TP x PP) LLM training engine with ZeRO, in the DeepSpeed/Megatron tradition",
        packages=engine_packages(),
        python_requires=">=3.10",
        install_requires=INSTALL_REQUIRES,
        extras_require=EXTRAS,
        ext_modules=ext_modules,
        cmdclass={**cmdclass, "build_py": BuildPyWithCsrc},
        include_package_data=True,
        package_data={"engine": ["py.typed"]},
    )


if __name__ == "__main__":  # pip (setuptools.build_meta) and `python setup.py ...` run it as __main__
    main()
