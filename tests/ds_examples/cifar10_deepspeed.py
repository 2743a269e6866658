"""Mirrors DeepSpeedExamples training/cifar/cifar10_deepspeed.py (the CIFAR-10 getting-started
tutorial), written here against the same API: ``deepspeed.add_config_arguments`` with
``--local_rank`` / ``--epochs`` / ``--dtype`` / ``--stage`` / ``--log-interval``,
``deepspeed.init_distributed()``, the tutorial's config dict (Adam, WarmupLR, gradient
clipping, ``prescale_gradients``, ``bf16`` / ``fp16`` switches, a ``zero_optimization`` section
with its bucket and overlap keys and the deprecated ``cpu_offload``), ``deepspeed.initialize(
args=args, model=net, model_parameters=parameters, training_data=trainset, config=ds_config)``
and its data loader, ``get_accelerator().device_name(model_engine.local_rank)``,
``model_engine(inputs)``, ``model_engine.backward(loss)``, ``model_engine.step()``, then the
tutorial's test pass under ``torch.no_grad()``.

Differences, each for CPU: random tensors of CIFAR-10's shapes (``--num_samples`` of them)
instead of the torchvision download; the MoE variant (``--moe``) is left out; ``--max_steps``
ends the epoch early.
"""

import argparse

import _losslog
import deepspeed
import torch
import torch.nn as nn
import torch.nn.functional as F
from deepspeed.accelerator import get_accelerator


def add_argument():
    parser = argparse.ArgumentParser(description="CIFAR")
    parser.add_argument("--local_rank", type=int, default=-1, help="local rank passed from distributed launcher")
    parser.add_argument("-e", "--epochs", default=30, type=int, help="number of total epochs (default: 30)")
    parser.add_argument("--log-interval", type=int, default=2000, help="output logging information at a given interval")
    parser.add_argument("--dtype", default="fp16", type=str, choices=["bf16", "fp16", "fp32"],
                        help="Datatype used for training")
    parser.add_argument("--stage", default=0, type=int, choices=[0, 1, 2, 3], help="ZeRO optimization stage")
    parser.add_argument("--num_samples", type=int, default=50000)
    parser.add_argument("--max_steps", type=int, default=-1)
    parser.add_argument("--loss_log_file", type=str, default=None)
    parser = deepspeed.add_config_arguments(parser)
    return parser.parse_args()


class RandomCifar(torch.utils.data.Dataset):
    def __init__(self, n, seed):
        g = torch.Generator().manual_seed(seed)
        self.x = torch.randn(n, 3, 32, 32, generator=g)
        self.y = torch.randint(0, 10, (n,), generator=g)

    def __len__(self):
        return len(self.x)

    def __getitem__(self, i):
        return self.x[i], self.y[i]


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv1 = nn.Conv2d(3, 6, 5)
        self.pool = nn.MaxPool2d(2, 2)
        self.conv2 = nn.Conv2d(6, 16, 5)
        self.fc1 = nn.Linear(16 * 5 * 5, 120)
        self.fc2 = nn.Linear(120, 84)
        self.fc3 = nn.Linear(84, 10)

    def forward(self, x):
        x = self.pool(F.relu(self.conv1(x)))
        x = self.pool(F.relu(self.conv2(x)))
        x = x.view(-1, 16 * 5 * 5)
        x = F.relu(self.fc1(x))
        x = F.relu(self.fc2(x))
        return self.fc3(x)


def get_ds_config(args):
    return {
        "train_batch_size": 16,
        "steps_per_print": 2000,
        "optimizer": {"type": "Adam", "params": {"lr": 0.001, "betas": [0.8, 0.999], "eps": 1e-8,
                                                 "weight_decay": 3e-7}},
        "scheduler": {"type": "WarmupLR", "params": {"warmup_min_lr": 0, "warmup_max_lr": 0.001,
                                                     "warmup_num_steps": 1000}},
        "gradient_clipping": 1.0,
        "prescale_gradients": False,
        "bf16": {"enabled": args.dtype == "bf16"},
        "fp16": {"enabled": args.dtype == "fp16", "fp16_master_weights_and_grads": False, "loss_scale": 0,
                 "loss_scale_window": 500, "hysteresis": 2, "min_loss_scale": 1, "initial_scale_power": 15},
        "wall_clock_breakdown": False,
        "zero_optimization": {"stage": args.stage, "allgather_partitions": True, "reduce_scatter": True,
                              "allgather_bucket_size": 50000000, "reduce_bucket_size": 50000000,
                              "overlap_comm": True, "contiguous_gradients": True, "cpu_offload": False},
    }


def test(model_engine, testset, local_device, target_dtype):
    testloader = torch.utils.data.DataLoader(testset, batch_size=4, shuffle=False, num_workers=0)
    correct, total, losses = 0, 0, []
    model_engine.eval()
    with torch.no_grad():
        for images, labels in testloader:
            if target_dtype is not None:
                images = images.to(target_dtype)
            outputs = model_engine(images.to(local_device))
            losses.append(F.cross_entropy(outputs.float(), labels.to(local_device)).item())
            _, predicted = torch.max(outputs.data, 1)
            total += labels.size(0)
            correct += (predicted == labels.to(predicted.device)).sum().item()
    return losses, correct / total


def main(args):
    deepspeed.init_distributed()
    torch.manual_seed(0)
    trainset = RandomCifar(args.num_samples, seed=1)
    testset = RandomCifar(16, seed=2)
    net = Net()
    parameters = filter(lambda p: p.requires_grad, net.parameters())
    ds_config = get_ds_config(args)
    model_engine, optimizer, trainloader, __ = deepspeed.initialize(
        args=args, model=net, model_parameters=parameters, training_data=trainset, config=ds_config)
    local_device = get_accelerator().device_name(model_engine.local_rank)
    local_rank = model_engine.local_rank
    target_dtype = None
    if model_engine.bfloat16_enabled():
        target_dtype = torch.bfloat16
    elif model_engine.fp16_enabled():
        target_dtype = torch.half
    criterion = nn.CrossEntropyLoss()
    losses, lrs = [], []
    for epoch in range(args.epochs):
        running_loss = 0.0
        for i, data in enumerate(trainloader):
            inputs, labels = data[0].to(local_device), data[1].to(local_device)
            if target_dtype is not None:
                inputs = inputs.to(target_dtype)
            outputs = model_engine(inputs)
            loss = criterion(outputs, labels)
            model_engine.backward(loss)
            model_engine.step()
            losses.append(loss.item())
            lrs.append(model_engine.get_lr()[0])
            running_loss += loss.item()
            if local_rank == 0 and i % args.log_interval == (args.log_interval - 1):
                print(f"[{epoch + 1 : d}, {i + 1 : 5d}] loss: {running_loss / args.log_interval : .3f}")
                running_loss = 0.0
            if i + 1 == args.max_steps:
                break
    test_losses, accuracy = test(model_engine, testset, local_device, target_dtype)
    _losslog.write(args.loss_log_file, {"losses": losses, "lrs": lrs, "test_losses": test_losses,
                                        "accuracy": accuracy})


if __name__ == "__main__":
    main(add_argument())
