"""Package `engine`: a 3D-parallel (DP x TP x PP) training engine on PyTorch.

Fused ops in csrc/ are JIT-built on first use by default. Set ENGINE_BUILD_OPS=1 to
build them ahead of time here (see engine/ops/).
"""

from setuptools import find_packages, setup

# Ranges that torch 2.13.0 (installed first, see .ci/run) satisfies, so pip never pulls
# another torch build.
INSTALL_REQUIRES = ["torch>=2.4", "numpy", "sentencepiece", "tqdm", "safetensors"]
EXTRAS = {
    "test": ["pytest>=7", "pytest-timeout", "ninja", "transformers", "tensorboard", "ruff==0.17.6", "mypy==2.4.1"],
    "deepspeed": ["deepspeed"],
}


def _ext_modules_and_cmdclass():
    try:
        from engine.ops.builder import ahead_of_time_extensions  # type: ignore
    except Exception:  # noqa: BLE001 - the op builder is optional at install time
        return [], {}
    return ahead_of_time_extensions()


ext_modules, cmdclass = _ext_modules_and_cmdclass()

setup(
    name="engine",
    version="0.1.0",
    description="3D-parallel (DP x TP x PP) LLM training engine with ZeRO, in the DeepSpeed/Megatron tradition",
    packages=find_packages(include=["engine", "engine.*"]),
    python_requires=">=3.10",
    install_requires=INSTALL_REQUIRES,
    extras_require=EXTRAS,
    ext_modules=ext_modules,
    cmdclass=cmdclass,
    include_package_data=True,
    package_data={"engine": ["py.typed"]},
)
