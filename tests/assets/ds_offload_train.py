"""A DeepSpeed-API training script for ZeRO-Offload, as a Hugging Face user would run one:
the config is the Hugging Face DeepSpeed integration's ZeRO-2 or ZeRO-3 offload example
(tests/assets/hf_ds_config_zero{2,3}_offload.json, its "auto" values filled as the Trainer
fills them), given with ``--deepspeed_config``; the optimizer and the LR schedule come from
the config (DeepSpeed steps its CPU Adam on the host).

tests/distributed/test_deepspeed_offload.py runs it under real DeepSpeed (on CPU) and, with
only the ``import deepspeed`` line changed to ``import engine.compat.deepspeed as deepspeed``,
under this engine, and compares the losses. Rank 0 writes every rank's losses and learning
rates as JSON to ``--out``.
"""

import argparse
import json

import torch
import torch.distributed as dist
import torch.nn as nn

import deepspeed

STEPS = 4


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(8, 16)
        self.norm = nn.LayerNorm(16)
        self.fc2 = nn.Linear(16, 4)

    def forward(self, x, y):
        return nn.functional.mse_loss(self.fc2(torch.tanh(self.norm(self.fc1(x)))), y)


def batch(step, micro, rank, size):
    g = torch.Generator().manual_seed(1000 * step + 10 * micro + rank)
    return torch.randn(size, 8, generator=g), torch.randn(size, 4, generator=g)


def main():
    parser = argparse.ArgumentParser(description="DeepSpeed ZeRO-Offload training")
    parser.add_argument("--local_rank", type=int, default=-1, help="passed by the deepspeed launcher")
    parser.add_argument("--out", type=str, required=True)
    parser = deepspeed.add_config_arguments(parser)
    args = parser.parse_args()

    deepspeed.init_distributed(dist_backend="gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(1234)
    model = Net()
    model_engine, _, _, _ = deepspeed.initialize(args=args, model=model, model_parameters=model.parameters())
    micro, ga = model_engine.train_micro_batch_size_per_gpu(), model_engine.gradient_accumulation_steps()
    losses, lrs = [], []
    for step in range(STEPS):
        for m in range(ga):
            loss = model_engine(*batch(step, m, rank, micro))
            model_engine.backward(loss)
            model_engine.step()
            losses.append(loss.item())
        lrs.append(model_engine.get_lr()[0])
    gathered = [None] * world
    dist.all_gather_object(gathered, {"losses": losses, "lrs": lrs})
    if rank == 0:
        with open(args.out, "w") as f:
            json.dump({"world_size": world, "ranks": gathered}, f)
    dist.barrier()


if __name__ == "__main__":
    main()
