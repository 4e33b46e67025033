"""Benchmark: the prefix-trie walk against the peers, same model, same loss, same gradients.

    python benchmarks/peers.py                 # CPU, full: tables, JSON, plots under docs/ (~25 min, 2 cores)
    python benchmarks/peers.py --quick         # CI-sized smoke run (tiny model and shapes, ~1 min)
    python benchmarks/peers.py --profile gpu   # what benchmarks/gpu.sh runs on a CUDA machine (bf16)
    python benchmarks/peers.py --parity        # fp32 gradient parity of every method on the device, no timing
    python benchmarks/peers.py --replot docs/peers.json --plots docs   # redraw the plots of a result file

Methods (each accumulates into ``.grad`` the gradient of the same loss: on-policy GRPO surrogate per
rollout, ``-advantage x mean log-prob of its completion tokens / rows``, log-softmax in fp32):

* ``dense``       TRL-style padded batch: one GRPO group per micro-batch (per_device_train_batch_size =
                  num_generations), prompt + right-padded completions, ``logits_to_keep`` = completion width
                  + 1 (LM head on completion positions only), as in TRL's
                  ``GRPOTrainer._get_per_token_logps_and_entropies``.
* ``dense_ckpt``  the same with gradient checkpointing (non-reentrant), TRL's default.
* ``pg``          PrefixGrouper (PyPI ``prefix-grouper``), integrated as its README describes: one packed row
                  per group (prompt, c1..cG) from ``PrefixGrouper.from_ungrouped_masks`` + ``concat_input``,
                  position ids restarting at the prompt length for every completion, the model run with its
                  registered ``prefix_grouper_attention`` and ``split_output(logits, include_prefix_last=1)``.
                  Its attention kernel must apply bottom-right-aligned causal masking over (prompt K/V
                  repeated + own completion K/V); flash-attn does, transformers' sdpa function does not (with
                  a mask it drops the causal flag and errors for G > 1), so where flash-attn is absent the
                  kernel is ``bottom_right_sdpa`` below: the same masking, written with torch sdpa. Logits
                  are computed for every position of the packed row (prompt included), as PrefixGrouper does.
* ``pg_lmhead``   PrefixGrouper with the LM head on completion positions only: ``split_output`` on the hidden
                  states, then the head (what verl later did).
* ``tree_mask``   packed tree attention (AReaL's and TRL AsyncGRPO's idea, written here from the idea): all
                  unique tokens of the step's trie in one row, in DFS order, RoPE position = depth, and a 4-D
                  boolean mask (token i sees token j iff j is an ancestor-or-self of i) through sdpa; one
                  forward and one backward; LM head on the positions that score completion tokens only.
* ``tree``        ``TreeExecutor(model, block_size=...).backward(PrefixTrie.from_sequences(rows), loss,
                  score_from=prompt lengths - 1)`` (LM head on completion positions only, as the trainer)
                  on the step's trie (every group), LM head on every unique token (it has no completion-only
                  option).

Dense and PrefixGrouper work one group at a time (accumulating); the two tree methods take the whole step,
so on multi-group shapes they also share what groups share (the system prompt). ``dedup`` = tokens / unique
tokens of the step's trie is the speedup to expect if cost were linear in tokens; ``pg dedup`` = tokens /
tokens PrefixGrouper forwards is its own ideal.

Protocol: every method first runs once, metered (autograd-saved activations via ``SavedTensorMeter``; peak
RSS increase on CPU, ``torch.cuda.max_memory_allocated`` increase on CUDA), and its gradients are compared
with dense's (``max over tensors of max|g - g_dense| / max|g_dense|``); a method whose gradients differ
(> 1e-4 in fp32, > 1e-1 in bf16) is reported as a mismatch, not timed, and the script exits non-zero. Then
``--repeats`` rounds of all methods in alternation; times are medians. A method that runs out of memory is
reported as OOM. Extra parts: peak memory against the number of leaves (one group, growing G), and the time
breakdown of TreePPOTrainer steps (tests/grpo_setup.py's offline fixture; needs TRL; CPU profiles only).
``--methods ...,tree_mask_fullhead`` adds a diagnostic: the tree mask with the LM head on every unique
token, as the walk computes it.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import math
import os
import statistics
import sys
import time
from dataclasses import dataclass, field

import numpy as np
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)  # this checkout's trl_dta
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # common.py
import common  # noqa: E402

from trl_dta import PrefixTrie, TreeExecutor  # noqa: E402
from trl_dta.testing.memory import SavedTensorMeter  # noqa: E402

METHODS = ["dense", "dense_ckpt", "pg", "pg_lmhead", "tree_mask", "tree"]
LABELS = {
    "dense": "dense padded (TRL)",
    "dense_ckpt": "dense + checkpointing",
    "pg": "PrefixGrouper",
    "pg_lmhead": "PrefixGrouper, LM head on completions",
    "tree_mask": "packed tree mask (sdpa)",
    "tree": "TreeExecutor (walk)",
    "tree_mask_fullhead": "packed tree mask, LM head on all tokens",
}
# bf16: two exact methods already differ by ~1e-2 (measured, tiny model); a wrong mask or position is O(1).
# The strict check of the GPU kernels is --parity, in fp32.
TOLERANCE = {torch.float32: 1e-4, torch.float64: 1e-10, torch.bfloat16: 1e-1, torch.float16: 1e-1}

# Random-weight Qwen3 shapes. "cpu": the shape benchmarks/executor.py uses (the 32k vocabulary makes the LM
# head and the fp32 logits dominate, as in small real models). Qwen3-0.6B/1.7B: the published configs.
MODELS = {
    "tiny": {
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 16,
        "vocab_size": 4096,
        "tie_word_embeddings": False,
    },
    "cpu": {
        "hidden_size": 256,
        "intermediate_size": 768,
        "num_hidden_layers": 4,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 64,
        "vocab_size": 32_000,
        "tie_word_embeddings": False,
    },
    "qwen3-0.6b": {
        "hidden_size": 1024,
        "intermediate_size": 3072,
        "num_hidden_layers": 28,
        "num_attention_heads": 16,
        "num_key_value_heads": 8,
        "head_dim": 128,
        "vocab_size": 151_936,
        "tie_word_embeddings": True,
    },
    "qwen3-1.7b": {
        "hidden_size": 2048,
        "intermediate_size": 6144,
        "num_hidden_layers": 28,
        "num_attention_heads": 16,
        "num_key_value_heads": 8,
        "head_dim": 128,
        "vocab_size": 151_936,
        "tie_word_embeddings": True,
    },
}


# ------------------------------------------------------------------------------------------------ workloads
@dataclass
class Workload:
    """One optimizer step's rollouts: GRPO groups of (prompt, completions). A row = prompt + completion."""

    name: str
    kind: str
    groups: list[tuple[list[int], list[list[int]]]]
    advantages: torch.Tensor = field(repr=False)

    @property
    def rows(self) -> list[tuple[list[int], int]]:  # (sequence, prompt length), group-major
        return [(p + c, len(p)) for p, cs in self.groups for c in cs]

    @property
    def num_rows(self) -> int:
        return sum(len(cs) for _, cs in self.groups)

    def stats(self) -> dict:
        trie = PrefixTrie.from_sequences([s for s, _ in self.rows])
        pg_tokens = sum(len(p) + sum(map(len, cs)) for p, cs in self.groups)
        return {
            "shape": self.name,
            "kind": self.kind,
            "groups": len(self.groups),
            "rows": self.num_rows,
            "leaves": trie.num_leaves,
            "tokens": trie.num_tokens,
            "unique": trie.num_unique_tokens,
            "dedup": trie.dedup_ratio,
            "pg_tokens": pg_tokens,
            "pg_dedup": trie.num_tokens / pg_tokens,
            "longest": trie.max_depth,
        }


def _advantages(rng, groups: int, size: int) -> torch.Tensor:
    """Random rewards standardised within each group, as GRPO does."""
    r = torch.as_tensor(rng.normal(size=(groups, size)), dtype=torch.float32)
    return ((r - r.mean(1, keepdim=True)) / (r.std(1, keepdim=True) + 1e-4)).flatten()


def grpo_shape(name, vocab, prompt, group, completion, groups=1, seed=0) -> Workload:
    """Single-level GRPO: per group one prompt, ``group`` completions of U[c/2, 3c/2] tokens."""
    rng = np.random.default_rng(seed)
    rand = lambda n: rng.integers(0, vocab, size=int(n)).tolist()
    gs = [
        (rand(prompt), [rand(rng.integers(completion // 2, completion * 3 // 2 + 1)) for _ in range(group)])
        for _ in range(groups)
    ]
    return Workload(name, "grpo", gs, _advantages(rng, groups, group))


def tau2_shape(name, vocab, tasks, group, system, prompt, turn, final, seed=0) -> Workload:
    """τ²-shaped multi-turn step: a system prompt + tool schemas shared by every task; per task a user
    prompt (TRL's prompt = system + user); the completion is a first tool-call turn + tool response shared by
    half the group, a second one shared by a quarter, then each rollout's own final turns (U[f/2, 3f/2])."""
    rng = np.random.default_rng(seed)
    rand = lambda n: rng.integers(0, vocab, size=int(n)).tolist()
    sys_tokens, gs = rand(system), []
    for _ in range(tasks):
        halves = [rand(turn) for _ in range(2)]
        quarters = [rand(turn) for _ in range(4)]
        comps = [
            halves[2 * r // group]
            + quarters[4 * r // group]
            + rand(rng.integers(final // 2, final * 3 // 2 + 1))
            for r in range(group)
        ]
        gs.append((sys_tokens + rand(prompt), comps))
    return Workload(name, "tau2", gs, _advantages(rng, tasks, group))


_LENGTHS = ("prompt", "completion", "system", "turn", "final")


def _scaled(kwargs: dict, scale: float) -> dict:
    return {k: (max(2, int(v * scale)) if k in _LENGTHS else v) for k, v in kwargs.items()}


def shapes_for(profile: str, vocab: int, scale: float = 1.0) -> list[Workload]:
    """The profile's shapes; ``scale`` multiplies every length (a dry run of a big profile on a CPU)."""
    g, t = (
        (lambda *a, **k: grpo_shape(*a, vocab=vocab, **_scaled(k, scale))),
        (lambda *a, **k: tau2_shape(*a, vocab=vocab, **_scaled(k, scale))),
    )
    if profile == "quick":
        return [
            g("grpo-128-g4", prompt=128, group=4, completion=32),
            t("tau2-tiny", tasks=2, group=4, system=96, prompt=16, turn=16, final=24),
            g("long-512-g2", prompt=512, group=2, completion=32),
        ]
    if (
        profile == "cpu"
    ):  # scaled down for 2 shared CPU cores: prompts 0.5-3k, 4-16 completions, ~8-13k tokens
        return [
            g("grpo-512-g16", prompt=512, group=16, completion=64),
            g("grpo-1k-g8", prompt=1024, group=8, completion=128),
            g("grpo-2k-g4", prompt=2048, group=4, completion=64),
            t("tau2-2x8", tasks=2, group=8, system=384, prompt=64, turn=96, final=96),
            g("long-3k-g4", prompt=3072, group=4, completion=128),
        ]
    if profile == "gpu":  # 4k-16k contexts
        return [
            g("grpo-4k-g16", prompt=4096, group=16, completion=512),
            g("grpo-8k-g8", prompt=8192, group=8, completion=1024),
            t("tau2-2x8-10k", tasks=2, group=8, system=6144, prompt=512, turn=1024, final=2048),
            g("long-16k-g4", prompt=16384, group=4, completion=1024),
        ]
    raise ValueError(profile)


def leaves_sweep(
    profile: str, vocab: int, scale: float = 1.0, leaves: list[int] | None = None
) -> list[Workload]:
    """One GRPO group with a growing number of completions: peak memory against the number of leaves."""
    prompt, completion, sizes = {
        "quick": (128, 32, [2, 4, 8]),
        "cpu": (256, 64, [2, 4, 8, 16, 32]),
        "gpu": (4096, 512, [2, 4, 8, 16, 32]),
    }[profile]
    prompt, completion = max(2, int(prompt * scale)), max(2, int(completion * scale))
    sizes = leaves or sizes
    return [grpo_shape(f"leaves-{n}", vocab, prompt, n, completion, seed=n) for n in sizes]


# ------------------------------------------------------------------------------------------------ model
def make_model(name: str, device, dtype, attn: str) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM, Qwen3Config

    config = Qwen3Config(**MODELS[name], max_position_embeddings=40_960, attention_dropout=0.0)
    torch.manual_seed(0)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, attn_implementation=attn, dtype=dtype)
    return model.eval()  # dropout off (the walk requires it; dense is compared with it)


# ------------------------------------------------------------------------------------------------ methods
def grpo_loss(mean_logp: torch.Tensor, adv: torch.Tensor, rows: int) -> torch.Tensor:
    """On-policy GRPO surrogate: -advantage x mean completion log-prob, averaged over the step's rows."""
    return (-adv * mean_logp / rows).sum()


def completion_logps(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return torch.log_softmax(logits.float(), -1).gather(-1, targets[..., None]).squeeze(-1)


def _padded(seqs: list[list[int]], device) -> tuple[torch.Tensor, torch.Tensor]:
    width = max(map(len, seqs))
    ids = torch.zeros(len(seqs), width, dtype=torch.long)
    mask = torch.zeros(len(seqs), width, dtype=torch.long)
    for r, s in enumerate(seqs):
        ids[r, : len(s)], mask[r, : len(s)] = torch.as_tensor(s), 1
    return ids.to(device), mask.to(device)


class Context:
    """The model and everything the methods share for one (model, attention, dtype) configuration."""

    def __init__(self, model, device, attn: str, block_size: int):
        self.model, self.device, self.attn, self.block_size = model, torch.device(device), attn, block_size
        self.executor = TreeExecutor(model, block_size=block_size)  # once: it runs a small probe
        self.pg_kernel = "flash_attention_2" if attn == "flash_attention_2" else "bottom_right_sdpa"

    @contextlib.contextmanager
    def attention(self, impl: str):
        """Run the model with another attention function (config._attn_implementation is read per call)."""
        config = self.model.config
        saved = config._attn_implementation
        config._attn_implementation = impl
        try:
            yield
        finally:
            config._attn_implementation = saved


def run_dense(ctx: Context, wl: Workload, checkpointing: bool = False) -> None:
    model, rows = ctx.model, wl.num_rows
    if checkpointing:  # transformers >= 5.2x renamed it; 5.17 (the GPU machine) has only the old name
        if hasattr(model, "activation_checkpointing_enable"):
            model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
        else:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        model.train()  # HF checkpoints only in training mode; dropout is 0 in these configs
    try:
        lo = 0
        for prompt, comps in wl.groups:  # one micro-batch per group, gradients accumulate
            c_ids, c_mask = _padded(comps, ctx.device)
            p_ids = torch.as_tensor(prompt, device=ctx.device)[None].expand(len(comps), -1)
            ids = torch.cat([p_ids, c_ids], 1)
            mask = torch.cat([torch.ones_like(p_ids), c_mask], 1)
            width = c_ids.shape[1]
            logits = model(input_ids=ids, attention_mask=mask, logits_to_keep=width + 1).logits[:, :-1]
            lp = completion_logps(logits, c_ids)
            m = c_mask.float()
            grpo_loss(
                (lp * m).sum(1) / m.sum(1), wl.advantages[lo : lo + len(comps)].to(ctx.device), rows
            ).backward()
            lo += len(comps)
    finally:
        if checkpointing:
            getattr(model, "activation_checkpointing_disable", model.gradient_checkpointing_disable)()
            model.eval()


def bottom_right_sdpa(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """The kernel PrefixGrouper needs, in plain torch: causal attention aligned at the bottom right, per row,
    over the valid (unpadded) keys, as flash-attn's varlen causal mode does when queries are fewer than keys.
    query [B, H, Lq, d]; key/value [B, Hkv, Lk, d]; attention_mask [B, Lk] (True = real token; the queries
    are its last Lq columns). Returns [B, Lq, H, d] (the attention-interface layout)."""
    heads = query.shape[1]
    key = key.repeat_interleave(heads // key.shape[1], dim=1)
    value = value.repeat_interleave(heads // value.shape[1], dim=1)
    k_valid = attention_mask.bool()
    q_valid = k_valid[:, k_valid.shape[1] - query.shape[2] :]
    k_rank, q_rank = k_valid.long().cumsum(1) - 1, q_valid.long().cumsum(1) - 1
    shift = k_valid.sum(1, keepdim=True) - q_valid.sum(1, keepdim=True)  # keys before the first query
    visible = k_valid[:, None, :] & (k_rank[:, None, :] <= (q_rank + shift)[:, :, None])
    visible |= ~q_valid[:, :, None]  # padding queries see everything (their output is discarded): no NaN rows
    out = torch.nn.functional.scaled_dot_product_attention(
        query, key, value, attn_mask=visible[:, None], scale=scaling
    )
    return out.transpose(1, 2).contiguous(), None


_PG_REGISTERED = False


def _register_prefix_grouper() -> None:
    global _PG_REGISTERED
    if not _PG_REGISTERED:
        from prefix_grouper.utils.register_transformers import register_attention
        from transformers import AttentionInterface

        register_attention()  # PrefixGrouper's own transformers integration: "prefix_grouper_attention"
        AttentionInterface.register("bottom_right_sdpa", bottom_right_sdpa)
        _PG_REGISTERED = True


def run_prefix_grouper(ctx: Context, wl: Workload, lm_head_only: bool = False) -> None:
    from prefix_grouper import PrefixGrouper

    _register_prefix_grouper()
    model, rows, lo = ctx.model, wl.num_rows, 0
    for prompt, comps in wl.groups:
        p_ids = torch.as_tensor(prompt, device=ctx.device)[None]
        p_mask = torch.ones_like(p_ids)
        c_ids, c_mask = _padded(comps, ctx.device)
        pg = PrefixGrouper.from_ungrouped_masks(
            prefix_mask=p_mask,
            suffix_mask=c_mask,
            group_sizes=len(comps),
            padding_mode="right",
            device=ctx.device,
        )
        ids = pg.concat_input(p_ids, p_mask, c_ids, c_mask)
        # positions: 0..P-1 for the prompt, then P, P+1, ... again for every completion
        info = pg.group_info[0]
        pos = [torch.arange(info.prefix_len)] + [
            torch.arange(info.prefix_len, info.prefix_len + n) for n in info.suffix_lens
        ]
        position_ids = torch.zeros_like(ids)
        position_ids[0, : info.total_len] = torch.cat(pos).to(ctx.device)
        kwargs = {"prefix_grouper": pg, "prefix_grouper_attn_func": ctx.pg_kernel}
        targets = pg.convert_padding(c_ids, c_mask, padding_mode="right")
        with ctx.attention("prefix_grouper_attention"):
            if lm_head_only:
                hidden = model.get_decoder()(
                    input_ids=ids, position_ids=position_ids, **kwargs
                ).last_hidden_state
                _, _, s_hidden, s_mask = pg.split_output(hidden, include_prefix_last=1)
                s_hidden, s_mask = s_hidden[:, :-1], s_mask[:, 1:].bool()
                lp_flat = completion_logps(model.get_output_embeddings()(s_hidden[s_mask]), targets[s_mask])
                lp = torch.zeros(s_mask.shape, dtype=lp_flat.dtype, device=ctx.device).masked_scatter(
                    s_mask, lp_flat
                )
            else:
                logits = model(input_ids=ids, position_ids=position_ids, **kwargs).logits
                _, _, s_logits, s_mask = pg.split_output(logits, include_prefix_last=1)
                s_logits, s_mask = s_logits[:, :-1], s_mask[:, 1:].bool()
                lp = completion_logps(s_logits, targets)
        m = s_mask.float()
        grpo_loss(
            (lp * m).sum(1) / m.sum(1), wl.advantages[lo : lo + len(comps)].to(ctx.device), rows
        ).backward()
        lo += len(comps)


def packed_tree(seqs: list[list[int]]):
    """Unique tokens of the sequences' token trie in DFS order. In lexicographic order each sequence shares
    with all earlier ones exactly its LCP with the previous one, so numbering new tokens as they appear is a
    DFS preorder, and a token's subtree is the id range [id, last id any sequence through it reaches].
    Returns tokens [N], depth [N], subtree end [N] and each sequence's path of ids (input order)."""
    order = sorted(range(len(seqs)), key=lambda i: seqs[i])
    tokens, depth, paths = [], [], [None] * len(seqs)
    end = np.zeros(sum(map(len, seqs)), dtype=np.int64)
    prev, prev_seq, next_id = np.zeros(0, dtype=np.int64), [], 0
    for i in order:
        s = seqs[i]
        lcp = 0
        for a, b in zip(prev_seq, s, strict=False):
            if a != b:
                break
            lcp += 1
        new = np.arange(next_id, next_id + len(s) - lcp)
        tokens += s[lcp:]
        depth += range(lcp, len(s))
        next_id += len(new)
        path = np.concatenate([prev[:lcp], new])
        end[path] = np.maximum(end[path], path[-1])
        paths[i], prev, prev_seq = path, path, s
    return tokens, depth, end[:next_id].tolist(), paths


def run_tree_mask(ctx: Context, wl: Workload, head_on_all: bool = False) -> None:
    model, rows = ctx.model, wl.rows
    tokens, depth, end, paths = packed_tree([s for s, _ in rows])
    n = len(tokens)
    ids = torch.arange(n, device=ctx.device)
    end_t = torch.as_tensor(end, device=ctx.device)
    # token i sees j iff j is an ancestor-or-self of i: j <= i <= subtree end of j
    visible = (ids[None, :] <= ids[:, None]) & (ids[:, None] <= end_t[None, :])
    # scoring: sequence k's completion token t (t >= prompt length) is scored at the id of its token t - 1
    score_ids = torch.cat(
        [torch.as_tensor(p[plen - 1 : -1]) for p, (_, plen) in zip(paths, rows, strict=True)]
    ).to(ctx.device)
    targets = torch.cat([torch.as_tensor(s[plen:]) for s, plen in rows]).to(ctx.device)
    counts = torch.tensor([len(s) - plen for s, plen in rows], device=ctx.device)
    needed, inverse = torch.unique(score_ids, return_inverse=True)
    if head_on_all:  # diagnostic: the LM head on every unique token, as the walk does
        needed, inverse = ids, score_ids
    with ctx.attention("sdpa"):
        hidden = model.get_decoder()(
            input_ids=torch.as_tensor(tokens, device=ctx.device)[None],
            position_ids=torch.as_tensor(depth, device=ctx.device)[None],
            attention_mask=visible[None, None],
        ).last_hidden_state[0]
    logsm = torch.log_softmax(model.get_output_embeddings()(hidden[needed]).float(), -1)
    lp = logsm[inverse, targets]
    row = torch.repeat_interleave(torch.arange(len(rows), device=ctx.device), counts)
    mean = torch.zeros(len(rows), device=ctx.device).index_add(0, row, lp) / counts
    grpo_loss(mean, wl.advantages.to(ctx.device), len(rows)).backward()


def run_tree(ctx: Context, wl: Workload, executor: TreeExecutor | None = None) -> None:
    rows = wl.rows
    trie = PrefixTrie.from_sequences([s for s, _ in rows])
    adv = wl.advantages.to(ctx.device)

    def loss_fn(i, lp, _):  # lp: the completion's log-probs (score_from = prompt length - 1)
        return grpo_loss(lp.mean(), adv[i], len(rows))

    # the LM head only on completion positions, as the trainer runs it
    (executor or ctx.executor).backward(trie, loss_fn, score_from=[plen - 1 for _, plen in rows])


RUNNERS = {
    "dense": run_dense,
    "dense_ckpt": lambda ctx, wl: run_dense(ctx, wl, checkpointing=True),
    "pg": run_prefix_grouper,
    "pg_lmhead": lambda ctx, wl: run_prefix_grouper(ctx, wl, lm_head_only=True),
    "tree_mask": run_tree_mask,
    "tree": run_tree,
    # diagnostic, not in METHODS (--methods ...,tree_mask_fullhead): the LM head on every unique token, to
    # measure how much of the walk's gap to tree_mask is its LM head on prompt positions
    "tree_mask_fullhead": lambda ctx, wl: run_tree_mask(ctx, wl, head_on_all=True),
}


# ------------------------------------------------------------------------------------------------ measuring
def grads_of(model) -> dict[str, torch.Tensor]:
    return {n: p.grad.detach().float().clone() for n, p in model.named_parameters() if p.grad is not None}


def max_rel_diff(got: dict, ref: dict) -> float:
    """max over tensors of max|got - ref| / max|ref| (a tensor whose reference is ~0 is measured against the
    largest gradient of all, as in tests/conftest.py)."""
    if got.keys() != ref.keys():
        return math.inf
    overall = max(v.abs().max().item() for v in ref.values())
    errs = []
    for k, r in ref.items():
        scale = r.abs().max().item()
        errs.append((got[k] - r).abs().max().item() / (scale if scale > 1e-9 * overall else overall))
    return max(errs)


def _is_oom(exc: BaseException) -> bool:
    return isinstance(exc, torch.cuda.OutOfMemoryError) or "out of memory" in str(exc).lower()


def _release(model, device) -> None:
    model.zero_grad(set_to_none=True)
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def _release(model, device) -> None:
    model.zero_grad(set_to_none=True)
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def measure(
    ctx: Context, wl: Workload, methods: list[str], repeats: int, tolerance: float, log
) -> list[dict]:
    """One metered run per method (gradients compared with the first method that ran), then ``repeats``
    alternating timed rounds. Returns one result dict per method."""
    model, device = ctx.model, ctx.device
    stats = wl.stats()
    res = {m: dict(stats, method=m, status="ok") for m in methods}
    ref, ref_name = None, None
    for m in methods:
        model.zero_grad(set_to_none=True)
        try:
            with common.PeakMemory(device) as peak, SavedTensorMeter(model) as saved:
                seconds = common.timed(lambda m=m: RUNNERS[m](ctx, wl), device)
        except Exception as exc:  # noqa: BLE001 - an OOM or a failing peer is a result, not a crash
            res[m]["status"] = "OOM" if _is_oom(exc) else "error"
            res[m]["error"] = f"{type(exc).__name__}: {str(exc)[:300]}"
        if res[m]["status"] != "ok":  # outside the except block: its traceback no longer pins the tensors
            _release(model, device)
            log(f"  {m:10s} {res[m]['status']}: {res[m]['error'][:160]}")
            continue
        res[m].update(
            first_s=seconds,
            saved_mib=saved.peak / 2**20,
            peak_mib=None if peak.peak is None else peak.peak / 2**20,
        )
        got = grads_of(model)
        if ref is None:
            ref, ref_name = got, m
            res[m]["grad_err"] = 0.0
        else:
            err = max_rel_diff(got, ref)
            res[m]["grad_err"] = err
            if not err <= tolerance:
                res[m]["status"] = "grad mismatch"
        res[m]["grad_ref"] = ref_name
        log(
            f"  {m:10s} first run {seconds:7.2f} s, saved {res[m]['saved_mib']:8.0f} MiB, "
            f"grad err vs {ref_name} {res[m]['grad_err']:.1e}"
            + ("" if res[m]["status"] == "ok" else "  MISMATCH")
        )
    del ref
    timed_methods = [m for m in methods if res[m]["status"] == "ok"]
    runs = {m: [] for m in timed_methods}
    for _ in range(repeats):
        for m in timed_methods:
            if res[m]["status"] != "ok":
                continue
            model.zero_grad(set_to_none=True)
            try:
                runs[m].append(common.timed(lambda m=m: RUNNERS[m](ctx, wl), device))
            except Exception as exc:  # noqa: BLE001 - e.g. an OOM from fragmentation in a later round
                res[m]["status"] = "OOM" if _is_oom(exc) else "error"
                res[m]["error"] = f"{type(exc).__name__}: {str(exc)[:300]}"
            if res[m]["status"] != "ok":
                _release(model, device)
    timed_methods = [m for m in timed_methods if res[m]["status"] == "ok"]
    model.zero_grad(set_to_none=True)
    for m in timed_methods:
        res[m]["runs_s"] = runs[m]
        res[m]["time_s"] = statistics.median(runs[m]) if runs[m] else res[m]["first_s"]
    for base in ("dense", "dense_ckpt"):
        b = res.get(base, {}).get("time_s")
        for m in timed_methods:
            res[m][f"vs_{base}"] = b / res[m]["time_s"] if b else None
    return [res[m] for m in methods]


# ---------------------------------------------------------------------------------------------- trainer step
def trainer_breakdown(steps: int, quick: bool) -> dict:
    """Where one TreePPOTrainer step spends its time, on the offline fixture of tests/grpo_setup.py (scripted
    generation: no sampling, TRL's tool loop and rewards run): generation + scoring (minus the no-grad tree
    log-prob pass inside it), that pass, the walk (forward + backward of the loss), the optimizer, the
    rest."""
    sys.path.insert(0, os.path.join(ROOT, "tests"))
    from transformers import TrainerCallback

    from trl_dta import TreePPOConfig, TreePPOTrainer
    from trl_dta.testing.grpo import ScriptedGenerationMixin, make_config, make_trainer, tiny_model

    times: dict[str, list[float]] = {
        k: [] for k in ("step", "generate", "logprob", "walk", "train_step", "optimizer")
    }

    class Timed(ScriptedGenerationMixin, TreePPOTrainer):
        scripted_record = False

        def _generate_and_score_completions(self, inputs):
            t0 = time.perf_counter()
            out = super()._generate_and_score_completions(inputs)
            times["generate"][-1] += time.perf_counter() - t0
            return out

        def _get_per_token_logps_and_entropies(self, *args, **kwargs):
            t0 = time.perf_counter()
            out = super()._get_per_token_logps_and_entropies(*args, **kwargs)
            if self._tree_detached is None:
                times["logprob"][-1] += time.perf_counter() - t0
            return out

        def training_step(self, *args, **kwargs):
            t0 = time.perf_counter()
            out = super().training_step(*args, **kwargs)
            times["train_step"][-1] += time.perf_counter() - t0
            times["walk"][-1] += self._metrics["train"]["tree/time"][-1]
            return out

    class Clock(TrainerCallback):
        def on_step_begin(self, *a, **k):
            for v in times.values():
                v.append(0.0)
            self.t_step = time.perf_counter()

        def on_pre_optimizer_step(self, *a, **k):
            self.t_opt = time.perf_counter()

        def on_optimizer_step(self, *a, **k):
            times["optimizer"][-1] += time.perf_counter() - self.t_opt

        def on_step_end(self, *a, **k):
            times["step"][-1] += time.perf_counter() - self.t_step

    size = (
        {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2}
        if quick
        else {
            "hidden_size": 256,
            "intermediate_size": 768,
            "num_hidden_layers": 4,
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            "head_dim": 64,
        }
    )
    config = make_config(
        config_cls=TreePPOConfig,
        per_device_train_batch_size=8,
        num_generations=8,
        num_iterations=2,
        max_steps=steps,
        max_completion_length=256,
        optim="adamw_torch",
        learning_rate=1e-5,
    )
    trainer = make_trainer(Timed, config, model=tiny_model(**size), callbacks=[Clock()], num_prompts=steps)
    torch.manual_seed(0)
    trainer.train()
    # num_iterations=2: a generation every second step. Drop the first generation cycle (warm-up: the
    # executor's probe, first allocations) and average the rest: per-step costs, generation amortised.
    keep = slice(2, None) if steps >= 4 else slice(None)
    mean = {k: statistics.mean(v[keep]) for k, v in times.items()}
    parts = {
        "generation": mean["generate"] - mean["logprob"],
        "old_logprob_pass": mean["logprob"],
        "walk": mean["walk"],
        "trl_loss_and_rest": mean["train_step"] - mean["generate"] - mean["walk"],
        "optimizer": mean["optimizer"],
        "other": mean["step"] - mean["train_step"] - mean["optimizer"],
    }
    dedup = [float(h["tree/dedup_ratio"]) for h in trainer.state.log_history if "tree/dedup_ratio" in h]
    return {
        "steps": steps,
        "steps_averaged": len(times["step"][keep]),
        "step_s": mean["step"],
        "parts_s": parts,
        "raw": times,
        "dedup_ratio": float(np.mean(dedup)) if dedup else None,
    }


# ------------------------------------------------------------------------------------------------ output
COLUMNS = [  # (header, key, format)
    ("model", "model", "{}"),
    ("attn", "attn", "{}"),
    ("shape", "shape", "{}"),
    ("rows", "rows", "{}"),
    ("tokens", "tokens", "{:,}"),
    ("dedup", "dedup", "{:.2f}x"),
    ("pg dedup", "pg_dedup", "{:.2f}x"),
    ("method", "method", "{}"),
    ("status", "status", "{}"),
    ("s", "time_s", "{:.3f}"),
    ("vs dense", "vs_dense", "{:.2f}x"),
    ("vs ckpt", "vs_dense_ckpt", "{:.2f}x"),
    ("saved MiB", "saved_mib", "{:.0f}"),
    ("peak MiB", "peak_mib", "{:.0f}"),
    ("grad err", "grad_err", "{:.1e}"),
]
SWEEP_COLUMNS = [
    ("model", "model", "{}"),
    ("leaves", "leaves", "{}"),
    ("tokens", "tokens", "{:,}"),
    ("dedup", "dedup", "{:.2f}x"),
    ("method", "method", "{}"),
    ("status", "status", "{}"),
    ("saved MiB", "saved_mib", "{:.0f}"),
    ("peak MiB", "peak_mib", "{:.0f}"),
    ("grad err", "grad_err", "{:.1e}"),
]


def pivot_markdown(results: list[dict]) -> str:
    """One row per (model, attention, shape): time of dense, every method's speedup over it, and the saved
    activations of every method (the README table)."""
    methods = [m for m in METHODS if any(r["method"] == m for r in results)]
    short = {"dense": "dense", "dense_ckpt": "ckpt", "pg": "PG", "pg_lmhead": "PG head",
             "tree_mask": "tree mask", "tree": "walk"}  # fmt: skip
    head = ["shape", "tokens", "dedup", "PG dedup", "dense s"] + [f"{short[m]} ×" for m in methods[1:]]
    head += ["saved MiB: " + " / ".join(short[m] for m in methods)]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    keys = list(dict.fromkeys((r["model"], r["attn"], r["shape"]) for r in results))
    for key in keys:
        rs = {r["method"]: r for r in results if (r["model"], r["attn"], r["shape"]) == key}
        first = next(iter(rs.values()))

        def speed(m, rs=rs):
            r = rs.get(m)
            if r is None:
                return "-"
            return f"{r['vs_dense']:.2f}×" if r["status"] == "ok" and r.get("vs_dense") else r["status"]

        dense = rs.get("dense", {})
        row = [key[2], f"{first['tokens']:,}", f"{first['dedup']:.2f}", f"{first['pg_dedup']:.2f}"]
        row += [f"{dense['time_s']:.2f}" if dense.get("time_s") else dense.get("status", "-")]
        row += [speed(m) for m in methods[1:]]
        row += [
            " / ".join(
                f"{rs[m]['saved_mib']:.0f}" if rs.get(m, {}).get("saved_mib") else "-" for m in methods
            )
        ]
        lines.append("| " + " | ".join(row) + " |")
    return "\n".join(lines)


def plot_speedup(results: list[dict], path: str, title: str) -> None:
    plt = common.pyplot()
    fig, ax = plt.subplots(figsize=(7.5, 5))
    ok = [r for r in results if r["status"] == "ok" and r.get("vs_dense")]
    top = max([r["dedup"] for r in ok] + [r["vs_dense"] for r in ok] + [2.0]) * 1.1
    ax.plot([1, top], [1, top], "k--", lw=1, label="speedup = dedup ratio (linear in tokens)")
    ax.axhline(1.0, color="grey", lw=0.8)
    markers = {"dense_ckpt": "v", "pg": "s", "pg_lmhead": "D", "tree_mask": "^", "tree": "o"}
    for m in METHODS[1:]:
        pts = [r for r in ok if r["method"] == m]
        if pts:
            ax.scatter(
                [r["dedup"] for r in pts],
                [r["vs_dense"] for r in pts],
                marker=markers[m],
                s=55,
                label=LABELS[m],
                zorder=3,
            )
            if m == "tree":
                for r in pts:
                    ax.annotate(
                        r["shape"],
                        (r["dedup"], r["vs_dense"]),
                        textcoords="offset points",
                        xytext=(6, -4),
                        fontsize=8,
                    )
    ax.set(
        xlabel="dedup ratio of the step's trie (tokens / unique tokens)",
        ylabel="speedup over dense padded (same run)",
        title=title,
        xlim=(1, top),
        ylim=(0, top),
    )
    ax.legend(fontsize=8, loc="upper left")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def plot_memory(sweep: list[dict], path: str, title: str, device_kind: str) -> None:
    plt = common.pyplot()
    second = "peak_mib"
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.6))
    for ax, key, label in (
        (axes[0], "saved_mib", "autograd-saved activations, MiB (peak)"),
        (
            axes[1],
            second,
            ("CUDA max_memory_allocated" if device_kind == "cuda" else "peak RSS") + " increase, MiB",
        ),
    ):
        for m in METHODS:
            pts = [r for r in sweep if r["method"] == m and r.get(key) is not None and r["status"] == "ok"]
            if pts:
                ax.plot([r["leaves"] for r in pts], [r[key] for r in pts], marker="o", label=LABELS[m])
        ax.set(xlabel="leaves (completions in the group)", ylabel=label, xscale="log", yscale="log")
        ax.set_xticks(sorted({r["leaves"] for r in sweep}))
        ax.get_xaxis().set_major_formatter(plt.matplotlib.ticker.ScalarFormatter())
        ax.get_xaxis().set_minor_formatter(plt.matplotlib.ticker.NullFormatter())
    axes[0].legend(fontsize=8)
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def plot_breakdown(breakdown: dict, path: str) -> None:
    plt = common.pyplot()
    parts = breakdown["parts_s"]
    fig, ax = plt.subplots(figsize=(8, 2.8))
    left = 0.0
    for name, value in parts.items():
        value = max(value, 0.0)
        ax.barh([0], [value], left=left, label=f"{name.replace('_', ' ')}: {value:.3f} s")
        left += value
    n, dedup = breakdown.get("steps_averaged", breakdown["steps"]), breakdown.get("dedup_ratio") or 0
    ax.set(
        yticks=[],
        xlabel=f"seconds per optimizer step (mean of the last {n} steps; a generation every 2nd step)",
        title=f"One TreePPOTrainer step: {breakdown['step_s']:.2f} s (offline fixture, scripted generation, "
        f"dedup {dedup:.1f})",
    )
    ax.legend(fontsize=8, loc="upper center", bbox_to_anchor=(0.5, -0.35), ncol=3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


# ------------------------------------------------------------------------------------------------ main
PROFILES = {  # defaults per profile; flags override
    "quick": {
        "models": "tiny",
        "attn": "sdpa",
        "dtype": "float32",
        "device": "cpu",
        "repeats": 1,
        "block_size": 256,
        "breakdown_steps": 4,
    },
    "cpu": {
        "models": "cpu",
        "attn": "sdpa",
        "dtype": "float32",
        "device": "cpu",
        "repeats": 3,
        "block_size": 2048,
        "breakdown_steps": 8,
    },
    "gpu": {
        "models": "qwen3-0.6b,qwen3-1.7b",
        "attn": "sdpa,flash_attention_2",
        "dtype": "bfloat16",
        "device": "cuda",
        "repeats": 2,
        "block_size": 2048,
        "breakdown_steps": 0,
    },
}


def plan(args) -> list[tuple[str, str]]:
    """(model, attention) configurations to run; flash-attn only where it imports."""
    attns = args.attn.split(",")
    if "flash_attention_2" in attns:
        try:
            import flash_attn  # noqa: F401
        except ImportError:
            attns = [a for a in attns if a != "flash_attention_2"]
            print("flash-attn not installed: skipping attn=flash_attention_2")
    return [(m, a) for m in args.models.split(",") for a in attns]


def draw_plots(data: dict, folder: str, name: str) -> None:
    """The three plots from a result file's content (``--replot`` redraws them from the JSON alone)."""
    env = data["env"]
    where = (
        env.get("gpu")
        or f"{env['cpu_count']}-core {env['processor']}, load {env['load_avg_1min_before']:.1f}"
    )
    where += f", {env['dtype']}"
    if data["results"]:
        plot_speedup(
            data["results"], os.path.join(folder, f"{name}_speedup.png"), f"Speedup vs dedup ({where})"
        )
    if data["sweep"]:
        title = f"Peak memory vs leaves: one group ({where})"
        kind = torch.device(env["device"]).type
        plot_memory(data["sweep"], os.path.join(folder, f"{name}_memory.png"), title, kind)
    if data.get("breakdown"):
        plot_breakdown(data["breakdown"], os.path.join(folder, f"{name}_trainer_step.png"))


def show_plan(args) -> int:
    """Print what a run would do (configurations, shapes and their sizes) and check the shapes fit the
    models' position range; no model is built. Returns 1 if a shape does not fit."""
    configs = plan(args)
    print(
        f"profile {args.profile}: {args.dtype} on {args.device}, repeats {args.repeats}, "
        f"block_size {args.block_size}"
    )
    print("configurations: " + ", ".join(f"{m}/{a}" for m, a in configs))
    bad = 0
    for name in dict.fromkeys(m for m, _ in configs):
        p = MODELS[name]
        params = p["vocab_size"] * p["hidden_size"] * (1 if p["tie_word_embeddings"] else 2) + p[
            "num_hidden_layers"
        ] * (
            p["hidden_size"] * p["head_dim"] * (2 * p["num_attention_heads"] + 2 * p["num_key_value_heads"])
            + 3 * p["hidden_size"] * p["intermediate_size"]
        )
        print(f"model {name}: ~{params / 1e6:.0f}M parameters")
        rows = []
        shapes = shapes_for(args.profile, p["vocab_size"], args.scale)
        if not args.no_sweep:
            shapes += leaves_sweep(args.profile, p["vocab_size"], args.scale)
        for wl in shapes:
            s = wl.stats()
            s["mask_mib"] = s["unique"] ** 2 / 2**20  # the packed tree mask, bool
            s["fits"] = "yes" if s["longest"] <= 40_960 else "NO"
            bad += s["fits"] != "yes"
            rows.append(s)
        cols = [("shape", "shape", "{}"), ("rows", "rows", "{}"), ("tokens", "tokens", "{:,}")]
        cols += [
            ("unique", "unique", "{:,}"),
            ("dedup", "dedup", "{:.2f}x"),
            ("pg dedup", "pg_dedup", "{:.2f}x"),
        ]
        cols += [
            ("longest", "longest", "{:,}"),
            ("tree mask MiB", "mask_mib", "{:.0f}"),
            ("fits", "fits", "{}"),
        ]
        print(common.format_table(rows, cols))
    return 1 if bad else 0


def parity(args, log) -> int:
    """fp32 gradients of every method (and of the executor's chunked and unpacked paths) against dense on the
    device, on the quick shapes and the tiny model; no timing. flash-attn has no fp32 kernels: with it, bf16
    and bf16's tolerance. Returns the number of failures."""
    failures = 0
    rows = []
    for _, attn in plan(args):
        dtype = torch.bfloat16 if attn.startswith("flash") else torch.float32
        model = make_model("tiny", args.device, dtype, attn)
        ctx = Context(model, args.device, attn, block_size=256)
        extra = {
            "tree_chunked": TreeExecutor(model, block_size=40),  # chunked backward: blocks recomputed at pop
            "tree_unpacked": TreeExecutor(model, block_size=256, pack_leaves=False),  # padded sibling leaves
        }
        for name, ex in extra.items():
            RUNNERS[name] = lambda c, w, ex=ex: run_tree(c, w, ex)
        methods = [m for m in METHODS if not (attn == "flash_attention_2" and m == "tree_mask")] + list(extra)
        for wl in shapes_for("quick", MODELS["tiny"]["vocab_size"]):
            log(f"[parity {attn}] {wl.name}")
            for r in measure(ctx, wl, methods, 0, TOLERANCE[dtype], log):
                r.update(model="tiny", attn=attn, dtype=str(dtype))
                rows.append(r)
                failures += r["status"] != "ok"
        del ctx, model
    print(
        common.format_table(rows, [c for c in COLUMNS if c[1] not in ("time_s", "vs_dense", "vs_dense_ckpt")])
    )
    with open(os.path.join(args.out, "parity.json"), "w") as f:
        json.dump(rows, f, indent=2, default=str)
    tolerances = f"fp32 {TOLERANCE[torch.float32]:g}, bf16 {TOLERANCE[torch.bfloat16]:g}"
    print(f"parity: {len(rows) - failures}/{len(rows)} ok (relative tolerance: {tolerances})")
    return failures


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--profile", choices=list(PROFILES), default="cpu")
    ap.add_argument("--quick", action="store_true", help="= --profile quick (CI smoke run)")
    ap.add_argument("--parity", action="store_true", help="fp32 gradient parity of every method only")
    ap.add_argument("--models", help=f"comma-separated, of {list(MODELS)}")
    ap.add_argument("--attn", help="comma-separated attention implementations (sdpa, flash_attention_2)")
    ap.add_argument("--dtype", choices=["float32", "bfloat16", "float64"])
    ap.add_argument("--device")
    ap.add_argument("--shapes", help="comma-separated shape names of the profile (default: all)")
    ap.add_argument("--methods", default=",".join(METHODS))
    ap.add_argument("--repeats", type=int, help="timed rounds after the metered run")
    ap.add_argument("--block_size", type=int, help="TreeExecutor block_size")
    ap.add_argument("--no_sweep", action="store_true", help="skip peak memory vs number of leaves")
    ap.add_argument(
        "--sweep_leaves", help="comma-separated group sizes of the memory sweep (default: profile's)"
    )
    ap.add_argument("--scale", type=float, default=1.0, help="multiply every sequence length (dry runs)")
    ap.add_argument("--plan", action="store_true", help="print the configurations and shapes, run nothing")
    ap.add_argument(
        "--replot", metavar="JSON", help="redraw the plots of a result file into --plots, run nothing"
    )
    ap.add_argument("--breakdown_steps", type=int, help="TreePPOTrainer steps for the breakdown (0: skip)")
    ap.add_argument(
        "--time_budget", type=float, default=0, help="seconds; stop starting new configs after it"
    )
    ap.add_argument("--threads", type=int, default=2, help="torch CPU threads")
    ap.add_argument("--out", default=os.path.join(ROOT, "benchmarks", "out"), help="JSON and tables")
    ap.add_argument("--plots", help="plot folder (default: docs/ for --profile cpu, else --out)")
    args = ap.parse_args()
    if args.quick:
        args.profile = "quick"
    for k, v in PROFILES[args.profile].items():
        if getattr(args, k) is None:
            setattr(args, k, v)
    args.plots = args.plots or (os.path.join(ROOT, "docs") if args.profile == "cpu" else args.out)
    os.makedirs(args.out, exist_ok=True)
    os.makedirs(args.plots, exist_ok=True)
    sys.stdout.reconfigure(line_buffering=True)
    torch.set_num_threads(args.threads)
    if args.device.startswith("cuda"):
        torch.backends.cuda.matmul.allow_tf32 = False  # fp32 parity means fp32
        torch.backends.cudnn.allow_tf32 = False

    def log(msg):
        print(msg, flush=True)

    if args.replot:
        with open(args.replot) as f:
            draw_plots(json.load(f), args.plots, os.path.basename(args.replot).removesuffix(".json"))
        return 0
    if args.plan:
        return show_plan(args)
    if args.parity:
        return 1 if parity(args, log) else 0

    dtype = getattr(torch, args.dtype)
    tolerance = TOLERANCE[dtype]
    methods = args.methods.split(",")
    load_before = common.warn_if_busy(args.threads)
    wall = time.perf_counter()
    results, sweep, skipped = [], [], []
    breakdown = None
    name = "peers" if args.profile == "cpu" else f"peers_{args.profile}"

    def save(final: bool = False) -> None:
        """JSON and markdown tables after every shape (a run killed by a timeout keeps what it measured);
        the plots at the end."""
        env = common.environment(
            load_before, time.perf_counter() - wall, profile=args.profile, dtype=args.dtype,
            device=args.device, repeats=args.repeats, skipped=skipped, complete=final,
        )  # fmt: skip
        with open(os.path.join(args.out, f"{name}.json"), "w") as f:
            data = {
                "args": vars(args),
                "env": env,
                "results": results,
                "sweep": sweep,
                "breakdown": breakdown,
            }
            json.dump(data, f, indent=2, default=str)
        with open(os.path.join(args.out, f"{name}.md"), "w") as f:
            if results:
                f.write(pivot_markdown(results) + "\n\n")
            f.write(common.markdown_table(results, COLUMNS) + "\n\n")
            if sweep:
                f.write(common.markdown_table(sweep, SWEEP_COLUMNS) + "\n")
        if not final:
            return
        draw_plots({"env": env, "results": results, "sweep": sweep, "breakdown": breakdown}, args.plots, name)

    for model_name, attn in plan(args):
        if args.time_budget and time.perf_counter() - wall > args.time_budget:
            skipped.append(f"{model_name}/{attn}")
            continue
        log(f"== model {model_name}, attn {attn}, {args.dtype}, {args.device}")
        model = make_model(model_name, args.device, dtype, attn)
        ctx = Context(model, args.device, attn, args.block_size)
        ms = [m for m in methods if not (m == "tree_mask" and attn not in ("sdpa", "eager"))]
        wanted = set(args.shapes.split(",")) if args.shapes else None
        for wl in shapes_for(args.profile, MODELS[model_name]["vocab_size"], args.scale):
            if wanted and wl.name not in wanted:
                continue
            if args.time_budget and time.perf_counter() - wall > args.time_budget:
                skipped.append(f"{model_name}/{attn}/{wl.name}")
                continue
            s = wl.stats()
            log(
                f"[{wl.name}] rows {s['rows']}, tokens {s['tokens']:,}, unique {s['unique']:,}, "
                f"dedup {s['dedup']:.2f}, "
                f"pg dedup {s['pg_dedup']:.2f}, load {common.load_average():.2f}"
            )
            for r in measure(ctx, wl, ms, args.repeats, tolerance, log):
                results.append(dict(r, model=model_name, attn=attn, load=common.load_average()))
            save()
        if not args.no_sweep and attn == plan(args)[0][1] and model_name == plan(args)[0][0]:
            sizes = [int(n) for n in args.sweep_leaves.split(",")] if args.sweep_leaves else None
            for wl in leaves_sweep(args.profile, MODELS[model_name]["vocab_size"], args.scale, sizes):
                if args.time_budget and time.perf_counter() - wall > args.time_budget:
                    skipped.append(f"sweep/{wl.name}")
                    continue
                log(f"[sweep {wl.name}]")
                for r in measure(ctx, wl, ms, 0, tolerance, log):
                    sweep.append(dict(r, model=model_name, attn=attn))
                save()
        del ctx, model
        if args.device.startswith("cuda"):
            torch.cuda.empty_cache()
    if args.breakdown_steps:
        log(f"[trainer breakdown] {args.breakdown_steps} TreePPOTrainer steps")
        breakdown = trainer_breakdown(args.breakdown_steps, args.profile == "quick")
        log("  " + ", ".join(f"{k} {v:.3f} s" for k, v in breakdown["parts_s"].items()))
    save(final=True)
    print("\n" + common.format_table(results, COLUMNS))
    if sweep:
        print("\n" + common.format_table(sweep, SWEEP_COLUMNS))
    print(
        f"\nmedian of {args.repeats} alternating run(s); {torch.get_num_threads()} threads; load before "
        f"{load_before:.2f}, after {common.load_average():.2f}; wall {time.perf_counter() - wall:.0f} s"
        + (f"; skipped (time budget): {skipped}" if skipped else "")
    )
    print(f"wrote {args.out}/{name}.json, {name}.md and plots under {args.plots}")
    bad = [r for r in results + sweep if r["status"] == "grad mismatch"]
    if bad:
        print(f"GRADIENT MISMATCH: {[(r['shape'], r['method'], r['grad_err']) for r in bad]}")
        return 1
    errors = [r for r in results + sweep if r["status"] == "error"]
    if errors:
        print(f"ERRORS: {[(r['shape'], r['method'], r['error']) for r in errors]}")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
