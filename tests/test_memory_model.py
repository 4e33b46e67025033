"""The memory and cost models against what the first GPU run measured (docs/gpu-2026-12-04.json: one H200).

Each measured walk is rebuilt on this CPU (the same shape, budgets and plan: the plan as the CUDA constants
of that run built it) and the models evaluated on it: the walk's activation memory step by step
(``trl_dta.walk.memory.memory_model.plan_peak``, with the bytes that run's setting adds: autocast's weight
copies, the walk's gradients), dense + gradient checkpointing's (``benchmarks/vllm_memory.py``), and the
walk's time by the shipped CUDA constants (``trl_dta.walk.cost.costs.DEVICE_COSTS``). Each must land within
20% of the GPU's figure.
"""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from peer_bench.workloads import MODELS, approx_params, shapes_for  # benchmarks/, on pytest's pythonpath
from transformers import Qwen3Config

from trl_dta import PrefixTrie
from trl_dta.walk.attention.flex import FLEX_TILES
from trl_dta.walk.attention.masked import ModelAttention
from trl_dta.walk.attention.sdpa import SDPA_SEGMENTS
from trl_dta.walk.attention.torch_varlen import TORCH_VARLEN
from trl_dta.walk.cost.costs import CallCost
from trl_dta.walk.memory.memory_model import activation_bytes, plan_peak
from trl_dta.walk.plan import build_plan, plan_seconds
from trl_dta.walk.scoring import scored_from

DATA = json.loads((Path(__file__).parents[1] / "docs" / "gpu-2026-12-04.json").read_text())
WITHIN = 0.2
# how the 2026-12-04 run's records name the attention its walks ran: the kernel that attends so now
RECORDED_ATTENTION = {
    "mask": ModelAttention("sdpa"),
    "flex": FLEX_TILES,
    "segments": SDPA_SEGMENTS,
    "flash": TORCH_VARLEN,
}
THEN = 182 * 5e-6  # the CUDA fixed cost per layer and call the measured plans were built with (3494ed2)


def measured_step(entry):
    """The entry's model config, trie and where each sequence's scored part starts."""
    config = Qwen3Config(**MODELS[entry["model"]])
    workload = next(
        w for w in shapes_for("gpu", config.vocab_size, entry["scale"]) if w.name == entry["shape"]
    )
    seqs = [p + c for p, cs in workload.groups for c in cs]
    froms = [len(p) - 1 for p, cs in workload.groups for c in cs]
    return config, PrefixTrie.from_sequences(seqs), froms


def measured_plan(entry, config, trie):
    """The plan the GPU walked: its budgets, its call costs (that run's CUDA constants) or none."""
    b = entry["budgets"]
    costs = None
    if entry.get("cost_model"):
        costs = CallCost.for_model(config, "cuda")
        costs = replace(costs, fixed=THEN * config.num_hidden_layers)
    return build_plan(trie, b["block_size"], b["batch_tokens"], True, b["subtree_tokens"], costs)


@pytest.mark.parametrize("entry", [e for e in DATA["memory"] if "budgets" in e], ids=lambda e: e["name"][:40])
def test_the_walks_memory_model_lands_within_20_percent_of_the_gpu(entry):
    config, trie, froms = measured_step(entry)
    plan = measured_plan(entry, config, trie)
    per = activation_bytes(config, torch.bfloat16, entropy_grad=False, autocast=entry["autocast"])
    kernel = RECORDED_ATTENTION[entry["attention"]]
    peak = plan_peak(plan, config, per, scored_from(trie, froms)[1], kernel).total
    params = approx_params(entry["model"])
    peak += (entry["gradient_bytes_per_param"] + entry["weight_copy_bytes_per_param"]) * params
    assert abs(peak / entry["measured_bytes"] - 1) <= WITHIN, (peak / 1e9, entry["measured_bytes"] / 1e9)


def test_dense_checkpointings_memory_model_lands_within_20_percent_of_the_gpu():
    import vllm_memory

    entry = next(e for e in DATA["memory"] if e["name"].startswith("dense"))
    config = Qwen3Config(**MODELS[entry["model"]])
    seqs, froms, _ = vllm_memory.step(entry["scale"], config.vocab_size)
    peak = vllm_memory.dense_checkpointed_peak(config, seqs, froms, entry["dense_micro_batch"])
    assert abs(peak / entry["measured_bytes"] - 1) <= WITHIN, (peak / 1e9, entry["measured_bytes"] / 1e9)


@pytest.mark.parametrize("entry", DATA["times"], ids=lambda e: e["name"][:40])
def test_the_cuda_cost_model_lands_within_20_percent_of_the_gpus_walk_times(entry):
    config, trie, _ = measured_step(entry)
    plan = measured_plan({**entry, "cost_model": "cuda"}, config, trie)
    predicted = plan_seconds(plan, CallCost.for_model(config, "cuda"), True)
    assert abs(predicted / entry["measured_s"] - 1) <= WITHIN, (predicted, entry["measured_s"])
