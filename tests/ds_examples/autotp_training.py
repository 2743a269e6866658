"""Mirrors DeepSpeed's AutoTP training example (the "Automatic Tensor Parallelism (Training)"
tutorial of DeepSpeed 0.19.8 and DeepSpeedExamples' AutoTP training scripts): a Hugging Face
causal LM, a DeepSpeed config with ``"tensor_parallel": {"autotp_size": N}`` and ZeRO,
``deepspeed.initialize(model=model, model_parameters=model.parameters(), config=ds_config)``
applying AutoTP sharding, and an unchanged training loop: ``outputs = engine(input_ids=...,
labels=...)``, ``engine.backward(outputs.loss)``, ``engine.step()``. As the tutorial says, all
ranks of a TP group are fed the same batches.

Differences, each for CPU: a tiny Llama built from a config with random weights instead of
``from_pretrained("meta-llama/...")`` (no download), random token ids instead of a tokenised
dataset, fp32 (``--dtype bf16`` gives the tutorial's ``"bf16": {"enabled": true}``).
"""

import argparse

import _losslog
import deepspeed
import torch
from deepspeed.accelerator import get_accelerator
from transformers import AutoModelForCausalLM, LlamaConfig

VOCAB, SEQ = 128, 16


def build_model(seed):
    cfg = LlamaConfig(vocab_size=VOCAB, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, intermediate_size=128, max_position_embeddings=64,
                      tie_word_embeddings=False)
    cfg._attn_implementation = "eager"
    torch.manual_seed(seed)
    return AutoModelForCausalLM.from_config(cfg).float()


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--local_rank", type=int, default=-1)
    parser.add_argument("--autotp_size", type=int, default=2)
    parser.add_argument("--zero_stage", type=int, default=1)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--dtype", choices=["fp32", "bf16"], default="fp32")
    parser.add_argument("--loss_log_file", type=str, default=None)
    args = parser.parse_args()
    deepspeed.init_distributed()
    model = build_model(seed=0)
    ds_config = {
        "train_micro_batch_size_per_gpu": 2,
        "gradient_accumulation_steps": 1,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "weight_decay": 0.01}},
        "zero_optimization": {"stage": args.zero_stage},
        "bf16": {"enabled": args.dtype == "bf16"},
        "tensor_parallel": {"autotp_size": args.autotp_size},
        "gradient_clipping": 1.0,
        "steps_per_print": 1000,
    }
    engine, optimizer, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(),
                                                   config=ds_config)
    device = get_accelerator().device_name(engine.local_rank)
    g = torch.Generator().manual_seed(1234)  # the same batches on every rank of a TP group
    losses = []
    engine.train()
    for _ in range(args.steps):
        input_ids = torch.randint(0, VOCAB, (2, SEQ), generator=g).to(device)
        outputs = engine(input_ids=input_ids, labels=input_ids)
        engine.backward(outputs.loss)
        engine.step()
        losses.append(outputs.loss.item())
    _losslog.write(args.loss_log_file, {"losses": losses})


if __name__ == "__main__":
    main()
