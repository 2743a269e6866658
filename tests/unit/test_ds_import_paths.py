"""Every DeepSpeed public import path that DeepSpeed's docs and tutorials name resolves under
``engine.compat.deepspeed``, and under ``deepspeed`` after ``alias()``: either to a working
object, or to a refusal that names the feature and says why. Nothing is missing by accident.

The list: deepspeedai/DeepSpeed at edaa72212 (DeepSpeed 0.19.x), docs/ (``_tutorials``,
``_pages``, ``code-docs``), every ``from deepspeed... import ...``, ``import deepspeed...`` and
``deepspeed.a.b`` reference that names code, checked against the installed DeepSpeed 0.19.8
(the slow test below). Left out as not code: site links (``deepspeed.ai``, readthedocs),
file names (``deepspeed.py``, ``.sh``, ``.gif``), the pre-0.3 ``deepspeed.pt.*`` paths, the
``deepspeed.env_report`` CLI, and two typos in the docs that real DeepSpeed does not have
either (``deepspeed.com.log_summary``, ``deepspeed.checkpoint.get_cuda_rng_tracker``), and what
the docs (written against DeepSpeed's main branch) name but 0.19.8 does not have:
``runtime.fp16.onebit.*``, ``ops.sparse_attention.*``, ``compression.compress``,
``runtime.torch_autocast.has_autocast_dtype``, ``zero.unregister_external_parameter`` (the
package refuses or provides them all the same).
"""

from __future__ import annotations

import importlib
import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from harness import scaled

from engine.compat.deepspeed._unsupported import (
    UnsupportedAttributeError,
    UnsupportedFeatureError,
    UnsupportedModuleError,
    is_unsupported,
)

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = "engine.compat.deepspeed"

# paths that work with DeepSpeed's meaning (the first group is issue 31's list)
WORKING = [
    "deepspeed.accelerator.get_accelerator", "deepspeed.comm", "deepspeed.utils.RepeatingLoader",
    "deepspeed.utils.zero_to_fp32.get_fp32_state_dict_from_zero_checkpoint",
    "deepspeed.utils.zero_to_fp32.convert_zero_checkpoint_to_fp32_state_dict",
    "deepspeed.utils.zero_to_fp32.load_state_dict_from_zero_checkpoint",
    "deepspeed.runtime.utils.set_random_seed", "deepspeed.runtime.pipe.topology.PipeModelDataParallelTopology",
    "deepspeed.runtime.pipe.topology.ProcessTopology", "deepspeed.pipe", "deepspeed.ops.adam.FusedAdam",
    "deepspeed.ops.adam.DeepSpeedCPUAdam", "deepspeed.DeepSpeedConfig",
    # the docs and tutorials
    "deepspeed.initialize", "deepspeed.init_distributed", "deepspeed.add_config_arguments", "deepspeed.accelerator",
    "deepspeed.accelerator.set_accelerator", "deepspeed.comm.get_rank", "deepspeed.comm.init_distributed",
    "deepspeed.zero.Init", "deepspeed.zero.GatheredParameters", "deepspeed.utils", "deepspeed.utils.groups",
    "deepspeed.utils.logger", "deepspeed.log_dist", "deepspeed.runtime.config.DeepSpeedConfig",
    "deepspeed.runtime.utils.move_to_device", "deepspeed.runtime.zero", "deepspeed.pipe.PipelineModule",
    "deepspeed.pipe.LayerSpec", "deepspeed.pipe.TiedLayerSpec", "deepspeed.runtime.pipe.ProcessTopology",
    "deepspeed.runtime.pipe.engine", "deepspeed.runtime.lr_schedules.WarmupLR",
    "deepspeed.runtime.lr_schedules.WarmupDecayLR", "deepspeed.runtime.lr_schedules.WarmupCosineLR",
    "deepspeed.DeepSpeedEngine.forward", "deepspeed.DeepSpeedEngine.backward", "deepspeed.DeepSpeedEngine.step",
    "deepspeed.DeepSpeedEngine.is_gradient_accumulation_boundary", "deepspeed.DeepSpeedEngine.save_checkpoint",
    "deepspeed.DeepSpeedEngine.load_checkpoint", "deepspeed.DeepSpeedEngine.save_16bit_model",
    "deepspeed.DeepSpeedEngine.empty_partition_cache",
    # what Hugging Face's Trainer.save_model reaches through accelerate's get_state_dict
    "deepspeed.checkpoint.utils.clone_tensors_for_torch_save",
    "deepspeed.DeepSpeedEngine.zero_gather_16bit_weights_on_model_save",
    "deepspeed.DeepSpeedEngine._zero3_consolidated_16bit_state_dict",
    # the MoE layer and activation checkpointing (engine/compat/deepspeed/moe/, checkpointing.py)
    "deepspeed.moe.layer.MoE", "deepspeed.moe.utils.split_params_into_different_moe_groups_for_optimizer",
    "deepspeed.checkpointing", "deepspeed.checkpointing.configure", "deepspeed.checkpointing.is_configured",
    "deepspeed.checkpointing.checkpoint", "deepspeed.checkpointing.get_cuda_rng_tracker",
    "deepspeed.checkpointing.model_parallel_cuda_manual_seed", "deepspeed.checkpointing.reset",
    "deepspeed.checkpointing.CudaRNGStatesTracker", "deepspeed.checkpointing.CheckpointFunction",
    "deepspeed.runtime.activation_checkpointing.checkpointing",
]

# importable names that raise UnsupportedFeatureError (with the reason) when used, and modules
# whose import raises UnsupportedModuleError (with the reason)
REFUSED = [
    "deepspeed.init_inference", "deepspeed.tp_model_init", "deepspeed.InferenceEngine.forward",
    "deepspeed.DeepSpeedTransformerLayer", "deepspeed.DeepSpeedTransformerConfig", "deepspeed.comm.log_summary",
    "deepspeed.zero.TiledLinear", "deepspeed.zero.TiledLinearReturnBias", "deepspeed.utils.groups.initialize",
    "deepspeed.utils.safe_get_full_fp32_param", "deepspeed.utils.safe_get_full_grad",
    "deepspeed.utils.safe_get_full_optimizer_state", "deepspeed.utils.safe_get_local_fp32_param",
    "deepspeed.utils.safe_get_local_grad", "deepspeed.utils.safe_get_local_optimizer_state",
    "deepspeed.utils.safe_set_full_fp32_param", "deepspeed.utils.safe_set_full_grad",
    "deepspeed.utils.safe_set_full_optimizer_state", "deepspeed.utils.safe_set_local_fp32_param",
    "deepspeed.utils.safe_set_local_grad", "deepspeed.utils.safe_set_local_optimizer_state",
    "deepspeed.utils.safe_update_full_grad_vectorized", "deepspeed.utils.set_z3_leaf_modules",
    "deepspeed.utils.set_z3_leaf_modules_by_name", "deepspeed.utils.set_z3_leaf_modules_by_suffix",
    "deepspeed.runtime.zero.utils.is_zero_param",
    "deepspeed.runtime.zero.stage_1_and_2.estimate_zero2_model_states_mem_needs_all_live",
    "deepspeed.runtime.zero.stage_1_and_2.estimate_zero2_model_states_mem_needs_all_cold",
    "deepspeed.runtime.zero.stage3.estimate_zero3_model_states_mem_needs_all_live",
    "deepspeed.runtime.zero.stage3.estimate_zero3_model_states_mem_needs_all_cold",
    "deepspeed.runtime.zero.offload_states.get_state_devices", "deepspeed.runtime.zero.config.DeepSpeedZeroConfig",
    "deepspeed.runtime.zero.config.DeepSpeedZeroOffloadParamConfig",
    "deepspeed.runtime.zero.config.DeepSpeedZeroOffloadOptimizerConfig",
    "deepspeed.runtime.torch_autocast.init_autocast_params", "deepspeed.runtime.torch_autocast.is_autocast_initialized",
    "deepspeed.runtime.torch_autocast.get_default_autocast_lower_precision_modules",
    "deepspeed.runtime.lr_schedules.OneCycle", "deepspeed.runtime.lr_schedules.LRRangeTest",
    "deepspeed.runtime.data_pipeline.curriculum_scheduler",
    "deepspeed.runtime.pipe.schedule", "deepspeed.runtime.sequence_parallel.ulysses_sp.UlyssesSPAttentionHF",
    "deepspeed.runtime.sequence_parallel.ulysses_sp.UlyssesSPDataLoaderAdapter",
    "deepspeed.runtime.sequence_parallel.ulysses_sp.TiledMLP",
    "deepspeed.runtime.activation_checkpointing.offload_activations", "deepspeed.sequence.layer.DistributedAttention",
    "deepspeed.profiling.flops_profiler.get_model_profile", "deepspeed.profiling.flops_profiler.FlopsProfiler",
    "deepspeed.ops.op_builder.PinMemoryBuilder", "deepspeed.ops.op_builder.GDSBuilder",
    "deepspeed.ops.op_builder.AsyncIOBuilder", "deepspeed.ops.op_builder.builder.OpBuilder",
    "deepspeed.ops.deepspeed4science.DS4Sci_EvoformerAttention", "deepspeed.ops.lamb.FusedLamb",
    "deepspeed.monitor.monitor.MonitorMaster", "deepspeed.monitor.config.WandbConfig",
    "deepspeed.monitor.config.TensorBoardConfig", "deepspeed.monitor.config.CometConfig",
    "deepspeed.monitor.config.CSVConfig", "deepspeed.compile.passes.sp_compile.prepare_autosp_inputs",
    "deepspeed.inference.config.DeepSpeedInferenceConfig", "deepspeed.inference.config.DeepSpeedTPConfig",
    "deepspeed.inference.config.DeepSpeedMoEConfig", "deepspeed.inference.config.QuantizationConfig",
    "deepspeed.inference.config.InferenceCheckpointConfig",
    "deepspeed.checkpoint.deepspeed_checkpoint.DeepSpeedCheckpoint",
    "deepspeed.checkpoint.ds_to_universal", "deepspeed.autotuning.autotuner",
]

# engine methods DeepSpeed documents that raise NotImplementedError here, with the way to do it
REFUSED_ENGINE_METHODS = ["scale", "no_sync", "coalesce_grad_reduction"]

# ZeRO-3 external-parameter registration (engine/zero/external.py)
WORKING_WHEN_IMPLEMENTED = ["deepspeed.zero.register_external_parameter"]



def resolve(path: str, root: str = PACKAGE) -> Any:
    """The object ``path`` (``deepspeed.a.b.C``) names under ``root``: the longest importable
    module prefix, then attributes. Unsupported modules raise as they do on import."""
    parts = path.split(".")[1:]
    for end in range(len(parts), -1, -1):
        name = ".".join([root, *parts[:end]])
        try:
            obj = importlib.import_module(name)
        except UnsupportedModuleError:
            raise
        except ModuleNotFoundError as e:
            if e.name is None or not (name == e.name or name.startswith(e.name + ".")):
                raise  # a module that exists failed to import something else
            continue
        for attr in parts[end:]:
            if is_unsupported(obj):
                break  # a refused class: its attributes are refused with it
            obj = getattr(obj, attr)
        return obj
    raise AssertionError(f"{root} itself does not import")


def status(path: str, root: str = PACKAGE) -> str:
    """``"working"``, ``"refused: <message>"`` or ``"missing: <error>"``."""
    try:
        obj = resolve(path, root)
    except (UnsupportedModuleError, UnsupportedAttributeError) as e:
        return f"refused: {e}"
    except (ImportError, AttributeError) as e:
        return f"missing: {type(e).__name__}: {e}"
    if is_unsupported(obj):
        try:
            obj()
        except UnsupportedFeatureError as e:
            return f"refused: {e}"
        return "missing: a placeholder that did not raise"
    return "working"


def _refusal_is_explained(message: str) -> bool:
    # names the DeepSpeed path and gives a reason after it
    return message.startswith("refused: deepspeed.") and "not supported by this engine: " in message \
        and len(message.split("not supported by this engine: ", 1)[1]) > 20


@pytest.mark.parametrize("path", WORKING)
def test_working_path_resolves(path):
    assert status(path) == "working"


@pytest.mark.parametrize("path", REFUSED)
def test_refused_path_says_why(path):
    got = status(path)
    assert _refusal_is_explained(got), got


def test_refused_engine_methods_say_how():
    from engine.engine import Engine

    for name in REFUSED_ENGINE_METHODS:
        with pytest.raises(NotImplementedError, match="not (supported|needed)"):
            getattr(Engine, name)(None, *([None] if name == "scale" else []))


@pytest.mark.parametrize("path", WORKING_WHEN_IMPLEMENTED)
def test_zero3_external_parameter_paths_work(path):
    assert status(path) == "working"


_ALIAS_PROBE = """
import json, sys
sys.path[:0] = [{tests!r}, {tests_root!r}]
import test_ds_import_paths as t
from engine.compat.deepspeed import alias
alias()
import deepspeed, deepspeed.comm as dist
from deepspeed.accelerator import get_accelerator
from deepspeed.runtime.pipe.topology import PipeModelDataParallelTopology
import engine.compat.deepspeed as ours
paths = t.WORKING + t.REFUSED
out = {{p: (t.status(p, "deepspeed"), t.status(p)) for p in paths}}
same = all(sys.modules[n] is sys.modules["engine.compat.deepspeed" + n[len("deepspeed"):]]
           for n in sys.modules if n == "deepspeed" or n.startswith("deepspeed."))
print(json.dumps({{"statuses": out, "same": same, "is_ours": deepspeed is ours and dist is ours.comm,
                   "count": sum(n.startswith("deepspeed.") for n in sys.modules)}}))
"""


def _probe(code: str) -> dict:
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")
    proc = subprocess.run([sys.executable, "-c", code], cwd=str(ROOT), env=env, capture_output=True, text=True,
                          timeout=scaled(120))
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_alias_gives_the_engine_for_every_path():
    """After alias(): ``import deepspeed`` is this package, each ``deepspeed.X`` module is the
    same object as ``engine.compat.deepspeed.X``, and every listed path resolves as above."""
    res = _probe(_ALIAS_PROBE.format(tests=str(Path(__file__).parent), tests_root=str(ROOT / "tests")))
    assert res["is_ours"] and res["same"] and res["count"] > 20
    for path, (aliased, direct) in res["statuses"].items():
        assert aliased == direct.replace(PACKAGE, "deepspeed"), path
        assert aliased == "working" if path in WORKING else _refusal_is_explained(aliased), (path, aliased)


def test_alias_refuses_after_real_deepspeed_was_imported(monkeypatch):
    import types

    from engine.compat.deepspeed import alias

    monkeypatch.setitem(sys.modules, "deepspeed", types.ModuleType("deepspeed"))
    with pytest.raises(RuntimeError, match="real DeepSpeed package is already imported"):
        alias()


_REAL_PROBE = """
import json, sys
sys.path[:0] = [{tests!r}, {tests_root!r}]
import test_ds_import_paths as t
def real(p):
    try:
        t.resolve(p, "deepspeed")
        return "ok"
    except Exception as e:
        return f"{{type(e).__name__}}: {{e}}"
paths = t.WORKING + t.REFUSED + t.WORKING_WHEN_IMPLEMENTED
import deepspeed
top = [n for n in dir(deepspeed) if not n.startswith("_")]
print(json.dumps({{"paths": {{p: real(p) for p in paths}}, "top": top}}))
"""

# names at DeepSpeed's top level that are not its API: what its __init__ imports for itself
# (typing, the standard library, torch), its version-file modules and its Muon tagging constants
_NOT_API = {"Callable", "Dict", "Optional", "Tuple", "Union", "Optimizer", "argparse", "io", "json", "os", "torch",
            "pkg_version", "KV", "MLA_KV", "MLA_Q", "QUERY", "NOT_HEAD_BLOCKED", "git_version_info",
            "git_version_info_installed", "constants", "dist", "git_branch", "git_hash"}


@pytest.mark.slow
def test_every_listed_path_exists_in_real_deepspeed():
    """The list is DeepSpeed's: each path resolves in the installed DeepSpeed 0.19.8."""
    if importlib.util.find_spec("deepspeed") is None:  # not imported here: it takes over the "DeepSpeed" logger
        pytest.skip("DeepSpeed is not installed")
    res = _probe(_REAL_PROBE.format(tests=str(Path(__file__).parent), tests_root=str(ROOT / "tests")))
    bad = {p: r for p, r in res["paths"].items() if r != "ok"}
    assert not bad, bad
    # and every public name of DeepSpeed's top level is here, working or refused with the reason
    for name in sorted(set(res["top"]) - _NOT_API):
        got = status(f"deepspeed.{name}")
        assert got == "working" or _refusal_is_explained(got), (name, got)
