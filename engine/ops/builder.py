"""Op builder: one `OpBuilder` per kernel family in csrc/ (adam, fp8).

A builder knows its sources and flags and gets the compiled library in one of two ways:

* ahead of time: `setup.py` calls :func:`ahead_of_time_extensions` and, when
  ``ENGINE_BUILD_OPS=1`` (read by :mod:`engine.distributed.env`), builds ``engine.ops._<name>_C``;
* just in time otherwise: ``torch.utils.cpp_extension.load`` with ninja, into a cache
  directory of our own keyed by a fingerprint of (sources, flags, torch, python), under
  an ``fcntl`` lock so concurrent ranks build once and all load the same library.

The libraries register ``torch.ops.engine_<name>.*`` through ``TORCH_LIBRARY`` (no
pybind11: the headers compile ~3x faster than ``torch/extension.h``). If anything is
missing (compiler, ninja, sources) or the build fails, :meth:`OpBuilder.load` logs ONE
line and returns False; callers then use the PyTorch reference. Importing this module
never compiles anything and never raises for a missing toolchain.

CPU flags: ``-O3 -fopenmp -fno-math-errno -fno-trapping-math -ffp-contract=off``. No
``-march=native`` (a cached or wheel-built library must run on any x86-64): the kernels
are compiled for AVX-512, AVX2 and baseline x86-64 through ``target`` attributes and the
best one is chosen at run time with ``__builtin_cpu_supports``. ``-ffp-contract=off`` keeps
every variant (and the CUDA kernel) rounding identically; ``-fno-trapping-math`` only lets
the vectorizer compute both sides of a select (it does not change any result).
"""

from __future__ import annotations

import fcntl
import hashlib
import importlib.util
import logging
import os
import re
import shutil
import sys
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional

import torch

from engine.distributed.env import OpBuildSettings, op_build_settings

__all__ = [
    "OpSpec",
    "OpStatus",
    "OpBuilder",
    "OP_SPECS",
    "get_builder",
    "load_op",
    "ahead_of_time_extensions",
    "csrc_root",
]

logger = logging.getLogger(__name__)

CPU_CFLAGS = ("-O3", "-fopenmp", "-fno-math-errno", "-fno-trapping-math", "-ffp-contract=off")
CPU_LDFLAGS = ("-fopenmp",)
# --fmad=false for the same reason as -ffp-contract=off on the CPU side.
CUDA_CFLAGS = ("-O3", "--fmad=false", "-lineinfo", "--expt-relaxed-constexpr", "-DENGINE_WITH_CUDA")


@dataclass(frozen=True)
class OpSpec:
    """Sources of one kernel family, relative to the csrc/ directory."""

    name: str
    cpu_sources: tuple[str, ...]
    cuda_sources: tuple[str, ...]
    headers: tuple[str, ...]  # not compiled on their own, but part of the fingerprint

    @property
    def namespace(self) -> str:
        return f"engine_{self.name}"

    @property
    def aot_module(self) -> str:
        return f"engine.ops._{self.name}_C"


OP_SPECS: dict[str, OpSpec] = {
    "adam": OpSpec(
        name="adam",
        cpu_sources=("adam/adam_ops.cpp", "adam/adam_cpu.cpp"),
        cuda_sources=("adam/adam_cuda_ops.cpp", "adam/adam_cuda.cu"),
        headers=("adam/adam_kernel.h", "common/engine_macros.h"),
    ),
    "fp8": OpSpec(
        name="fp8",
        cpu_sources=("fp8/fp8_ops.cpp", "fp8/fp8_cpu.cpp"),
        cuda_sources=("fp8/fp8_cuda_ops.cpp", "fp8/fp8_cuda.cu"),
        headers=("fp8/fp8_convert.h", "fp8/fp8_kernel.h", "common/engine_macros.h"),
    ),
}


@dataclass(frozen=True)
class OpStatus:
    """What the report prints for one op. `state` is built / jit-cached / jit-able / unavailable."""

    name: str
    state: str
    detail: str
    loaded: bool = False
    cuda: str = ""


def csrc_root() -> Path:
    """Where the kernel sources are: engine/ops/csrc/ in an installed wheel (setup.py copies
    csrc/ there), else csrc/ next to the engine package (a checkout or an editable install)."""
    here = Path(__file__).resolve().parent
    shipped = here / "csrc"
    return shipped if shipped.is_dir() else here.parents[1] / "csrc"


def _cuda_toolkit_problem() -> Optional[str]:
    """None when this torch can build and run CUDA kernels, else the reason it cannot."""
    if torch.version.cuda is None:
        return f"torch {torch.__version__} is built without CUDA"
    from torch.utils.cpp_extension import CUDA_HOME

    if CUDA_HOME is None or not (Path(CUDA_HOME) / "bin" / "nvcc").exists():
        return "nvcc not found (CUDA_HOME is not set and no nvcc on PATH)"
    return None


def _cuda_problem(cuda_arch_list: Optional[str]) -> Optional[str]:
    """None when the CUDA kernel should be built here, else why not: no toolkit, or no GPU
    visible and no TORCH_CUDA_ARCH_LIST (torch's arch detection then has nothing to compile
    for and fails: a CUDA build of torch on a CPU-only host builds the CPU kernel only)."""
    problem = _cuda_toolkit_problem()
    if problem is None and not cuda_arch_list and not torch.cuda.is_available():
        return "no GPU is visible and TORCH_CUDA_ARCH_LIST is unset: nothing to compile it for"
    return problem


# TORCH_CUDA_ARCH_LIST names, as torch's cpp_extension accepts them
NAMED_ARCHES = {"Volta": "7.0+PTX", "Turing": "7.5+PTX", "Ampere": "8.0;8.6+PTX", "Ada": "8.9+PTX",
                "Hopper": "9.0+PTX", "Blackwell": "10.0;10.3;12.0;12.1+PTX"}
_ARCH = re.compile(r"(\d+)\.(\d+)([af]?)")


def _arch_flags(cuda_arch_list: Optional[str]) -> list[str]:
    """'8.0;9.0a;Hopper;10.0+PTX' -> nvcc -gencode flags (None: let torch pick the visible
    GPUs' archs). ``9.0a`` / ``10.0a`` are the architecture-specific targets (Hopper's wgmma /
    TMA instructions); names expand as in torch (``Hopper`` = ``9.0+PTX``)."""
    if not cuda_arch_list:
        return []
    flags: list[str] = []
    entries = cuda_arch_list.replace(",", ";").replace(" ", ";").split(";")
    for arch in [e for name in entries for e in NAMED_ARCHES.get(name, name).split(";")]:
        if not arch:
            continue
        ptx = arch.endswith("+PTX")
        m = _ARCH.fullmatch(arch.removesuffix("+PTX"))
        if m is None:
            raise ValueError(f"TORCH_CUDA_ARCH_LIST entry {arch!r} is not like '9.0', '9.0a', '9.0+PTX' or one of "
                             f"{', '.join(NAMED_ARCHES)}")
        num = m.group(1) + m.group(2) + m.group(3)
        flag = f"-gencode=arch=compute_{num},code=sm_{num}"
        if flag not in flags:
            flags.append(flag)
        if ptx:
            flags.append(f"-gencode=arch=compute_{num},code=compute_{num}")
    return flags


def _visible_gpu_archs() -> str:
    """Compute capabilities of the visible GPUs ('' without CUDA): what torch compiles for
    when TORCH_CUDA_ARCH_LIST is unset, so it belongs in the cache key - a cache shared by
    nodes with different GPUs must not hand an sm_80 build to an H100."""
    if not torch.cuda.is_available():
        return ""
    caps = sorted({torch.cuda.get_device_capability(i) for i in range(torch.cuda.device_count())})
    return ";".join(f"{a}.{b}" for a, b in caps)


class OpBuilder:
    """Builds and loads one op family; see the module docstring."""

    def __init__(self, spec: OpSpec, settings: Optional[OpBuildSettings] = None,
                 root: Optional[Path] = None,
                 compile_fn: Optional[Callable[["OpBuilder", Path], None]] = None) -> None:
        self.spec = spec
        self.settings = settings if settings is not None else op_build_settings()
        self.root = Path(root) if root is not None else csrc_root()
        # Injectable for tests of the cache/lock logic; default compiles with torch.
        self._compile_fn = compile_fn if compile_fn is not None else _torch_jit_compile

    # ---- what to build ---------------------------------------------------------------
    def with_cuda(self) -> bool:
        return _cuda_problem(self.settings.cuda_arch_list) is None

    def cuda_problem(self) -> Optional[str]:
        """Why the CUDA kernel is not built here (no nvcc, a torch without CUDA, ...), or None."""
        return _cuda_problem(self.settings.cuda_arch_list)

    def sources(self, with_cuda: Optional[bool] = None) -> list[Path]:
        cuda = self.with_cuda() if with_cuda is None else with_cuda
        names = self.spec.cpu_sources + (self.spec.cuda_sources if cuda else ())
        return [self.root / s for s in names]

    def cflags(self, with_cuda: bool) -> list[str]:
        return list(CPU_CFLAGS) + (["-DENGINE_WITH_CUDA"] if with_cuda else [])

    def cuda_cflags(self) -> list[str]:
        return list(CUDA_CFLAGS) + _arch_flags(self.settings.cuda_arch_list)

    def fingerprint(self) -> str:
        """Hash of everything that changes the binary: sources, headers, flags, torch, python."""
        cuda = self.with_cuda()
        h = hashlib.sha256()
        for path in self.sources(cuda) + [self.root / p for p in self.spec.headers]:
            h.update(path.name.encode())
            h.update(path.read_bytes())
        h.update(" ".join(self.cflags(cuda) + list(CPU_LDFLAGS)).encode())
        if cuda:
            h.update(" ".join(self.cuda_cflags()).encode())
            if not self.settings.cuda_arch_list:
                h.update(f"gpus:{_visible_gpu_archs()}".encode())
        h.update(f"{torch.__version__}|{torch.version.cuda}|{sys.version_info[:3]}|{sys.platform}".encode())
        return h.hexdigest()[:16]

    def build_directory(self) -> Path:
        """<extensions_dir or ~/.cache/engine/torch_extensions>/<torch>-py<ver>/<name>-<fingerprint>."""
        base = (Path(self.settings.extensions_dir) if self.settings.extensions_dir
                else Path.home() / ".cache" / "engine" / "torch_extensions")
        tag = f"torch{torch.__version__}-py{sys.version_info[0]}{sys.version_info[1]}"
        return base / tag / f"{self.spec.name}-{self.fingerprint()}"

    @property
    def library_name(self) -> str:
        return f"engine_{self.spec.name}_{self.fingerprint()}"

    def jit_library_path(self) -> Path:
        return self.build_directory() / f"{self.library_name}.so"

    def aot_library_path(self) -> Optional[Path]:
        """The library setup.py built (ENGINE_BUILD_OPS=1), if installed."""
        try:
            spec = importlib.util.find_spec(self.spec.aot_module)
        except (ImportError, ValueError):
            return None
        return Path(spec.origin) if spec is not None and spec.origin else None

    def jit_problem(self) -> Optional[str]:
        """Why a JIT build is impossible here (None when it is possible)."""
        from torch.utils.cpp_extension import get_cxx_compiler, is_ninja_available

        missing = [str(p) for p in self.sources(False) if not p.exists()]
        if missing:
            return f"sources not found ({missing[0]}); JIT needs a source checkout or ENGINE_BUILD_OPS=1 at install"
        if shutil.which(get_cxx_compiler()) is None:
            return f"no C++ compiler ({get_cxx_compiler()!r} not on PATH)"
        if not is_ninja_available():
            return "ninja is not installed (pip install ninja)"
        return None

    # ---- loading ---------------------------------------------------------------------
    def is_loaded(self) -> bool:
        return _namespace_loaded(self.spec.namespace)

    def load(self) -> bool:
        """Load the op (AOT library, cached JIT build, or a fresh JIT build). Never raises."""
        if self.is_loaded():
            return True
        try:
            aot = self.aot_library_path()
            if aot is not None:
                torch.ops.load_library(str(aot))
            else:
                problem = self.jit_problem()
                if problem is not None:
                    logger.warning("engine.ops: fused %s op unavailable (%s); using the PyTorch reference",
                                   self.spec.name, problem)
                    return False
                self._jit_build_and_load()
        except Exception as exc:  # noqa: BLE001 - any build/load failure means "use the reference"
            logger.warning("engine.ops: fused %s op failed to build/load (%s: %s); using the PyTorch reference",
                           self.spec.name, type(exc).__name__, str(exc).strip().splitlines()[-1:] or "")
            return False
        return self.is_loaded()

    def _jit_build_and_load(self) -> None:
        build_dir = self.build_directory()
        build_dir.mkdir(parents=True, exist_ok=True)
        lib = self.jit_library_path()
        # flock is released by the kernel if the holder dies, so a crashed build never
        # leaves a stale lock (torch's own FileBaton would spin forever on one).
        with open(build_dir / "engine_build.lock", "w") as lock_file:
            fcntl.flock(lock_file, fcntl.LOCK_EX)
            try:
                if not lib.exists():
                    logger.info("engine.ops: JIT-building %s into %s (once per source/flag change)",
                                self.spec.name, build_dir)
                    self._compile_fn(self, build_dir)
                if not self.is_loaded():
                    torch.ops.load_library(str(lib))
            finally:
                fcntl.flock(lock_file, fcntl.LOCK_UN)

    def status(self) -> OpStatus:
        """For the report: does not build anything."""
        cuda_problem = _cuda_problem(self.settings.cuda_arch_list)
        cuda = "cuda kernel: will be built" if cuda_problem is None else f"cuda kernel: no ({cuda_problem})"
        loaded = self.is_loaded()
        aot = self.aot_library_path()
        if aot is not None:
            return OpStatus(self.spec.name, "built", f"ahead of time: {aot}", loaded, cuda)
        problem = self.jit_problem()
        if problem is not None:
            return OpStatus(self.spec.name, "unavailable", problem, loaded, cuda)
        if self.jit_library_path().exists():
            return OpStatus(self.spec.name, "jit-cached", f"cached build: {self.jit_library_path()}", loaded, cuda)
        return OpStatus(self.spec.name, "jit-able", f"will JIT-build into {self.build_directory()}", loaded, cuda)

    # ---- ahead of time ---------------------------------------------------------------
    def extension(self):
        """A setuptools Extension for setup.py (CUDAExtension when the toolkit is usable)."""
        from torch.utils.cpp_extension import CppExtension, CUDAExtension

        cuda = self.with_cuda()
        # setuptools wants paths relative to setup.py
        rel = [os.path.relpath(p, self.root.parent) for p in self.sources(cuda)]
        args = {"cxx": self.cflags(cuda)}
        if cuda:
            args["nvcc"] = self.cuda_cflags()
            return CUDAExtension(self.spec.aot_module, rel, extra_compile_args=args,
                                 extra_link_args=list(CPU_LDFLAGS))
        return CppExtension(self.spec.aot_module, rel, extra_compile_args=args,
                            extra_link_args=list(CPU_LDFLAGS))


def _torch_jit_compile(builder: OpBuilder, build_dir: Path) -> None:
    """Compile with torch.utils.cpp_extension (ninja) and leave the .so in build_dir."""
    from torch.utils.cpp_extension import load

    cuda = builder.with_cuda()
    load(
        name=builder.library_name,
        sources=[str(p) for p in builder.sources(cuda)],
        extra_cflags=builder.cflags(cuda),
        extra_cuda_cflags=builder.cuda_cflags() if cuda else None,
        extra_ldflags=list(CPU_LDFLAGS),
        build_directory=str(build_dir),
        with_cuda=cuda,
        is_python_module=False,  # loads it with torch.ops.load_library
        verbose=False,
    )


def _namespace_loaded(namespace: str) -> bool:
    # torch.ops.<ns> always exists as a lazy object; every library in csrc/ defines
    # `cpu_isa() -> str`, so resolving it tells whether the library is registered.
    try:
        _ = getattr(torch.ops, namespace).cpu_isa
    except (AttributeError, RuntimeError):
        return False
    return True


_LOCK = threading.Lock()
_ATTEMPTED: dict[str, bool] = {}  # name -> loaded; one attempt (and one log line) per process


def get_builder(name: str, settings: Optional[OpBuildSettings] = None) -> OpBuilder:
    if name not in OP_SPECS:
        raise KeyError(f"unknown op {name!r}; known ops: {sorted(OP_SPECS)}")
    return OpBuilder(OP_SPECS[name], settings)


def load_op(name: str) -> bool:
    """True when torch.ops.engine_<name> is usable; builds/loads at most once per process."""
    with _LOCK:
        if name not in _ATTEMPTED:
            _ATTEMPTED[name] = get_builder(name).load()
        return _ATTEMPTED[name]


def ahead_of_time_extensions(settings: Optional[OpBuildSettings] = None) -> tuple[list, dict]:
    """(ext_modules, cmdclass) for setup.py: empty unless ENGINE_BUILD_OPS=1."""
    settings = settings if settings is not None else op_build_settings()
    if not settings.build_ops:
        return [], {}
    from torch.utils.cpp_extension import BuildExtension

    exts = []
    for spec in OP_SPECS.values():
        builder = OpBuilder(spec, settings)
        problem = builder.jit_problem()
        if problem is not None and "ninja" not in problem:  # setuptools can build without ninja
            raise RuntimeError(f"ENGINE_BUILD_OPS=1 but op {spec.name!r} cannot be built: {problem}")
        exts.append(builder.extension())
    return exts, {"build_ext": BuildExtension.with_options(use_ninja=True)}

