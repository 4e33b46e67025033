"""PrefixGrouper (PyPI ``prefix-grouper``) as a peer method, integrated as its README describes, and the
bottom-right-aligned causal sdpa kernel it needs where flash-attn is absent."""

from __future__ import annotations

import torch

from .context import Context, completion_logps, grpo_loss, padded
from .workloads import Workload


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
        c_ids, c_mask = padded(comps, ctx.device)
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
