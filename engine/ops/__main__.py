"""`python -m engine.ops`: report every op's state (like DeepSpeed's ds_report).

States: built (ahead of time, installed), jit-cached (a JIT build for these exact sources
and flags exists), jit-able (will be JIT-built on first use), unavailable (with the reason;
the PyTorch reference is used). Add --load to also build/load each op now.
"""

from __future__ import annotations

import sys

import torch

from engine.ops.builder import OP_SPECS, csrc_root, get_builder


def report(load: bool = False) -> str:
    from torch.utils.cpp_extension import CUDA_HOME, get_cxx_compiler, is_ninja_available

    lines = [
        f"torch {torch.__version__} (cuda {torch.version.cuda}), cuda available: {torch.cuda.is_available()}",
        f"c++ compiler: {get_cxx_compiler()}   ninja: {'yes' if is_ninja_available() else 'no'}   "
        f"CUDA_HOME: {CUDA_HOME}",
        f"sources: {csrc_root()}",
        "",
        f"{'op':<6} {'state':<12} {'loaded':<7} detail",
    ]
    for name in OP_SPECS:
        builder = get_builder(name)
        if load:
            builder.load()
        st = builder.status()
        isa = ""
        if st.loaded:
            isa = f" [cpu kernel: {getattr(torch.ops, builder.spec.namespace).cpu_isa()}]"
        lines.append(f"{name:<6} {st.state:<12} {'yes' if st.loaded else 'no':<7} {st.detail}{isa}")
        lines.append(f"{'':<6} {'':<12} {'':<7} {st.cuda}")
    return "\n".join(lines)


def main(argv: list[str]) -> int:
    if argv and argv[0] in ("-h", "--help"):
        sys.stdout.write("usage: python -m engine.ops [--load]\n\n" + (__doc__ or "") + "\n")
        return 0
    unknown = [a for a in argv if a != "--load"]
    if unknown:
        sys.stderr.write(f"unknown argument(s) {unknown}; usage: python -m engine.ops [--load]\n")
        return 2
    sys.stdout.write(report(load="--load" in argv) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
