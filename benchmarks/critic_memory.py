"""What a value model costs in memory, on paper: Qwen3-1.7B and Qwen3-8B (their published configs, built
here without downloading anything), a policy alone against a policy with a value model of the same size.

    python benchmarks/critic_memory.py [--out docs/critic-memory.json]

* **Static**: weights, gradients and two Adam states per trainable parameter, with float32 master weights
  (bf16 autocast, as `bf16=True` trains: 16 bytes per parameter). A value model is the same decoder with a
  d -> 1 head instead of the LM head (a model with tied embeddings keeps the same count).
* **The walk**: the peak of one walk on the τ² step `tau2-2x8-10k` (8,704 tokens on the deepest path, as
  docs/memory.md), from `trl_dta.walk.memory.budgets.activation_bytes` (checked within 10% against autograd's
  saved bytes in tests/test_budgets.py): the path's K/V with their gradient and the graph of every token of
  the path (nothing recomputed), plus a call of 2,048 tokens and the LM head's working space. The value
  model's walk has a d -> 1 head: no log-softmax per scored token, no logits. The two walks run one after the
  other, so a step's peak is the larger, not the sum.
* **Dense with activation checkpointing** (the usual alternative): per row, each layer's input kept
  (`2 d` bytes per token and layer in bf16), one layer's activations recomputed at a time, and the LM head's
  logits and log-softmax in float32 for the row (TRL's dense forward): the longest row, 8,704 tokens.
"""

from __future__ import annotations

import argparse
import json

import torch
from transformers import Qwen3Config

from trl_dta.walk.memory.budgets import activation_bytes

GIB = 2**30
PATH, CALL = 8704, 2048  # the τ² step's deepest path (docs/memory.md), one call's tokens
MODELS = {  # the Hub configs' numbers (hidden, intermediate, layers, heads, kv heads, tied embeddings)
    "Qwen3-1.7B": dict(hidden_size=2048, intermediate_size=6144, num_hidden_layers=28, num_attention_heads=16,
                       num_key_value_heads=8, head_dim=128, tie_word_embeddings=True),
    "Qwen3-8B": dict(hidden_size=4096, intermediate_size=12288, num_hidden_layers=36, num_attention_heads=32,
                     num_key_value_heads=8, head_dim=128, tie_word_embeddings=False),
}  # fmt: skip


def parameters(config: Qwen3Config, value_model: bool) -> int:
    """Parameters of the decoder with its embeddings, plus the LM head (untied) or a d -> 1 value head."""
    d, i, layers = config.hidden_size, config.intermediate_size, config.num_hidden_layers
    q = config.num_attention_heads * config.head_dim
    kv = config.num_key_value_heads * config.head_dim
    layer = d * q + 2 * d * kv + q * d + 3 * d * i + 2 * d + 2 * config.head_dim
    embed = config.vocab_size * d
    head = d if value_model else (0 if config.tie_word_embeddings else embed)
    return embed + layers * layer + d + head


def walk_peak(config: Qwen3Config, value_model: bool) -> float:
    per = activation_bytes(config, torch.bfloat16, entropy_grad=False, outputs=1 if value_model else None)
    tokens = PATH + CALL
    head = 0 if value_model else per.transient * 1024  # the head's chunk of logits and their gradient
    return per.position * tokens + (per.token + per.scored) * tokens + head


def dense_checkpointed_peak(config: Qwen3Config, value_model: bool) -> float:
    per = activation_bytes(config, torch.bfloat16, entropy_grad=False, outputs=1 if value_model else None)
    layers = config.num_hidden_layers
    kept = 2 * config.hidden_size * layers * PATH  # each layer's input, bf16
    one_layer = per.token / layers * PATH  # the layer being recomputed
    head = 0 if value_model else 12 * config.vocab_size * PATH  # logits, log-softmax, gradient (fp32)
    return kept + one_layer + head


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=None, help="write the table as JSON here")
    args = parser.parse_args()
    rows = []
    for name, dims in MODELS.items():
        config = Qwen3Config(vocab_size=151936, **dims)
        policy, critic = parameters(config, False), parameters(config, True)
        row = {
            "model": name,
            "policy_params_b": policy / 1e9,
            "value_params_b": critic / 1e9,
            "static_policy_gib": 16 * policy / GIB,
            "static_policy_and_value_gib": 16 * (policy + critic) / GIB,
            "static_lora_value_gib": (2 * critic + 16 * 0.01 * critic) / GIB,  # bf16 frozen + 1% trained
            "walk_policy_gib": walk_peak(config, False) / GIB,
            "walk_value_gib": walk_peak(config, True) / GIB,
            "dense_ckpt_policy_gib": dense_checkpointed_peak(config, False) / GIB,
            "dense_ckpt_value_gib": dense_checkpointed_peak(config, True) / GIB,
        }
        rows.append(row)
        print(" | ".join(f"{k} {v:.1f}" if isinstance(v, float) else str(v) for k, v in row.items()))
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"path_tokens": PATH, "call_tokens": CALL, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
