"""The walk's refusal: a model, attention backend or input it cannot compute exactly."""

from __future__ import annotations


class UnsupportedModelError(ValueError):
    """The tree walk cannot run this model (or this call's sequences on it) exactly, so it refuses instead of
    returning other gradients than the dense loss's. The message names the cause. A ``ValueError``, so code
    that caught the walk's refusals as ``ValueError`` keeps working."""


class ArgumentTypeError(TypeError, ValueError):
    """An argument or setting of the wrong type (a float block size, a float ``score_from``, a ``loss_fn``
    that returns no tensor). A ``TypeError``, and a ``ValueError`` too, as Hugging Face's argument checks
    (``TrainingArguments``, ``GRPOConfig``) raise for bad settings."""
