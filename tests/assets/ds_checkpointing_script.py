"""A Megatron-DeepSpeed-style model that checkpoints its layers with
``deepspeed.checkpointing`` (configure with an mpu, model_parallel_cuda_manual_seed, dropout
under the tracker's fork inside checkpointed layers, checkpoint with a keyword argument).

``run(out_path, partition, cpu)``: 4 SGD steps of a tiny replicated MLP stack on the given
ranks (every rank the same data; the TP group is the whole world); writes the per-step
losses and the final weights' checksum to ``out_path`` (torch.save). The test runs it with
``import deepspeed`` and with only that line changed (tests/distributed/test_ds_checkpointing.py).
"""

import torch
import torch.distributed as dist
import torch.nn as nn

import deepspeed


class Mpu:
    """Megatron's model-parallel unit: the whole world is one TP group."""

    def get_tensor_model_parallel_rank(self):
        return dist.get_rank()

    def get_tensor_model_parallel_world_size(self):
        return dist.get_world_size()

    def get_tensor_model_parallel_group(self):
        return dist.group.WORLD

    def get_data_parallel_rank(self):
        return 0


class Layer(nn.Module):
    def __init__(self, h):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(h, 2 * h), nn.Linear(2 * h, h)

    def forward(self, x, scale=1.0):
        y = torch.nn.functional.gelu(self.fc1(x))
        with deepspeed.checkpointing.get_cuda_rng_tracker().fork():
            y = torch.nn.functional.dropout(y, p=0.3, training=True)  # TP-region dropout
        y = torch.nn.functional.dropout(self.fc2(y), p=0.1, training=True)  # default generator
        return x + scale * y


class Model(nn.Module):
    def __init__(self, h=16, n=3):
        super().__init__()
        self.layers = nn.ModuleList(Layer(h) for _ in range(n))

    def forward(self, x):
        for layer in self.layers:
            x = deepspeed.checkpointing.checkpoint(layer, x, scale=0.5)
        return x.pow(2).mean()


def run(out_path, partition, cpu):
    deepspeed.checkpointing.configure(Mpu(), partition_activations=partition, checkpoint_in_cpu=cpu)
    assert deepspeed.checkpointing.is_configured()
    torch.manual_seed(0)
    model = Model()
    deepspeed.checkpointing.model_parallel_cuda_manual_seed(1234)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    data = torch.randn(4, 8, 16, generator=torch.Generator().manual_seed(5))
    losses = []
    for step in range(4):
        x = data[step].clone().requires_grad_(True)  # requires grad: DeepSpeed's reentrant checkpoint needs one
        loss = model(x)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.detach())
    deepspeed.checkpointing.reset()
    torch.save({"losses": torch.stack(losses), "weights": [p.detach().clone() for p in model.parameters()]},
               out_path)
