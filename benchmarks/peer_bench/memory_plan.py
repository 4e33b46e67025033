"""The peer benchmark's memory estimate per method (``peers.py --plan``, the decisive table's "predicted"
column): what one training step of a method holds on the device at its peak, against the card's memory.

    peak = fixed + held tokens x layers x A + logit positions x vocabulary x (b + 8) + method's extra

* ``fixed``: weights, gradients and AdamW's two states, all in the parameters' dtype (``b`` bytes each, as
  ``torch.optim.AdamW`` keeps them for a bf16 model): ``4 b`` per parameter. The benchmark itself runs no
  optimizer, so its measured peaks are ``2 b`` per parameter below this.
* ``A``: the bytes autograd saves per token and decoder layer (``layer_bytes``) of a Hugging Face
  Llama/Qwen3 layer without checkpointing, sdpa with a flash or memory-efficient kernel: each RMSNorm an fp32
  copy of its input and the normalised input (``(4 + b) h`` each, two norms and Qwen3's q/k norms), the q/k/v
  input, RoPE's inputs, the attention's q, k, v and output, the output projection's input, and the MLP's
  input, gate and up outputs, activation and product (``b (h + 4 I)``). Qwen3-0.6B in bf16: 88,064 bytes.
* logits: the bf16 logits, their fp32 log-softmax and its fp32 gradient at every scored position.
* Per method, the tokens held at once (``held``) and the extras:
  - ``dense``: one padded micro-batch (rows x (longest prompt + longest completion)), every layer whole;
  - ``dense_ckpt``: the same micro-batch, each layer's input kept (``b h``) plus one layer recomputed whole;
  - ``pg`` / ``pg_lmhead``: one group's packed row (prompt + its completions); its suffix attention adds each
    completion's copy of the padded prompt + completion K/V, before and after the GQA repeat, and the
    bottom-right mask (bool and its additive form), per layer; ``pg`` scores every position, ``pg_lmhead``
    the completions';
  - ``tree_mask``: every unique token, the ancestor mask (bool once, additive per layer);
  - ``trl_packing``: every unique token, each segment's gathered path K/V per layer;
  - ``tree`` (the walk, TreeExecutor's defaults): the library's own memory model
    (``trl_dta.walk.memory.memory_model``, checked within 20% of the first GPU run's walks by
    ``tests/test_memory_model.py``) on the plan the walk builds on that card: ``memory_budget="auto"``'s
    budgets from the card's memory less the weights, gradients and AdamW states, the CUDA cost model with
    attention per segment through the flash kernel; its peak step by step (``plan_peak``). Its floor: the
    deepest path's K/V plus one 2,048-token call (``WALK_FLOOR_TOKENS``), what halved budgets come down to.
* ``fits``: the estimate within ``USABLE`` of the card (the rest: the CUDA context, cuBLAS workspaces, the
  allocator's fragmentation).

Checked against the first GPU run (shared/gpu-runs/2026-12-04, Qwen3-0.6B, grpo-4k-g16, bf16, one group per
micro-batch; peaks above the weights, ``Estimate.step``): dense + checkpointing measured 31.3 GB (estimate
31.0), PrefixGrouper 80.4 GB (85.4); dense without checkpointing, which ran out of memory on the 141 GB H200,
is estimated at 211 GB (tests/test_peers_bench.py checks them).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from transformers import Qwen3Config

from trl_dta import PrefixTrie
from trl_dta.walk.attention.torch_varlen import TORCH_VARLEN
from trl_dta.walk.cost.costs import CallCost
from trl_dta.walk.memory.memory_budget import AUTO_FRACTION
from trl_dta.walk.memory.memory_model import activation_bytes, plan_peak, token_budgets
from trl_dta.walk.plan import build_plan
from trl_dta.walk.scoring import scored_from

from .workloads import Workload

H200_BYTES = 150.1e9  # an H200 as torch reports it (139.8 GiB; sold as 141 GB)
METHODS = ("dense", "dense_ckpt", "pg", "pg_lmhead", "tree_mask", "trl_packing", "tree")  # estimated
USABLE = 0.92  # of the card's memory
WALK_FLOOR_TOKENS = 2048


def layer_bytes(p: dict, b: int) -> int:
    """Bytes autograd saves per token in one decoder layer (the module docstring's ``A``); ``p``: a
    ``workloads.MODELS`` entry, ``b``: bytes per element of the model's dtype."""
    h, inter, d = p["hidden_size"], p["intermediate_size"], p["head_dim"]
    q, kv = p["num_attention_heads"] * d, p["num_key_value_heads"] * d
    norms = 2 * (4 + b) * h + (4 + b) * (q + kv)  # input and post-attention norms; q/k norms
    attention = b * h + 2 * b * (q + kv) + b * (2 * q + 2 * kv) + b * q  # qkv input, RoPE, sdpa, o_proj input
    mlp = b * h + 4 * b * inter
    return norms + attention + mlp


@dataclass
class Estimate:
    """One method's peak on one step, in bytes, by part."""

    method: str
    fixed: int
    activations: int
    logits: int
    extra: int
    held_tokens: int
    floor: int | None = None  # the walk: what its budgets cannot split

    @property
    def total(self) -> int:
        return self.fixed + self.activations + self.logits + self.extra

    @property
    def step(self) -> int:
        """What a step adds to the memory held before it (the weights): its gradients, activations and
        logits, no optimizer states; what the benchmark measures as a peak above its start."""
        return self.total - 3 * self.fixed // 4

    def fits(self, card_bytes: float) -> bool:
        return (self.floor if self.floor is not None else self.total) <= USABLE * card_bytes


def estimate(
    method: str,
    wl: Workload,
    p: dict,
    b: int,
    params: int,
    micro_batch: int | None = None,
    card_bytes: float = H200_BYTES,
) -> Estimate:
    """``method``'s peak on workload ``wl`` for model ``p`` (``workloads.MODELS`` entry, ``params`` its
    parameters) in a dtype of ``b`` bytes; ``micro_batch``: rows per dense micro-batch (None: a group);
    ``card_bytes``: the card's memory (the walk's "auto" budgets depend on it)."""
    layers, vocab = p["num_hidden_layers"], p["vocab_size"]
    per_token, logit_bytes = layers * layer_bytes(p, b), vocab * (b + 8)
    kv = 2 * p["num_key_value_heads"] * p["head_dim"] * b  # K and V, one token, one layer
    heads = p["num_attention_heads"] * p["head_dim"] * 2 * b
    fixed = 4 * b * params

    if method in ("dense", "dense_ckpt"):
        worst = (0, 0, 0)  # (padded tokens, scored positions, bytes)
        for prompts, comps in _micro_batches(wl, micro_batch):
            tokens = len(comps) * (max(map(len, prompts)) + max(map(len, comps)))
            scored = len(comps) * (max(map(len, comps)) + 1)
            if method == "dense":
                held = tokens * per_token
            else:
                held = tokens * layers * b * p["hidden_size"] + tokens * layer_bytes(p, b)
            worst = max(worst, (tokens, scored, held + scored * logit_bytes), key=lambda w: w[2])
        tokens, scored, _ = worst
        activations = worst[2] - scored * logit_bytes
        return Estimate(method, fixed, activations, scored * logit_bytes, 0, tokens)
    if method in ("pg", "pg_lmhead"):
        worst = None
        for prompt, comps in wl.groups:
            tokens = len(prompt) + sum(map(len, comps))
            scored = tokens if method == "pg" else sum(map(len, comps))
            width = len(prompt) + max(map(len, comps))  # the suffix attention's padded keys
            extra = layers * len(comps) * (width * (kv + heads) + max(map(len, comps)) * width * (1 + b))
            e = Estimate(method, fixed, tokens * per_token, scored * logit_bytes, extra, tokens)
            worst = e if worst is None or e.total > worst.total else worst
        return worst
    trie = PrefixTrie.from_sequences([s for s, _ in wl.rows])
    unique = trie.num_unique_tokens
    scored = _scored_positions(wl, trie)
    if method == "tree_mask":
        extra = unique * unique * (1 + b * layers)
        return Estimate(method, fixed, unique * per_token, scored * logit_bytes, extra, unique)
    if method == "trl_packing":
        path_keys = sum(node.end for node in trie.nodes())  # every segment's root-to-segment path, end to end
        return Estimate(
            method, fixed, unique * per_token, scored * logit_bytes, layers * path_keys * kv, unique
        )
    if method == "tree":
        e = _walk(wl, trie, p, b, params, fixed, card_bytes)
        e.floor = min(
            e.total, fixed + trie.max_depth * layers * kv + WALK_FLOOR_TOKENS * (per_token + logit_bytes)
        )
        return e
    raise ValueError(f"no memory estimate for method {method!r}")


def _walk(wl: Workload, trie: PrefixTrie, p: dict, b: int, params: int, fixed: int, card: float) -> Estimate:
    """The walk's peak by the library's memory model, on the plan its defaults build on ``card``."""
    config = Qwen3Config(**p)
    dtype = torch.bfloat16 if b == 2 else torch.float32
    path = max((n.start for n in trie.nodes() if n.is_leaf), default=0)
    memory = AUTO_FRACTION * (card - b * params) - 3 * b * params  # "auto": free less grads and AdamW
    budgets = token_budgets(config, dtype, memory, "cuda", path, entropy_grad=False)
    per = activation_bytes(config, dtype, entropy_grad=False)
    costs = CallCost.for_model(config, "cuda", TORCH_VARLEN)
    plan = build_plan(trie, budgets.block_size, budgets.batch_tokens, True, budgets.subtree_tokens, costs)
    froms = [plen - 1 for _, plen in wl.rows]  # (the flash kernel's gathered keys: recomputed, not kept)
    peak = plan_peak(plan, config, per, scored_from(trie, froms)[1], TORCH_VARLEN)
    calls = sum(1 for step in plan if hasattr(step, "segments") or getattr(step, "keep_graph", False))
    return Estimate("tree", fixed, int(peak.graphs + peak.path_kv), int(peak.head), 0, calls)


def _micro_batches(wl: Workload, micro_batch: int | None):
    """(prompts, completions) per dense micro-batch, as ``methods.micro_batches`` cuts them."""
    if micro_batch is None:
        for prompt, comps in wl.groups:
            yield [prompt] * len(comps), comps
        return
    rows = [(p, c) for p, cs in wl.groups for c in cs]
    for lo in range(0, len(rows), micro_batch):
        chunk = rows[lo : lo + micro_batch]
        yield [p for p, _ in chunk], [c for _, c in chunk]


def _scored_positions(wl: Workload, trie: PrefixTrie) -> int:
    """Positions of the step's trie that score a completion token (a shared one scores once): its unique
    tokens less the prompts', plus each distinct prompt's last position (it scores the first completion
    token)."""
    prompts = PrefixTrie.from_sequences([s[:plen] for s, plen in wl.rows])
    return trie.num_unique_tokens - prompts.num_unique_tokens + prompts.num_leaves


def _inner(trie: PrefixTrie):
    """Nodes with at least one leaf child (the root included: leaves straight under it)."""
    nodes = [trie.root, *trie.nodes()]
    return [n for n in nodes if any(c.is_leaf for c in n.children)] or [trie.root]
