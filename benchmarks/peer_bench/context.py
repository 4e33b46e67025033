"""What every method of the peer benchmark shares: the model and its switchable attention (``Context``), the
GRPO loss, completion log-probs, left and right padding."""

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


def padded(seqs: list[list[int]], device, left: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """Right-padded (``left``: left-padded, as TRL pads prompts) token ids and their attention mask, both
    [len(seqs), longest]."""
    width = max(map(len, seqs))
    ids = torch.zeros(len(seqs), width, dtype=torch.long)
    mask = torch.zeros(len(seqs), width, dtype=torch.long)
    for r, s in enumerate(seqs):
        cols = slice(width - len(s), width) if left else slice(0, len(s))
        ids[r, cols], mask[r, cols] = torch.as_tensor(s, dtype=torch.long), 1
    return ids.to(device), mask.to(device)


class Context:
    """The model and everything the methods share for one (model, attention, dtype) configuration.

    ``block_size``: the walk's ``TreeExecutor(block_size=...)``; None: the executor's defaults (budgets from
    the free memory, ``memory_budget="auto"``). ``micro_batch``: rows per forward/backward of the dense
    methods (TRL's ``per_device_train_batch_size``), accumulating; None: one GRPO group per micro-batch.
    ``memory_budget``: the walk's ``TreeExecutor(memory_budget=...)`` where ``block_size`` is None (default
    "auto": a share of the free memory)."""

    def __init__(
        self,
        model,
        device,
        attn: str,
        block_size: int | None,
        micro_batch: int | None = None,
        memory_budget: float | str = "auto",
    ):
        self.model, self.device, self.attn, self.block_size = model, torch.device(device), attn, block_size
        self.micro_batch, self.memory_budget = micro_batch, memory_budget
        self._executor: TreeExecutor | None = None
        self.pg_kernel = "flash_attention_2" if attn == "flash_attention_2" else "bottom_right_sdpa"

    @property
    def executor(self) -> TreeExecutor:
        """The walk's executor, built at its first use and kept (its construction runs a small probe), so that
        a process that runs no walk builds none."""
        if self._executor is None:
            sizes = {"memory_budget": self.memory_budget}
            if self.block_size is not None:
                sizes = {"block_size": self.block_size}
            self._executor = TreeExecutor(self.model, **sizes)
        return self._executor

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
