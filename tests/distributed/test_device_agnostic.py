"""A forgotten ``.to(device)`` fails on CPU.

On a CPU-only machine the batches and the module share one device, so a batch that never
reaches the engine's device goes unnoticed until the first GPU run (NCCL/CUDA: "Expected all
tensors to be on the same device"). Here every batch tensor is a :class:`HostTensor`: a CPU
tensor marked "still on the host" that loses the mark only through ``.to(...)`` (the move
to the engine's device). A forward pre-hook on the model, the pipeline chunks included,
rejects any marked input. The engine's DP/ZeRO path (DeepSpeed loop, train_batch and
eval_batch with tensor, tuple, dict and nested micro-batches from the engine's own
DataLoader) and its pipeline path (train_batch, eval_batch) are run under it, and each
engine's losses are compared with the same run on plain tensors (equal: the marking does
not change a value).
"""

import torch
import torch.nn as nn
from harness import run_ranks


class HostTensor(torch.Tensor):
    """A batch tensor not yet moved to the engine's device (marks propagate through ops)."""

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        out = super().__torch_function__(func, types, args, kwargs or {})
        if getattr(func, "__name__", "") == "to" and isinstance(out, torch.Tensor):
            return out.as_subclass(torch.Tensor)  # moved: the mark is gone
        return out


def mark(x):
    if isinstance(x, torch.Tensor):
        return x.as_subclass(HostTensor)
    if isinstance(x, dict):
        return {k: mark(v) for k, v in x.items()}
    if isinstance(x, (tuple, list)):
        return type(x)(mark(v) for v in x)
    return x


def _reject_host_inputs(module, args, kwargs):
    def walk(v):
        if isinstance(v, HostTensor):
            raise AssertionError(f"{type(module).__name__} got a batch tensor that was never moved to the "
                                 f"engine's device (shape {tuple(v.shape)})")
        if isinstance(v, dict):
            for w in v.values():
                walk(w)
        elif isinstance(v, (tuple, list)):
            for w in v:
                walk(w)
    walk(args)
    walk(kwargs)


def guard(module: nn.Module) -> nn.Module:
    module.register_forward_pre_hook(_reject_host_inputs, with_kwargs=True)
    return module


class DictModel(nn.Module):
    """loss = mse(net(x), y); called as module(**dict), module(*tuple) or module(x, y)."""

    def __init__(self):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1))

    def forward(self, x, y=None, extra=None):
        if y is None:  # a bare tensor batch (B, 5): features then target
            x, y = x[:, :4], x[:, 4:]
        out = self.net(x)
        if extra is not None:
            out = out + 0.0 * extra["scale"]
        return ((out - y) ** 2).mean()


class Pairs(torch.utils.data.Dataset):
    def __init__(self, kind, marked):
        g = torch.Generator().manual_seed(1)
        self.x, self.y = torch.randn(32, 4, generator=g), torch.randn(32, 1, generator=g)
        self.kind, self.marked = kind, marked

    def __len__(self):
        return 32

    def __getitem__(self, i):
        x, y = self.x[i], self.y[i]
        item = {"dict": {"x": x, "y": y, "extra": {"scale": torch.ones(1)}}, "tuple": (x, y),
                "tensor": torch.cat([x, y])}[self.kind]
        return mark(item) if self.marked else item


def _dp_both(rank, world):
    return _dp_losses(rank, world, True), _dp_losses(rank, world, False)


def _pp_both(rank, world):
    return _pp_losses(rank, world, True), _pp_losses(rank, world, False)


def _dp_losses(rank, world, marked):
    import engine

    out = {}
    for kind in ("dict", "tuple", "tensor"):
        for stage in (0, 3):
            cfg = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 2,
                   "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}}, "zero_optimization": {"stage": stage}}
            torch.manual_seed(0)
            eng, _, loader, _ = engine.initialize(model=guard(DictModel()), config=cfg,
                                                  training_data=Pairs(kind, marked))
            losses = [float(eng.train_batch()) for _ in range(2)]
            losses.append(float(eng.eval_batch(iter(loader))))
            if kind == "tuple":  # the DeepSpeed loop with an explicitly moved batch is the user's job
                x, y = next(iter(loader))
                loss = eng(x.to(eng.device), y.to(eng.device))
                eng.backward(loss)
                eng.step()
            out[(kind, stage)] = losses
            eng.destroy()
    return out


def test_dp_and_zero_paths_move_every_batch_to_the_device():
    for marked, plain in run_ranks(_dp_both, 2, timeout=240):
        assert marked == plain


def _pp_losses(rank, world, marked):
    import engine

    cfg = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 2,
           "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}}, "zero_optimization": {"stage": 1},
           "pipeline": {"stages": 2},
           "model": {"vocab_size": 64, "hidden_size": 16, "num_layers": 2, "num_heads": 2, "seq_len": 8}}
    eng, *_ = engine.initialize(model=None, config=cfg)
    for chunk in eng.module:
        guard(chunk)
    g = torch.Generator().manual_seed(3)
    tokens = torch.randint(0, 64, (8, 2, 9), generator=g)

    def batches(i):
        items = [(tokens[j, :, :-1], tokens[j, :, 1:]) for j in range(2 * i, 2 * i + 2)]
        return iter([mark(it) if marked else it for it in items])

    losses = [float(eng.train_batch(batches(i))) for i in range(2)]
    losses.append(float(eng.eval_batch(batches(3))))
    eng.destroy()
    return losses


def test_pipeline_path_moves_every_batch_to_the_device():
    (m0, p0), (m1, p1) = run_ranks(_pp_both, 2, timeout=240)
    assert m0 == p0 and m1 == p1
    assert m0 == m1  # the loss is broadcast to every stage
