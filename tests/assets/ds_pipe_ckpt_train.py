"""DeepSpeed's pipeline API with activation checkpointing, PP 2 x DP 1, ZeRO 0 and 1:

- ``partition_method="parameters"`` over linear layers that draw their weights from their
  own generator, with parameter-free layers (a callable, ``nn.Tanh``) where the cut must fall
  as DeepSpeed's ``partition_balanced`` puts it, ``activation_checkpoint_interval`` 1 and 2;
- ``partition_method="uniform"`` over plain ``nn.Linear`` LayerSpecs with ``seed_layers=True``
  (each layer seeded with base_seed + its index, DeepSpeed's rule, so a stage's weights do not
  depend on which layers the rank builds). (DeepSpeed 0.19.8's ``seed_layers`` crashes with
  ``parameters``: its ``partition_balanced`` returns numpy integers, which ``random.seed``
  refuses.)

Run as it is under real DeepSpeed it wrote tests/assets/ds_pipe_ckpt_train_deepspeed.json:

    OMP_NUM_THREADS=1 torchrun --nproc_per_node 2 tests/assets/ds_pipe_ckpt_train.py --out ds.json

tests/distributed/test_pipe_lazy_build.py runs it with its deepspeed imports changed to
engine.compat.deepspeed / engine.pipe and compares the losses.
"""

import argparse
import json

import torch
import torch.distributed as dist
import torch.nn as nn

import deepspeed
from deepspeed.pipe import LayerSpec, PipelineModule

H, OUT, MICRO, GA, STEPS, LR = 16, 4, 2, 2, 3, 1e-2
RUNS = {"zero0_interval1": (0, 1, "parameters"), "zero1_interval2": (1, 2, "parameters"),
        "zero1_interval1_seed_layers": (1, 1, "uniform")}


class SeededLinear(nn.Linear):
    def __init__(self, n_in, n_out, seed):
        super().__init__(n_in, n_out)
        g = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            self.weight.copy_(torch.randn(n_out, n_in, generator=g) * n_in ** -0.5)
            self.bias.copy_(torch.randn(n_out, generator=g) * 0.1)


def scale(x):
    return x * 0.5


def specs(seed_layers):
    def linear(i, n_out=H):
        return LayerSpec(nn.Linear, H, n_out) if seed_layers else LayerSpec(SeededLinear, H, n_out, 10 + i)

    return [linear(0), LayerSpec(nn.Tanh), linear(2), scale, linear(4), LayerSpec(nn.Tanh), linear(6),
            linear(7, OUT)]


def loss_fn(out, target):
    return ((out - target) ** 2).mean()


def batch(step, m):
    g = torch.Generator().manual_seed(1000 * step + m)
    return torch.randn(MICRO, H, generator=g), torch.randn(MICRO, OUT, generator=g)


def config(stage):
    return {"train_micro_batch_size_per_gpu": MICRO, "gradient_accumulation_steps": GA,
            "optimizer": {"type": "AdamW", "params": {"lr": LR, "weight_decay": 0.01, "torch_adam": True}},
            "zero_optimization": {"stage": stage}, "steps_per_print": 1000}


def net(interval, method):
    seed_layers = method == "uniform"
    return PipelineModule(layers=specs(seed_layers), num_stages=2, loss_fn=loss_fn, partition_method=method,
                          seed_layers=seed_layers, activation_checkpoint_interval=interval)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--local_rank", type=int, default=-1)
    parser.add_argument("--out", type=str, required=True)
    args = parser.parse_args()
    deepspeed.init_distributed(dist_backend="gloo")
    results = {}
    for name, (stage, interval, method) in RUNS.items():
        model = net(interval, method)
        engine, _, _, _ = deepspeed.initialize(model=model, config=config(stage),
                                               model_parameters=[p for p in model.parameters() if p.requires_grad])
        results[name] = [engine.train_batch(iter([batch(s, m) for m in range(GA)])).item() for s in range(STEPS)]
    if dist.get_rank() == 0:
        with open(args.out, "w") as f:
            json.dump({"source": "real DeepSpeed " + deepspeed.__version__ + " running tests/assets/ds_pipe_ckpt_train.py "
                       "under torchrun --nproc_per_node 2 (CPU, gloo)", "losses": results}, f, indent=1)
    dist.barrier()


if __name__ == "__main__":
    main()
