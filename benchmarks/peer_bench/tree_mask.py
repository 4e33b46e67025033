"""Packed tree attention as a peer method (AReaL's and TRL AsyncGRPO's idea, written here from the idea): all
unique tokens of the step's trie in one row, in DFS order, RoPE position = depth, and a 4-D boolean mask
(token i sees token j iff j is an ancestor-or-self of i) through sdpa."""

from __future__ import annotations

import numpy as np
import torch

from .context import Context, grpo_loss
from .workloads import Workload


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
