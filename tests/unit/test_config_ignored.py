"""The accept-and-ignore table (engine/config/ignored.py) is complete and honest.

- every field of the config schema is read by the engine (an attribute read outside the
  modules that parse the JSON into the schema) or listed in IGNORED_KEYS with a reason;
- no listed key is read (a key that starts to matter leaves the table);
- every listed key still loads, is reported in ``Config.ignored_keys`` (DeepSpeed's other
  spellings too), and is named once in a rank-0 warning.
"""

import ast
import dataclasses
import inspect
import logging
import pathlib

import engine.config.schema as schema
from engine.config import load_config
from engine.config.ignored import IGNORED_KEYS, ignored_keys_in, log_ignored_keys

ROOT = pathlib.Path(__file__).resolve().parents[2]
# the modules that turn JSON into the schema: their reads are defaults and validation, not use
PARSERS = {"engine/config/schema.py", "engine/config/sections.py", "engine/config/optim.py",
           "engine/config/monitor.py", "engine/config/ignored.py"}
# sections consumed whole (every field by name through to_dict() / dataclasses.fields())
WHOLE = {
    "FP8Config": "engine/precision/fp8.py fp8_recipe_from_config reads section.to_dict()",
    "WarmupLRParams": "engine/optim/lr_schedules.py passes every field by name",
    "WarmupDecayLRParams": "engine/optim/lr_schedules.py passes every field by name",
}
# schema class -> its JSON section (for IGNORED_KEYS paths)
SECTION = {"ZeroConfig": "zero_optimization.", "PipelineConfig": "pipeline.", "FP16Config": "fp16.",
           "ActivationCheckpointingConfig": "activation_checkpointing.", "CheckpointConfig": "checkpoint.",
           "Config": ""}


# attributes that share an ignored config key's name without reading the key: (file, name) -> why
SAME_NAME = {
    ("engine/pipe/module.py", "seed_layers"): "PipelineModule(seed_layers=) is DeepSpeed's constructor argument; "
                                              "the config's pipeline.seed_layers stays ignored",
}


def _attribute_reads() -> set[str]:
    """Names read as attributes (``x.name`` not called) in engine/ and launch/ outside PARSERS."""
    reads: set[str] = set()
    for path in [*ROOT.joinpath("engine").rglob("*.py"), *ROOT.joinpath("launch").rglob("*.py")]:
        rel = str(path.relative_to(ROOT))
        if rel in PARSERS:
            continue
        tree = ast.parse(path.read_text())
        called = {id(n.func) for n in ast.walk(tree) if isinstance(n, ast.Call)}
        reads |= {n.attr for n in ast.walk(tree) if isinstance(n, ast.Attribute) and id(n) not in called
                  and (rel, n.attr) not in SAME_NAME}
    return reads


def _schema_fields() -> list[tuple[str, str]]:
    return [(name, f.name) for name, cls in inspect.getmembers(schema, inspect.isclass)
            if dataclasses.is_dataclass(cls) and cls.__module__ == schema.__name__
            for f in dataclasses.fields(cls) if f.name != "ignored_keys"]


def test_every_schema_field_is_read_or_listed_and_no_listed_key_is_read():
    reads = _attribute_reads()
    unused, listed_but_read = [], []
    for cls, name in _schema_fields():
        if cls in WHOLE:
            continue
        key = SECTION.get(cls, "?") + name
        if key in IGNORED_KEYS:
            if name in reads:
                listed_but_read.append(key)
        elif name not in reads:
            unused.append(f"{cls}.{name}")
    assert not unused, (f"schema fields nothing in engine/ reads: {unused}; implement them or add them to "
                        f"IGNORED_KEYS in engine/config/ignored.py with the reason")
    assert not listed_but_read, f"keys listed as ignored but read by the engine: {listed_but_read}; unlist them"


def test_listed_keys_name_real_keys_with_reasons():
    zero = {f.name for f in dataclasses.fields(schema.ZeroConfig)} | {"leaf_module"}
    for key, reason in IGNORED_KEYS.items():
        assert len(reason) > 15, key
        if key.startswith("zero_optimization."):
            assert key.split(".", 1)[1] in zero, key


def _config_with_every_ignored_key() -> dict:
    cfg: dict = {"train_batch_size": 2, "train_micro_batch_size_per_gpu": 2,
                 "zero_optimization": {"stage": 1, "contiguous_gradients": False, "reduce_scatter": False,
                                       "leaf_module": {"classes": ["Block"]}},
                 "fp16": {"enabled": False, "auto_cast": False},
                 "pipeline": {"seed_layers": True, "pipe_partitioned": False},
                 "activation_checkpointing": {"profile": True, "number_checkpoints": 4},
                 "checkpoint": {"parallel_write": {"pipeline_stage": True}},
                 "zero_allow_untested_optimizer": True}
    return cfg


def test_listed_keys_load_and_are_reported_once_on_rank_0(caplog):
    cfg = load_config(_config_with_every_ignored_key(), world_size=1)
    assert cfg.ignored_keys == (
        "zero_allow_untested_optimizer", "fp16.auto_cast", "zero_optimization.contiguous_gradients",
        "zero_optimization.reduce_scatter", "zero_optimization.leaf_module", "activation_checkpointing.number_checkpoints",
        "activation_checkpointing.profile", "pipeline.seed_layers", "pipeline.pipe_partitioned",
        "checkpoint.parallel_write")
    assert not cfg.zero.contiguous_gradients  # still validated and written back
    assert load_config({"train_batch_size": 2}, world_size=1).ignored_keys == ()
    assert cfg == load_config(cfg.to_dict(), world_size=1)  # not part of the config's value
    log = logging.getLogger("test.ignored")
    with caplog.at_level(logging.WARNING, logger="test.ignored"):
        log_ignored_keys(cfg.ignored_keys, 1, log)
        assert not caplog.records
        log_ignored_keys(cfg.ignored_keys, 0, log)
    assert len(caplog.records) == 1
    text = caplog.records[0].getMessage()
    assert "10 config key(s)" in text and "no effect" in text
    assert f"zero_optimization.reduce_scatter: {IGNORED_KEYS['zero_optimization.reduce_scatter']}" in text


def test_null_values_are_not_reported():
    assert ignored_keys_in({"zero_optimization": {"leaf_module": None, "sub_group_size": 5}}) == \
        ("zero_optimization.sub_group_size",)
