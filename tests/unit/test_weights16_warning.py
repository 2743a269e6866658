"""save_16bit_model at ZeRO-3 without stage3_gather_16bit_weights_on_model_save writes nothing:
it says so at WARNING (the README's DeepSpeed loop promises pytorch_model.bin)."""

from __future__ import annotations

import logging

import torch

from engine.config import load_config
from engine.weights16 import save_16bit_model


def test_zero3_without_gather_warns_and_writes_nothing(tmp_path, caplog):
    cfg = load_config({"train_micro_batch_size_per_gpu": 1, "zero_optimization": {"stage": 3}}, world_size=1)
    with caplog.at_level(logging.WARNING, logger="engine.weights16"):
        assert save_16bit_model(cfg, torch.nn.Linear(2, 2), None, str(tmp_path / "out")) is False
    assert not (tmp_path / "out").exists()
    (msg,) = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert "wrote nothing" in msg and "stage3_gather_16bit_weights_on_model_save is true" in msg
