"""PipelineModule's ``partition_method`` boundaries equal DeepSpeed 0.19.8's.

DeepSpeed's functions are called directly (``deepspeed.runtime.utils.partition_uniform`` /
``partition_balanced``, and its PipelineModule's own per-layer weights,
``_count_layer_params`` / ``_find_layer_type``, run on the same layer specs): a table of
weight lists (zero-parameter layers at the ends, in the middle, runs of them, ties, fewer
layers than pieces), a seeded random sweep, and layer lists with callables, tied layers and
class names for ``parameters``, ``uniform`` and ``type:<regex>``. Boundaries are integers:
exact equality. Skipped only where deepspeed is not installed (CI installs it).
"""

from __future__ import annotations

import random

import pytest
import torch.nn as nn

from engine.pipe import LayerSpec, PipelineModule, TiedLayerSpec
from engine.pipeline.partition import partition_balanced, partition_uniform

ds_utils = pytest.importorskip("deepspeed.runtime.utils")
ds_pipe = pytest.importorskip("deepspeed.runtime.pipe.module")

TABLE = [
    ([0, 100, 100, 100, 0], 2), ([0, 100, 100, 100, 0], 3), ([100, 0, 0, 100], 2), ([0, 0, 10, 10], 2),
    ([10, 0, 10, 0, 10, 0], 3), ([5, 5, 5, 5], 4), ([1, 2, 3], 3), ([1, 2], 4), ([0], 1), ([0, 0, 0, 0], 2),
    ([272, 272, 0, 544, 528, 272, 272, 272], 2), ([7, 0, 0, 0, 7], 2), ([100, 1, 1, 1, 1, 1, 1, 1, 1, 100], 4),
    ([3, 1, 4, 1, 5, 9, 2, 6, 5, 3, 5], 4),
]


def _ds(parts):
    return [int(p) for p in parts]


@pytest.mark.parametrize("weights,parts", TABLE)
def test_balanced_and_uniform_equal_deepspeeds_on_the_table(weights, parts):
    assert partition_balanced(weights, parts) == _ds(ds_utils.partition_balanced(weights, parts))
    assert partition_uniform(len(weights), parts) == _ds(ds_utils.partition_uniform(len(weights), parts))


def test_balanced_equals_deepspeeds_on_a_random_sweep():
    rng = random.Random(0)
    for _ in range(400):
        n, parts = rng.randint(1, 12), rng.randint(1, 5)
        weights = [rng.choice([0, 0, 1, 2, 64, rng.randint(0, 999)]) for _ in range(n)]
        assert partition_balanced(weights, parts) == _ds(ds_utils.partition_balanced(weights, parts)), (weights, parts)


class Embed(nn.Module):
    def __init__(self, v=10, h=4):
        super().__init__()
        self.weight = nn.Parameter(nn.init.normal_(nn.Parameter(nn.Linear(h, v).weight.detach())))

    def forward(self, x):
        return self.weight[x]


class TransformerBlock(nn.Module):
    def __init__(self, h=4, frozen=False):
        super().__init__()
        self.fc = nn.Linear(h, h)
        self.fc.bias.requires_grad_(not frozen)  # a frozen parameter is not counted

    def forward(self, x):
        return self.fc(x)


class Norm(nn.Module):  # zero parameters
    def forward(self, x):
        return x / x.norm()


def _double(x):
    return 2 * x


def _head(e, x):
    return x @ e.weight.t()


def _specs(api):
    """The same model in either API (ours: engine.pipe; DeepSpeed's: deepspeed.pipe)."""
    return [api.TiedLayerSpec("e", Embed), Norm(), api.LayerSpec(TransformerBlock), _double,
            api.LayerSpec(TransformerBlock, 4, True), api.LayerSpec(Norm), api.LayerSpec(TransformerBlock, 8),
            nn.ReLU(inplace=True), api.LayerSpec(TransformerBlock), api.TiedLayerSpec("e", Embed, forward_fn=_head)]


class _Ours:
    LayerSpec, TiedLayerSpec = LayerSpec, TiedLayerSpec


class _Theirs:
    LayerSpec, TiedLayerSpec = ds_pipe.LayerSpec, ds_pipe.TiedLayerSpec


class _DsModule:
    """DeepSpeed's PipelineModule's weighing methods on a layer list, without its process groups."""

    def __init__(self, specs):
        self._layer_specs = specs

    def parts(self, method, num_stages):  # DeepSpeed's _partition_layers, without the topology
        method = method.lower()
        if method == "uniform":
            return _ds(ds_utils.partition_uniform(len(self._layer_specs), num_stages))
        if method == "parameters":
            weights = ds_pipe.PipelineModule._count_layer_params(self)
        else:
            weights = [0] * len(self._layer_specs)
            for i in ds_pipe.PipelineModule._find_layer_type(self, method.split(":")[1]):
                weights[i] = 1
        return _ds(ds_utils.partition_balanced(weights, num_stages))


@pytest.mark.parametrize("method", ["parameters", "uniform", "type:transformer", "type:Norm|relu", "type:^norm$",
                                    "type:BLOCK"])
@pytest.mark.parametrize("stages", [2, 3, 4])
def test_pipeline_module_cuts_where_deepspeeds_does(method, stages):
    ours = PipelineModule(_specs(_Ours), num_stages=stages, partition_method=method)
    theirs = _DsModule(_specs(_Theirs))
    if method == "parameters":
        assert ours.layer_weights() == ds_pipe.PipelineModule._count_layer_params(theirs)
    assert ours.partition(stages) == theirs.parts(method, stages), (method, stages)
