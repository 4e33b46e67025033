"""What the walk can refuse before it walks anything: from a model, the size of its tokenizer and the longest
sequence a caller's settings allow, with the messages a first walk would give.

The walk refuses in two places (:mod:`trl_dta.walk.adapter.checks`): when it wraps a model in a
:class:`~trl_dta.walk.adapter.model.CausalLM` (the model's structure, its attention backend, the probe's
forwards), and at each call (randomness left on, token ids outside the vocabulary, sequences longer than an
attention window, a length-dependent RoPE or a learned position table). :func:`preflight` runs every one of
them that does not need the sequences themselves, so that a trainer built on a model the walk cannot run fails
when it is built, not after a generation phase:

* the structure and the probe: a model that is not a decoder + LM head, ignores the passed cache, is not
  causal, transforms its logits in a way the walk does not reproduce, keeps states the walk does not carry;
  FSDP1, PEFT prompt learning, an attention backend the walk does not run (an ``AttentionInterface``
  registration), flex attention on CPU, ``lm_head_fp32`` with an adapted head;
* a tokenizer with more ids than the model's vocabulary (ids past it fail in generation and in the walk);
* a configured longest sequence (``max_length``) past the model's attention window or chunk, its
  length-dependent RoPE's original context, or its learned position table;
* randomness left on by a setting, for a model that will train (the caller's ``disable_dropout=False``).

What only the first walk can refuse, because it depends on the data: a sequence past those limits where no
setting bounds its length (a prompt, when nothing truncates prompts), a token id past the vocabulary where
the tokenizer fits (a dataset tokenized with another tokenizer), a sequence shorter than two tokens. A model
whose weights are not on this process (the meta device: FSDP's ``cpu_ram_efficient_loading`` loads them on
rank 0 only), or that is not yet on the device it will run on (a trainer's DeepSpeed or FSDP preparation
moves it there later), has its structure checked now and is probed at its first walk. The probe's verdict
is kept for the model's executor (:func:`~trl_dta.walk.adapter.probe.kept_verdict`), which takes it instead of
probing again where the model still walks as probed.
"""

from __future__ import annotations

from torch import nn

from . import checks
from .model import CausalLM
from .probe import keep_verdict


def preflight(
    model: nn.Module,
    *,
    lm_head_fp32: bool = False,
    tokenizer_size: int | None = None,
    max_length: int | None = None,
    length_setting: str = "",
    option: str = "the sequences' length",
    training: bool = False,
    probe: bool = True,
) -> None:
    """Refuse now what a walk of ``model`` would refuse at its first call whatever the data (module
    docstring), raising the walk's own errors (:class:`~trl_dta.UnsupportedModelError` or ``ValueError``).

    Args:
        model: a ``transformers`` causal LM, plain or PEFT-wrapped (not a DDP or DeepSpeed wrapper).
        lm_head_fp32: as :class:`~trl_dta.TreeExecutor`'s.
        tokenizer_size: the tokenizer's number of ids (``len(tokenizer)``); None: not checked.
        max_length: the longest sequence (prompt and completion, in tokens) the caller's settings allow;
            None: not known, checked per call.
        length_setting: where ``max_length`` comes from, for the message (e.g. ``"max_length=2048"``).
        option: the setting to lower, for the message (e.g. ``"max_length"``).
        training: the model will train: randomness left on by a setting is refused (its mode now does not
            matter; a trainer puts it in train mode later).
        probe: run the probe's forwards now; False where the model is not yet on the device it will walk on
            (a trainer whose DeepSpeed or FSDP preparation moves it later): its structure is checked now, and
            the first walk probes it where it runs. A model on the meta device is never probed here.
    """
    probed = probe and not any(p.is_meta for p in model.parameters())
    lm = CausalLM(model, lm_head_fp32=lm_head_fp32, probe=probed)
    if tokenizer_size is not None:
        checks.check_tokenizer_size(int(tokenizer_size), lm.vocab_size)
    if max_length is not None:
        what = f"the longest sequence the settings allow ({max_length} tokens: {length_setting})"
        checks.check_length(lm, max_length, what=what, hint=f" Lower {option} to fit.")
        checks.check_position_limit(lm.position_limit, max_length, what, option)
    if training:
        checks.check_no_randomness(model, training=True)
    if probed:  # (the executor built at the first walk takes the verdict instead of probing again)
        keep_verdict(lm)
