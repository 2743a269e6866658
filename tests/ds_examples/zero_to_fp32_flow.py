"""Mirrors the ZeRO-to-fp32 flow of DeepSpeed's docs (deepspeed.utils.zero_to_fp32, "Getting
the fp32 weights after training", and DeepSpeed's tests/unit/checkpoint zero_to_fp32 cases with
their SimpleModel and random_dataloader), written here against the same API: train a model
with ZeRO (a frozen layer included), ``engine.save_checkpoint(save_dir)``, then, without the
engine, ``get_fp32_state_dict_from_zero_checkpoint(save_dir)``,
``convert_zero_checkpoint_to_fp32_state_dict(save_dir, output_dir)`` (read back from
``output_dir/pytorch_model.bin``), ``load_state_dict_from_zero_checkpoint(model, save_dir)`` and
the docs' command line ``python zero_to_fp32.py SAVE_DIR OUTPUT_DIR`` with the script that
``save_checkpoint`` leaves in the save directory, each loaded into a plain ``nn.Module`` and
evaluated on held-out batches.

Each rank records its training losses; rank 0 also the parameter names, the eval losses of
the three consolidated models and how far apart the three state dicts are.
"""

import argparse
import os
import subprocess
import sys

import _losslog
import deepspeed
import torch
import torch.nn as nn
from deepspeed.utils.zero_to_fp32 import (
    convert_zero_checkpoint_to_fp32_state_dict,
    get_fp32_state_dict_from_zero_checkpoint,
    load_state_dict_from_zero_checkpoint,
)

HIDDEN = 16


class SimpleModel(nn.Module):
    """DeepSpeed's unit-test SimpleModel: a stack of linears and cross-entropy over the
    hidden dimension as classes; here with a frozen first layer."""

    def __init__(self, hidden_dim, nlayers=2):
        super().__init__()
        self.frozen = nn.Linear(hidden_dim, hidden_dim)
        self.frozen.requires_grad_(False)
        self.linears = nn.ModuleList([nn.Linear(hidden_dim, hidden_dim) for _ in range(nlayers)])
        self.cross_entropy_loss = nn.CrossEntropyLoss()

    def forward(self, x, y):
        x = torch.tanh(self.frozen(x))
        for lin in self.linears:
            x = lin(x)
        return self.cross_entropy_loss(x, y)


def random_batches(n, batch, seed):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(batch, HIDDEN, generator=g), torch.randint(0, HIDDEN, (batch,), generator=g))
            for _ in range(n)]


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--local_rank", type=int, default=-1)
    parser.add_argument("--zero_stage", type=int, default=3)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--save_dir", type=str, required=True)
    parser.add_argument("--loss_log_file", type=str, default=None)
    parser = deepspeed.add_config_arguments(parser)
    args = parser.parse_args()
    deepspeed.init_distributed()
    rank = deepspeed.comm.get_rank()
    config = {"train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 1, "steps_per_print": 1000,
              "optimizer": {"type": "Adam", "params": {"lr": 0.01}},
              "zero_optimization": {"stage": args.zero_stage}}
    torch.manual_seed(0)
    model = SimpleModel(HIDDEN)
    engine, _, _, _ = deepspeed.initialize(args=args, model=model, config=config,
                                           model_parameters=[p for p in model.parameters() if p.requires_grad])
    losses = []
    for x, y in random_batches(args.steps, 4, seed=100 + rank):
        loss = engine(x.to(engine.device), y.to(engine.device))
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    engine.save_checkpoint(args.save_dir)
    deepspeed.comm.barrier()
    record = {"losses": losses}
    if rank == 0:
        held_out = random_batches(3, 8, seed=7)
        sd_get = get_fp32_state_dict_from_zero_checkpoint(args.save_dir)
        out_dir = os.path.join(args.save_dir, "fp32")
        convert_zero_checkpoint_to_fp32_state_dict(args.save_dir, out_dir)
        sd_file = torch.load(os.path.join(out_dir, "pytorch_model.bin"), map_location="cpu")
        loaded = load_state_dict_from_zero_checkpoint(SimpleModel(HIDDEN), args.save_dir)
        cli_dir = os.path.join(args.save_dir, "fp32_cli")
        subprocess.run([sys.executable, os.path.join(args.save_dir, "zero_to_fp32.py"), args.save_dir, cli_dir],
                       check=True)
        sd_cli = torch.load(os.path.join(cli_dir, "pytorch_model.bin"), map_location="cpu")
        record["names"] = sorted(sd_get)
        record["file_names"] = sorted(sd_file)
        sd_load = loaded.state_dict()
        record["max_diff"] = max(max((sd_get[k].float() - v.float()).abs().max().item() for k, v in sd.items())
                                 for sd in (sd_file, sd_load, sd_cli))
        evals = {}
        for what, sd in (("get", sd_get), ("file", sd_file), ("load", sd_load), ("cli", sd_cli)):
            plain = SimpleModel(HIDDEN)
            plain.load_state_dict(sd)
            with torch.no_grad():
                evals[what] = [plain(x, y).item() for x, y in held_out]
        record["eval_losses"] = evals
    _losslog.write(args.loss_log_file, record)
    deepspeed.comm.barrier()


if __name__ == "__main__":
    main()
