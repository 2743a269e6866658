"""DeepSpeed's pipeline tutorial, in miniature: a PipelineModule of LayerSpecs with a tied
embedding / head (TiedLayerSpec with forward_fn), a plain callable, loss_fn, train_batch.

tests/distributed/test_pipeline_module.py trains these layers through engine.pipe (this
file with its deepspeed imports changed) and compares with one process; run as it is
under real DeepSpeed it wrote the pp2 / pp4 entries of tests/assets/ds_pipe_train_deepspeed.json:

    OMP_NUM_THREADS=1 torchrun --nproc_per_node 4 tests/assets/ds_pipe_train.py --out pp2.json
    OMP_NUM_THREADS=1 torchrun --nproc_per_node 8 tests/assets/ds_pipe_train.py --num_stages 4 --out pp4.json
"""

import argparse
import json

import torch
import torch.distributed as dist
import torch.nn as nn

import deepspeed
from deepspeed.pipe import LayerSpec, PipelineModule, TiedLayerSpec

V, H, BLOCKS, MICRO, GA, STEPS, LR = 16, 8, 6, 2, 4, 3, 1e-2


class Embed(nn.Module):
    def __init__(self, vocab, hidden, seed):
        super().__init__()
        g = torch.Generator().manual_seed(seed)  # the weights do not depend on the global RNG
        self.weight = nn.Parameter(torch.randn(vocab, hidden, generator=g) * 0.5)

    def forward(self, ids):
        return nn.functional.embedding(ids, self.weight)


class Block(nn.Module):
    def __init__(self, hidden, seed):
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        self.fc = nn.Linear(hidden, hidden)
        with torch.no_grad():
            self.fc.weight.copy_(torch.randn(hidden, hidden, generator=g) * 0.3)
            self.fc.bias.copy_(torch.randn(hidden, generator=g) * 0.1)

    def forward(self, x):
        return x + torch.tanh(self.fc(x))


def head(embed, x):
    return x @ embed.weight.t()  # (B, S, V): the tied embedding as the output projection


def scale(x):
    return x * 0.9


def loss_fn(logits, labels):
    return nn.functional.cross_entropy(logits.reshape(-1, V), labels.reshape(-1))


def specs():
    blocks = [LayerSpec(Block, H, 100 + i) for i in range(BLOCKS)]
    return [TiedLayerSpec("embed", Embed, V, H, 7), *blocks[:3], scale, *blocks[3:],
            TiedLayerSpec("embed", Embed, V, H, 7, forward_fn=head)]


def batch(step, m, dp_rank):
    g = torch.Generator().manual_seed(1000 * step + 10 * m + dp_rank)
    return torch.randint(0, V, (MICRO, 5), generator=g), torch.randint(0, V, (MICRO, 5), generator=g)


def config(stage):
    return {"train_micro_batch_size_per_gpu": MICRO, "gradient_accumulation_steps": GA, "gradient_clipping": 1.0,
            "optimizer": {"type": "AdamW", "params": {"lr": LR, "weight_decay": 0.01, "torch_adam": True}},
            "zero_optimization": {"stage": stage}, "steps_per_print": 1000}


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--local_rank", type=int, default=-1)
    parser.add_argument("--out", type=str, required=True)
    parser.add_argument("--num_stages", type=int, default=2)
    args = parser.parse_args()
    deepspeed.init_distributed(dist_backend="gloo")
    results = {}
    for stage in (0, 1):  # the ZeRO stages DeepSpeed's pipeline engine supports
        net = PipelineModule(layers=specs(), num_stages=args.num_stages, loss_fn=loss_fn,
                             partition_method="parameters")
        engine, _, _, _ = deepspeed.initialize(model=net, config=config(stage),
                                               model_parameters=[p for p in net.parameters() if p.requires_grad])
        dp_rank = dist.get_rank() % (dist.get_world_size() // args.num_stages)
        losses = [engine.train_batch(iter([batch(s, m, dp_rank) for m in range(GA)])).item() for s in range(STEPS)]
        results[str(stage)] = losses
    if dist.get_rank() == 0:
        with open(args.out, "w") as f:
            json.dump({"world_size": dist.get_world_size(), "num_stages": args.num_stages, "losses": results}, f)
    dist.barrier()


if __name__ == "__main__":
    main()
