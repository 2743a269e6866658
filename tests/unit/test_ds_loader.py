"""engine.data.ds_loader against DeepSpeed 0.19.8's own DeepSpeedDataLoader, built as its
``deepspeed_io`` builds it (runtime/engine.py: num_replicas = the DP size, rank = the DP rank,
``dataloader_drop_last`` from the config) and as its pipeline engine's ``_build_data_iter``
does (runtime/pipe/engine.py: a ``DistributedSampler(shuffle=False)``, wrapped in its
``RepeatingLoader``). Exact: the rows of every micro-batch on every rank."""

import itertools

import pytest
import torch

from engine.data.ds_loader import RepeatingLoader, deepspeed_loader

N, MICRO = 13, 2  # 13 rows: padded to 14 over 2 ranks, a short last micro-batch


def _data(n=N):
    return torch.utils.data.TensorDataset(torch.arange(n))


def _rows(loader, n=None):
    it = loader if n is None else itertools.islice(loader, n)
    return [b[0].tolist() for b in it]


def _ds_loader(dp, rank, drop_last, sampler=None):
    dl = pytest.importorskip("deepspeed.runtime.dataloader")
    return dl.DeepSpeedDataLoader(_data(), batch_size=MICRO, pin_memory=False, local_rank=rank, tput_timer=None,
                                  num_local_io_workers=0, data_sampler=sampler, data_parallel_world_size=dp,
                                  data_parallel_rank=rank, dataloader_drop_last=drop_last)


@pytest.mark.parametrize("dp", [1, 2, 3])
@pytest.mark.parametrize("drop_last", [False, True])
def test_engine_loader_equals_deepspeeds(dp, drop_last):
    for rank in range(dp):
        ours = deepspeed_loader(_data(), MICRO, dp, rank, drop_last=drop_last)
        theirs = _ds_loader(dp, rank, drop_last)
        assert _rows(ours) == _rows(theirs), (dp, rank)
        assert len(ours) == len(theirs)
        assert _rows(ours) == _rows(ours)  # no set_epoch: every pass repeats the first (DeepSpeed)


def test_set_epoch_through_data_sampler_reshuffles_as_deepspeed():
    ours, theirs = deepspeed_loader(_data(), MICRO, 2, 1), _ds_loader(2, 1, False)
    ours.data_sampler.set_epoch(3)
    theirs.data_sampler.set_epoch(3)
    assert _rows(ours) == _rows(theirs) != _rows(deepspeed_loader(_data(), MICRO, 2, 1))


@pytest.mark.parametrize("dp", [1, 2])
def test_pipeline_loader_is_deepspeeds_unshuffled_repeating_one(dp):
    pytest.importorskip("deepspeed")
    from deepspeed.runtime.dataloader import RepeatingLoader as DSRepeating
    for rank in range(dp):
        sampler = torch.utils.data.distributed.DistributedSampler(_data(), num_replicas=dp, rank=rank, shuffle=False)
        theirs = DSRepeating(_ds_loader(dp, rank, False, sampler=sampler))
        ours = deepspeed_loader(_data(), MICRO, dp, rank, pipeline=True)
        assert isinstance(ours, RepeatingLoader)
        assert _rows(ours, 20) == _rows(theirs, 20)  # several passes: it never runs out
    assert _rows(deepspeed_loader(_data(), MICRO, 1, 0, pipeline=True), 2) == [[0, 1], [2, 3]]


def test_not_a_dataset_is_refused():
    with pytest.raises(TypeError, match="torch.utils.data.Dataset"):
        deepspeed_loader([1, 2, 3], MICRO, 1, 0)
