"""RowLoss against TRL's own GRPOTrainer._compute_loss: same value, same gradients, every loss type/option.

TRL's method runs on a stand-in trainer object (single process, identity collectives) whose log-prob
function returns leaf tensors, so the comparison needs no model and covers the whole option space fast.
"""

from __future__ import annotations

from collections import defaultdict
from types import SimpleNamespace

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from trl import GRPOTrainer

from trl_dta.train.ppo.losses import LOSS_TYPES, LossSettings, RowLoss

B, T = 5, 7


class _Accelerator:
    num_processes = 1
    sync_gradients = True

    def gather(self, x):
        return x

    gather_for_metrics = gather

    def reduce(self, x, reduction="sum"):
        return x

    def pad_across_processes(self, x, dim=0, pad_index=0):
        return x


def fake_trainer(opts, logps, entropies):
    args = SimpleNamespace(
        delta=opts["delta"],
        use_bias_correction_kl=opts["bias_kl"],
        sapo_temperature_pos=1.0,
        sapo_temperature_neg=1.05,
        vespo_k_pos=2.0,
        vespo_lambda_pos=3.0,
        vespo_k_neg=3.0,
        vespo_lambda_neg=2.0,
        steps_per_generation=opts["spg"],
        entropy_target=0.5,
    )
    fake = SimpleNamespace(
        args=args,
        loss_type=opts["loss_type"],
        epsilon_low=0.2,
        epsilon_high=0.28,
        beta=opts["beta"],
        importance_sampling_level=opts["is_level"],
        off_policy_mask_threshold=opts["off_policy"],
        use_vllm=opts["vllm_is"],
        vllm_importance_sampling_correction=opts["vllm_is"],
        max_completion_length=T,
        top_entropy_quantile=opts["top_q"],
        accelerator=_Accelerator(),
        model=SimpleNamespace(training=opts["train"]),
        current_gradient_accumulation_steps=opts["ga"],
        _entropy_bonus_enabled=opts["entropy_coef"] != 0.0,
        entropy_coef=opts["entropy_coef"],
        use_adaptive_entropy=False,
        aux_loss_enabled=False,
        _metrics={"train": defaultdict(list), "eval": defaultdict(list)},
        get_off_policy_mask=GRPOTrainer.get_off_policy_mask,
        get_gamma_weights=GRPOTrainer.get_gamma_weights,
    )
    fake.get_high_entropy_mask = lambda e, m, q: GRPOTrainer.get_high_entropy_mask(fake, e, m, q)
    fake._get_per_token_logps_and_entropies = lambda *a, **k: (logps, entropies, None)
    return fake


def make_inputs(opts, gen):
    lengths = torch.randint(1, T + 1, (B,), generator=gen)
    completion_mask = (torch.arange(T)[None] < lengths[:, None]).float()
    completion_mask[0] = 0.0  # a mask_truncated_completions row
    inputs = {
        "prompt_ids": torch.zeros(B, 2, dtype=torch.long),
        "prompt_mask": torch.ones(B, 2),
        "completion_ids": torch.zeros(B, T, dtype=torch.long),
        "completion_mask": completion_mask,
        "advantages": torch.randn(B, generator=gen),
        "num_items_in_batch": completion_mask.sum() * opts["spg"] + 3,
    }
    if opts["tool_mask"]:
        inputs["tool_mask"] = (torch.rand(B, T, generator=gen) > 0.3).float()
    if opts["old"]:
        inputs["old_per_token_logps"] = -torch.rand(B, T, generator=gen, dtype=torch.float64).float() * 3
    if opts["beta"]:
        inputs["ref_per_token_logps"] = -torch.rand(B, T, generator=gen) * 3
    if opts["vllm_is"]:
        inputs["importance_sampling_ratio"] = 0.5 + torch.rand(B, T, generator=gen)
        inputs["sampling_per_token_logps"] = -torch.rand(B, T, generator=gen) * 3
    return inputs, lengths


OPTIONS = st.fixed_dictionaries(
    {
        "loss_type": st.sampled_from(LOSS_TYPES),
        "is_level": st.sampled_from(["token", "sequence"]),
        "beta": st.sampled_from([0.0, 0.04]),
        "bias_kl": st.booleans(),
        "delta": st.sampled_from([None, 1.3]),
        "off_policy": st.sampled_from([None, 0.05]),
        "vllm_is": st.booleans(),
        "top_q": st.sampled_from([1.0, 0.6]),
        "entropy_coef": st.sampled_from([0.0, 0.05]),
        "tool_mask": st.booleans(),
        "old": st.booleans(),
        "train": st.booleans(),
        "ga": st.sampled_from([1, 3]),
        "spg": st.sampled_from([1, 3]),
        "seed": st.integers(0, 10_000),
    }
)


def check_row_loss_matches_trl(opts):
    gen = torch.Generator().manual_seed(opts["seed"])
    inputs, lengths = make_inputs(opts, gen)
    if opts["old"]:  # current log-probs near the old ones, so some ratios clip and some do not
        base = inputs["old_per_token_logps"]
    else:
        base = -torch.rand(B, T, generator=gen) * 3
    logps = (base + 0.4 * torch.randn(B, T, generator=gen)).requires_grad_(True)
    entropies = (torch.rand(B, T, generator=gen) * 2).requires_grad_(True)

    fake = fake_trainer(opts, logps, entropies)
    ref_loss = GRPOTrainer._compute_loss(fake, None, inputs)
    ref_loss.backward()

    mask = inputs["completion_mask"] * inputs.get("tool_mask", 1.0)
    entropy_mask = None
    if opts["top_q"] < 1.0:
        entropy_mask = fake.get_high_entropy_mask(entropies.detach(), mask, 1 - opts["top_q"])
    ga = opts["ga"] if opts["train"] else 1
    row_loss = RowLoss(
        LossSettings.from_trainer(fake),
        inputs,
        ga,
        entropy_mask,
        opts["entropy_coef"],
        training=opts["train"],
    )
    lp2 = logps.detach().clone().requires_grad_(True)
    ent2 = entropies.detach().clone().requires_grad_(True)
    total = sum(row_loss(i, lp2[i, : lengths[i]], ent2[i, : lengths[i]]) for i in range(B))
    total.backward()

    # fp32; rtol: the suite's parity bound. The total sums its terms per row here, over the (B, T) tensor in
    # TRL: cancelling to near 0, it keeps the rounding of their O(0.1..1) sum (seen 4e-8), hence atol 1e-6.
    # A gradient is its token's formula times per-row factors (sums of <= T terms): a few ulps (seen 2e-8)
    torch.testing.assert_close(total.detach(), ref_loss.detach(), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(lp2.grad, logps.grad, rtol=1e-5, atol=1e-7)
    torch.testing.assert_close(ent2.grad, entropies.grad, rtol=1e-5, atol=1e-7)
    return ref_loss


@settings(max_examples=300, deadline=None)
@given(opts=OPTIONS)
def test_row_loss_matches_trl_compute_loss(opts):
    check_row_loss_matches_trl(opts)


@pytest.mark.parametrize("loss_type", LOSS_TYPES)
def test_each_loss_type_with_every_option_on(loss_type):
    opts = dict(
        loss_type=loss_type,
        is_level="token",
        beta=0.04,
        bias_kl=True,
        delta=1.3,
        off_policy=0.05,
        vllm_is=True,
        top_q=0.6,
        entropy_coef=0.05,
        tool_mask=True,
        old=True,
        train=True,
        ga=3,
        spg=3,
        seed=1,
    )
    check_row_loss_matches_trl(opts)
    check_row_loss_matches_trl(
        {**opts, "is_level": "sequence", "vllm_is": False, "top_q": 1.0, "delta": None}
    )
