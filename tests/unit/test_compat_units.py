"""Pure pieces of the DeepSpeed surface: argument parsing, the config without an optimizer
section, the client-group mapping and scheduler bridge, PipelineModule partitioning."""

from __future__ import annotations

import argparse

import pytest
import torch
import torch.nn as nn

import engine
import engine.compat.deepspeed as deepspeed
from engine.config import ConfigError, load_config
from engine.optim.client import ClientLRScheduler, param_groups_from_client
from engine.pipe import LayerSpec, PipelineModule, TiedLayerSpec


def test_add_config_arguments_is_deepspeeds():
    p = deepspeed.add_config_arguments(argparse.ArgumentParser())
    a = p.parse_args(["--deepspeed", "--deepspeed_config", "ds.json"])
    assert a.deepspeed and a.deepspeed_config == "ds.json" and not a.deepscale and a.deepscale_config is None
    assert engine.add_config_arguments is deepspeed.add_config_arguments
    assert engine.init_distributed is deepspeed.init_distributed


def test_init_distributed_refuses_a_manual_rendezvous():
    with pytest.raises(ValueError, match="init_method"):
        deepspeed.init_distributed(init_method="tcp://127.0.0.1:1234", rank=0, world_size=1)
    with pytest.raises(ValueError, match="dist_backend 'mpi'"):
        deepspeed.init_distributed(dist_backend="mpi")


def test_config_without_optimizer_section_round_trips():
    cfg = load_config({"train_batch_size": 4, "tensorboard": {"enabled": True, "output_path": "tb"}}, world_size=2)
    assert cfg.optimizer is None and cfg.monitor.tensorboard.enabled
    assert cfg.monitor.tensorboard.job_name == "DeepSpeedJobName"
    d = cfg.to_dict()
    assert "optimizer" not in d and d["tensorboard"]["output_path"] == "tb"
    assert load_config(d, world_size=2) == cfg
    with pytest.raises(ConfigError, match="tensorboard.enable"):
        load_config({"train_batch_size": 4, "tensorboard": {"enable": True}}, world_size=2)


def _groups_model():
    m = nn.Sequential(nn.Linear(3, 4), nn.LayerNorm(4))
    opt = torch.optim.AdamW([{"params": [m[0].weight], "weight_decay": 0.1},
                             {"params": [m[0].bias, m[1].weight, m[1].bias], "weight_decay": 0.0, "lr": 5e-3}],
                            lr=1e-2)
    return m, opt


def test_param_groups_from_client_keeps_groups_options_and_maps_replaced_params():
    m, opt = _groups_model()
    groups = param_groups_from_client(opt, m.parameters())
    assert [len(g["params"]) for g in groups] == [1, 3]
    assert groups[0]["weight_decay"] == 0.1 and groups[1]["lr"] == 5e-3 and groups[0]["lr"] == 1e-2
    copy = nn.Parameter(m[0].weight.detach().clone())  # e.g. the last stage's copy of a tied weight
    mine = [copy] + list(m.parameters())[1:]
    groups = param_groups_from_client(opt, mine, {id(m[0].weight): copy})
    assert groups[0]["params"][0] is copy
    with pytest.raises(ValueError, match="in none of the client optimizer's param groups"):
        param_groups_from_client(opt, list(m.parameters()) + [nn.Parameter(torch.zeros(2))])


def test_client_scheduler_drives_the_inner_optimizer_groups():
    m, opt = _groups_model()
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 0.5 ** s)
    # the inner optimizer splits client group 1 in two flat groups (group_of maps them back)
    inner = torch.optim.AdamW([{"params": [torch.zeros(2, requires_grad=True)]} for _ in range(3)], lr=1.0)
    bridge = ClientLRScheduler(sched, opt, inner, [0, 1, 1])
    assert [g["lr"] for g in inner.param_groups] == [1e-2, 5e-3, 5e-3]
    bridge.step()
    assert [g["lr"] for g in inner.param_groups] == [5e-3, 2.5e-3, 2.5e-3]
    assert bridge.get_last_lr() == sched.get_last_lr() and bridge.last_epoch == 1
    state = bridge.state_dict()
    bridge.step()
    bridge.load_state_dict(state)
    assert [g["lr"] for g in inner.param_groups] == [5e-3, 2.5e-3, 2.5e-3]


class Emb(nn.Module):
    def __init__(self):
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(10, 4))

    def forward(self, x):
        return self.weight[x]


class Block(nn.Module):
    def __init__(self, width=4):
        super().__init__()
        self.fc = nn.Linear(width, width)

    def forward(self, x):
        return self.fc(x)


def _layers():
    return [TiedLayerSpec("e", Emb), LayerSpec(Block), LayerSpec(Block), lambda x: x * 2, LayerSpec(Block),
            LayerSpec(Block, 4), TiedLayerSpec("e", Emb, forward_fn=lambda e, x: x @ e.weight.t())]


def test_pipeline_module_partition_methods_and_ties():
    pm = PipelineModule(_layers(), num_stages=2, partition_method="type:block")
    assert pm.layer_weights() == [0, 1, 1, 0, 1, 1, 0] and pm.partition(2) in ([0, 3, 7], [0, 4, 7])
    pm = PipelineModule(_layers(), num_stages=2, partition_method="uniform")
    assert pm.layer_weights() == [1] * 7
    pm = PipelineModule(_layers(), num_stages=2)  # parameters: the tied module counts where it appears
    assert pm.layer_weights() == [40, 20, 20, 0, 20, 20, 40]
    # the whole model's layers are asked on the meta device (initialize's config checks: every rank the same)
    assert pm.any_layer(lambda m: isinstance(m, Block)) and not pm.any_layer(lambda m: isinstance(m, nn.Conv1d))
    assert list(pm.parameters()) == []  # no process group: nothing is built until a stage is known ...
    assert pm(torch.tensor([[1, 2]])).shape == (1, 2, 10)  # ... or a one-process forward builds it all
    assert pm.layers[0] is pm.layers[-1].tied  # one module per key
    with pytest.raises(ConfigError, match="matches no layer"):
        PipelineModule(_layers(), num_stages=2, partition_method="type:attention").layer_weights()
    with pytest.raises(ValueError, match="partition_method 'profile'"):
        PipelineModule(_layers(), num_stages=2, partition_method="profile")
    with pytest.raises(ValueError, match="num_stages"):
        PipelineModule(_layers())
