"""Hugging Face ``Trainer`` with ``deepspeed=`` (a DeepSpeed config whose ``"auto"`` values HF
fills in) on a tiny random Llama, as a user writes it: nothing here knows which DeepSpeed it
gets. Run under torchrun on CPU (gloo), each ZeRO stage of ``--zero`` in its own launch:

    torchrun --nproc_per_node 2 tests/assets/hf_trainer_ds.py --zero 2 --out OUT.json         # real DeepSpeed
    torchrun --nproc_per_node 2 -m engine.compat.deepspeed tests/assets/hf_trainer_ds.py ...   # this engine

(the second is the same file, every rank started through the alias: ``import deepspeed`` in
transformers and accelerate gives the engine). Every rank records the loss of each micro-batch
it computed (``compute_loss``'s value, before the Trainer averages and rounds it for its log),
the learning rate and grad norm HF logs each step, and rank 0 writes them with the resolved
config, the trained weights' norms and those of the file ``trainer.save_model`` wrote to ``--out``.

Origin: written for this repository against the documented Trainer / TrainingArguments API.
"""

import argparse
import json
import os

import torch
from transformers import (
    AutoModelForCausalLM,
    LlamaConfig,
    LlamaForCausalLM,
    Trainer,
    TrainerCallback,
    TrainingArguments,
)

VOCAB, SEQ, SAMPLES = 128, 16, 32
MICRO, GA, STEPS = 2, 2, 5


def ds_config(stage: int, config_optimizer: bool) -> dict:
    """A DeepSpeed config as HF's docs write one: "auto" wherever TrainingArguments decides."""
    cfg: dict = {
        "train_batch_size": "auto",
        "train_micro_batch_size_per_gpu": "auto",
        "gradient_accumulation_steps": "auto",
        "gradient_clipping": "auto",
        "fp16": {"enabled": "auto"},
        "bf16": {"enabled": "auto"},
        "zero_optimization": {"stage": stage, "overlap_comm": False, "contiguous_gradients": True,
                              "reduce_bucket_size": "auto"},
        "steps_per_print": 1000,
        "wall_clock_breakdown": False,
    }
    if stage == 3:
        cfg["zero_optimization"].update({"stage3_prefetch_bucket_size": "auto",
                                         "stage3_param_persistence_threshold": "auto",
                                         "stage3_gather_16bit_weights_on_model_save": True})
    if config_optimizer:  # DeepSpeed builds the optimizer and scheduler from the config
        cfg["optimizer"] = {"type": "AdamW", "params": {"lr": "auto", "betas": "auto", "eps": "auto",
                                                        "weight_decay": "auto"}}
        cfg["scheduler"] = {"type": "WarmupDecayLR", "params": {"warmup_min_lr": "auto", "warmup_max_lr": "auto",
                                                                "warmup_num_steps": "auto", "total_num_steps": "auto"}}
    return cfg


class RandomTokens(torch.utils.data.Dataset):
    """SAMPLES sequences of SEQ random token ids (labels = inputs: causal LM)."""

    def __init__(self) -> None:
        g = torch.Generator().manual_seed(7)
        self.ids = torch.randint(0, VOCAB, (SAMPLES, SEQ), generator=g)

    def __len__(self) -> int:
        return SAMPLES

    def __getitem__(self, i: int) -> dict:
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


class RecordingTrainer(Trainer):
    """Trainer that keeps each micro-batch's loss at full precision."""

    micro_losses: list

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        loss = super().compute_loss(model, inputs, return_outputs=return_outputs,
                                    num_items_in_batch=num_items_in_batch)
        value = loss[0] if return_outputs else loss
        self.micro_losses.append(value.detach().float().item())
        return loss


class LogRecorder(TrainerCallback):
    def __init__(self) -> None:
        self.logs: list = []

    def on_log(self, args, state, control, logs=None, **kwargs):
        if logs and "loss" in logs:
            self.logs.append({k: logs[k] for k in ("loss", "learning_rate", "grad_norm") if k in logs})


def tiny_llama(from_config: bool) -> LlamaForCausalLM:
    """``from_config``: through ``AutoModelForCausalLM.from_config``, which (after
    TrainingArguments set up a ZeRO-3 config) builds it under ``deepspeed.zero.Init`` and
    initializes the partitioned weights gathered; else the class itself, a plain module."""
    config = LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=SEQ,
                         tie_word_embeddings=False)
    torch.manual_seed(0)
    if from_config:
        return AutoModelForCausalLM.from_config(config)
    return LlamaForCausalLM(config)


def weight_norms(trainer: Trainer, stage: int) -> dict:
    """Each trained parameter's L2 norm (ZeRO-3's gathered first, as DeepSpeed's API does it)."""
    import deepspeed  # whichever this process runs on

    model = trainer.model_wrapped.module if hasattr(trainer.model_wrapped, "module") else trainer.model
    params = list(model.named_parameters())
    with deepspeed.zero.GatheredParameters([p for _, p in params], modifier_rank=None, enabled=stage == 3):
        return {n: p.detach().float().norm().item() for n, p in params}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--zero", type=int, required=True, choices=(2, 3))
    ap.add_argument("--config_optimizer", action="store_true", help="optimizer/scheduler from the ds config")
    ap.add_argument("--from_config", action="store_true",
                    help="build the model after TrainingArguments with AutoModelForCausalLM.from_config (zero.Init)")
    ap.add_argument("--out", required=True)
    ap.add_argument("--local_rank", type=int, default=-1)  # the deepspeed launcher passes it
    a = ap.parse_args()
    workdir = os.path.dirname(os.path.abspath(a.out))
    model = None if a.from_config else tiny_llama(False)
    args = TrainingArguments(
        output_dir=os.path.join(workdir, f"trainer_zero{a.zero}"), deepspeed=ds_config(a.zero, a.config_optimizer),
        per_device_train_batch_size=MICRO, gradient_accumulation_steps=GA, max_steps=STEPS,
        learning_rate=1e-2, weight_decay=0.01, adam_beta1=0.9, adam_beta2=0.95, adam_epsilon=1e-8,
        warmup_steps=2, lr_scheduler_type="linear", max_grad_norm=1.0, logging_steps=1, save_strategy="no",
        report_to="none", use_cpu=True, seed=42, data_seed=42, dataloader_num_workers=0,
        disable_tqdm=True)
    # HF's example scripts (run_clm.py) log this before building the model; reading args.device
    # sets up the process group, which zero.Init's partitioning needs
    print(f"process rank {args.process_index}, device {args.device}, world size {args.world_size}")
    if model is None:
        # on the CPU accelerate sets up torch.distributed but not deepspeed.comm, whose world size
        # zero.Init's config check reads (DeepSpeed's docs: init_distributed before zero.Init)
        import deepspeed

        deepspeed.init_distributed(dist_backend="gloo")
        model = tiny_llama(True)
    recorder = LogRecorder()
    trainer = RecordingTrainer(model=model, args=args, train_dataset=RandomTokens(), callbacks=[recorder])
    trainer.micro_losses = []
    trainer.train()
    import deepspeed

    gathered: list = [None] * torch.distributed.get_world_size()
    torch.distributed.all_gather_object(gathered, trainer.micro_losses)
    norms = weight_norms(trainer, a.zero)
    # what a user keeps: save_model writes model.safetensors (ZeRO-3: gathered, as the config's
    # stage3_gather_16bit_weights_on_model_save asks); rank 0 reads it back
    saved_dir = os.path.join(workdir, f"saved_zero{a.zero}")
    trainer.save_model(saved_dir)
    if torch.distributed.get_rank() == 0:
        from safetensors.torch import load_file

        saved = load_file(os.path.join(saved_dir, "model.safetensors"))
        saved_norms = {n: t.float().norm().item() for n, t in saved.items()}
        import accelerate
        import transformers

        result = {"deepspeed": deepspeed.__version__, "transformers": transformers.__version__,
                  "accelerate": accelerate.__version__, "zero": a.zero, "config_optimizer": a.config_optimizer,
                  "from_config": a.from_config,
                  "world_size": len(gathered), "micro_losses": gathered, "logs": recorder.logs,
                  "weight_norms": norms, "saved_norms": saved_norms,
                  "engine": type(trainer.model_wrapped).__module__}
        with open(a.out, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
