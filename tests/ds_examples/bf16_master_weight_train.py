"""Mirrors DeepSpeedExamples training/bf16_master_weight/train.py (DeepSpeed 0.19.8's
low-precision master-state example: a transformer with ``nn.MultiheadAttention`` blocks under
ZeRO-3 and ``"bf16": {"enabled": true, ...}``, configs baseline.json / bf16_master_wg.json /
bf16_full.json, here in bf16_configs/), written here against the same API: its own
``--deepspeed_config`` / ``--local_rank`` arguments, ``deepspeed.init_distributed()``,
``deepspeed.comm.get_rank()`` / ``get_world_size()``, ``get_accelerator().device_name(local_rank)``,
``deepspeed.initialize(model=..., model_parameters=..., config=<path>)``, ``torch.autocast``
when the config's ``torch_autocast`` is enabled, the PyTorch-style ``loss.backward()`` then
``model_engine.step()``, and ``model_engine.destroy()``.

Differences, each for CPU: ``get_accelerator().set_device`` and the accelerator's memory
figures in place of the ``torch.cuda`` calls, a small model (``--hidden_dim`` etc.), random
token ids (the original's default; its WikiText option is left out).
"""

import argparse
import json

import _losslog
import deepspeed
import torch
import torch.nn as nn
from deepspeed.accelerator import get_accelerator


class SimpleTransformerBlock(nn.Module):
    def __init__(self, hidden_dim, num_heads=8, ff_dim=None):
        super().__init__()
        ff_dim = ff_dim or hidden_dim * 4
        self.attention = nn.MultiheadAttention(hidden_dim, num_heads, batch_first=True)
        self.norm1 = nn.LayerNorm(hidden_dim)
        self.norm2 = nn.LayerNorm(hidden_dim)
        self.ff = nn.Sequential(nn.Linear(hidden_dim, ff_dim), nn.GELU(), nn.Linear(ff_dim, hidden_dim))

    def forward(self, x):
        attn_out, _ = self.attention(x, x, x)
        x = self.norm1(x + attn_out)
        return self.norm2(x + self.ff(x))


class SimpleTransformerModel(nn.Module):
    def __init__(self, vocab_size, hidden_dim, num_layers, num_heads, max_seq_len):
        super().__init__()
        self.embedding = nn.Embedding(vocab_size, hidden_dim)
        self.pos_embedding = nn.Embedding(max_seq_len, hidden_dim)
        self.layers = nn.ModuleList([SimpleTransformerBlock(hidden_dim, num_heads) for _ in range(num_layers)])
        self.output_proj = nn.Linear(hidden_dim, vocab_size)

    def forward(self, input_ids):
        batch_size, seq_len = input_ids.shape
        positions = torch.arange(seq_len, device=input_ids.device).unsqueeze(0).expand(batch_size, -1)
        x = self.embedding(input_ids) + self.pos_embedding(positions)
        for layer in self.layers:
            x = layer(x)
        return self.output_proj(x)


def get_args():
    parser = argparse.ArgumentParser(description="BF16 Low-Precision Master Weights Demo")
    parser.add_argument("--hidden_dim", type=int, default=32)
    parser.add_argument("--num_layers", type=int, default=2)
    parser.add_argument("--num_heads", type=int, default=4)
    parser.add_argument("--vocab_size", type=int, default=128)
    parser.add_argument("--batch_size", type=int, default=2)
    parser.add_argument("--seq_length", type=int, default=16)
    parser.add_argument("--num_steps", type=int, default=4)
    parser.add_argument("--deepspeed_config", type=str, required=True)
    parser.add_argument("--local_rank", type=int, default=-1)
    parser.add_argument("--loss_log_file", type=str, default=None)
    parser.add_argument("--seed", type=int, default=42)
    return parser.parse_args()


def main():
    args = get_args()
    deepspeed.init_distributed()
    local_rank = args.local_rank
    if local_rank == -1:
        local_rank = int(deepspeed.comm.get_rank())
    world_size = deepspeed.comm.get_world_size()
    device = get_accelerator().device_name(local_rank)
    get_accelerator().set_device(local_rank)
    torch.manual_seed(args.seed)
    get_accelerator().manual_seed_all(args.seed)
    model = SimpleTransformerModel(args.vocab_size, args.hidden_dim, args.num_layers, args.num_heads,
                                   args.seq_length)
    with open(args.deepspeed_config) as f:
        ds_config = json.load(f)
    use_autocast = ds_config.get("torch_autocast", {}).get("enabled", False)
    autocast_dtype = torch.bfloat16 if "bfloat16" in ds_config.get("torch_autocast", {}).get("dtype", "bfloat16") \
        else torch.float16
    model_engine, optimizer, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(),
                                                         config=args.deepspeed_config)
    model_engine.train()
    loss_fn = nn.CrossEntropyLoss()
    loss_history, fp32_history, data_sums = [], [], []
    for step in range(args.num_steps):
        input_ids = torch.randint(0, args.vocab_size, (args.batch_size, args.seq_length), device=device)
        labels = torch.randint(0, args.vocab_size, (args.batch_size, args.seq_length), device=device)
        if use_autocast:
            with torch.autocast(device_type=get_accelerator().device_name(), dtype=autocast_dtype):
                logits = model_engine(input_ids)
                loss = loss_fn(logits.view(-1, args.vocab_size), labels.view(-1))
        else:
            logits = model_engine(input_ids)
            loss = loss_fn(logits.view(-1, args.vocab_size), labels.view(-1))
        loss.backward()
        model_engine.step()
        loss_history.append(loss.item())
        data_sums.append(int(input_ids.sum() + labels.sum()))
        with torch.no_grad():  # the same bf16 logits' loss in fp32: finer than bf16's 2^-8 steps
            fp32_history.append(loss_fn(logits.float().view(-1, args.vocab_size), labels.view(-1)).item())
        print(f"[Rank {local_rank}/{world_size}] Step {step}: loss={loss.item():.4f} "
              f"alloc_mem={get_accelerator().memory_allocated()}")
    _losslog.write(args.loss_log_file, {"losses": loss_history, "fp32_losses": fp32_history, "data_sums": data_sums, "logits_dtype": str(logits.dtype)})
    model_engine.destroy()


if __name__ == "__main__":
    main()
