"""Where a sharded model lives, and that building, exporting and sampling it never hold more
than a rank's shards plus one unit.

- ``engine.zero.Init`` puts each rank's shards on its accelerator (here a fake one: the
  "meta" device stands in for ``cuda:<local rank>``, so a shard left on the CPU is caught),
  or on the host with ``remote_device="cpu"`` / the config's ``offload_param.device``; a
  moved placeholder takes its shard along at the next gather; ``GatheredParameters`` gathers
  on that device.
- ZeRO-3 ``save_16bit_model`` (DP = 4): the file equals the whole model's state dict, at
  most one unit's bucket is gathered at a time, and no rank's live tensors grow by more than
  one unit (rank 0: plus the host copy it writes).
- The end-of-run sample with pipeline stages (pp = 2 x dp = 2 at ZeRO-3, pp = 2 x tp = 2 at
  ZeRO-1): the tokens equal the dense model's; no rank builds a whole copy (no object
  collective, no whole-model gather; live tensors grow by at most one unit plus the
  sample's activations).

Tolerances: tokens are exact (argmax of the same fp32 model; tp = 2 sums in another order,
and the tiny random model has no near-ties in its top logits, as in test_generate_gather.py);
the exported weights are bit-identical copies.
"""

import gc

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
from harness import run_ranks, watch_gathered_numel

MODEL = {"vocab_size": 64, "hidden_size": 32, "num_layers": 4, "num_heads": 2, "seq_len": 16}
PROMPT, NEW = [1, 5, 9], 6


def _cfg(world, stage, pp=1, tp=1, **zero):
    from engine.config import load_config

    z = {"stage": stage, "stage3_param_persistence_threshold": 0, **zero}
    return load_config({"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 2, "seed": 7,
                        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}}, "zero_optimization": z,
                        "pipeline": {"stages": pp}, "tensor_parallel": {"autotp_size": tp},
                        "model": MODEL}, world_size=world)


def _forbidden(*a, **k):
    raise AssertionError("an object collective stages the whole model on one device")


# ---------------------------------------------------------------------- Init placement (1 rank)
def _placement(rank, world):
    from engine.zero import init as zinit
    from engine.zero.init import GatheredParameters, Init

    out = {"gloo_accelerator": str(zinit.accelerator_device())}
    zinit.accelerator_device = lambda: torch.device("meta")  # the fake accelerator of this rank
    with Init():
        lin = nn.Linear(8, 4)
    out["default"] = {p.ds_tensor.device.type for p in lin.parameters()} | {p.device.type for p in lin.parameters()}
    with GatheredParameters(list(lin.parameters())):
        out["gathered_on"] = {p.device.type for p in lin.parameters()}
        out["gathered_shape"] = [tuple(p.shape) for p in lin.parameters()]
    with Init(remote_device="cpu"):
        host = nn.Linear(8, 4)
    out["remote_cpu"] = {p.ds_tensor.device.type for p in host.parameters()}
    with Init(config_dict_or_path={"zero_optimization": {"offload_param": {"device": "cpu"}},
                                   "bf16": {"enabled": True}}):
        cfg_host = nn.Linear(8, 4)
    out["config_cpu"] = {(p.ds_tensor.device.type, p.ds_tensor.dtype) for p in cfg_host.parameters()}
    # what model.to("cuda") does to a CPU placeholder (``p.data = moved``; nn.Module.to would
    # replace a parameter for the meta device, which shares no shallow copy with the CPU)
    for p in host.parameters():
        zinit.set_data(p, p.data.to("meta"))
    with GatheredParameters(list(host.parameters())):
        out["followed"] = {p.device.type for p in host.parameters()}
    out["shard_moved"] = {p.ds_tensor.device.type for p in host.parameters()}
    for bad in ({"remote_device": "nvme"}, {"config_dict_or_path": {"zero_optimization": {"offload_param": {
            "device": "nvme"}}}}, {"pin_memory": True}):
        try:
            Init(**bad)
            out[str(bad)] = "accepted"
        except ValueError as e:
            out[str(bad)] = str(e)
    return out


def test_init_places_shards_on_the_accelerator_or_the_host_and_gathers_there():
    (r,) = run_ranks(_placement, 1, timeout=120)
    assert r["gloo_accelerator"] == "cpu"  # gloo's collectives run on the CPU
    assert r["default"] == {"meta"}
    assert r["gathered_on"] == {"meta"} and r["gathered_shape"] == [(4, 8), (4,)]
    assert r["remote_cpu"] == {"cpu"}
    assert r["config_cpu"] == {("cpu", torch.bfloat16)}
    assert r["followed"] == {"meta"} and r["shard_moved"] == {"meta"}
    for key, msg in r.items():
        if key.startswith("{"):
            assert msg != "accepted" and ("nvme" in msg or "pin_memory" in msg), (key, msg)


# ---------------------------------------------------------------------- export and samples (4 ranks)
def _unit_bytes(opt):
    units = sorted(sum(b.layout.padded_numel * b.dtype.itemsize for b in bs) for bs in opt._units.values())
    return units[-1], sum(b.layout.padded_numel * b.dtype.itemsize for b in opt.buckets)


def _export(rank, world, tmp):
    import engine
    from engine.zero.peak import LiveMemoryTracker

    cfg = _cfg(world, 3, stage3_gather_16bit_weights_on_model_save=True)
    eng, *_ = engine.initialize(config=cfg)
    opt = eng.optimizer
    largest_unit, model_bytes = _unit_bytes(opt)
    gathered = watch_gathered_numel(opt)
    gc.collect()
    with LiveMemoryTracker() as t:
        before = t.current
        assert eng.save_16bit_model(tmp)
    grew, most_gathered = t.peak - before, gathered[0]
    with opt.gathered_params():  # the reference: the whole model, as the old export gathered it
        want = {k: v.detach().clone() for k, v in eng.module.state_dict().items()}
    eng.destroy()
    got = torch.load(f"{tmp}/pytorch_model.bin") if rank == 0 else None
    same = None if got is None else (list(got) == list(want) and all(torch.equal(got[k], want[k]) for k in want))
    return {"same": same, "gathered": most_gathered, "grew": grew, "largest_unit": largest_unit,
            "model_bytes": model_bytes, "largest_unit_numel": largest_unit // 4}


def _sample(rank, world, layout):
    import engine
    from engine import generate
    from engine.distributed.groups import NO_TP
    from engine.models import GPT
    from engine.zero.peak import LiveMemoryTracker

    stage, pp, tp = layout
    cfg = _cfg(world, stage, pp=pp, tp=tp)
    eng, *_ = engine.initialize(config=cfg)
    gathered = watch_gathered_numel(eng.optimizer) if stage == 3 else [0]
    # one unit: a ZeRO-3 unit's bucket, else the largest parameter (TP-gathered by the old path)
    largest_param = max([p.numel() * 4 for p in GPT(cfg.model, tp_group=NO_TP, seed=7).parameters()]
                        + ([_unit_bytes(eng.optimizer)[0]] if stage == 3 else []))
    gc.collect()
    with LiveMemoryTracker() as t:
        before = t.current
        assert generate.generates_sharded(eng)
        got = generate.greedy_generate_sharded(eng, PROMPT, NEW)
    grew = t.peak - before
    eng.destroy()
    want = generate.greedy_generate(GPT(cfg.model, tp_group=NO_TP, seed=7).eval(), PROMPT, NEW)
    dense_bytes = sum(p.numel() * 4 for p in GPT(cfg.model, tp_group=NO_TP, seed=7).parameters())
    return {"got": got, "want": want, "grew": grew, "gathered": gathered[0], "largest_param": largest_param,
            "dense_bytes": dense_bytes}


def _all(rank, world, tmp):
    dist.gather_object = dist.all_gather_object = _forbidden
    return {"export": _export(rank, world, tmp),
            "samples": [_sample(rank, world, layout) for layout in ((3, 2, 1), (1, 2, 2))]}


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    return run_ranks(_all, 4, str(tmp_path_factory.mktemp("w16")), timeout=300)


@pytest.mark.slow
def test_zero3_save_16bit_model_gathers_one_unit_at_a_time(results):
    for rank, r in enumerate(results):
        e = r["export"]
        if rank == 0:
            assert e["same"] is True
        assert 0 < e["gathered"] <= e["largest_unit_numel"], e
        assert e["largest_unit"] < e["model_bytes"] / 3, e  # so "one unit" is far below "the model"
        # rank 0 also keeps the host copy it writes (the whole model, the file's content)
        bound = e["largest_unit"] + (e["model_bytes"] if rank == 0 else 0) + 64 * 1024
        assert e["grew"] <= bound, (rank, e)


@pytest.mark.slow
def test_pipeline_sample_runs_staged_and_equals_the_dense_model(results):
    # activations of the sample: a few (1, S, max(V, 4H)) fp32 tensors, ~8 KiB each here
    slack = 16 * MODEL["seq_len"] * max(MODEL["vocab_size"], 4 * MODEL["hidden_size"]) * 4
    for r in results:
        for s in r["samples"]:
            assert s["got"] == s["want"]
            assert s["grew"] <= s["largest_param"] + slack < s["dense_bytes"], s


# ---------------------------------------------------------------------- AutoTP (2 ranks)
def _autotp(rank, world):
    """What reaches the device when AutoTP takes a Hugging Face model: ``model.to(device)``
    must come after the split (before the change the whole model went to every GPU first),
    and the TP broadcast stages one tensor at a time on the device."""
    from _autotp_models import build

    import engine
    import engine.assembly.autotp as at

    model = build("llama", seed=rank)  # different weights per rank: the broadcast must make them equal
    whole = sum(p.numel() for p in model.parameters())
    moved, staged = [], []
    real_to, real_bcast = nn.Module.to, at.comm.broadcast

    def to(self, *a, **k):
        if self is model and (a or "device" in k):
            moved.append(sum(p.numel() for p in self.parameters()))
        return real_to(self, *a, **k)

    def bcast(t, src, group, **k):
        staged.append(t.numel())
        return real_bcast(t, src, group, **k)

    nn.Module.to, at.comm.broadcast = to, bcast
    try:
        eng, *_ = engine.initialize(model=model, config={
            "train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 1, "seed": 0,
            "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}}, "tensor_parallel": {"autotp_size": 2}})
    finally:
        nn.Module.to, at.comm.broadcast = real_to, real_bcast
    sharded = sum(p.numel() for p in eng.module.parameters())
    eng.destroy()
    return {"whole": whole, "moved": moved, "sharded": sharded, "staged": staged,
            "largest": max(p.numel() for p in build("llama").parameters())}


@pytest.mark.slow
def test_autotp_moves_only_the_shards_to_the_device():
    for r in run_ranks(_autotp, 2, timeout=180):
        assert r["moved"] and all(n == r["sharded"] for n in r["moved"]), r
        assert r["sharded"] < r["whole"]
        assert r["staged"] and max(r["staged"]) <= r["largest"], r  # one tensor at a time


# ---------------------------------------------------------------------- PipelineModule (2 ranks)
PIPE_WIDTH, PIPE_LAYERS = 64, 8


def _pipe(rank, world):
    """A PipelineModule builds only this rank's stage (DeepSpeed's: LayerSpecs are built on
    the rank that owns them): while it is constructed the live tensor bytes never exceed the
    stage plus one layer (the other stage's layers are built one at a time and freed, for
    their random draws); engine.initialize keeps that stage, and the module refuses a
    whole-model forward with a clear error."""
    import engine
    from engine.pipe import LayerSpec, PipelineModule
    from engine.zero.peak import LiveMemoryTracker

    layer = (PIPE_WIDTH * PIPE_WIDTH + PIPE_WIDTH) * 4  # fp32 bytes of one Linear
    torch.manual_seed(0)
    gc.collect()
    with LiveMemoryTracker() as t:
        net = PipelineModule([LayerSpec(nn.Linear, PIPE_WIDTH, PIPE_WIDTH) for _ in range(PIPE_LAYERS)], num_stages=2,
                             loss_fn=lambda out, y: ((out - y) ** 2).mean(), partition_method="uniform")
    built = sum(p.numel() * 4 for p in net.parameters())
    eng, *_ = engine.initialize(model=net, model_parameters=[p for p in net.parameters()], config={
        "train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 2, "seed": 0,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}}, "zero_optimization": {"stage": 1}})
    gc.collect()
    kept = sum(p.numel() * 4 for p in net.parameters())
    x = torch.randn(1, PIPE_WIDTH)
    loss = eng.train_batch(iter([(x, x), (x, x)]))
    try:
        net(x)
        err = ""
    except RuntimeError as e:
        err = str(e)
    eng.destroy()
    return {"peak": t.peak, "built": built, "kept": kept, "layer": layer, "whole": PIPE_LAYERS * layer, "err": err,
            "trained": loss is None or bool(torch.isfinite(loss))}


def test_pipeline_module_builds_and_keeps_only_its_stage():
    for r in run_ranks(_pipe, 2, timeout=180):
        assert r["built"] == r["kept"] == r["whole"] // 2, r  # four of the eight equal layers
        # exact storage bytes (no slack needed: nothing else is allocated while building); before
        # the lazy build the peak was the whole model (8 layers) on every rank
        assert r["peak"] <= r["built"] + r["layer"] < r["whole"], r
        assert r["trained"] and "build a new PipelineModule" in r["err"], r
