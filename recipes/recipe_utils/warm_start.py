"""Supervised warm start: a few SFT steps on gold conversations of the training tasks.

A small model given τ²'s tools practically never calls one, so every rollout scores 0 and RL has no signal.
Before RL, :func:`warm_start` trains the policy on the training tasks' gold conversations
(:func:`trl_dta.envs.tau2.gold.gold_conversation`: the gold tool calls with the environment's real results),
with the loss on the assistant's tokens only (``assistant_only_loss``; TRL switches to its training chat
template, whose generation markers delimit them). The held-out tasks are never used.

It runs on :class:`~trl_dta.TreeSFTTrainer` (exactly TRL's ``SFTTrainer`` loss and gradients, on one prefix
trie of each step's conversations: their shared system turn and tool schemas are computed once), or on stock
``trl.SFTTrainer`` with ``tree=False`` (the recipe's ``--no_tree``).
"""

from __future__ import annotations

import os

import torch


def warm_start(model, tokenizer, rows, environment_factory, steps: int, learning_rate: float, batch_size: int,
               output_dir: str, seed: int, tree: bool = True) -> list[dict]:  # fmt: skip
    """Train ``model`` in place for ``steps`` optimizer steps on the gold conversations of ``rows`` (dataset
    rows with ``prompt`` and ``task_id``), with :class:`~trl_dta.TreeSFTTrainer` (``tree=False``: stock
    ``trl.SFTTrainer``); returns the SFT trainer's log history."""
    from datasets import Dataset
    from trl import SFTConfig, SFTTrainer

    from trl_dta import TreeSFTConfig, TreeSFTTrainer
    from trl_dta.envs.tau2.gold import gold_conversation

    conversations = Dataset.from_list([gold_conversation(dict(row), environment_factory()) for row in rows])
    config_cls, trainer_cls = (TreeSFTConfig, TreeSFTTrainer) if tree else (SFTConfig, SFTTrainer)
    config = config_cls(
        output_dir=os.path.join(output_dir, "warm_start"),
        max_steps=steps,
        per_device_train_batch_size=batch_size,
        learning_rate=learning_rate,
        lr_scheduler_type="constant",
        assistant_only_loss=True,
        max_length=None,  # never cut a conversation (the default 1024 would cut the prompt)
        bf16=torch.cuda.is_available(),
        gradient_checkpointing=False,
        logging_steps=1,
        save_strategy="no",
        report_to="none",
        seed=seed,
        disable_tqdm=True,
    )
    trainer = trainer_cls(model=model, args=config, train_dataset=conversations, processing_class=tokenizer)
    trainer.train()
    return trainer.state.log_history
