"""Mirrors DeepSpeedExamples training/HelloDeepSpeed/train_bert_ds.py (a small RoBERTa
masked-LM trained with DeepSpeed, saving and resuming checkpoints), written here against the
same API: ``deepspeed.initialize(model=..., model_parameters=..., config=ds_config)`` with
its config (Adam, ZeRO-1 with ``offload_optimizer`` on the CPU), ``model(**batch)``,
``model.backward(loss)``, ``model.step()``, ``model.save_checkpoint(save_dir=exp_dir,
client_state={'checkpoint_step': step})`` every ``checkpoint_every`` steps and at the end,
``_, client_state = model.load_checkpoint(load_dir=load_checkpoint_dir)`` resuming at
``checkpoint_step + 1`` with the hyperparameters read back from ``hparams.json``,
``deepspeed.utils.log_dist``, ``get_accelerator()``, and the same train(...) arguments.

Differences, each for CPU: random token ids with the original's masking (mask / random
replace / keep) instead of tokenised WikiText, a vocabulary of ``--vocab_size`` ids instead of
roberta-base's 50265; argparse instead of ``fire`` (not installed), a fixed experiment
directory name instead of a timestamped one, no TensorBoard writer; ``--dtype fp32`` added
(the original takes bf16 or fp16: on CPU the comparison with DeepSpeed is made in fp32).
"""

import argparse
import json
import logging
import pathlib
import random

import _losslog
import deepspeed
import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
from deepspeed.accelerator import get_accelerator
from deepspeed.utils import log_dist
from transformers import RobertaConfig
from transformers.models.roberta.modeling_roberta import RobertaLMHead, RobertaModel


def is_rank_0():
    return not dist.is_initialized() or dist.get_rank() == 0


class RobertaMLMModel(nn.Module):
    def __init__(self, config, encoder):
        super().__init__()
        self.config = config
        self.encoder = encoder
        self.lm_head = RobertaLMHead(config)

    def forward(self, src_tokens, attention_mask, tgt_tokens):
        hidden = self.encoder(input_ids=src_tokens, attention_mask=attention_mask).last_hidden_state
        logits = self.lm_head(hidden)  # (batch, seq, vocab)
        return nn.functional.cross_entropy(logits.view(-1, self.config.vocab_size), tgt_tokens.view(-1),
                                           ignore_index=self.config.pad_token_id)


def create_model(num_layers, num_heads, ff_dim, h_dim, dropout, vocab_size):
    config = RobertaConfig(vocab_size=vocab_size, hidden_size=h_dim, num_hidden_layers=num_layers,
                           num_attention_heads=num_heads, intermediate_size=ff_dim, hidden_dropout_prob=dropout,
                           attention_probs_dropout_prob=dropout, max_position_embeddings=520, pad_token_id=1)
    config._attn_implementation = "eager"
    return RobertaMLMModel(config, RobertaModel(config, add_pooling_layer=False))


def create_data_iterator(mask_prob, random_replace_prob, unmask_replace_prob, max_seq_length, batch_size,
                         vocab_size, seed=0):
    """The original's masking of every sequence (target = the token at masked places, pad
    elsewhere) over random ids; every rank reads the same batches, as the original's plain
    DataLoader."""
    g = torch.Generator().manual_seed(seed)
    mask_id, pad_id = 3, 1
    while True:
        tokens = torch.randint(4, vocab_size, (batch_size, max_seq_length), generator=g)
        masked = torch.rand(tokens.shape, generator=g) < mask_prob
        roll = torch.rand(tokens.shape, generator=g)
        src = tokens.clone()
        src[masked & (roll >= random_replace_prob + unmask_replace_prob)] = mask_id
        replace = masked & (roll < random_replace_prob)
        src[replace] = torch.randint(4, vocab_size, (int(replace.sum()),), generator=g)
        tgt = torch.where(masked, tokens, torch.full_like(tokens, pad_id))
        yield {"src_tokens": src, "attention_mask": torch.ones_like(src), "tgt_tokens": tgt}


def train(checkpoint_dir=None, load_checkpoint_dir=None, mask_prob=0.15, random_replace_prob=0.1,  # noqa: PLR0913
          unmask_replace_prob=0.1, max_seq_length=512, num_layers=6, num_heads=8, ff_dim=512, h_dim=256,
          dropout=0.1, batch_size=8, num_iterations=10000, checkpoint_every=1000, log_every=10, local_rank=-1,
          dtype="bf16", vocab_size=1000, loss_log_file=None):
    device = (torch.device(get_accelerator().device_name(), local_rank)
              if (local_rank > -1) and get_accelerator().is_available() else torch.device("cpu"))
    if (checkpoint_dir is None) == (load_checkpoint_dir is None):
        log_dist("Need exactly one of checkpoint_dir or load_checkpoint_dir", ranks=[0], level=logging.ERROR)
        return
    if checkpoint_dir:
        exp_dir = pathlib.Path(checkpoint_dir) / "bert_pretrain"
        if is_rank_0():
            exp_dir.mkdir(parents=True, exist_ok=True)
            hparams = dict(mask_prob=mask_prob, random_replace_prob=random_replace_prob,
                           unmask_replace_prob=unmask_replace_prob, max_seq_length=max_seq_length,
                           num_layers=num_layers, num_heads=num_heads, ff_dim=ff_dim, h_dim=h_dim, dropout=dropout,
                           batch_size=batch_size, num_iterations=num_iterations, checkpoint_every=checkpoint_every,
                           vocab_size=vocab_size)
            (exp_dir / "hparams.json").write_text(json.dumps(hparams, indent=2))
    else:
        exp_dir = pathlib.Path(load_checkpoint_dir)
        hparams = json.loads((exp_dir / "hparams.json").read_text())
        mask_prob, max_seq_length = hparams["mask_prob"], hparams["max_seq_length"]
        random_replace_prob, unmask_replace_prob = hparams["random_replace_prob"], hparams["unmask_replace_prob"]
        ff_dim, h_dim, dropout = hparams["ff_dim"], hparams["h_dim"], hparams["dropout"]
        num_layers, num_heads, vocab_size = hparams["num_layers"], hparams["num_heads"], hparams["vocab_size"]
        batch_size, checkpoint_every = hparams["batch_size"], hparams["checkpoint_every"]
        num_iterations = max(num_iterations, hparams["num_iterations"])
    data_iterator = create_data_iterator(mask_prob, random_replace_prob, unmask_replace_prob, max_seq_length,
                                         batch_size, vocab_size)
    model = create_model(num_layers, num_heads, ff_dim, h_dim, dropout, vocab_size)
    assert dtype in ("fp16", "bf16", "fp32")
    ds_config = {
        "train_micro_batch_size_per_gpu": batch_size,
        "optimizer": {"type": "Adam", "params": {"lr": 1e-4}},
        "zero_optimization": {"stage": 1, "offload_optimizer": {"device": "cpu"}},
    }
    if dtype != "fp32":
        ds_config[dtype] = {"enabled": True}
    model, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=ds_config)
    start_step = 1
    if load_checkpoint_dir is not None:
        _, client_state = model.load_checkpoint(load_dir=load_checkpoint_dir)
        checkpoint_step = client_state["checkpoint_step"]
        start_step = checkpoint_step + 1
    log_dist(f"Total number of model parameters: {sum([p.numel() for p in model.parameters()]):,d}", ranks=[0],
             level=logging.INFO)
    model.train()
    losses, steps = [], []
    for step, batch in enumerate(data_iterator, start=start_step):
        if step >= num_iterations:
            break
        for key, value in batch.items():
            batch[key] = value.to(device)
        loss = model(**batch)
        model.backward(loss)
        model.step()
        losses.append(loss.item())
        steps.append(step)
        if step % log_every == 0:
            log_dist(f"Loss: {np.mean(losses):.4f}", ranks=[0], level=logging.INFO)
        if step % checkpoint_every == 0:
            model.save_checkpoint(save_dir=exp_dir, client_state={"checkpoint_step": step})
    if step % checkpoint_every != 0:
        model.save_checkpoint(save_dir=exp_dir, client_state={"checkpoint_step": step})
    _losslog.write(loss_log_file, {"steps": steps, "losses": losses})
    return exp_dir


def main():
    p = argparse.ArgumentParser()
    defaults = train.__defaults__
    names = train.__code__.co_varnames[:train.__code__.co_argcount]
    for name, default in zip(names, defaults):
        kind = type(default) if default is not None else str
        p.add_argument(f"--{name}", type=kind, default=default)
    args = p.parse_args()
    deepspeed.init_distributed()
    train(**vars(args))


if __name__ == "__main__":
    torch.manual_seed(42)
    np.random.seed(0)
    random.seed(0)
    main()
