"""What every method of the peer benchmark shares: the model and its switchable attention (``Context``), the
GRPO loss, completion log-probs, right padding."""

from __future__ import annotations

import contextlib

import torch

from trl_dta import TreeExecutor


def grpo_loss(mean_logp: torch.Tensor, adv: torch.Tensor, rows: int) -> torch.Tensor:
    """On-policy GRPO surrogate: -advantage x mean completion log-prob, averaged over the step's rows."""
    return (-adv * mean_logp / rows).sum()


def completion_logps(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """log p(target) per position, log-softmax in fp32: logits [..., T, V], targets [..., T] -> [..., T]."""
    return torch.log_softmax(logits.float(), -1).gather(-1, targets[..., None]).squeeze(-1)


def padded(seqs: list[list[int]], device) -> tuple[torch.Tensor, torch.Tensor]:
    """Right-padded token ids and their attention mask, both [len(seqs), longest]."""
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
