"""Mirrors DeepSpeedExamples training/pipeline_parallelism/train.py (AlexNet on CIFAR-10 as a
PipelineModule trained with ``engine.train_batch()``), written here against the same API:
``deepspeed.add_config_arguments`` with ``--local_rank`` / ``-s`` / ``--pipeline-parallel-size``
/ ``--backend`` / ``--seed``, ``deepspeed.init_distributed(dist_backend=...)``,
``deepspeed.runtime.utils.set_random_seed``, ``PipelineModule(layers=..., loss_fn=..., num_stages=...,
partition_method=..., activation_checkpoint_interval=0)``, ``deepspeed.initialize(args=args,
model=net, model_parameters=..., training_data=trainset)`` and ``engine.train_batch()``.

Differences, each for CPU: random tensors of CIFAR-10's shapes ((3, 32, 32) images, 10
classes) instead of the torchvision download, and the AlexNet layer sequence at a smaller
width without its dropout layers (dropout draws a different mask on every engine's RNG
stream: the losses could not be compared).
"""

import argparse
import os

import _losslog
import deepspeed
import torch
import torch.nn as nn
from deepspeed.pipe import PipelineModule
from deepspeed.utils import RepeatingLoader  # noqa: F401 (imported by the original)


def get_args():
    parser = argparse.ArgumentParser(description="CIFAR")
    parser.add_argument("--local_rank", type=int, default=-1, help="local rank passed from distributed launcher")
    parser.add_argument("-s", "--steps", type=int, default=100, help="quit after this many steps")
    parser.add_argument("-p", "--pipeline-parallel-size", type=int, default=2, help="pipeline parallelism")
    parser.add_argument("--backend", type=str, default="nccl", help="distributed backend")
    parser.add_argument("--seed", type=int, default=1138, help="PRNG seed")
    parser.add_argument("--num_samples", type=int, default=256, help="random CIFAR-shaped samples")
    parser.add_argument("--loss_log_file", type=str, default=None)
    parser = deepspeed.add_config_arguments(parser)
    return parser.parse_args()


class AlexNet(nn.Module):
    """torchvision's AlexNet layer sequence (features, avgpool, classifier), narrower."""

    def __init__(self, num_classes=10, w=8):
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(3, w, kernel_size=11, stride=4, padding=5), nn.ReLU(inplace=True),
            nn.MaxPool2d(kernel_size=2, stride=2),
            nn.Conv2d(w, 2 * w, kernel_size=5, padding=2), nn.ReLU(inplace=True),
            nn.MaxPool2d(kernel_size=2, stride=2),
            nn.Conv2d(2 * w, 4 * w, kernel_size=3, padding=1), nn.ReLU(inplace=True),
            nn.Conv2d(4 * w, 4 * w, kernel_size=3, padding=1), nn.ReLU(inplace=True),
            nn.Conv2d(4 * w, 4 * w, kernel_size=3, padding=1), nn.ReLU(inplace=True),
            nn.MaxPool2d(kernel_size=2, stride=2))
        self.avgpool = nn.AdaptiveAvgPool2d((2, 2))
        self.classifier = nn.Sequential(
            nn.Linear(4 * w * 2 * 2, 64), nn.ReLU(inplace=True),
            nn.Linear(64, 64), nn.ReLU(inplace=True), nn.Linear(64, num_classes))


def join_layers(vision_model):
    return [*vision_model.features, vision_model.avgpool, lambda x: torch.flatten(x, 1), *vision_model.classifier]


class RandomCifar(torch.utils.data.Dataset):
    """CIFAR-10's shapes: a normalised (3, 32, 32) image and a label in [0, 10)."""

    def __init__(self, n, seed=0):
        g = torch.Generator().manual_seed(seed)
        self.x = torch.randn(n, 3, 32, 32, generator=g)
        self.y = torch.randint(0, 10, (n,), generator=g)

    def __len__(self):
        return len(self.x)

    def __getitem__(self, i):
        return self.x[i], self.y[i]


def train_pipe(args, part="parameters"):
    torch.manual_seed(args.seed)
    deepspeed.runtime.utils.set_random_seed(args.seed)
    net = AlexNet(num_classes=10)
    net = PipelineModule(layers=join_layers(net), loss_fn=torch.nn.CrossEntropyLoss(),
                         num_stages=args.pipeline_parallel_size, partition_method=part,
                         activation_checkpoint_interval=0)
    trainset = RandomCifar(args.num_samples)
    engine, _, _, _ = deepspeed.initialize(args=args, model=net,
                                           model_parameters=[p for p in net.parameters() if p.requires_grad],
                                           training_data=trainset)
    losses = []
    for _step in range(args.steps):
        loss = engine.train_batch()
        losses.append(loss.item())
    _losslog.write(args.loss_log_file, {"losses": losses, "lr": engine.get_lr()})


if __name__ == "__main__":
    args = get_args()
    deepspeed.init_distributed(dist_backend=args.backend)
    args.local_rank = int(os.environ["LOCAL_RANK"])
    train_pipe(args)
