"""The samples of TRL's SFT batches, as the tree walk takes them.

TRL's SFT collator (``DataCollatorForLanguageModeling``) delivers ``input_ids`` and ``labels`` (-100 where a
token is not trained) and either a right-padding ``attention_mask`` (one sample per row) or, padding-free
and with packing's ``bfd`` strategies, ``position_ids`` whose restarts at 0 mark where each sample of a
flattened row begins (the model keeps samples apart by them). A *sample* is what the model attends over as
one sequence: a row's unpadded tokens, or one run of a padding-free row. Packing without padding-free
(``packing_strategy="wrapped"``) leaves a row attended as one sequence, so that row is one sample too. Each
sample is walked as one trie sequence, which is what TRL's forward computes for it.

Log-prob index ``t`` of a sample scores its token ``t + 1``, whose label is ``labels[t + 1]``: the sample is
cut after its last trained token (later tokens change no trained log-prob), scored from its first trained
index on (``score_from``), and weighted by its trained indices (``mask``). With ``whole=True`` (MoE models:
TRL's load-balancing loss counts every real token of the batch) samples are kept whole, those without a
trained token too (scored nowhere). :func:`sample_length`: the longest sample the trainer can see, which the
walk's checks at construction read.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import torch

from ..refusals import LengthBound

IGNORE = -100
# what TRL's collator delivers; padding-free's sequence boundaries are read from position_ids alone
KNOWN = {
    "input_ids",
    "labels",
    "attention_mask",
    "position_ids",
    "cu_seq_lens_q",
    "cu_seq_lens_k",
    "max_length_q",
    "max_length_k",
    "seq_idx",
}


class Sample(NamedTuple):
    batch: int  # the micro-batch it comes from
    tokens: list[int]  # up to its last trained token
    score_from: int  # its first trained log-prob index
    mask: torch.Tensor  # (len(tokens) - 1 - score_from,) bool: trained log-prob indices from score_from on


def _runs(positions: torch.Tensor) -> list[tuple[int, int]]:
    """``(start, end)`` of each run of a padding-free row's ``position_ids`` (a run starts at each 0), each
    checked to count 0, 1, 2, ... (what the model's position embeddings and masks see)."""
    starts = (positions == 0).nonzero().flatten().tolist()
    if not starts or starts[0] != 0:
        raise ValueError("position_ids of a padding-free row must start at 0 (TRL's collator).")
    runs = list(zip(starts, [*starts[1:], positions.numel()], strict=True))
    for start, end in runs:
        expected = torch.arange(end - start, device=positions.device)
        if not torch.equal(positions[start:end], expected):
            raise ValueError(
                "position_ids of a padding-free row must count 0, 1, 2, ... within each sample (TRL's "
                f"collator); got {positions[start:end].tolist()[:16]} at {start}."
            )
    return runs


def _row_pieces(inputs: dict, r: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Row ``r``'s samples as (ids, labels) pairs, before cutting."""
    ids, labels = inputs["input_ids"][r], inputs["labels"][r]
    mask = inputs.get("attention_mask")
    if mask is not None:
        mask = mask[r].bool()
        real = mask.nonzero().flatten()
        if real.numel() and not bool(mask[real[0] : real[-1] + 1].all()):
            raise ValueError(
                f"row {r}'s attention_mask has holes; the tree walk needs one padded run per row."
            )
        if bool((labels[~mask] != IGNORE).any()):
            raise ValueError(f"row {r} has labels on padding (attention_mask 0): they must be -100.")
        if not real.numel():
            return []
        span = slice(int(real[0]), int(real[-1]) + 1)
        return [(ids[span], labels[span])]
    positions = inputs.get("position_ids")
    if positions is None:
        raise ValueError("an SFT batch needs an attention_mask or (padding-free) position_ids.")
    return [(ids[a:b], labels[a:b]) for a, b in _runs(positions[r])]


def batch_samples(batches: Sequence[dict], whole: bool = False) -> list[Sample]:
    """Every sample of ``batches`` (TRL SFT micro-batches) that has a trained token, in order, cut after it;
    ``whole``: every sample, uncut."""
    samples = []
    for b, inputs in enumerate(batches):
        unknown = sorted(set(inputs) - KNOWN)
        if unknown:
            raise ValueError(
                f"the batch has inputs the tree walk does not pass to the model: {unknown} (a custom "
                "collator, multimodal data?); TreeSFTTrainer takes TRL's language-modeling collator's "
                "batches."
            )
        if inputs["labels"].shape != inputs["input_ids"].shape:
            raise ValueError("labels and input_ids must have the same shape (TRL's causal-LM collator).")
        for r in range(inputs["input_ids"].shape[0]):
            for ids, labels in _row_pieces(inputs, r):
                trained = labels[1:] != IGNORE  # log-prob index t scores token t + 1
                if not (whole or bool(trained.any())):
                    continue
                wrong = trained & (labels[1:] != ids[1:])
                if bool(wrong.any()):
                    raise ValueError(
                        f"row {r} of micro-batch {b} has labels that differ from its input_ids (not -100): "
                        "the tree walk scores each token of the sequence, as TRL's collator labels it."
                    )
                if whole and ids.numel() < 2:
                    raise ValueError(
                        f"row {r} of micro-batch {b} has a one-token sample: the MoE load-balancing loss "
                        "counts every token, and the tree walk needs two or more per sequence."
                    )
                where = trained.nonzero().flatten()
                first = int(where[0]) if where.numel() else ids.numel() - 1
                end = ids.numel() if whole else int(where[-1]) + 2
                samples.append(Sample(b, ids[:end].tolist(), first, trained[first : end - 1].clone()))
    return samples


def trained_tokens(inputs: dict) -> int:
    """TRL's count of a micro-batch's trained tokens (its fused LM head's ``label_mask``: shifted
    labels)."""
    return int((inputs["labels"][:, 1:] != IGNORE).sum())


def num_input_tokens(inputs: dict) -> int:
    """The tokens TRL's ``num_tokens`` metric counts for a micro-batch (before gathering over ranks)."""
    if "attention_mask" in inputs:
        return int(inputs["attention_mask"].sum())
    if "position_ids" in inputs:
        return int(inputs["position_ids"].size(1))
    raise ValueError("Expected 'attention_mask' or 'position_ids' in inputs.")


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
