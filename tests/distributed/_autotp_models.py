"""Tiny Hugging Face decoders for the AutoTP tests (built from configs, no downloads).

Each family is chosen for what it exercises: Llama with GQA (4 heads, 2 KV heads: split at
TP 2, replicated at TP 4) and attention biases (replicated k/v biases at TP 4, a row-parallel
o_proj bias), Qwen2 (biases on q/k/v), GPT-2 (Conv1D transposed weights, a
fused c_attn, tied embeddings), GPT-NeoX (per-head packed query_key_value), Phi-3 (fused
qkv and gate_up, head counts read from the config in the forward).
"""

from __future__ import annotations

import torch

VOCAB, SEQ = 96, 12


def build(family: str, seed: int = 0, *, meta: bool = False, layers: int = 2, hidden: int = 32,
          heads: int = 4, kv: int = 2, inter: int = 64, vocab: int = VOCAB):
    import transformers as tf

    common = dict(vocab_size=vocab, hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=heads,
                  intermediate_size=inter, max_position_embeddings=64)
    if family == "llama":
        cfg = tf.LlamaConfig(num_key_value_heads=kv, tie_word_embeddings=False, attention_bias=True, **common)
    elif family == "qwen2":
        cfg = tf.Qwen2Config(num_key_value_heads=heads, tie_word_embeddings=False, **common)
    elif family == "gpt2":
        cfg = tf.GPT2Config(vocab_size=vocab, n_embd=hidden, n_layer=layers, n_head=heads, n_positions=64,
                            n_inner=inter, bos_token_id=0, eos_token_id=0, resid_pdrop=0.0, embd_pdrop=0.0,
                            attn_pdrop=0.0, tie_word_embeddings=True)
    elif family == "gpt_neox":
        cfg = tf.GPTNeoXConfig(bos_token_id=0, eos_token_id=0, hidden_dropout=0.0, attention_dropout=0.0,
                               tie_word_embeddings=False,
                               use_parallel_residual=True, **common)
    elif family == "phi3":
        cfg = tf.Phi3Config(num_key_value_heads=heads, bos_token_id=0, eos_token_id=0, tie_word_embeddings=False,
                            resid_pdrop=0.0,
                            embd_pdrop=0.0, attention_dropout=0.0, pad_token_id=0, **common)
    else:
        raise ValueError(family)
    cfg._attn_implementation = "eager"
    torch.manual_seed(seed)
    if meta:
        with torch.device("meta"):
            return tf.AutoModelForCausalLM.from_config(cfg)
    model = tf.AutoModelForCausalLM.from_config(cfg).float()
    if family in ("qwen2", "llama"):  # HF zero-inits biases: make them matter
        with torch.no_grad():
            for n, p in model.named_parameters():
                if n.endswith("bias"):
                    p.normal_(0.0, 0.1)
    return model


def batch(step: int, b: int = 2, seq: int = SEQ, vocab: int = VOCAB) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 + step)
    return torch.randint(0, vocab, (b, seq), generator=g)
