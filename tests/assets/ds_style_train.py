"""A training script written against DeepSpeed's documented API, as a user would write it.

tests/distributed/test_deepspeed_compat.py runs it under real DeepSpeed and, with only the
``import deepspeed`` line changed to ``import engine.compat.deepspeed as deepspeed``, under
this engine (torchrun and the deepspeed launcher), and compares the losses.

Its own optimizer (AdamW with decay / no-decay groups) and LambdaLR, no optimizer or
scheduler section; several ZeRO stages per launch (``--zero_stages``), each with a fresh
model: train, save a checkpoint, train on, load the checkpoint and train the same steps
again. Rank 0 writes every rank's losses and learning rates as JSON to ``--out``.
"""

import argparse
import json
import os

import torch
import torch.distributed as dist
import torch.nn as nn

import deepspeed

MICRO, GA, STEPS, SAVE_AT = 2, 2, 4, 2


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(8, 16)
        self.norm = nn.LayerNorm(16)
        self.fc2 = nn.Linear(16, 4)

    def forward(self, x, y):
        return nn.functional.mse_loss(self.fc2(torch.tanh(self.norm(self.fc1(x)))), y)


def batch(step, micro, rank):
    g = torch.Generator().manual_seed(1000 * step + 10 * micro + rank)
    return torch.randn(MICRO, 8, generator=g), torch.randn(MICRO, 4, generator=g)


def write_config(path, stage):
    cfg = {"train_micro_batch_size_per_gpu": MICRO, "gradient_accumulation_steps": GA, "gradient_clipping": 1.0,
           "zero_optimization": {"stage": stage, "stage3_gather_16bit_weights_on_model_save": True},
           "zero_allow_untested_optimizer": True, "steps_per_print": 1000}
    with open(path, "w") as f:
        json.dump(cfg, f)


def train_steps(model_engine, steps, rank):
    losses, lrs = [], []
    for step in steps:
        for m in range(GA):
            x, y = batch(step, m, rank)
            loss = model_engine(x, y)
            model_engine.backward(loss)
            model_engine.step()
            losses.append(loss.item())
        lrs.append(model_engine.get_lr()[0])
    return losses, lrs


def run_stage(args, stage, rank):
    config_path = os.path.join(args.workdir, f"ds_config_zero{stage}.json")
    if rank == 0:
        write_config(config_path, stage)
    dist.barrier()
    args.deepspeed_config = config_path

    torch.manual_seed(1234)
    model = Net()
    decay = [p for n, p in model.named_parameters() if n.endswith("weight") and "norm" not in n]
    no_decay = [p for n, p in model.named_parameters() if not (n.endswith("weight") and "norm" not in n)]
    optimizer = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1},
                                   {"params": no_decay, "weight_decay": 0.0}], lr=1e-2, betas=(0.9, 0.95))
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: min(1.0, (s + 1) / 3))
    model_engine, _, _, lr_scheduler = deepspeed.initialize(args=args, model=model,
                                                            model_parameters=model.parameters(),
                                                            optimizer=optimizer, lr_scheduler=scheduler)
    losses, lrs = train_steps(model_engine, range(SAVE_AT), rank)
    ckpt = os.path.join(args.workdir, f"ckpt_zero{stage}")
    model_engine.save_checkpoint(ckpt, tag="mid", client_state={"stage": stage})
    after, after_lrs = train_steps(model_engine, range(SAVE_AT, STEPS), rank)
    _, client_state = model_engine.load_checkpoint(ckpt, tag="mid")
    again, again_lrs = train_steps(model_engine, range(SAVE_AT, STEPS), rank)
    model_engine.save_16bit_model(args.workdir, f"model16_zero{stage}.bin")
    return {"losses": losses + after, "lrs": lrs + after_lrs, "resumed_losses": again, "resumed_lrs": again_lrs,
            "client_stage": client_state["stage"], "scheduler_lr": lr_scheduler.get_last_lr()[0]}


def main():
    parser = argparse.ArgumentParser(description="DeepSpeed-style training")
    parser.add_argument("--local_rank", type=int, default=-1, help="passed by the deepspeed launcher")
    parser.add_argument("--zero_stages", type=str, default="0,1,2,3")
    parser.add_argument("--workdir", type=str, required=True)
    parser.add_argument("--out", type=str, required=True)
    parser = deepspeed.add_config_arguments(parser)
    args = parser.parse_args()

    deepspeed.init_distributed(dist_backend="gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    results = {}
    for stage in [int(s) for s in args.zero_stages.split(",")]:
        mine = run_stage(args, stage, rank)
        gathered = [None] * world
        dist.all_gather_object(gathered, mine)
        results[str(stage)] = gathered
    if rank == 0:
        with open(args.out, "w") as f:
            json.dump({"world_size": world, "stages": results}, f)
    dist.barrier()


if __name__ == "__main__":
    main()
