"""Fused ops (csrc/) with their PyTorch references; `python -m engine.ops` prints a report.

Importing this package never compiles anything: each op is built or loaded on first use,
and if that fails (no compiler, no ninja, no CUDA toolkit) the op logs one line and the
PyTorch reference is used instead.
"""

from engine.ops.adam import AdamWHyper, adamw_reference, adamw_step, fused_adamw_available
from engine.ops.builder import OP_SPECS, OpBuilder, OpStatus, ahead_of_time_extensions, get_builder, load_op
from engine.ops.fp8 import FP8_DTYPES, fp8_cast, fp8_cast_kernel, fp8_cast_reference, fp8_kernel_available, fp8_max

__all__ = [
    "OP_SPECS",
    "OpBuilder",
    "OpStatus",
    "ahead_of_time_extensions",
    "get_builder",
    "load_op",
    "FP8_DTYPES",
    "fp8_cast",
    "fp8_cast_kernel",
    "fp8_cast_reference",
    "fp8_kernel_available",
    "fp8_max",
    "AdamWHyper",
    "adamw_reference",
    "adamw_step",
    "fused_adamw_available",
]
