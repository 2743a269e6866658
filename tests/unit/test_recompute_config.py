"""The ``activation_checkpointing`` section: what it accepts, the policy it gives, and the
errors that name the key and the fix (docs/config.md)."""

from __future__ import annotations

import pytest

from engine.config import load_config
from engine.errors import ConfigError
from engine.models.recompute import RecomputePolicy, full_units, policy_from_config


def _cfg(ac=None, tp=1, sp=False, interval=0):
    c = {"train_batch_size": 2, "train_micro_batch_size_per_gpu": 1,
         "tensor_parallel": {"autotp_size": tp, "sequence_parallel": sp},
         "pipeline": {"activation_checkpoint_interval": interval},
         "model": {"vocab_size": 64, "hidden_size": 32, "num_layers": 4, "num_heads": 4, "seq_len": 16}}
    if ac is not None:
        c["activation_checkpointing"] = ac
    return load_config(c, world_size=tp * (2 // tp if tp <= 2 else 1))


def test_policies_from_config():
    assert policy_from_config(_cfg()) == RecomputePolicy()
    assert policy_from_config(_cfg({"granularity": "selective"})).modules == ("norm", "mlp_act")
    p = policy_from_config(_cfg({"granularity": "full", "method": "block", "num_layers": 2,
                                 "cpu_checkpointing": True}))
    assert (p.granularity, p.method, p.num_layers, p.cpu_checkpointing) == ("full", "block", 2, True)
    assert policy_from_config(_cfg(interval=2)) == RecomputePolicy("full", num_layers=2)
    assert policy_from_config(_cfg({"granularity": "full", "partition_activations": True}, tp=2)).partition_activations


def test_units():
    assert full_units(RecomputePolicy("full", num_layers=2), 1, 6) == [(1, 3, True), (3, 5, True), (5, 6, True)]
    assert full_units(RecomputePolicy("full", method="block", num_layers=2), 0, 4) == [
        (0, 1, True), (1, 2, True), (2, 4, False)]
    assert full_units(RecomputePolicy(), 0, 3) == [(0, 3, False)]


@pytest.mark.parametrize("ac,kw,match", [
    ({"granularity": "partial"}, {}, "granularity"),
    ({"granularity": "selective", "modules": ["mlp_gate"]}, {}, "'mlp_gate' is not a part"),
    ({"granularity": "full", "modules": ["norm"]}, {}, "modules names the parts"),
    ({"granularity": "selective", "num_layers": 2}, {}, "num_layers applies to granularity"),
    ({"granularity": "full", "method": "every"}, {}, "method"),
    ({"granularity": "full"}, {"interval": 1}, "both choose what to recompute"),
    ({"partition_activations": True}, {}, "nothing is fully recomputed"),
    ({"granularity": "full", "partition_activations": True}, {"tp": 2, "sp": True}, "already split"),
])
def test_errors_name_the_key(ac, kw, match):
    with pytest.raises(ConfigError, match=match):
        _cfg(ac, **kw)
