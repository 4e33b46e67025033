"""The offline GRPOTrainer fixture (trl_dta/testing/grpo.py): scripted multi-turn tool rollouts whose groups
share the prompt and the whole first tool-call turn, recorded gradients, and bit-identical repeated runs."""

from __future__ import annotations

import torch

from trl_dta.testing.grpo import (
    GradRecorder,
    ScriptedGRPOTrainer,
    cancel_order,
    get_order_status,
    make_config,
    make_trainer,
    tiny_tokenizer,
)


def _run(tmp_path, **config_overrides):
    rec = GradRecorder()
    trainer = make_trainer(ScriptedGRPOTrainer, make_config(tmp_path, **config_overrides), callbacks=[rec])
    trainer.train()
    return trainer, rec


def _rows(batch):
    """Unpadded (prompt, completion, tool_mask) lists per row."""
    out = []
    for r in range(batch["prompt_ids"].shape[0]):
        p = batch["prompt_ids"][r][batch["prompt_mask"][r].bool()].tolist()
        m = batch["completion_mask"][r].bool()
        out.append((p, batch["completion_ids"][r][m].tolist(), batch["tool_mask"][r][m].tolist()))
    return out


def _lcp(a, b):
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def test_scripted_tool_rollouts_share_first_turn_and_are_deterministic(tmp_path):
    tok = tiny_tokenizer()
    G = 4
    # 8 rows = 2 prompts x 4 generations in one generation batch, used for 2 optimizer steps.
    trainer, rec = _run(tmp_path / "a", per_device_train_batch_size=8, num_generations=G)
    assert len(trainer.generation_batches) == 1 and len(trainer.step_inputs) == 2
    batch = trainer.generation_batches[0]
    assert "old_per_token_logps" in batch and "tool_mask" in batch
    rows = _rows(batch)
    tools = {"get_order_status": get_order_status, "cancel_order": cancel_order}
    for g in range(len(rows) // G):
        group = rows[g * G : (g + 1) * G]
        prompt, comp0, mask0 = group[0]
        # The tool response is the single run of tool_mask == 0; the first turn ends where it ends.
        start = mask0.index(0)
        end = start + mask0[start:].index(1)
        assert start > 0 and 0 not in mask0[end:]  # one run of tool tokens, after the generated call
        shared = comp0[:end]
        text = tok.decode(shared)
        assert "<tool_call>" in text and "</tool_call><|im_end|>" in text
        response = tok.decode(shared[start:])
        assert response.startswith("\n<|im_start|>user\n<tool_response>\n")
        assert response.endswith("</tool_response><|im_end|>\n<|im_start|>assistant\n")
        # The response is what TRL got by executing the scripted call.
        name = "cancel_order" if "cancel_order" in text.split("<tool_call>")[1] else "get_order_status"
        oid = text.split('"order_id": "')[1].split('"')[0]
        expected = tools[name](oid, "changed my mind") if name == "cancel_order" else tools[name](oid)
        assert expected in response
        for p, c, m in group:
            assert p == prompt  # same prompt
            assert c[:end] == shared and m[:end] == mask0[:end]  # same first turn, tool response included
            assert m[end:] == [1] * (len(c) - end)  # the final answer is trained on
            assert c[-1] == tok.eos_token_id  # terminated, not truncated
        tails = [tuple(c[end:]) for _, c, _ in group]
        assert len({len(t) for t in tails}) == G  # the final answers differ, in length too
        lcp = max(_lcp(a, b) for i, a in enumerate(tails) for b in tails[i + 1 :])
        assert 0 < lcp < 12  # ... right after a short common opening
        adv = batch["advantages"][g * G : (g + 1) * G]
        assert len(set(adv.tolist())) == G and adv.abs().min() > 0
    # The two groups differ in their prompt (user message) and first turn.
    assert rows[0][0] != rows[G][0] and rows[0][1][:10] != rows[G][1][:10]
    # Each step is served the same (shuffled) generation batch.
    assert torch.equal(trainer.step_inputs[0]["completion_ids"], trainer.step_inputs[1]["completion_ids"])

    # Gradients: recorded before each of the 2 optimizer steps, for every parameter, finite, non-zero, and the
    # second differs from the first (the weights moved, so ratios != 1).
    names = [n for n, p in trainer.model.named_parameters() if p.requires_grad]
    assert len(rec.grads) == 2 and rec.steps == [0, 1]
    for grads in rec.grads:
        assert list(grads) == names
        assert all(torch.isfinite(v).all() for v in grads.values())
        assert sum(v.abs().sum().item() for v in grads.values()) > 0
        assert grads["lm_head.weight"].abs().max() > 1e-4
    assert any(not torch.equal(rec.grads[0][n], rec.grads[1][n]) for n in names)

    # A second identical run gives the same batches and bit-identical gradients.
    trainer2, rec2 = _run(tmp_path / "b", per_device_train_batch_size=8, num_generations=G)
    for k, v in batch.items():
        v2 = trainer2.generation_batches[0][k]
        assert torch.equal(v, v2) if torch.is_tensor(v) else v == v2, k
    for k, v in trainer.step_inputs[0].items():
        v2 = trainer2.step_inputs[0][k]
        assert torch.equal(v, v2) if torch.is_tensor(v) else v == v2, k
    for g1, g2 in zip(rec.grads, rec2.grads, strict=True):
        assert g1.keys() == g2.keys()
        assert all(torch.equal(g1[n], g2[n]) for n in g1)


def test_scripted_single_turn_without_tools(tmp_path):
    tok = tiny_tokenizer()
    rec = GradRecorder()
    trainer = make_trainer(ScriptedGRPOTrainer, make_config(tmp_path), tools=False, callbacks=[rec])
    trainer.train()
    batch = trainer.generation_batches[0]
    assert "tool_mask" not in batch
    rows = _rows({**batch, "tool_mask": torch.ones_like(batch["completion_ids"])})
    comps = [c for _, c, _ in rows]
    assert all(p == rows[0][0] for p, _, _ in rows)
    shared = tok.encode("Checking order A17 in the shop system now.", add_special_tokens=False)
    assert all(c[: len(shared)] == shared and c[-1] == tok.eos_token_id for c in comps)
    assert len({len(c) for c in comps}) == len(comps)
    assert len(rec.grads) == 2 and all(g["lm_head.weight"].abs().max() > 1e-4 for g in rec.grads)
    # Without budget fitting, a scripted turn longer than max_completion_length is cut without EOS, as
    # `generate` would cut it; with it (the default), every row is shortened to fit and ends with EOS.
    prompts = [rows[0][0]] * len(rows)
    trainer.max_completion_length = len(comps[1]) - 1
    fitted, _ = trainer._generate_single_turn(prompts, None, {}, len(rows))
    assert all(len(c) <= trainer.max_completion_length and c[-1] == tok.eos_token_id for c in fitted)
    trainer.scripted_fit_budget = False
    cut, _ = trainer._generate_single_turn(prompts, None, {}, len(rows))
    assert cut[0] == comps[0] and all(c == comps[i][: len(c)] for i, c in enumerate(cut))
    assert all(len(c) == trainer.max_completion_length and c[-1] != tok.eos_token_id for c in cut[1:])
