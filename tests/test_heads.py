"""The output head as a seam (trl_dta/walk/heads.py): a loss over the whole vocabulary, read from the hidden
states at the scored positions with the output head applied chunk by chunk, walked exactly (fp64, random
tries, every call kind: chunked pops, sibling leaves padded and packed, packed subtrees); the default heads
give what they gave; what a head costs reaches the memory model."""

from __future__ import annotations

import pytest
import torch
from conftest import VOCAB, cached_model, grads_of, max_rel_diff
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from test_executor import shared_prefix_sequences

from trl_dta import PrefixTrie, TreeExecutor
from trl_dta.walk.cost.costs import CallCost
from trl_dta.walk.heads import HiddenStates, LogProbs, Values, chunked
from trl_dta.walk.memory.memory_model import activation_bytes

pytestmark = pytest.mark.usefixtures("fp64_exact")
TIGHT = 1e-10


def targets_for(seqs, seed=0):
    """Per sequence, a fixed distribution over the vocabulary at each of its positions (a teacher's)."""
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(len(s) - 1, VOCAB, generator=gen, dtype=torch.float64).log_softmax(-1) for s in seqs]


def divergence(logits, teacher, temperature):
    """Reverse KL(student || teacher) summed over positions, over the whole vocabulary."""
    student = torch.log_softmax(logits / temperature, -1)
    return (student.exp() * (student - teacher)).sum()


def dense(model, seqs, froms, teachers, temperature):
    model.zero_grad(set_to_none=True)
    for i, (seq, start) in enumerate(zip(seqs, froms, strict=True)):
        logits = model(input_ids=torch.tensor([seq])).logits[0, :-1][start:]
        ((1 + 0.5 * i) * divergence(logits, teachers[i][start:], temperature)).backward()
    return grads_of(model)


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    seqs=shared_prefix_sequences(),
    block_size=st.sampled_from([2, 5, 1000]),
    batch_tokens=st.sampled_from([0, 7, None]),
    pack=st.booleans(),
    merge_all=st.booleans(),
    rows=st.sampled_from([1, 3, 1024]),
    data=st.data(),
)
def test_a_loss_over_the_whole_vocabulary_through_the_hidden_states_equals_dense(
    seqs, block_size, batch_tokens, pack, merge_all, rows, data
):
    model = cached_model("qwen3", "sdpa")
    froms = [data.draw(st.integers(0, len(s) - 2)) for s in seqs]
    teachers, temperature = targets_for(seqs), 0.8
    ref = dense(model, seqs, froms, teachers, temperature)
    executor = TreeExecutor(
        model, block_size=block_size, batch_tokens=batch_tokens, pack_leaves=pack, head=HiddenStates()
    )
    if merge_all:  # (only calls cost: leaves and subtrees merged into packed rows as the budgets allow)
        executor.call_cost = CallCost(fixed=1.0, per_token=0.0, per_pair=0.0)
    seen = []

    def loss_fn(i, hidden, entropies):
        assert entropies is None and hidden.shape == (len(seqs[i]) - 1 - froms[i], model.config.hidden_size)
        seen.append(i)
        teacher = teachers[i][froms[i] :]

        def rows_loss(chunk, k):  # (each chunk's logits over the vocabulary, recomputed in the backward)
            logits = executor.head_logits(chunk)
            return divergence(logits, teacher[k : k + chunk.shape[0]], temperature)

        return (1 + 0.5 * i) * chunked(rows_loss, hidden, rows)

    model.zero_grad(set_to_none=True)
    executor.backward(PrefixTrie.from_sequences(seqs), loss_fn, score_from=froms)
    assert sorted(seen) == list(range(len(seqs)))
    assert max_rel_diff(grads_of(model), ref) < TIGHT


def test_the_hidden_states_are_the_models_and_refuse_what_they_cannot_give():
    model = cached_model("qwen3", "sdpa")
    seqs = [[1, 2, 3, 4, 5], [1, 2, 3, 9, 8, 7], [1, 2]]
    executor = TreeExecutor(model, block_size=2, head=HiddenStates())
    hidden = executor.logprobs(PrefixTrie.from_sequences(seqs), score_from=[1, 2, 0])
    with torch.no_grad():
        for i, (seq, start) in enumerate(zip(seqs, [1, 2, 0], strict=True)):
            out = model(input_ids=torch.tensor([seq]), output_hidden_states=True)
            torch.testing.assert_close(hidden[i], out.hidden_states[-1][0, :-1][start:], rtol=0, atol=1e-12)
            torch.testing.assert_close(executor.head_logits(hidden[i]), out.logits[0, :-1][start:])
    for kwargs in ({"entropies": True}, {"temperature": 0.7}):
        with pytest.raises(ValueError, match="applies the output head itself"):
            executor.logprobs(PrefixTrie.from_sequences(seqs), **kwargs)


def test_the_default_head_is_log_probs_and_a_value_models_values():
    assert isinstance(TreeExecutor(cached_model("qwen3", "sdpa")).head, LogProbs)
    config = cached_model("qwen3", "sdpa").config
    per = {
        name: activation_bytes(config, torch.bfloat16, entropy_grad=True, head=head)
        for name, head in (("logprobs", LogProbs()), ("values", Values()), ("hidden", HiddenStates()))
    }
    d, v = config.hidden_size, config.vocab_size
    assert per["logprobs"] == activation_bytes(config, torch.bfloat16, entropy_grad=True)  # (the default)
    assert per["values"] == activation_bytes(config, torch.bfloat16, entropy_grad=True, outputs=1)
    assert per["logprobs"].scored == 8 * v + 2 * d and per["logprobs"].transient == 8 * v
    assert per["hidden"].scored == 4 * d + 2 * d and per["hidden"].transient == 8 * v  # (the loss's chunk)
