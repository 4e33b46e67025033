"""What the trainers refuse when they are built: their arguments, and their models with the tokenizer and the
longest sequence the arguments allow.

A trainer refuses everything it can know before its first step at construction, so that a misconfiguration
fails in seconds, not after a generation phase on a real model:

* :func:`check_arguments`, before TRL's own set-up: fp16 gradient scaling, Liger kernels, PEFT prompt
  learning (a value model's own: :func:`~trl_dta.train.critic.value_model.check_value_model`);
* :meth:`StepWalker.check_models <trl_dta.train.step.StepWalker.check_models>`, after it (TRL loads the
  model and the tokenizer): every refusal of the walk's probe and first walk that depends only on the
  model, the tokenizer and the arguments (:mod:`trl_dta.walk.adapter.preflight`), given the tokenizer's size
  (:func:`tokenizer_size`) and the longest sequence the arguments allow (:func:`rollout_length` for the
  two PPO trainers; SFT's: :func:`~trl_dta.train.sft.samples.sample_length`).

What is left to the first walk depends on the data (the prompts' lengths, where nothing bounds them; the
token ids of a dataset tokenized elsewhere): :mod:`trl_dta.walk.adapter.preflight` lists it.
"""

from __future__ import annotations

from typing import NamedTuple

from .multi_process import check_trainable


class LengthBound(NamedTuple):
    """The longest sequence a trainer's arguments allow, in tokens (a lower bound where prompts are not
    truncated), where it comes from, and the option that lowers it: what
    :func:`~trl_dta.walk.adapter.preflight` reads."""

    tokens: int | None
    setting: str = ""
    option: str = ""


def check_arguments(args, model=None, peft_config=None) -> None:
    """What the walk refuses in a trainer's arguments (call it early: before TRL prepares the datasets):
    fp16 gradient scaling, Liger kernels, PEFT prompt learning (``model`` or ``peft_config``)."""
    if getattr(args, "fp16", False):
        raise ValueError(
            "fp16 mixed precision (gradient scaling) is not supported by the tree walk; use bf16."
        )
    if getattr(args, "use_liger_kernel", False):
        raise ValueError(
            "use_liger_kernel replaces the model's layers and loss kernels; it is not supported by the tree "
            "walk."
        )
    for thing in (model, peft_config):
        check_trainable(thing)


def rollout_length(args) -> LengthBound:
    """A GRPO trainer's rollouts: ``max_completion_length`` tokens after a prompt of at least one (TRL 1.16
    does not truncate prompts, so their length is known only from the data)."""
    completion = getattr(args, "max_completion_length", None)
    if completion is None:
        return LengthBound(None)
    setting = f"max_completion_length={completion} after a prompt of one token or more"
    return LengthBound(int(completion) + 1, setting, "max_completion_length")


def tokenizer_size(processing_class) -> int | None:
    """Ids of a trainer's tokenizer (``len``, added tokens included; a processor's tokenizer), or None."""
    tokenizer = getattr(processing_class, "tokenizer", processing_class)
    try:
        return len(tokenizer)
    except TypeError:  # (no tokenizer, or one without a length)
        return None
