"""What the trainers refuse when they are built: their arguments, and their models with the tokenizer and the
longest sequence the arguments allow.

A trainer refuses everything it can know before its first step at construction, so that a misconfiguration
fails in seconds, not after a generation phase on a real model:

* :func:`check_arguments`, before TRL's own set-up: fp16 gradient scaling, Liger kernels, PEFT prompt
  learning (a value model's own: :func:`~trl_dta.train.critic.value_model.check_value_model`);
* :meth:`StepWalker.check_models <trl_dta.train.step.StepWalker.check_models>`, after it (TRL loads the
  model and the tokenizer): every refusal of the walk's probe and first walk that depends only on the
  model, the tokenizer and the arguments (:mod:`trl_dta.walk.preflight`), given the tokenizer's size
  (:func:`tokenizer_size`) and the longest sequence the arguments allow (:func:`rollout_length`,
  :func:`sample_length`).

What is left to the first walk depends on the data (the prompts' lengths, where nothing bounds them; the
token ids of a dataset tokenized elsewhere): :mod:`trl_dta.walk.preflight` lists it.
"""

from __future__ import annotations

from typing import NamedTuple

from .multi_process import check_trainable


class LengthBound(NamedTuple):
    """The longest sequence a trainer's arguments allow, in tokens (a lower bound where prompts are not
    truncated), where it comes from, and the option that lowers it: what :func:`~trl_dta.walk.preflight`
    reads."""

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


def sample_length(args, *datasets) -> LengthBound:
    """An SFT trainer's samples: the longest in its ``datasets`` (the train and eval datasets, which TRL has
    tokenized, and truncated to ``max_length``, when the trainer is built); ``max_length`` where one of them
    is not held in memory (an iterable dataset); None where neither is known."""
    length = getattr(args, "max_length", None)
    longest = [_longest_sample(d) for d in _each_dataset(datasets)]
    if longest and None not in longest:
        setting = f"the longest tokenized sample, with max_length={length}"
        return LengthBound(max(longest), setting, "max_length")
    if length is None:
        return LengthBound(None)
    return LengthBound(int(length), f"max_length={length}", "max_length")


def _each_dataset(datasets):
    for d in datasets:
        if isinstance(d, dict):  # (several eval datasets, by name)
            yield from d.values()
        elif d is not None:
            yield d


def _longest_sample(dataset) -> int | None:
    """Tokens of the longest sample of a tokenized map-style ``datasets.Dataset`` (read from its Arrow table,
    unselected rows included: an upper bound), or None for anything else. A packed dataset's samples are its
    ``seq_lengths``."""
    import pyarrow.compute as pc
    from datasets import Dataset

    if not isinstance(dataset, Dataset) or "input_ids" not in dataset.column_names:
        return None
    if "seq_lengths" in dataset.column_names:
        lengths = pc.list_flatten(dataset.data.column("seq_lengths"))
    else:
        lengths = pc.list_value_length(dataset.data.column("input_ids"))
    return int(pc.max(lengths).as_py() or 0)


def tokenizer_size(processing_class) -> int | None:
    """Ids of a trainer's tokenizer (``len``, added tokens included; a processor's tokenizer), or None."""
    tokenizer = getattr(processing_class, "tokenizer", processing_class)
    try:
        return len(tokenizer)
    except TypeError:  # (no tokenizer, or one without a length)
        return None
