"""The walk's errors: a refusal (a model, attention backend or input it cannot compute exactly), and running
out of memory.

Running out of memory is never turned into anything else: every ``except`` of the walk that catches broadly
lets :data:`MEMORY_ERRORS` through first, unchanged (a refusal would tell the user their model is not
supported). The walk's own out-of-memory errors (:mod:`trl_dta.walk.memory.recovery`) are subclasses of
``torch.OutOfMemoryError``, so code that catches PyTorch's keeps catching them.
"""

from __future__ import annotations

import torch

# What an allocation that failed raises: on a GPU torch.OutOfMemoryError, in Python code MemoryError. (A
# failed CPU allocation inside torch is a plain RuntimeError, "DefaultCPUAllocator: can't allocate memory",
# in torch 2.13: not recognisable by type, so not among these.)
MEMORY_ERRORS = (torch.OutOfMemoryError, MemoryError)


class UnsupportedModelError(ValueError):
    """The tree walk cannot run this model (or this call's sequences on it) exactly, so it refuses instead of
    returning other gradients than the dense loss's. The message names the cause. A ``ValueError``, so code
    that caught the walk's refusals as ``ValueError`` keeps working."""


class ArgumentTypeError(TypeError, ValueError):
    """An argument or setting of the wrong type (a float block size, a float ``score_from``, a ``loss_fn``
    that returns no tensor). A ``TypeError``, and a ``ValueError`` too, as Hugging Face's argument checks
    (``TrainingArguments``, ``GRPOConfig``) raise for bad settings."""


class WalkOutOfMemoryError(torch.OutOfMemoryError, MemoryError):
    """A walk ran out of memory at its smallest budgets (:mod:`trl_dta.walk.memory.recovery`): the message
    names the budgets tried, the longest path of the trie and what was being allocated. The last out-of-memory
    error is its ``__cause__``."""


class PeerOutOfMemoryError(torch.OutOfMemoryError, MemoryError):
    """Raised on the ranks whose walk succeeded when another rank's walk of the same sharded model ran out
    of memory: no rank reduces, and every rank walks again (or gives up) together."""
