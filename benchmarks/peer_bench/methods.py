"""The peer benchmark's methods by name: each accumulates into ``.grad`` the gradient of the same GRPO loss
for one workload (see ``benchmarks/peers.py`` for what each one is)."""

from __future__ import annotations

import torch

from trl_dta import PrefixTrie, TreeExecutor

from .context import Context, completion_logps, grpo_loss, padded
from .prefix_grouping import run_prefix_grouper
from .tree_mask import run_tree_mask
from .trl_packing import run_trl_packing
from .workloads import Workload

METHODS = ["dense", "dense_ckpt", "pg", "pg_lmhead", "tree_mask", "tree"]
LABELS = {
    "dense": "dense padded (TRL)",
    "dense_ckpt": "dense + checkpointing",
    "pg": "PrefixGrouper",
    "pg_lmhead": "PrefixGrouper, LM head on completions",
    "tree_mask": "packed tree mask (sdpa)",
    "tree": "TreeExecutor (walk)",
    "trl_packing": "TRL's per-segment packing (TreeRow)",
    "tree_mask_fullhead": "packed tree mask, LM head on all tokens",
}


def micro_batches(ctx: Context, wl: Workload):
    """(prompts, completions, advantages) of each dense micro-batch: one GRPO group each (``ctx.micro_batch``
    None), else ``ctx.micro_batch`` rows at a time in group-major order, as TRL cuts its batch into
    ``per_device_train_batch_size`` rows."""
    rows = [(p, c) for p, cs in wl.groups for c in cs]
    if ctx.micro_batch is None:
        bounds, lo = [], 0
        for _, comps in wl.groups:
            bounds.append((lo, lo + len(comps)))
            lo += len(comps)
    else:
        bounds = [(lo, min(lo + ctx.micro_batch, len(rows))) for lo in range(0, len(rows), ctx.micro_batch)]
    for lo, hi in bounds:
        yield [p for p, _ in rows[lo:hi]], [c for _, c in rows[lo:hi]], wl.advantages[lo:hi]


def run_dense(ctx: Context, wl: Workload, checkpointing: bool = False) -> None:
    """TRL-style: padded micro-batches (prompts left-padded, completions right-padded; see ``micro_batches``),
    gradients accumulating, the LM head on completion positions only."""
    model, rows = ctx.model, wl.num_rows
    if checkpointing:  # transformers >= 5.2x renamed it; 5.17 (the GPU machine) has only the old name
        if hasattr(model, "activation_checkpointing_enable"):
            model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
        else:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        model.train()  # HF checkpoints only in training mode; dropout is 0 in these configs
    try:
        for prompts, comps, adv in micro_batches(ctx, wl):
            p_ids, p_mask = padded(prompts, ctx.device, left=True)
            c_ids, c_mask = padded(comps, ctx.device)
            ids = torch.cat([p_ids, c_ids], 1)
            mask = torch.cat([p_mask, c_mask], 1)
            width = c_ids.shape[1]
            logits = model(input_ids=ids, attention_mask=mask, logits_to_keep=width + 1).logits[:, :-1]
            lp = completion_logps(logits, c_ids)
            m = c_mask.float()
            grpo_loss((lp * m).sum(1) / m.sum(1), adv.to(ctx.device), rows).backward()
    finally:
        if checkpointing:
            getattr(model, "activation_checkpointing_disable", model.gradient_checkpointing_disable)()
            model.eval()


def run_tree(ctx: Context, wl: Workload, executor: TreeExecutor | None = None) -> None:
    """The walk: ``TreeExecutor.backward`` on the step's trie (every group at once)."""
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
    # not in METHODS (needs TRL, which the GPU machine lacks): TRL 1.16's TreeRow layout, attended per segment
    "trl_packing": run_trl_packing,
}
