"""``engine.compat.deepspeed.checkpointing`` against DeepSpeed 0.19.8's ``deepspeed.checkpointing``:
tests/assets/ds_checkpointing_script.py (a model whose layers call
``deepspeed.checkpointing.checkpoint``, with dropout under the RNG tracker and the default
generator inside the checkpointed layers) runs with only ``import deepspeed`` changed to
``import engine.compat.deepspeed as deepspeed``, on 1 and 2 CPU ranks (2: the TP group of the
mpu, partitioned activations, with and without CPU checkpointing), and gives the same
per-step losses and final weights as real DeepSpeed, exactly (torch.equal): both replay the
forward's RNG states and run the same kernels. A recomputation under another RNG state
(a different dropout mask) changes the gradients, hence the second step's loss.
"""

from __future__ import annotations

import types
from pathlib import Path

import pytest
from harness import run_ranks

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "tests" / "assets" / "ds_checkpointing_script.py"


def _module(ours: bool) -> types.ModuleType:
    text = SCRIPT.read_text()
    assert text.count("\nimport deepspeed\n") == 1
    if ours:
        import engine.compat.deepspeed.checkpointing  # noqa: F401  (until the package imports it)
        text = text.replace("\nimport deepspeed\n", "\nimport engine.compat.deepspeed as deepspeed\n")
    mod = types.ModuleType("ds_checkpointing_script")
    exec(compile(text, str(SCRIPT), "exec"), mod.__dict__)
    return mod


def _run(rank, world, out_dir, partition, cpu):
    import torch

    results = {}
    for ours in (False, True):
        if not ours:
            import deepspeed
            deepspeed.init_distributed(dist_backend="gloo")
        path = f"{out_dir}/r{rank}_{'ours' if ours else 'ds'}.pt"
        _module(ours).run(path, partition, cpu)
        results[ours] = torch.load(path)
    return results


@pytest.mark.slow
@pytest.mark.timeout(600)
@pytest.mark.parametrize("world,partition,cpu", [
    (1, False, False),
    pytest.param(2, True, False, marks=pytest.mark.extended),
    pytest.param(2, True, True, marks=pytest.mark.extended)],
    ids=["1rank", "2ranks-partitioned", "2ranks-partitioned-cpu"])
def test_script_equals_deepspeed(tmp_path, world, partition, cpu):
    import torch

    per_rank = run_ranks(_run, world, str(tmp_path), partition, cpu, timeout=500)
    for r, res in enumerate(per_rank):
        ds, ours = res[False], res[True]
        assert ds["losses"][-1] < ds["losses"][0], ds["losses"]
        assert torch.equal(ours["losses"], ds["losses"]), (r, ours["losses"], ds["losses"])
        assert all(torch.equal(a, b) for a, b in zip(ours["weights"], ds["weights"])), r


def test_recomputation_replays_dropout():
    """One process, no DeepSpeed: the checkpointed model's gradients equal the plain model's
    (same seeds), so the recomputed forward drew the forward's dropout masks."""
    import torch

    from engine.compat.deepspeed import checkpointing

    mod = _module(True)
    checkpointing.configure(None)
    grads = []
    for plain in (False, True):
        torch.manual_seed(0)
        model = mod.Model()
        checkpointing.model_parallel_cuda_manual_seed(1234)
        x = torch.randn(8, 16, generator=torch.Generator().manual_seed(5), requires_grad=True)
        if plain:
            h = x
            for layer in model.layers:
                h = layer(h, scale=0.5)
            loss = h.pow(2).mean()
        else:
            loss = model(x)
        loss.backward()
        grads.append([p.grad for p in model.parameters()] + [x.grad])
    assert all(torch.equal(a, b) for a, b in zip(*grads))
