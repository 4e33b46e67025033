"""What a walk launches on a GPU, counted on a CPU (trl_dta/testing/launches.py): every ATen operator a
walk dispatches is a kernel launch and host time there. The walk of a GRPO group, as it runs on CUDA (its
calls attend per segment through the flash kernel, stood in for by one operator each way; the plan of the
CUDA cost model within a GPU's memory), dispatches at most 1.5x the operators of a dense forward and backward
of the same rows: the whole group is one call, and nothing per layer is added to the model's own."""

from __future__ import annotations

import torch
from transformers import Qwen3Config, Qwen3ForCausalLM

from trl_dta import PrefixTrie, TreeExecutor
from trl_dta.testing.launches import OpCounter
from trl_dta.testing.varlen import counted_varlen_attn, flash_on_cpu
from trl_dta.walk.cost.costs import CallCost

LIMIT = 1.5  # walk / dense operators (issue 53: 3.6x before attention per segment)


def group(prompt: int = 300, completions: int = 16, length: int = 100):
    gen = torch.Generator().manual_seed(1)
    head = torch.randint(1, 500, (prompt,), generator=gen).tolist()
    return [head + torch.randint(1, 500, (length,), generator=gen).tolist() for _ in range(completions)]


def test_a_grpo_group_walk_launches_at_most_1_5x_dense():
    config = Qwen3Config(
        vocab_size=512,
        hidden_size=64,
        intermediate_size=192,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        num_hidden_layers=4,
        attn_implementation="sdpa",
    )
    torch.manual_seed(0)
    model = Qwen3ForCausalLM(config).train()
    seqs, prompt = group(), 300
    trie = PrefixTrie.from_sequences(seqs)
    froms = [prompt - 1] * len(seqs)

    def loss(i, logps, entropies):
        return -logps.sum()

    calls, kernel = 1 << 16, flash_on_cpu(counted_varlen_attn)  # (a GPU's cap on calls: DEVICE_COSTS["cuda"])
    executor = TreeExecutor(
        model, memory_budget=60e9, batch_tokens=calls, subtree_tokens=calls, attention_kernel=kernel
    )
    executor.call_cost = CallCost.for_model(config, "cuda", kernel)
    executor.backward(trie, loss, score_from=froms)  # (warm: first-call checks)
    calls = executor.calls.forward
    with OpCounter() as walk:
        executor.backward(trie, loss, score_from=froms)
    calls = executor.calls.forward - calls
    ids = torch.tensor(seqs)
    with OpCounter() as dense:  # one padded batch, the LM head on completion positions (TRL's)
        logits = model(input_ids=ids, logits_to_keep=ids.shape[1] - prompt + 1).logits[:, :-1]
        logps = torch.log_softmax(logits.float(), -1).gather(-1, ids[:, prompt:, None]).squeeze(-1)
        (-logps.sum()).backward()
    assert calls == 1  # the whole group in one call (its gathered attention recomputed in the backward:)
    assert walk.by_name["varlen"] == 2 * config.num_hidden_layers == 2 * walk.by_name["varlen_backward"]
    print(f"walk {walk.ops} operators, dense {dense.ops}: {walk.ops / dense.ops:.2f}x")
    assert walk.ops <= LIMIT * dense.ops, (walk.ops, dense.ops, walk.by_name.most_common(12))
