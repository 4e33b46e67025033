"""TRL's own per-segment packing as a peer method, where TRL is importable (the GPU machine has no TRL: there
the decisive table says "n/a (no TRL)").

The step's rows go into TRL 1.16's ``trl.experimental.async_grpo.packing.TreeRow`` (its trie keyed on
(token, next token), laid out in DFS pre-order, every segment attending to the K/V of its root-to-segment
path) and the whole step runs as one forward and one backward, the LM head on the positions that score
completion tokens. TRL attends with FA3 from the ``kernels`` hub, which these machines cannot fetch;
``segment_sdpa`` here runs the same layout through torch's sdpa, one segment at a time (each segment's queries
are the last positions of its path, so the causal mask is aligned at the bottom right)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .context import Context, completion_logps, grpo_loss
from .workloads import Workload

ATTENTION = "trl_packing_segment_sdpa"


def segment_sdpa(
    module, query, key, value, attention_mask, *, tree_kv_index, tree_cu_seqlens_q, tree_cu_seqlens_k,
    scaling=None, **kwargs,
):  # fmt: skip
    """query [1, H, N, d], key/value [1, Hkv, N, d] over the packed row; segment s's queries are rows
    ``cu_q[s]:cu_q[s+1]``, its keys the packed positions ``tree_kv_index[cu_k[s]:cu_k[s+1]]`` (its path).
    Returns [1, N, H, d] (the attention-interface layout)."""
    k = key[0].index_select(1, tree_kv_index)  # (Hkv, K, d): every segment's path, end to end
    v = value[0].index_select(1, tree_kv_index)
    cu_q, cu_k = tree_cu_seqlens_q.tolist(), tree_cu_seqlens_k.tolist()
    outs = []
    for s in range(len(cu_q) - 1):
        q_s = query[0, :, cu_q[s] : cu_q[s + 1]]
        k_s, v_s = k[:, cu_k[s] : cu_k[s + 1]], v[:, cu_k[s] : cu_k[s + 1]]
        lq, lk = q_s.shape[1], k_s.shape[1]
        visible = torch.ones(lq, lk, dtype=torch.bool, device=query.device).tril(diagonal=lk - lq)
        outs.append(
            F.scaled_dot_product_attention(q_s, k_s, v_s, attn_mask=visible, scale=scaling, enable_gqa=True)
        )
    return torch.cat(outs, 1).transpose(0, 1)[None].contiguous(), None


_REGISTERED = False


def _register() -> None:
    global _REGISTERED
    if not _REGISTERED:
        from transformers import AttentionInterface
        from transformers.masking_utils import AttentionMaskInterface

        AttentionInterface.register(ATTENTION, segment_sdpa)
        AttentionMaskInterface.register(ATTENTION, lambda **kwargs: None)  # the layout is the mask
        _REGISTERED = True


def run_trl_packing(ctx: Context, wl: Workload) -> None:
    from trl.experimental.async_grpo.packing import TreeRow

    _register()
    row = TreeRow()
    group_of = [g for g, (_, comps) in enumerate(wl.groups) for _ in comps]
    for i, (seq, plen) in enumerate(wl.rows):
        completion = torch.zeros(len(seq), dtype=torch.long)
        completion[plen:] = 1
        sample = {"input_ids": torch.as_tensor(seq), "completion_mask": completion, "group_id": group_of[i],
                  "old_log_probs": torch.zeros(len(seq)), "advantage": float(wl.advantages[i])}  # fmt: skip
        row.add(sample)
    packed = {k: v.to(ctx.device) for k, v in row.pack().items()}
    lengths = packed["tree_max_seqlens"].tolist()
    with ctx.attention(ATTENTION):
        hidden = ctx.model.get_decoder()(
            input_ids=packed["input_ids"][None],
            position_ids=packed["position_ids"][None],
            tree_kv_index=packed["tree_kv_index"],
            tree_cu_seqlens_q=packed["tree_cu_seqlens_q"],
            tree_cu_seqlens_k=packed["tree_cu_seqlens_k"],
            tree_max_seqlen_q=lengths[0],
            tree_max_seqlen_k=lengths[1],
        ).last_hidden_state[0]
    # one loss term per trained token: position token_index predicts shift_labels there, for sample segment_id
    index, sample = packed["token_index"], packed["segment_id"]
    needed, inverse = torch.unique(index, return_inverse=True)  # a shared position is scored once
    logits = ctx.model.get_output_embeddings()(hidden[needed])
    lp = completion_logps(logits[inverse], packed["shift_labels"][index])
    counts = torch.bincount(sample, minlength=wl.num_rows)
    mean = torch.zeros(wl.num_rows, device=ctx.device).index_add(0, sample, lp) / counts
    grpo_loss(mean, wl.advantages.to(ctx.device), wl.num_rows).backward()
